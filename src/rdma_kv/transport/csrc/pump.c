/* rdma-kv pumps: loops that progress a UCX worker without the Python
 * interpreter lock, each on a thread of its own (an agent's own worker in progress="thread" mode, and
 * every lane's); what a poster does to them: kick (hold it off its worker
 * while its part is posted, steer it off the poster's CPU where the agent
 * asked for that, wake it early); and what a blocked waiter does: help
 * (progress a worker whose pump is not running) and sleep on its slot.
 * Uses core.c. Declarations: shim.h (public), core.h (for post.c). */

#define _GNU_SOURCE /* sched_getcpu, CPU_* */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include "shim.h"
#include "core.h"

enum {
    RK_AWAIT_NAP_NS = 1000000,  /* a blocked waiter looks for work to help with at least this often */
    RK_TAKEN_NAP_NS = 1000000,  /* a pump whose worker a waiter took looks again at least this often */
    /* Its fd woke it for nothing (no event) this long in a row: doze instead.
     * Long, because over TCP a busy endpoint's progress can report no event
     * for tens of milliseconds while its data moves (up to 100 ms seen here
     * on a loaded host); short dozes, so a doze taken wrongly costs little. */
    RK_EMPTY_NS = 250000000,
    RK_DOZE_MIN_NS = 100000,    /* the first doze; each next one twice as long, up to */
    RK_DOZE_MAX_NS = 1000000,
};

struct rk_pump {
    ucp_worker_h worker;
    ucp_worker_h wake_worker;
    int wake_fd;
    rk_ctx_t *watch;
    int efd;
    int stop;
    uint64_t spin_ns;
    pid_t tid;      /* set by the loop once running (0 before) */
    int steered_from; /* the poster CPU it was last kept off, or -1 (posters
                       * touch it under their agent's lock) */
    int steer;        /* the agent asked for steering, to the CPUs of allowed */
    cpu_set_t allowed;
    int hold;       /* > 0: a poster is posting on the worker, or a poller
                     * progresses it (rk_pump_help); keep off it */
    int busy;       /* 1 while the pump's thread is in ucp_worker_progress */
    int asleep;     /* 1 while it sleeps on its worker's event fd, 2 while it
                     * dozes because the fd keeps waking it for nothing */
    uint64_t ran_ns; /* when it last progressed its worker (rk_now_ns) */
    uint64_t kicks; /* bumped by rk_pump_kick: stay awake for spin_ns */
    uint32_t taken; /* > 0 while a blocked caller does the worker's work for
                     * the whole of its wait (rk_await): the pump naps on
                     * this word instead of spinning on its hold */
    int napping;    /* 1 while it naps on taken */
    uint32_t dozing; /* 1 while it dozes (rk_pump_doze): a kick wakes it */
};

/* Keep a pump off the CPU the poster runs on (the agent decides which
 * pumps, and to which CPUs: a lane only adds bandwidth on another core,
 * but the scheduler may wake a thread on its waker's CPU and then let it
 * preempt the waker, so that both parts are copied one after the other on
 * one core). Its affinity becomes the allowed set minus the poster's
 * current CPU; a syscall only when the poster has moved. */
static void rk_pump_steer(rk_pump_t *pump)
{
    int cpu = sched_getcpu();
    pid_t tid = __atomic_load_n(&pump->tid, __ATOMIC_ACQUIRE);
    cpu_set_t set;

    if (!pump->steer || cpu < 0 || cpu >= CPU_SETSIZE || tid == 0 || cpu == pump->steered_from) {
        return;
    }
    set = pump->allowed;
    CPU_CLR(cpu, &set);
    if (CPU_COUNT(&set) == 0 || sched_setaffinity(tid, sizeof(set), &set) == 0) {
        pump->steered_from = cpu; /* (one CPU only: nowhere else to go) */
    }
}

void rk_pump_hold(rk_pump_t *pump, int delta)
{
    __atomic_fetch_add(&pump->hold, delta, __ATOMIC_ACQ_REL);
}

/* Hold the pump (it keeps off its worker) before touching anything else of
 * it, and say whether the caller may progress its worker: not once the
 * agent is closing (the close sets closing, then waits for every pump's
 * hold to drop to 0), nor while the pump itself is in progress. Release
 * with rk_pump_hold(pump, -1) either way. */
