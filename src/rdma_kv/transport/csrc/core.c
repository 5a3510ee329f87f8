/* rdma-kv shim core: what the post loop (post.c) and the pumps (pump.c)
 * share. The agent's context: the slab of batch records and its free
 * stack, completion counting, the completion ring, waking a waiter, the
 * notification ring; bounded progress, the clock and cpu_relax. It calls
 * nothing else of the shim. No Python.h, no policy, no logging.
 * Declarations: shim.h (public), core.h (for post.c and pump.c). */

#define _GNU_SOURCE /* syscall */
#include <limits.h>
#include <linux/futex.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include "shim.h"
#include "core.h"

void rk_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* CLOCK_MONOTONIC: the clock of Python's time.monotonic and perf_counter. */
uint64_t rk_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void rk_ctx_init(rk_ctx_t *ctx, rk_batch_t *slots, uint32_t *free_slots, uint32_t nslots,
                 uint32_t *done_ring, uint64_t done_cap)
{
    uint32_t i;

    ctx->slots = slots;
    ctx->free_slots = free_slots;
    ctx->nslots = nslots;
    for (i = 0; i < nslots; ++i) {
        slots[i].ctx = ctx;
        free_slots[i] = nslots - 1 - i; /* slot 0 on top: the first requests reuse warm records */
    }
    ctx->nfree = nslots;
    ctx->done_ring = done_ring;
    ctx->done_cap = done_cap;
}

rk_batch_t *rk_slot_take(rk_ctx_t *ctx)
{
    return ctx->nfree > 0 ? &ctx->slots[ctx->free_slots[--ctx->nfree]] : NULL;
}

