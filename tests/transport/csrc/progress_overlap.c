/* A probe preloaded into a child process (test_take_stress.py): it
 * interposes ucp_worker_progress and counts the entries into one worker's
 * progress by its pump's thread (comm "rdma-kv-pump") while another thread
 * (a caller that took or helps the worker, the service thread) is inside
 * it for the same worker, and the other way round: the take protocol
 * (csrc/pump.c, rk_pump_claim) lets never both in at once. Workers are
 * told apart by handle (each lane's pump has its own). The test reads
 * progress_overlap_counts(): overlaps, the pumps' calls, the others'. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>

typedef unsigned (*progress_fn)(void *);
enum { SLOTS = 64 };
static void *keys[SLOTS];
static uint64_t words[SLOTS]; /* high 32: pump inside, low 32: others inside */
static uint64_t overlaps, pump_calls, other_calls;
static __thread int is_pump = -1; /* this thread is a pump (1), not (0), not yet looked at (-1) */

static uint64_t *word_of(void *w)
{
    unsigned i;

    for (i = 0; i < SLOTS; ++i) {
        void *k = __atomic_load_n(&keys[i], __ATOMIC_ACQUIRE);
        if (k == w) {
            return &words[i];
        }
        if (k == NULL) {
            void *expect = NULL;
            if (__atomic_compare_exchange_n(&keys[i], &expect, w, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) ||
                expect == w) {
                return &words[i];
            }
        }
    }
    return NULL;
}

unsigned ucp_worker_progress(void *worker)
{
    static progress_fn real;
    uint64_t *word, prev, mine;
    unsigned events;
    char name[17] = {0};

    if (real == NULL) {
        void *lib = dlopen("libucp.so.0", RTLD_LAZY | RTLD_NOLOAD);

        real = (progress_fn)dlsym(lib != NULL ? lib : RTLD_NEXT, "ucp_worker_progress");
        if (real == NULL || real == ucp_worker_progress) {
            fprintf(stderr, "progress-overlap: no real ucp_worker_progress\n");
            return 0;
        }
    }
    if (is_pump < 0) {
        prctl(PR_GET_NAME, name);
        is_pump = strcmp(name, "rdma-kv-pump") == 0;
    }
    word = word_of(worker);
    if (word == NULL) {
        return real(worker);
    }
    mine = is_pump ? (1ull << 32) : 1ull;
    prev = __atomic_fetch_add(word, mine, __ATOMIC_SEQ_CST);
    if (is_pump ? (prev & 0xffffffffu) != 0 : (prev >> 32) != 0) {
        __atomic_fetch_add(&overlaps, 1, __ATOMIC_RELAXED);
    }
    __atomic_fetch_add(is_pump ? &pump_calls : &other_calls, 1, __ATOMIC_RELAXED);
    events = real(worker);
    __atomic_fetch_sub(word, mine, __ATOMIC_SEQ_CST);
    return events;
}

void progress_overlap_counts(uint64_t *out)
{
    out[0] = __atomic_load_n(&overlaps, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&pump_calls, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&other_calls, __ATOMIC_RELAXED);
}