static int rk_pump_claim(rk_pump_t *pump)
{
    __atomic_fetch_add(&pump->hold, 1, __ATOMIC_SEQ_CST);
    return !__atomic_load_n(&pump->watch->closing, __ATOMIC_SEQ_CST) &&
           !__atomic_load_n(&pump->busy, __ATOMIC_SEQ_CST);
}

uint64_t rk_pump_help(rk_pump_t *pump, uint64_t max_rounds)
{
    uint64_t events = rk_pump_claim(pump) ? rk_progress(pump->worker, max_rounds) : 0;

    rk_pump_hold(pump, -1);
    return events;
}

/* Take the pump's worker for the whole of a wait, if the pump is not
 * progressing it and the agent is not closing: the caller then progresses
 * it itself, holding the pump, which naps meanwhile (rk_pump_nap). 1 if
 * taken; give it back with rk_pump_give. */
static int rk_pump_take(rk_pump_t *pump)
{
    if (!rk_pump_claim(pump)) {
        rk_pump_hold(pump, -1);
        return 0;
    }
    __atomic_fetch_add(&pump->taken, 1, __ATOMIC_SEQ_CST);
    return 1;
}

/* Give a taken worker back; wake the pump if it naps and the caller asks
 * (its wait goes on without the worker), or the agent has other transfers
 * in flight than the one just waited for (which counts until it is
 * settled). A lone request's wait leaves the pump to wake on its own: no
 * wake-up on the waiter's way out. */
static void rk_pump_give(rk_pump_t *pump, int wake)
{
    __atomic_fetch_sub(&pump->taken, 1, __ATOMIC_SEQ_CST);
    rk_pump_hold(pump, -1);
    if (__atomic_load_n(&pump->napping, __ATOMIC_SEQ_CST) &&
        (wake || __atomic_load_n(&pump->watch->live, __ATOMIC_RELAXED) > 1)) {
        rk_futex_wake(&pump->taken);
    }
}

void rk_pump_kick(rk_pump_t *pump)
{
    rk_pump_hold(pump, 1);
    rk_pump_steer(pump);
    __atomic_fetch_add(&pump->kicks, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pump->dozing, __ATOMIC_SEQ_CST) &&    /* (no store on the usual path) */
        __atomic_exchange_n(&pump->dozing, 0, __ATOMIC_SEQ_CST)) {
        rk_futex_wake(&pump->dozing);
    }
    (void)ucp_worker_signal(pump->worker);
}

static void rk_pump_wake(rk_pump_t *pump)
{
    uint64_t one = 1;

    if (pump->wake_worker != NULL) {
        (void)ucp_worker_signal(pump->wake_worker);
    }
    /* EAGAIN (counter saturated) is fine: the reader is due to wake. */
    if (pump->wake_fd >= 0 && write(pump->wake_fd, &one, sizeof(one)) < 0) {
        return;
    }
}

/* While a blocked caller has taken the worker (rk_pump_take), sleep on
 * taken rather than spin on the hold for the whole of its wait: on a host
 * with few CPUs the spin took a CPU from the caller doing the work, or from
 * a lane copying its part. At most RK_TAKEN_NAP_NS at a time (a stop
 * request, or work the waiter left, waits no longer); woken early when the
 * waiter leaves work in flight (rk_pump_give). 1 if it napped. */
static int rk_pump_nap(rk_pump_t *pump)
{
    uint32_t taken = __atomic_load_n(&pump->taken, __ATOMIC_SEQ_CST);

    if (taken == 0) {
        return 0;
    }
    /* Against rk_pump_give: mark napping, then look at taken again; the
     * giver changes taken, then looks for a napper. */
    __atomic_store_n(&pump->napping, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pump->taken, __ATOMIC_SEQ_CST) == taken &&
        !__atomic_load_n(&pump->stop, __ATOMIC_ACQUIRE)) {
        rk_futex_wait(&pump->taken, taken, RK_TAKEN_NAP_NS);
    }
    __atomic_store_n(&pump->napping, 0, __ATOMIC_SEQ_CST);
    return 1;
}