void rk_record(rk_batch_t *b, ucs_status_t status)
{
    int32_t ok = UCS_OK;

    if (status != UCS_OK) {             /* first failure wins */
        __atomic_compare_exchange_n(&b->status, &ok, (int32_t)status, 0,
                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
}

void rk_batch_inc(rk_batch_t *b)
{
    /* Counted *before* the UCX call, so a completion on another thread can
     * never see the count reach zero early. */
    __atomic_fetch_add(&b->pending, 1, __ATOMIC_RELAXED);
}

static void rk_op_cb(void *request, ucs_status_t status, void *user_data)
{
    rk_batch_t *b = (rk_batch_t *)user_data;

    rk_record(b, status);
    /* Released here, not at post time: ucp_request_free() on a pending
     * request suppresses its callback. */
    ucp_request_free(request);
    rk_batch_dec(b);
}

void rk_flush_cb(void *request, ucs_status_t status, void *user_data)
{
    rk_flush_ref_t *ref = (rk_flush_ref_t *)user_data;

    /* The state first: the batch's slot (ref is in it) may be reused once
     * it completes (rk_batch_dec). Whoever waits for the count to drop to
     * close the endpoint takes the worker's lock to close it, held by this
     * thread's progress call until the callback returns. */
    __atomic_fetch_sub(&ref->st->flushing, 1, __ATOMIC_ACQ_REL);
    rk_op_cb(request, status, ref->b);
}

int32_t rk_ep_wait_flushes(ucp_worker_h worker, rk_ep_state_t *st, uint64_t timeout_ns)
{
    uint64_t start = rk_now_ns();
    int32_t left;

    while ((left = __atomic_load_n(&st->flushing, __ATOMIC_ACQUIRE)) > 0 &&
           rk_now_ns() - start < timeout_ns) {
        if (ucp_worker_progress(worker) == 0) {
            rk_cpu_relax();
        }
    }
    return left;
}

ucs_status_t rk_account(rk_batch_t *b, ucs_status_ptr_t r)
{
    ucs_status_t status = UCS_OK;

    if (UCS_PTR_IS_ERR(r)) {
        status = UCS_PTR_STATUS(r);
        rk_record(b, status);
    }
    if (r == NULL || UCS_PTR_IS_ERR(r)) {
        rk_batch_dec(b);
    }
    return status;
}

void rk_batch_begin(rk_batch_t *b, ucp_request_param_t *p, ucp_mem_h const *memhs)
{
    memset(p, 0, sizeof(*p));
    /* MULTI_SEND: UCX may batch doorbells, more operations follow. */
    p->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FLAG_MULTI_SEND;
    if (memhs != NULL) {
        /* A memory handle spares UCX a registration-cache lookup per op
         * (it matters on verbs, where every local buffer needs an lkey). */
        p->op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    }
    p->cb.send = rk_op_cb;
    p->user_data = b;
    b->pending = 1;
}

/* Claim a ring slot, fill it, then advance done_head in claim order (a
 * producer that claimed earlier publishes first; the wait is the few
 * instructions between its claim and its store). */
static void rk_ring_push(rk_ctx_t *ctx, uint32_t slot)
{
    uint64_t at = __atomic_fetch_add(&ctx->done_claim, 1, __ATOMIC_RELAXED);

    ctx->done_ring[at % ctx->done_cap] = slot;
    while (__atomic_load_n(&ctx->done_head, __ATOMIC_ACQUIRE) != at) {
        rk_cpu_relax();
    }
    __atomic_store_n(&ctx->done_head, at + 1, __ATOMIC_RELEASE);
}

void rk_futex_wake(uint32_t *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

void rk_futex_wait(uint32_t *word, uint32_t expect, uint64_t timeout_ns)
{
    struct timespec ts;

    ts.tv_sec = (time_t)(timeout_ns / 1000000000u);
    ts.tv_nsec = (long)(timeout_ns % 1000000000u);
    /* EAGAIN (changed meanwhile), EINTR, ETIMEDOUT: the caller looks again. */
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expect, &ts, NULL, 0);
}

void rk_slot_sleep(rk_batch_t *b, uint32_t expect, uint64_t timeout_ns)
{
    __atomic_fetch_add(&b->waiters, 1, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&b->ctx->closing, __ATOMIC_SEQ_CST) &&
        __atomic_load_n(&b->state, __ATOMIC_SEQ_CST) == expect) {
        rk_futex_wait(&b->state, expect, timeout_ns);
    }
    __atomic_fetch_sub(&b->waiters, 1, __ATOMIC_SEQ_CST);
}

/* The batch is complete: mark it so, then publish it. The agent may free
 * and reuse the slot as soon as it is on the ring, so the state and the
 * waiters are settled first; a late wake of a reused slot is harmless. */
static void rk_publish(rk_batch_t *b)
{
    rk_ctx_t *ctx = b->ctx;
    uint32_t waiters, k;

    b->done_ns = rk_now_ns();
    for (k = 0; k < b->nparts; ++k) {  /* its bytes no longer queued */
        __atomic_fetch_sub(&ctx->queued[b->top - k], b->share, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&b->state, (uint32_t)(b->id << 1) | 1u, __ATOMIC_SEQ_CST);
    waiters = __atomic_load_n(&b->waiters, __ATOMIC_SEQ_CST);
    rk_ring_push(ctx, (uint32_t)(b - ctx->slots));
    if (waiters > 0) {
        rk_futex_wake(&b->state);
    }
}

/* Announce a send on the peer's endpoint, then look whether it is closing:
 * either rk_ep_quiesce sees the announcement and waits for the send, or
 * this sees the close coming and does not send (both sequentially
 * consistent). */
int rk_ep_enter(rk_ep_state_t *st)
{
    __atomic_fetch_add(&st->sending, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&st->closing, __ATOMIC_SEQ_CST)) {
        __atomic_fetch_sub(&st->sending, 1, __ATOMIC_RELEASE);
        return 0;
    }
    return 1;
}

void rk_ep_quiesce(rk_ep_state_t *st)
{
    __atomic_store_n(&st->closing, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&st->sending, __ATOMIC_SEQ_CST) > 0) {
        rk_cpu_relax();
    }
}

static void rk_batch_complete(rk_batch_t *b)
{
    ucp_request_param_t p;
    rk_ctx_t *ctx = b->ctx;
    ucs_status_ptr_t r;

    if (b->then != NULL && !b->then_sent && b->status == UCS_OK) {
        /* Its chained read: the batch completes once that does (through
         * this function again, then_sent set), here or on the thread that
         * progresses it. Not for an abandoned batch, nor on an endpoint
         * being closed (as a notification, below). */
        if (!__atomic_load_n(&b->abandoned, __ATOMIC_ACQUIRE) && b->chain(b)) {
            return;
        }
        b->status = UCS_ERR_CANCELED;
    }
    if (b->status == UCS_OK && b->has_notif && !b->notif_sent &&
        (__atomic_load_n(&b->abandoned, __ATOMIC_ACQUIRE) || !rk_ep_enter(b->peer))) {
        /* An abandoned batch's peer may be gone: its endpoint closed, its
         * state freed. A failed peer's endpoint is closed, or about to be
         * (its lanes' parts can complete after that, on their pumps). */
        b->status = UCS_ERR_CANCELED;
    } else if (b->status == UCS_OK && b->has_notif && !b->notif_sent) {
        /* Every operation completed locally on every worker (for PUT also
         * remotely, via a flush of each endpoint used), so the peer may now
         * act on the notification. This may run on a lane's pump: notif_ep
         * is the agent's own worker's, which is then UCS_THREAD_MODE_MULTI. */
        b->notif_sent = 1;
        __atomic_store_n(&b->pending, 1, __ATOMIC_RELAXED); /* a guard, as while posting */
        rk_batch_inc(b);
        memset(&p, 0, sizeof(p));
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_FLAGS;
        p.cb.send = rk_op_cb;
        p.user_data = b;
        /* Eager: the receiver's handler copies from the wire buffer and
         * never has to issue a rendezvous receive. */
        p.flags = UCP_AM_SEND_FLAG_EAGER;
        r = ucp_am_send_nbx(b->notif_ep, ctx->am_id, ctx->name, ctx->name_len,
                            b->notif_data, b->notif_len, &p);
        __atomic_fetch_sub(&b->peer->sending, 1, __ATOMIC_RELEASE); /* rk_ep_enter's */
        rk_account(b, r);
        if (__atomic_sub_fetch(&b->pending, 1, __ATOMIC_ACQ_REL) > 0) {
            return;
        }
    }
    rk_publish(b);
}

