/* rdma-kv C shim: batched one-sided posts, completion counting, bounded
 * progress and the notification receive ring. No Python.h, no policy, no
 * logging: every decision is made by the Python caller. Declarations and
 * ownership rules are in shim.h. */

#include <string.h>
#include <ucp/api/ucp.h>
#include "shim.h"

static void rk_batch_complete(rk_batch_t *b);

static void rk_record(rk_batch_t *b, ucs_status_t status)
{
    if (status != UCS_OK && b->status == UCS_OK) {
        b->status = status;
    }
}

/* One operation of the batch completed (UCX callback or inline). */
static void rk_batch_dec(rk_batch_t *b)
{
    if (--b->pending == 0) {
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

static ucs_status_t rk_account(rk_batch_t *b, ucs_status_ptr_t r)
{
    if (r == NULL) {
        return UCS_OK;                      /* completed in place */
    }
    if (UCS_PTR_IS_ERR(r)) {
        rk_record(b, UCS_PTR_STATUS(r));
        return UCS_PTR_STATUS(r);
    }
    /* Pending: rk_op_cb completes and releases it. */
    b->pending++;
    return UCS_OK;
}

static void rk_batch_complete(rk_batch_t *b)
{
    rk_ctx_t *ctx = b->ctx;
    ucp_request_param_t p;
    ucs_status_ptr_t r;

    if (b->status == UCS_OK && b->has_notif && !b->notif_sent) {
        /* Every operation completed locally (for PUT also remotely, via the
         * flush), so the peer may now act on the notification. */
        b->notif_sent = 1;
        b->pending = 1;
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
        if (--b->pending > 0) {
            return;
        }
    }
    b->done = 1;
    ctx->done_ring[ctx->done_head % ctx->done_cap] = b->id;
    ctx->done_head++;
}

void rk_ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    rk_ep_state_t *st = (rk_ep_state_t *)arg;
    (void)ep;
    if (!st->failed) {
        st->status = status;
        st->failed = 1;
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

/* Optional endpoint flush (remote completion before a notification), then
 * drop the guard; returns the operations posted. */
static uint64_t rk_end(rk_batch_t *b, ucp_request_param_t *p, int flush)
{
    if (flush && b->status == UCS_OK) {
        p->op_attr_mask &= ~(uint32_t)(UCP_OP_ATTR_FIELD_MEMH |
                                       UCP_OP_ATTR_FLAG_MULTI_SEND);
        rk_account(b, ucp_ep_flush_nbx(b->ep, p));
    }
    rk_batch_dec(b);
    return b->posted;
}

/* Post one merged run; false (and the batch's status set) on error. */
static int rk_post_one(rk_batch_t *b, int op, ucp_request_param_t *p,
                       uint64_t laddr, uint64_t raddr, uint64_t len,
                       ucp_mem_h const *memhs, uint32_t lreg, ucp_rkey_h rkey)
{
    ucs_status_ptr_t r;

    if (memhs != NULL) {
        p->memh = memhs[lreg];
    }
    if (op == RK_OP_GET) {
        r = ucp_get_nbx(b->ep, (void *)(uintptr_t)laddr, len, raddr, rkey, p);
    } else {
        r = ucp_put_nbx(b->ep, (const void *)(uintptr_t)laddr, len, raddr, rkey, p);
    }
    if (rk_account(b, r) != UCS_OK) {
        return 0;
    }
    b->posted++;
    return 1;
}

uint64_t rk_post(rk_batch_t *b, int op, uint64_t n,
                 const uint64_t *laddr, const uint64_t *raddr,
                 const uint64_t *len, const uint32_t *lreg,
                 ucp_mem_h const *memhs, const uint32_t *rreg,
                 ucp_rkey_h const *rkeys, int flush)
{
    ucp_request_param_t p;
    uint64_t i;

    rk_begin(b, &p, memhs);
    for (i = 0; i < n; ++i) {
        if (!rk_post_one(b, op, &p, laddr[i], raddr[i], len[i], memhs, lreg[i],
                         rkeys[rreg[i]])) {
            break;
        }
    }
    return rk_end(b, &p, flush);
}

uint64_t rk_check_indexed(uint64_t n, const int64_t *lidx, const int64_t *ridx,
                          uint64_t nl, uint64_t nr, const uint64_t *llen_tab,
                          const uint64_t *rlen_tab, uint64_t *nbytes)
{
    uint64_t i, total = 0;

    for (i = 0; i < n; ++i) {
        /* A negative index, cast, is larger than any list. */
        if ((uint64_t)lidx[i] >= nl || (uint64_t)ridx[i] >= nr) {
            break;
        }
        if (llen_tab != NULL) {
            if (rlen_tab == NULL || llen_tab[lidx[i]] != rlen_tab[ridx[i]]) {
                break;
            }
            total += llen_tab[lidx[i]];
        }
    }
    *nbytes = total;
    return i;
}

uint64_t rk_post_indexed(rk_batch_t *b, int op, uint64_t n,
                         const int64_t *lidx, const int64_t *ridx,
                         const uint64_t *laddr_tab, const uint64_t *raddr_tab,
                         const uint64_t *len_tab, const uint32_t *lreg_tab,
                         const uint32_t *rreg_tab, ucp_mem_h const *memhs,
                         ucp_rkey_h const *rkeys, int flush)
{
    ucp_request_param_t p;
    uint64_t i, la = 0, ra = 0, len = 0, l, x, y;
    uint32_t lr = 0, rr = 0, lr_i, rr_i;
    int open = 0, ok = 1;

    rk_begin(b, &p, memhs);
    for (i = 0; i < n && ok; ++i) {
        x = laddr_tab[lidx[i]];
        y = raddr_tab[ridx[i]];
        l = len_tab[lidx[i]];
        lr_i = lreg_tab != NULL ? lreg_tab[lidx[i]] : 0;
        rr_i = rreg_tab != NULL ? rreg_tab[ridx[i]] : 0;
        if (open && x == la + len && y == ra + len && lr_i == lr && rr_i == rr) {
            len += l;                   /* contiguous on both sides: extend */
            continue;
        }
        if (open) {
            ok = rk_post_one(b, op, &p, la, ra, len, memhs, lr, rkeys[rr]);
        }
        la = x; ra = y; len = l; lr = lr_i; rr = rr_i; open = 1;
    }
    if (open && ok) {
        rk_post_one(b, op, &p, la, ra, len, memhs, lr, rkeys[rr]);
    }
    return rk_end(b, &p, flush);
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
    ctx->notif_head++;
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