/* Sleep up to doze_ns instead of on the worker's fd, which keeps waking
 * the pump with nothing to progress: over TCP, while an endpoint's
 * connection waits for a peer that has not progressed yet (a peer stopped
 * or starved of CPU), UCX keeps the socket's EPOLLOUT ready and the pump
 * looped on it at most of a core. A kick (a post) ends the doze; a
 * completion that comes meanwhile is seen at its end. */
static void rk_pump_doze(rk_pump_t *pump, uint64_t kicks, uint64_t doze_ns)
{
    /* Against rk_pump_kick: mark dozing, then look at kicks; the kicker
     * bumps kicks, then takes the mark. */
    __atomic_store_n(&pump->dozing, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pump->kicks, __ATOMIC_SEQ_CST) == kicks &&
        !__atomic_load_n(&pump->stop, __ATOMIC_ACQUIRE)) {
        rk_futex_wait(&pump->dozing, 1, doze_ns);
    }
    __atomic_store_n(&pump->dozing, 0, __ATOMIC_SEQ_CST);
}

void rk_pump_run(rk_pump_t *pump)
{
    struct pollfd pfd;
    uint64_t last_event = 0, kicks = 0, spins = 0, k, stamp, now, doze_ns = RK_DOZE_MIN_NS;
    uint64_t empty_since = 0;   /* since when every wake by the fd found nothing (0: not so) */
    unsigned events;
    int woke = 0, dozy = 0, ready;
    uint64_t seen = rk_ctx_stamp(pump->watch);
    ucs_status_t status;

    __atomic_store_n(&pump->tid, (pid_t)syscall(SYS_gettid), __ATOMIC_RELEASE);
    pfd.fd = pump->efd;
    pfd.events = POLLIN;
    while (!__atomic_load_n(&pump->stop, __ATOMIC_ACQUIRE)) {
        k = __atomic_load_n(&pump->kicks, __ATOMIC_ACQUIRE);
        if (k != kicks) {               /* work is on its way: stay awake */
            kicks = k;
            last_event = rk_now_ns();
            empty_since = 0;
        }
        if (__atomic_load_n(&pump->hold, __ATOMIC_ACQUIRE) > 0 && rk_pump_nap(pump)) {
            continue;               /* a waiter had the worker: progress as before it */
        }
        if (__atomic_load_n(&pump->hold, __ATOMIC_ACQUIRE) > 0) {
            /* The poster is posting this worker's part (microseconds); yield
             * now and then in case it was preempted meanwhile. */
            if (++spins % 256 == 0) {
                sched_yield();
            }
            rk_cpu_relax();
            last_event = rk_now_ns();
            continue;
        }
        /* Claim the worker against rk_pump_help: store busy, then load
         * hold; the helper stores hold, then loads busy. Sequentially
         * consistent, so at least one of the two sees the other's store
         * and never both progress at once. */
        __atomic_store_n(&pump->busy, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&pump->hold, __ATOMIC_SEQ_CST) > 0) {
            __atomic_store_n(&pump->busy, 0, __ATOMIC_RELEASE);
            continue;
        }
        events = ucp_worker_progress(pump->worker);
        __atomic_store_n(&pump->busy, 0, __ATOMIC_RELEASE);
        now = rk_now_ns();
        if (events != 0) {
            last_event = now;
            empty_since = 0;
        } else if (woke && empty_since == 0) {
            empty_since = now;
        }
        woke = 0;
        dozy = empty_since != 0 && now - empty_since >= RK_EMPTY_NS;
        doze_ns = dozy ? doze_ns : RK_DOZE_MIN_NS;
        __atomic_store_n(&pump->ran_ns, now, __ATOMIC_RELAXED);
        stamp = rk_ctx_stamp(pump->watch);
        if (stamp != seen) {            /* something to settle */
            seen = stamp;
            rk_pump_wake(pump);
        }
        if (rk_now_ns() - last_event < pump->spin_ns) {
            continue;                   /* more may be queued right behind */
        }
        status = ucp_worker_arm(pump->worker);
        if (status == UCS_ERR_BUSY) {
            last_event = rk_now_ns();   /* events pending: progress again */
            continue;
        }
        if (status != UCS_OK) {
            /* Cannot sleep on the fd: poll slowly rather than spin. */
            poll(NULL, 0, 1);
            continue;
        }
        /* 100 ms: the longest a stop request waits if nobody signals. */
        __atomic_store_n(&pump->asleep, dozy ? 2 : 1, __ATOMIC_RELAXED);
        if (dozy) {                     /* then only look whether the fd still wakes it */
            rk_pump_doze(pump, kicks, doze_ns);
            doze_ns = doze_ns * 2 > RK_DOZE_MAX_NS ? RK_DOZE_MAX_NS : doze_ns * 2;
        }
        ready = poll(&pfd, 1, dozy ? 0 : 100);
        if (ready < 0 && errno != EINTR) {
            poll(NULL, 0, 1);
        }
        woke = ready > 0;
        empty_since = ready == 0 ? 0 : empty_since;     /* the fd quiet again: sleep on it */
        __atomic_store_n(&pump->asleep, 0, __ATOMIC_RELAXED);
    }
}