void rk_batch_dec(rk_batch_t *b)
{
    if (__atomic_sub_fetch(&b->pending, 1, __ATOMIC_ACQ_REL) == 0) {
        rk_batch_complete(b);
    }
}

uint64_t rk_drain(rk_ctx_t *ctx, uint64_t *out, uint64_t max)
{
    uint64_t head = __atomic_load_n(&ctx->done_head, __ATOMIC_ACQUIRE), n = 0;
    rk_batch_t *b;
    uint32_t slot;

    while (ctx->done_tail < head && n < max) {
        slot = ctx->done_ring[ctx->done_tail % ctx->done_cap];
        ctx->done_tail++;
        b = &ctx->slots[slot];
        out[2 * n] = (uint64_t)slot | ((uint64_t)(uint32_t)b->status << 32);
        out[2 * n + 1] = b->done_ns;
        n++;
        if (!b->abandoned) {
            b->peer->inflight--;
            ctx->live--;
        }
        b->deadline_ns = 0;
        b->abandoned = 0;
        ctx->free_slots[ctx->nfree++] = slot;
    }
    if (n > 0) {
        /* Against rk_service_nap: bump the word, then look for a napper;
         * it marks itself napping, then sleeps only on the word it read. */
        __atomic_fetch_add(&ctx->settled, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&ctx->napping, __ATOMIC_SEQ_CST)) {
            rk_futex_wake(&ctx->settled);
        }
    }
    return n;
}

uint64_t rk_expired(rk_ctx_t *ctx, uint64_t now_ns, uint32_t *out, uint64_t max)
{
    uint64_t n = 0, next = UINT64_MAX, d;
    uint32_t i;

    if (ctx->live == 0 || now_ns < ctx->next_deadline_ns) {
        return 0;
    }
    for (i = 0; i < ctx->nslots; ++i) {
        d = ctx->slots[i].deadline_ns;
        if (d == 0 || (__atomic_load_n(&ctx->slots[i].state, __ATOMIC_ACQUIRE) & 1u)) {
            continue;                   /* free, abandoned, or on its way to the ring */
        }
        if (d <= now_ns && n < max) {
            out[n++] = i;
        } else if (d < next) {
            next = d;
        }
    }
    ctx->next_deadline_ns = n == max ? now_ns : next;
    return n;
}

uint32_t rk_look(rk_ctx_t *ctx, uint64_t errors_seen, uint64_t dropped_seen)
{
    uint32_t bits = 0;

    if (__atomic_load_n(&ctx->done_head, __ATOMIC_ACQUIRE) != ctx->done_tail) {
        bits |= RK_LOOK_DONE;
    }
    if (__atomic_load_n(&ctx->notif_head, __ATOMIC_ACQUIRE) != ctx->notif_tail ||
        ctx->notif_dropped_full + ctx->notif_dropped_rndv != dropped_seen) {
        bits |= RK_LOOK_NOTIF;
    }
    if (__atomic_load_n(&ctx->ep_errors, __ATOMIC_ACQUIRE) != errors_seen) {
        bits |= RK_LOOK_ERRORS;
    }
    if (ctx->live > 0 && rk_now_ns() >= ctx->next_deadline_ns) {
        bits |= RK_LOOK_DUE;
    }
    return bits;
}

