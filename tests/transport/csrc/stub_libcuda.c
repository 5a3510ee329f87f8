/* A stand-in for libcuda.so.1 (soname libcuda.so.1) for tests without a
 * GPU, preloaded into a child process. It keeps a current "context" per
 * thread (cuCtxGetCurrent / cuCtxSetCurrent, and a stack under it:
 * cuCtxPushCurrent_v2 / cuCtxPopCurrent_v2) and interposes
 * ucp_worker_progress to record, per thread, which context was current
 * when the thread progressed a worker: none, the first one ever set (the
 * test's "creator" context), or another. The test reads the records with
 * stub_threads() / stub_thread(). stub_stall() blocks the pumps' progress
 * calls; ucp_worker_destroy and ucp_cleanup are interposed too, so that
 * stub_touched() counts what used a worker a pump was blocked in. */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define STUB_MAX_THREADS 256

typedef struct {
    long tid;
    char name[16];
    uintptr_t ctx_set;       /* the last context cuCtxSetCurrent made current */
    uint64_t sets;           /* cuCtxSetCurrent calls */
    uint64_t progress;       /* ucp_worker_progress calls */
    uint64_t progress_bare;  /* ... of them with no current context */
    uint64_t progress_other; /* ... with a context other than the first one set */
    uint64_t pushes;         /* cuCtxPushCurrent_v2 calls */
} stub_thread_t;

#define STUB_STACK 8

static __thread void *stub_current;
static __thread void *stub_below[STUB_STACK]; /* the contexts pushed over */
static __thread int stub_depth;
static void *stub_first;                      /* the first context set */
static int stub_stall_on;                     /* stub_stall(): pumps' progress blocks */
static int stub_stalled_now;                  /* pump threads blocked in it */
static void *stub_stalled_in[STUB_MAX_THREADS]; /* the workers they are blocked in */
static int stub_touched_now;                  /* stub_touched() */
static stub_thread_t stub_records[STUB_MAX_THREADS];
static int stub_count;
static pthread_mutex_t stub_lock = PTHREAD_MUTEX_INITIALIZER;

/* This thread's record (created on first use); NULL when the table is full. */
static stub_thread_t *stub_self(void)
{
    long tid = syscall(SYS_gettid);
    stub_thread_t *rec = NULL;
    int i;

    pthread_mutex_lock(&stub_lock);
    for (i = 0; i < stub_count; i++) {
        if (stub_records[i].tid == tid) {
            rec = &stub_records[i];
        }
    }
    if (rec == NULL && stub_count < STUB_MAX_THREADS) {
        rec = &stub_records[stub_count++];
        rec->tid = tid;
    }
    if (rec != NULL) {
        pthread_getname_np(pthread_self(), rec->name, sizeof(rec->name));
    }
    pthread_mutex_unlock(&stub_lock);
    return rec;
}

int cuCtxGetCurrent(void **ctx)
{
    *ctx = stub_current;
    return 0;
}

/* With STUB_CU_SET_FAIL set, every call after the first fails with
 * CUDA_ERROR_INVALID_CONTEXT (201): the test's own call succeeds, the
 * pumps' fail. */
int cuCtxSetCurrent(void *ctx)
{
    static int calls;
    stub_thread_t *rec = stub_self();
    void *none = NULL;

    if (__atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED) > 0 && getenv("STUB_CU_SET_FAIL") != NULL) {
        return 201;
    }
    stub_current = ctx;
    __atomic_compare_exchange_n(&stub_first, &none, ctx, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    if (rec != NULL) {
        __atomic_store_n(&rec->ctx_set, (uintptr_t)ctx, __ATOMIC_RELAXED);
        __atomic_fetch_add(&rec->sets, 1, __ATOMIC_RELAXED);
    }
    return 0;
}

int cuCtxPushCurrent_v2(void *ctx)
{
    stub_thread_t *rec = stub_self();

    if (stub_depth == STUB_STACK) {
        return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    }
    stub_below[stub_depth++] = stub_current;
    stub_current = ctx;
    if (rec != NULL) {
        __atomic_fetch_add(&rec->pushes, 1, __ATOMIC_RELAXED);
    }
    return 0;
}

int cuCtxPopCurrent_v2(void **ctx)
{
    *ctx = stub_current;
    stub_current = stub_depth > 0 ? stub_below[--stub_depth] : NULL;
    return 0;
}

typedef unsigned (*stub_progress_t)(void *worker);
typedef void (*stub_destroy_t)(void *handle);