rk_pump_t *rk_pump_new(ucp_worker_h worker, int efd, rk_ctx_t *watch,
                       ucp_worker_h wake_worker, int wake_fd, uint64_t spin_ns,
                       const uint64_t *steer_cpus, uint32_t steer_words)
{
    rk_pump_t *pump = calloc(1, sizeof(*pump));
    uint32_t cpu;

    if (pump == NULL) {
        return NULL;
    }
    pump->worker = worker;
    pump->wake_worker = wake_worker;
    pump->wake_fd = wake_fd;
    pump->watch = watch;
    pump->efd = efd;
    pump->spin_ns = spin_ns;
    pump->steered_from = -1;
    pump->steer = steer_cpus != NULL;
    CPU_ZERO(&pump->allowed);
    for (cpu = 0; pump->steer && cpu < 64 * steer_words && cpu < CPU_SETSIZE; ++cpu) {
        if ((steer_cpus[cpu / 64] >> (cpu % 64)) & 1) {
            CPU_SET(cpu, &pump->allowed);
        }
    }
    return pump;
}

void rk_pump_stop(rk_pump_t *pump)
{
    __atomic_store_n(&pump->stop, 1, __ATOMIC_RELEASE);
    (void)ucp_worker_signal(pump->worker);
}

void rk_pump_free(rk_pump_t *pump)
{
    free(pump);
}

int rk_pump_tid(const rk_pump_t *pump)
{
    return (int)__atomic_load_n(&pump->tid, __ATOMIC_ACQUIRE);
}

void rk_pump_state(rk_pump_t *pump, uint64_t *out)
{
    out[0] = (uint64_t)__atomic_load_n(&pump->hold, __ATOMIC_ACQUIRE);
    out[1] = (uint64_t)__atomic_load_n(&pump->busy, __ATOMIC_ACQUIRE);
    out[2] = (uint64_t)__atomic_load_n(&pump->asleep, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&pump->ran_ns, __ATOMIC_RELAXED);
    out[4] = (uint64_t)__atomic_load_n(&pump->taken, __ATOMIC_ACQUIRE);
}

/* Completions or notifications published before the marks (done_head,
 * notif_head) taken earlier that no one has settled yet. */
static int rk_unsettled(rk_ctx_t *ctx, uint64_t done_mark, uint64_t notif_mark)
{
    return __atomic_load_n(&ctx->done_tail, __ATOMIC_ACQUIRE) < done_mark ||
           __atomic_load_n(&ctx->notif_tail, __ATOMIC_ACQUIRE) < notif_mark;
}

/* A caller that settles anyway is about: one blocked in rk_await, or
 * one that left it or posted within delay_ns (woken, it settles next; a
 * poster settles in its next wait, settle() or step). */
static int rk_caller_about(rk_ctx_t *ctx, uint64_t now, uint64_t delay_ns)
{
    return __atomic_load_n(&ctx->awaiting, __ATOMIC_ACQUIRE) > 0 ||
           now - __atomic_load_n(&ctx->last_call_ns, __ATOMIC_RELAXED) < delay_ns;
}