void rk_abandon(rk_ctx_t *ctx, uint32_t slot)
{
    rk_batch_t *b = &ctx->slots[slot];

    __atomic_store_n(&b->abandoned, 1, __ATOMIC_RELEASE);
    b->deadline_ns = 0;
    b->peer->inflight--;
    ctx->live--;
    /* Waiters wake; the state is marked complete again when UCX hands the
     * slot back. */
    __atomic_store_n(&b->state, (uint32_t)(b->id << 1) | 1u, __ATOMIC_SEQ_CST);
    rk_futex_wake(&b->state);
}

void rk_wake_waiters(rk_ctx_t *ctx)
{
    uint32_t i;

    /* Against rk_slot_sleep: it counts itself a waiter, then looks at
     * closing; this sets closing, then looks at the waiters. One of the two
     * sees the other; a waiter seen has its word changed and is woken. */
    __atomic_store_n(&ctx->closing, 1, __ATOMIC_SEQ_CST);
    for (i = 0; i < ctx->nslots; ++i) {
        if (__atomic_load_n(&ctx->slots[i].waiters, __ATOMIC_SEQ_CST) > 0) {
            __atomic_fetch_or(&ctx->slots[i].state, 1u, __ATOMIC_SEQ_CST);
            rk_futex_wake(&ctx->slots[i].state);
        }
    }
}

/* A number that changes whenever the context has something to settle:
 * the three counters only grow. */
uint64_t rk_ctx_stamp(rk_ctx_t *ctx)
{
    return __atomic_load_n(&ctx->done_head, __ATOMIC_ACQUIRE) +
           __atomic_load_n(&ctx->notif_head, __ATOMIC_ACQUIRE) +
           __atomic_load_n(&ctx->ep_errors, __ATOMIC_ACQUIRE);
}

void rk_ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    rk_ep_state_t *st = (rk_ep_state_t *)arg;

    (void)ep;
    if (!st->failed) {
        st->status = status;
        __atomic_store_n(&st->failed, 1, __ATOMIC_RELEASE);
        if (st->ctx != NULL) {
            __atomic_fetch_add(&st->ctx->ep_errors, 1, __ATOMIC_RELEASE);
        }
    }
}

uint64_t rk_progress(ucp_worker_h worker, uint64_t max_rounds)
{
    uint64_t total = 0, i;
    unsigned events;

    for (i = 0; i < max_rounds; ++i) {
        events = ucp_worker_progress(worker);
        if (events == 0) {
            break;
        }
        total += events;
    }
    return total;
}

static ucs_status_t rk_notif_cb(void *arg, const void *header, size_t header_length,
                                void *data, size_t length, const ucp_am_recv_param_t *param)
{
    rk_ctx_t *ctx = (rk_ctx_t *)arg;
    uint8_t *slot;
    uint32_t hl, dl;

    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        /* Senders always use eager; a rendezvous message is not ours. */
        ctx->notif_dropped_rndv++;
        return UCS_OK;
    }
    if (ctx->notif_head - ctx->notif_tail >= ctx->notif_nslots ||
        header_length + length + 8 > ctx->notif_slot_size) {
        ctx->notif_dropped_full++;
        return UCS_OK;
    }
    slot = ctx->notif_slots + (ctx->notif_head % ctx->notif_nslots) * ctx->notif_slot_size;
    hl = (uint32_t)header_length;
    dl = (uint32_t)length;
    memcpy(slot, &hl, 4);
    memcpy(slot + 4, &dl, 4);
    if (hl) {
        memcpy(slot + 8, header, hl);
    }
    if (dl) {
        memcpy(slot + 8 + hl, data, dl);
    }
    __atomic_store_n(&ctx->notif_head, ctx->notif_head + 1, __ATOMIC_RELEASE);
    return UCS_OK;
}

ucs_status_t rk_set_notif_handler(ucp_worker_h worker, uint32_t am_id, rk_ctx_t *ctx)
{
    ucp_am_handler_param_t p;

    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id = am_id;
    p.cb = rk_notif_cb;
    p.arg = ctx;
    return ucp_worker_set_am_recv_handler(worker, &p);
}

ucs_status_t rk_wait_request(ucp_worker_h worker, ucs_status_ptr_t request, uint64_t timeout_ns)
{
    uint64_t start;
    ucs_status_t status;

    if (request == NULL) {
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(request)) {
        return UCS_PTR_STATUS(request);
    }
    start = rk_now_ns();
    status = ucp_request_check_status(request);
    while (status == UCS_INPROGRESS && rk_now_ns() - start < timeout_ns) {
        if (ucp_worker_progress(worker) == 0) {
            rk_cpu_relax();
        }
        status = ucp_request_check_status(request);
    }
    ucp_request_free(request);
    return status;
}