/* Count a call that uses `worker` (NULL: any) while a pump is blocked in it:
 * with UCX, that thread may hold the worker's lock (a hang) or use what
 * the call frees (a crash). */
static void stub_touch(void *worker)
{
    int i;

    if (__atomic_load_n(&stub_stalled_now, __ATOMIC_SEQ_CST) == 0) {
        return;
    }
    for (i = 0; i < STUB_MAX_THREADS; i++) {
        void *in = __atomic_load_n(&stub_stalled_in[i], __ATOMIC_SEQ_CST);
        if (in != NULL && (worker == NULL || in == worker)) {
            __atomic_fetch_add(&stub_touched_now, 1, __ATOMIC_SEQ_CST);
            return;
        }
    }
}

static stub_destroy_t stub_real(const char *name)
{
    void *ucp = dlopen("libucp.so.0", RTLD_NOLOAD | RTLD_LAZY);
    return (stub_destroy_t)dlsym(ucp != NULL ? ucp : RTLD_NEXT, name);
}

void ucp_worker_destroy(void *worker)
{
    stub_touch(worker);
    stub_real("ucp_worker_destroy")(worker);
}

void ucp_cleanup(void *context)
{
    stub_touch(NULL); /* every worker of the test's agent is of its context */
    stub_real("ucp_cleanup")(context);
}

unsigned ucp_worker_progress(void *worker)
{
    static stub_progress_t real;
    stub_thread_t *rec = stub_self();

    if (real == NULL) {
        void *ucp = dlopen("libucp.so.0", RTLD_NOLOAD | RTLD_LAZY);
        real = (stub_progress_t)dlsym(ucp != NULL ? ucp : RTLD_NEXT, "ucp_worker_progress");
    }
    if (__atomic_load_n(&stub_stall_on, __ATOMIC_ACQUIRE) && rec != NULL &&
        strcmp(rec->name, "rdma-kv-pump") == 0) {
        /* A pump stuck in progress (it never returns while stalled). */
        __atomic_store_n(&stub_stalled_in[rec - stub_records], worker, __ATOMIC_SEQ_CST);
        __atomic_fetch_add(&stub_stalled_now, 1, __ATOMIC_SEQ_CST);
        while (__atomic_load_n(&stub_stall_on, __ATOMIC_ACQUIRE)) {
            usleep(1000);
        }
        __atomic_fetch_sub(&stub_stalled_now, 1, __ATOMIC_SEQ_CST);
        __atomic_store_n(&stub_stalled_in[rec - stub_records], NULL, __ATOMIC_SEQ_CST);
    } else {
        stub_touch(worker);
    }
    if (rec != NULL) {
        __atomic_fetch_add(&rec->progress, 1, __ATOMIC_RELAXED);
        if (stub_current == NULL) {
            __atomic_fetch_add(&rec->progress_bare, 1, __ATOMIC_RELAXED);
        } else if (stub_current != __atomic_load_n(&stub_first, __ATOMIC_SEQ_CST)) {
            __atomic_fetch_add(&rec->progress_other, 1, __ATOMIC_RELAXED);
        }
    }
    return real(worker);
}

/* 1: every pump thread that calls ucp_worker_progress from now on blocks
 * there until stub_stall(0). */
void stub_stall(int on)
{
    __atomic_store_n(&stub_stall_on, on, __ATOMIC_RELEASE);
}

int stub_stalled(void)
{
    return __atomic_load_n(&stub_stalled_now, __ATOMIC_SEQ_CST);
}

/* Calls that progressed or destroyed a worker a pump was blocked in, or
 * cleaned up a context while a pump was blocked. */
int stub_touched(void)
{
    return __atomic_load_n(&stub_touched_now, __ATOMIC_SEQ_CST);
}

int stub_threads(void)
{
    return stub_count;
}

/* Copy record i out; returns 0, or -1 when i is out of range. */
int stub_thread(int i, long *tid, char *name, uintptr_t *ctx_set, uint64_t *counts)
{
    stub_thread_t rec;

    pthread_mutex_lock(&stub_lock);
    if (i < 0 || i >= stub_count) {
        pthread_mutex_unlock(&stub_lock);
        return -1;
    }
    rec = stub_records[i];
    pthread_mutex_unlock(&stub_lock);
    *tid = rec.tid;
    memcpy(name, rec.name, sizeof(rec.name));
    *ctx_set = rec.ctx_set;
    counts[0] = rec.sets;
    counts[1] = rec.progress;
    counts[2] = rec.progress_bare;
    counts[3] = rec.progress_other;
    counts[4] = rec.pushes;
    return 0;
}
