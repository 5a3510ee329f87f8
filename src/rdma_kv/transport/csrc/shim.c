/* rdma-kv C shim: batched one-sided posts, completion counting, bounded
 * progress and the notification receive ring. No Python.h, no policy, no
 * logging: every decision is made by the Python caller. Declarations and
 * ownership rules are in shim.h. */

#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>
#include "shim.h"
#include "pump.h"

static void rk_batch_complete(rk_batch_t *b);

/* Hold the pumps of workers 1..nparts-1 of a stripe (bit w of *held set)
 * while their parts are posted, and kick each one held so that its wake-up
 * overlaps the posting. Held first: a kicked pump spins on the worker,
 * taking its lock for every progress call and again at once, and on cma
 * each call copies -- a poster contending for that lock waits out the copy. */
static void rk_hold(const rk_stripe_t *s, uint32_t nparts, uint64_t *held)
{
    uint32_t w;

    *held = 0;
    for (w = 1; w < nparts && w < 64 && s->pumps != NULL; ++w) {
        if (s->pumps[w] != NULL) {
            rk_pump_hold(s->pumps[w], 1);
            *held |= (uint64_t)1 << w;
            rk_pump_kick(s->pumps[w]);
        }
    }
}

static void rk_release(const rk_stripe_t *s, uint64_t *held, uint32_t w)
{
    if (w < 64 && ((*held >> w) & 1)) {
        *held &= ~((uint64_t)1 << w);
        rk_pump_hold(s->pumps[w], -1);
    }
}