/* Sleep at most delay_ns, or until a caller settles: rk_drain bumps
 * ctx->settled, then wakes a napper; this marks itself napping, then
 * sleeps only on the word it read before. */
static void rk_service_nap(rk_ctx_t *ctx, uint64_t done_mark, uint64_t notif_mark, uint64_t delay_ns)
{
    uint32_t word = __atomic_load_n(&ctx->settled, __ATOMIC_SEQ_CST);

    __atomic_store_n(&ctx->napping, 1, __ATOMIC_SEQ_CST);
    if (rk_unsettled(ctx, done_mark, notif_mark)) {
        rk_futex_wait(&ctx->settled, word, delay_ns);
    }
    __atomic_store_n(&ctx->napping, 0, __ATOMIC_SEQ_CST);
}

/* Whether the worker's event fd has events its pump has not taken. */
static int rk_pump_ready(const rk_pump_t *pump)
{
    struct pollfd pfd = {.fd = pump->efd, .events = POLLIN};

    return poll(&pfd, 1, 0) > 0;
}

/* Progress, on the calling thread, each pump's worker whose pump has not
 * progressed it for stale_ns (runnable but given no CPU, or pinned to one
 * the scheduler keeps busy): nothing waits on a pump that does not run.
 * With nothing of the agent's own in flight (idle), only a worker with
 * events waiting: a passive target's (a peer's reads or writes, its
 * flushes) or a notification's. */
static void rk_help_stale(rk_pump_t *const *help, uint32_t nhelp, uint64_t now, uint64_t stale_ns, int idle)
{
    uint32_t i;

    for (i = 0; i < nhelp; ++i) {
        if (rk_pump_claim(help[i]) && now - __atomic_load_n(&help[i]->ran_ns, __ATOMIC_RELAXED) > stale_ns &&
            (!idle || rk_pump_ready(help[i]))) {
            (void)rk_progress(help[i]->worker, 64);
        }
        rk_pump_hold(help[i], -1);
    }
}

int rk_service_wait(rk_ctx_t *ctx, int wake_fd, uint64_t errors_seen, uint64_t delay_ns, uint64_t timeout_ns,
                    rk_pump_t *const *help, uint32_t nhelp, uint64_t stale_ns, uint64_t idle_ns)
{
    struct pollfd pfd = {.fd = wake_fd, .events = POLLIN};
    uint64_t start = rk_now_ns(), now = start, done_mark, notif_mark, value, wait_ns, look_ns, live, due;

    for (;;) {
        if (__atomic_load_n(&ctx->ep_errors, __ATOMIC_ACQUIRE) != errors_seen) {
            return 1;                   /* never left to a caller */
        }
        done_mark = __atomic_load_n(&ctx->done_head, __ATOMIC_ACQUIRE);
        notif_mark = __atomic_load_n(&ctx->notif_head, __ATOMIC_ACQUIRE);
        if (rk_unsettled(ctx, done_mark, notif_mark)) {
            if (!rk_caller_about(ctx, now, delay_ns)) {
                return 1;
            }
            /* Leave it to the caller for delay_ns, then look again at what
             * was there: the interpreter lock is taken only for what nobody
             * took, at most once per delay_ns while a caller is about. */
            rk_service_nap(ctx, done_mark, notif_mark, delay_ns);
            if (rk_unsettled(ctx, done_mark, notif_mark)) {
                return 1;
            }
            now = rk_now_ns();
            continue;                   /* more may have come meanwhile */
        }
        if (__atomic_load_n(&ctx->closing, __ATOMIC_ACQUIRE) || now - start >= timeout_ns) {
            return 0;
        }
        /* A deadline due: of a transfer posted after this wait began, with
         * a timeout shorter than the wait (its caller computed timeout_ns
         * from the deadlines it knew). */
        live = __atomic_load_n(&ctx->live, __ATOMIC_RELAXED);
        due = __atomic_load_n(&ctx->next_deadline_ns, __ATOMIC_RELAXED);
        if (live > 0 && now >= due) {
            return 1;
        }
        wait_ns = timeout_ns - (now - start);
        /* Look at the pumps every stale_ns while transfers are in flight,
         * every idle_ns otherwise; and at the next deadline. */
        look_ns = live > 0 ? stale_ns : idle_ns;
        if (nhelp > 0 && wait_ns > look_ns) {
            wait_ns = look_ns;
        }
        if (live > 0 && due - now < wait_ns) {
            wait_ns = due - now;
        }
        if (poll(&pfd, 1, (int)((wait_ns + 999999u) / 1000000u)) > 0) {
            /* Non-blocking eventfd: EAGAIN if another read took it. */
            (void)!read(wake_fd, &value, sizeof(value));
        }
        now = rk_now_ns();
        if (nhelp > 0 && !__atomic_load_n(&ctx->closing, __ATOMIC_ACQUIRE)) { /* closing: the lanes' pumps go next */
            rk_help_stale(help, nhelp, now, stale_ns, __atomic_load_n(&ctx->live, __ATOMIC_RELAXED) == 0);
            now = rk_now_ns();
        }
    }
}