static void rk_record(rk_batch_t *b, ucs_status_t status)
{
    int32_t ok = UCS_OK;

    if (status != UCS_OK) {             /* first failure wins */
        __atomic_compare_exchange_n(&b->status, &ok, (int32_t)status, 0,
                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
}

/* One more operation will be handed to UCX: counted *before* the call, so
 * a completion on another thread can never see the count reach zero early. */
static void rk_batch_inc(rk_batch_t *b)
{
    __atomic_fetch_add(&b->pending, 1, __ATOMIC_RELAXED);
}

/* One operation of the batch completed (UCX callback or inline). */
static void rk_batch_dec(rk_batch_t *b)
{
    if (__atomic_sub_fetch(&b->pending, 1, __ATOMIC_ACQ_REL) == 0) {
        rk_batch_complete(b);
    }
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

/* After a UCX call preceded by rk_batch_inc: done in place or refused
 * count down now; pending completes through rk_op_cb. */
static ucs_status_t rk_account(rk_batch_t *b, ucs_status_ptr_t r)
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

/* Publish a finished batch: claim a slot, fill it, then advance done_head
 * in claim order (a concurrent producer that claimed earlier publishes
 * first; the wait is the few instructions between its claim and store). */
static void rk_ring_push(rk_ctx_t *ctx, uint64_t id)
{
    uint64_t slot = __atomic_fetch_add(&ctx->done_claim, 1, __ATOMIC_RELAXED);

    ctx->done_ring[slot % ctx->done_cap] = id;
    while (__atomic_load_n(&ctx->done_head, __ATOMIC_ACQUIRE) != slot) {
        rk_cpu_relax();
    }
    __atomic_store_n(&ctx->done_head, slot + 1, __ATOMIC_RELEASE);
}

uint64_t rk_done_head(rk_ctx_t *ctx)
{
    return __atomic_load_n(&ctx->done_head, __ATOMIC_ACQUIRE);
}

static void rk_batch_complete(rk_batch_t *b)
{
    ucp_request_param_t p;
    ucs_status_ptr_t r;

    if (b->status == UCS_OK && b->has_notif && !b->notif_sent) {
        /* Every operation completed locally on every worker (for PUT also
         * remotely, via a flush of each endpoint used), so the peer may now
         * act on the notification. This may run on a lane's pump: b->ep is
         * the agent's own worker's, which is then UCS_THREAD_MODE_MULTI. */
        b->notif_sent = 1;
        __atomic_store_n(&b->pending, 2, __ATOMIC_RELAXED); /* guard + send */
        memset(&p, 0, sizeof(p));
        p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                         UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_FLAGS;
        p.cb.send = rk_op_cb;
        p.user_data = b;
        /* Eager: the receiver's handler copies from the wire buffer and
         * never has to issue a rendezvous receive. */
        p.flags = UCP_AM_SEND_FLAG_EAGER;
        r = ucp_am_send_nbx(b->ep, b->am_id, b->notif_header,
                            b->notif_header_len, b->notif_data,
                            b->notif_data_len, &p);
        rk_account(b, r);
        if (__atomic_sub_fetch(&b->pending, 1, __ATOMIC_ACQ_REL) > 0) {
            return;
        }
    }
    b->done = 1;
    rk_ring_push(b->ctx, b->id);
}

void rk_ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    rk_ep_state_t *st = (rk_ep_state_t *)arg;
    (void)ep;
    if (!st->failed) {
        st->status = status;
        st->failed = 1;
        if (st->ctx != NULL) {
            __atomic_fetch_add(&st->ctx->ep_errors, 1, __ATOMIC_RELEASE);
        }
    }
}

/* Request parameters shared by every operation of a batch; the guard count
 * keeps the batch from completing while it is still being posted. */
static void rk_begin(rk_batch_t *b, ucp_request_param_t *p, ucp_mem_h const *memhs)
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

/* An endpoint flush counted as one operation of the batch: it completes
 * once every operation posted on ep so far completed remotely (a PUT's data
 * is then visible at the target, so a notification may follow). */
static void rk_flush_ep(rk_batch_t *b, ucp_request_param_t *p, ucp_ep_h ep)
{
    if (b->status == UCS_OK) {
        p->op_attr_mask &= ~(uint32_t)(UCP_OP_ATTR_FIELD_MEMH |
                                       UCP_OP_ATTR_FLAG_MULTI_SEND);
        rk_batch_inc(b);
        rk_account(b, ucp_ep_flush_nbx(ep, p));
    }
}

/* Optional endpoint flush (remote completion before a notification), then
 * drop the guard; returns the operations posted. */
static uint64_t rk_end(rk_batch_t *b, ucp_request_param_t *p, int flush)
{
    if (flush) {
        rk_flush_ep(b, p, b->ep);
    }
    rk_batch_dec(b);
    return b->posted;
}

/* Post one merged run on ep; false (and the batch's status set) on error. */
static int rk_post_on(rk_batch_t *b, ucp_ep_h ep, int op, ucp_request_param_t *p,
                      uint64_t laddr, uint64_t raddr, uint64_t len,
                      ucp_mem_h const *memhs, uint32_t lreg, ucp_rkey_h rkey)
{
    ucs_status_ptr_t r;

    if (memhs != NULL) {
        p->memh = memhs[lreg];
    }
    rk_batch_inc(b);
    if (op == RK_OP_GET) {
        r = ucp_get_nbx(ep, (void *)(uintptr_t)laddr, len, raddr, rkey, p);
    } else {
        r = ucp_put_nbx(ep, (const void *)(uintptr_t)laddr, len, raddr, rkey, p);
    }
    if (rk_account(b, r) != UCS_OK) {
        return 0;
    }
    b->posted++;
    return 1;
}

/* Index i of an index array of int32 (is32) or int64, as unsigned: a
 * negative index becomes larger than any list. */
static inline uint64_t rk_at(const void *a, uint32_t is32, uint64_t i)
{
    return is32 ? (uint64_t)(int64_t)((const int32_t *)a)[i] : (uint64_t)((const int64_t *)a)[i];
}

uint64_t rk_check_indexed(uint64_t n, const void *lidx, const void *ridx, uint32_t idx32,
                          uint64_t nl, uint64_t nr, const uint64_t *llen_tab,
                          const uint64_t *rlen_tab, uint64_t *nbytes)
{
    uint64_t i, li, ri, total = 0;

    for (i = 0; i < n; ++i) {
        /* A negative index, cast, is larger than any list. */
        li = rk_at(lidx, idx32 & RK_IDX_L32, i);
        ri = rk_at(ridx, idx32 & RK_IDX_R32, i);
        if (li >= nl || ri >= nr) {
            break;
        }
        if (llen_tab != NULL) {
            if (rlen_tab == NULL || llen_tab[li] != rlen_tab[ri]) {
                break;
            }
            total += llen_tab[li];
        }
    }
    *nbytes = total;
    return i;
}

/* Worker w's part is posted: release its pump. A held pump was kicked
 * before the post and has spun since (a hold keeps it awake), so it
 * progresses the part at once; only a lane worker without a held pump is
 * signalled (an eventfd write: 10-25 us of the poster's time on a VM). */
static void rk_part_posted(const rk_stripe_t *s, uint64_t *held, uint32_t w, uint64_t ops)
{
    int kicked = w < 64 && ((*held >> w) & 1);

    rk_release(s, held, w);
    if (w > 0 && ops > 0 && !kicked) {
        ucp_worker_signal(s->workers[w]);
    }
}

/* End of part k of nparts in a stream of total bytes: a 4 KiB boundary
 * (the last part ends at the total). */
static uint64_t rk_cut(uint64_t total, uint32_t k, uint32_t nparts)
{
    return k >= nparts ? total : (uint64_t)(((__uint128_t)total * k / nparts) & ~(uint64_t)4095);
}

/* The byte stream of the index pairs, cut into nparts parts of about equal
 * bytes (a descriptor may be cut, at a 4 KiB boundary of the stream);
 * part j is posted on worker w = nparts-1-j (so the lanes' parts go first
 * and the poster's own worker, w = 0, takes the last). Runs contiguous on
 * both sides, in the same regions and the same part, merge into one op. */
static int rk_stream(rk_batch_t *b, int op, ucp_request_param_t *p, uint64_t n,
                     const void *lidx, const void *ridx, uint32_t idx32,
                     const uint64_t *laddr_tab, const uint64_t *raddr_tab,
                     const uint64_t *len_tab, const uint32_t *lreg_tab,
                     const uint32_t *rreg_tab, ucp_mem_h const *memhs,
                     const rk_stripe_t *s, uint32_t nparts, uint64_t nbytes,
                     uint64_t *worker_ops, uint64_t *held)
{
    uint64_t i, li, ri, off, take, l, x, y, pos = 0, la = 0, ra = 0, len = 0;
    uint64_t cut = rk_cut(nbytes, 1, nparts);
    uint32_t part = 0, w = nparts - 1, lr = 0, rr = 0, lr_i, rr_i;
    int open = 0;

#define RK_FLUSH_RUN()                                                      \
    do {                                                                    \
        if (open) {                                                         \
            if (!rk_post_on(b, s->eps[w], op, p, la, ra, len, memhs, lr,    \
                            s->rkeys[w][rr])) {                             \
                return 0;                                                   \
            }                                                               \
            worker_ops[w]++;                                                \
            open = 0;                                                       \
        }                                                                   \
    } while (0)

    for (i = 0; i < n; ++i) {
        li = rk_at(lidx, idx32 & RK_IDX_L32, i);
        ri = rk_at(ridx, idx32 & RK_IDX_R32, i);
        x = laddr_tab[li];
        y = raddr_tab[ri];
        l = len_tab[li];
        lr_i = lreg_tab != NULL ? lreg_tab[li] : 0;
        rr_i = rreg_tab != NULL ? rreg_tab[ri] : 0;
        for (off = 0; off < l;) {
            if (pos >= cut && part + 1 < nparts) {
                /* This part is full: post its last run, wake its worker. */
                RK_FLUSH_RUN();
                rk_part_posted(s, held, w, worker_ops[w]);
                part++;
                w--;
                cut = rk_cut(nbytes, part + 1, nparts);
                continue;
            }
            take = l - off;
            if (part + 1 < nparts && take > cut - pos) {
                take = cut - pos;
            }
            if (open && x + off == la + len && y + off == ra + len &&
                lr_i == lr && rr_i == rr) {
                len += take;            /* contiguous on both sides: extend */
            } else {
                RK_FLUSH_RUN();
                la = x + off; ra = y + off; len = take; lr = lr_i; rr = rr_i;
                open = 1;
            }
            off += take;
            pos += take;
        }
    }
    RK_FLUSH_RUN();
    rk_part_posted(s, held, w, worker_ops[w]);
#undef RK_FLUSH_RUN
    return 1;
}

uint64_t rk_post_indexed(rk_batch_t *b, int op, uint64_t n,
                         const void *lidx, const void *ridx, uint32_t idx32,
                         const uint64_t *laddr_tab, const uint64_t *raddr_tab,
                         const uint64_t *len_tab, const uint32_t *lreg_tab,
                         const uint32_t *rreg_tab, ucp_mem_h const *memhs,
                         ucp_rkey_h const *rkeys, const rk_stripe_t *stripe,
                         uint32_t nparts, uint64_t nbytes, uint64_t *worker_ops,
                         int flush)
{
    ucp_request_param_t p;
    rk_stripe_t one;
    uint64_t own_ops = 0, held = 0;
    uint32_t w;

    if (nparts <= 1) {
        /* The own worker only: batch->ep and rkeys, no lane to hold. */
        one.eps = &b->ep;
        one.rkeys = &rkeys;
        one.workers = NULL;
        one.pumps = NULL;
        if (worker_ops == NULL) {
            worker_ops = &own_ops;
        }
        worker_ops[0] = 0;
        rk_begin(b, &p, memhs);
        rk_stream(b, op, &p, n, lidx, ridx, idx32, laddr_tab, raddr_tab, len_tab, lreg_tab,
                  rreg_tab, memhs, &one, 1, 0, worker_ops, &held);
        return rk_end(b, &p, flush);
    }
    for (w = 0; w < nparts; ++w) {
        worker_ops[w] = 0;
    }
    rk_hold(stripe, nparts, &held);
    rk_begin(b, &p, memhs);
    rk_stream(b, op, &p, n, lidx, ridx, idx32, laddr_tab, raddr_tab, len_tab, lreg_tab,
              rreg_tab, memhs, stripe, nparts, nbytes, worker_ops, &held);
    for (w = 1; w < nparts; ++w) {  /* parts a failed post never reached */
        rk_release(stripe, &held, w);
    }
    /* A flush per endpoint that carried a part: each worker's endpoint
     * completes only its own operations remotely, so the notification
     * (sent on worker 0's endpoint once the count reaches zero) waits for
     * every lane's data to be visible at the target. */
    for (w = 0; flush && w < nparts; ++w) {
        if (worker_ops[w] > 0) {
            rk_flush_ep(b, &p, stripe->eps[w]);
        }
    }
    return rk_end(b, &p, 0);
}

uint32_t rk_stripe_parts(uint64_t nbytes, uint32_t nworkers, uint64_t lane_min_bytes)
{
    uint64_t parts = lane_min_bytes > 0 ? nbytes / lane_min_bytes : 0;

    return parts < 2 ? 1 : (parts > nworkers ? nworkers : (uint32_t)parts);
}

int64_t rk_submit(const rk_route_t *r, rk_batch_t *b, uint64_t id, int op, uint64_t n,
                  const void *lidx, const void *ridx, uint32_t idx32, int flush,
                  uint64_t *out)
{
    uint64_t nbytes, ok;
    uint32_t w, parts;

    if (*r->epoch != r->built_at) {
        return RK_SUBMIT_STALE;
    }
    b->id = id;
    b->ctx = r->ctx;
    b->ep = r->ep;
    for (w = 0; w < r->nworkers; ++w) {
        if (__atomic_load_n(&r->ep_states[w]->failed, __ATOMIC_ACQUIRE)) {
            return RK_SUBMIT_PEER_FAILED;
        }
    }
    if (r->uniform != 0) {
        ok = rk_check_indexed(n, lidx, ridx, idx32, r->nl, r->nr, NULL, NULL, &nbytes);
        nbytes = r->uniform * n;
    } else {
        ok = rk_check_indexed(n, lidx, ridx, idx32, r->nl, r->nr, r->llen, r->rlen, &nbytes);
    }
    if (ok != n) {
        out[0] = ok;
        return RK_SUBMIT_BAD_PAIR;
    }
    parts = rk_stripe_parts(nbytes, r->nworkers, r->lane_min_bytes);
    out[0] = nbytes;
    out[1] = parts;
    return (int64_t)rk_post_indexed(b, op, n, lidx, ridx, idx32, r->laddr, r->raddr, r->llen,
                                    r->lreg, r->rreg, r->memhs, r->rkeys, r->stripe, parts,
                                    nbytes, out + 2, flush);
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

static ucs_status_t rk_notif_cb(void *arg, const void *header,
                                size_t header_length, void *data,
                                size_t length, const ucp_am_recv_param_t *param)
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
    slot = ctx->notif_slots +
           (ctx->notif_head % ctx->notif_nslots) * ctx->notif_slot_size;
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

ucs_status_t rk_set_notif_handler(ucp_worker_h worker, uint32_t am_id,
                                  rk_ctx_t *ctx)
{
    ucp_am_handler_param_t p;

    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                   UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id = am_id;
    p.cb = rk_notif_cb;
    p.arg = ctx;
    return ucp_worker_set_am_recv_handler(worker, &p);
}

ucs_status_t rk_wait_request(ucp_worker_h worker, ucs_status_ptr_t request,
                             uint64_t max_rounds)
{
    ucs_status_t status;
    uint64_t i;

    if (request == NULL) {
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(request)) {
        return UCS_PTR_STATUS(request);
    }
    status = ucp_request_check_status(request);
    for (i = 0; status == UCS_INPROGRESS && i < max_rounds; ++i) {
        ucp_worker_progress(worker);
        status = ucp_request_check_status(request);
    }
    ucp_request_free(request);
    return status;
}