int rk_await(rk_ctx_t *ctx, uint32_t slot, uint64_t id, rk_pump_t *const *help, uint32_t nhelp,
             uint32_t take_first, uint64_t spin_ns, uint64_t timeout_ns)
{
    rk_batch_t *b = &ctx->slots[slot];
    uint32_t expect = (uint32_t)(id << 1), i, taken = 0;
    uint64_t start = rk_now_ns(), now = start, last = start, events, nap, stamp, seen = rk_ctx_stamp(ctx);
    int done = 1;

    __atomic_fetch_add(&ctx->awaiting, 1, __ATOMIC_ACQ_REL);
    take_first = take_first && nhelp > 0;
    while (__atomic_load_n(&b->state, __ATOMIC_ACQUIRE) == expect) {
        if (now - start >= timeout_ns || __atomic_load_n(&ctx->closing, __ATOMIC_ACQUIRE)) {
            done = 0;
            break;
        }
        if (take_first && !taken) {     /* its pump is in progress: try again next round */
            taken = rk_pump_take(help[0]);
        }
        /* The own worker, taken: progress it as its pump would. The others:
         * do the work of any pump that is not running (asleep, or runnable
         * but not given a CPU: on a busy host each of a pump's wake-ups can
         * wait a time slice) rather than wait for it. */
        events = 0;
        if (taken) {
            events = rk_progress(help[0]->worker, 64);
            __atomic_store_n(&help[0]->ran_ns, now, __ATOMIC_RELAXED); /* for the stall report */
            /* What the pump does: something else to settle (another transfer's
             * completion, a notification) wakes whoever settles it; the own
             * transfer's is settled by this caller as it returns. */
            stamp = rk_ctx_stamp(ctx);
            if (stamp != seen && __atomic_load_n(&b->state, __ATOMIC_ACQUIRE) == expect) {
                seen = stamp;
                rk_pump_wake(help[0]);
            }
        }
        for (i = taken; i < nhelp; ++i) {
            events += rk_pump_help(help[i], 64);
        }
        if (events > 0) {
            last = now;
        } else if (now - last < spin_ns) {
            rk_cpu_relax();
        } else if (taken) {
            /* Nothing for spin_ns: the rest is in flight (on the wire, or a
             * lane's part). The own worker goes back to its pump, awake,
             * which sleeps on the worker's event fd; this caller from here
             * on sleeps on the slot. */
            rk_pump_give(help[0], 1);
            taken = take_first = 0;
        } else {
            /* Nothing to help with for spin_ns: the rest is the pumps' (busy)
             * or in flight. Sleep on the slot, woken by its completion, and
             * look again within RK_AWAIT_NAP_NS. */
            nap = timeout_ns - (now - start);
            rk_slot_sleep(b, expect, nap < RK_AWAIT_NAP_NS ? nap : RK_AWAIT_NAP_NS);
        }
        now = rk_now_ns();
    }
    if (taken) {
        rk_pump_give(help[0], 0);
    }
    __atomic_store_n(&ctx->last_call_ns, rk_now_ns(), __ATOMIC_RELAXED);
    __atomic_fetch_sub(&ctx->awaiting, 1, __ATOMIC_ACQ_REL);
    return done;
}
