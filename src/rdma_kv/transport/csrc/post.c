/* rdma-kv post loop: the one submit path (rk_submit), for prepared lists
 * addressed by index and for explicit descriptors alike. It checks every
 * pair, takes a batch record from the slab, decides the workers by the
 * route's policy and posts in one pass: gathered, merged (runs contiguous
 * on both sides in the same regions become one operation) and, when large
 * enough, striped over the lanes. No Python.h, no logging. Declarations:
 * shim.h; uses core.c and pump.c through core.h. */

#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <ucp/api/ucp.h>
#include "shim.h"
#include "core.h"

/* One descriptor of one side. */
typedef struct rk_desc {
    uint64_t addr;
    uint64_t len;
    uint32_t reg;
} rk_desc_t;

/* The request being submitted: its route, its selection of pairs and, for
 * explicit descriptors, where on each side the last one was found. */
typedef struct rk_req {
    const rk_route_t *r;
    const void *lsel;
    const void *rsel;
    const uint64_t *llen;
    const uint64_t *rlen;
    uint32_t flags;
    uint64_t lhint;
    uint64_t rhint;
} rk_req_t;

/* A run being merged: consecutive pairs contiguous on both sides. */
typedef struct rk_run {
    uint64_t laddr;
    uint64_t raddr;
    uint64_t len;
    uint32_t lreg;
    uint32_t rreg;
    int open;
} rk_run_t;

/* What posting one batch needs: its record, route, operation and the
 * request parameters its operations share; wops[w] counts worker w's. */
typedef struct rk_poster {
    rk_batch_t *b;
    const rk_route_t *r;
    ucp_ep_h const *eps;        /* the route's endpoints, or its express ones */
    ucp_rkey_h const *const *rkeys;
    int op;
    ucp_request_param_t p;
    uint64_t *wops;
    uint32_t released;          /* parts whose worker was released */
} rk_poster_t;

/* Index i of an index array of int32 (is32) or int64, as unsigned: a
 * negative index becomes larger than any list. */
static uint64_t rk_at(const void *a, uint32_t is32, uint64_t i)
{
    return is32 ? (uint64_t)(int64_t)((const int32_t *)a)[i] : (uint64_t)((const int64_t *)a)[i];
}

/* Whether [addr, addr + len) lies inside one of the side's regions (then
 * *reg is that region's index). *hint is where the previous descriptor
 * was: most descriptors of a request share a region. */
static int rk_locate(const rk_side_t *s, uint64_t addr, uint64_t len, uint64_t *hint, uint32_t *reg)
{
    uint64_t lo = 0, hi = s->nregions, mid, k = *hint;

    if (len == 0) {
        return 0;
    }
    if (k >= s->nregions || addr < s->base[k] || addr >= s->end[k]) {
        while (lo < hi) {               /* the first region starting after addr */
            mid = lo + (hi - lo) / 2;
            if (s->base[mid] <= addr) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if (lo == 0 || addr >= s->end[lo - 1]) {
            return 0;
        }
        k = *hint = lo - 1;
    }
    if (len > s->end[k] - addr) {
        return 0;
    }
    *reg = s->order[k];
    return 1;
}

/* Pair i of the request, both sides; 0 when it fails its checks (index
 * out of range, lengths differ, a descriptor outside every region). */
static int rk_pair(rk_req_t *q, uint64_t i, rk_desc_t *l, rk_desc_t *r)
{
    const rk_side_t *ls = &q->r->local, *rs = &q->r->remote;
    uint64_t li, ri;

    if (q->flags & RK_LIST) {
        l->addr = ((const uint64_t *)q->lsel)[i];
        r->addr = ((const uint64_t *)q->rsel)[i];
        l->len = q->llen[i];
        r->len = q->rlen[i];
        return l->len == r->len && rk_locate(ls, l->addr, l->len, &q->lhint, &l->reg) &&
               rk_locate(rs, r->addr, r->len, &q->rhint, &r->reg);
    }
    li = rk_at(q->lsel, q->flags & RK_IDX_L32, i);
    ri = rk_at(q->rsel, q->flags & RK_IDX_R32, i);
    if (li >= ls->n || ri >= rs->n) {
        return 0;
    }
    l->addr = ls->addr[li];
    r->addr = rs->addr[ri];
    l->reg = ls->reg != NULL ? ls->reg[li] : 0;
    r->reg = rs->reg != NULL ? rs->reg[ri] : 0;
    if (q->r->uniform != 0) {
        l->len = r->len = q->r->uniform;
        return 1;
    }
    l->len = ls->len[li];
    r->len = rs->len[ri];
    return l->len == r->len;
}

/* Check every pair before anything is posted; returns n when all pass,
 * else the position of the first that does not. *nbytes: their bytes.
 * Prepared lists of one uniform length need only the index ranges here
 * (no table is read: on a cold cache each read is a miss). */
static uint64_t rk_check(rk_req_t *q, uint64_t n, uint64_t *nbytes)
{
    const rk_route_t *r = q->r;
    rk_desc_t l, d;
    uint64_t i, li, ri, total = 0;

    if ((q->flags & RK_LIST) || r->uniform == 0) {
        for (i = 0; i < n && rk_pair(q, i, &l, &d); ++i) {
            total += l.len;
        }
        *nbytes = total;
        return i;
    }
    for (i = 0; i < n; ++i) {
        li = rk_at(q->lsel, q->flags & RK_IDX_L32, i);
        ri = rk_at(q->rsel, q->flags & RK_IDX_R32, i);
        if (li >= r->local.n || ri >= r->remote.n) {
            break;
        }
    }
    *nbytes = i * r->uniform;
    return i;
}

/* How many workers carry nbytes: one part per lane_min_bytes, at most
 * nworkers; 1 (not striped) below two parts. */
static uint32_t rk_parts(uint64_t nbytes, uint32_t nworkers, uint64_t lane_min_bytes)
{
    uint64_t parts = lane_min_bytes > 0 ? nbytes / lane_min_bytes : 0;

    return parts < 2 ? 1 : (parts > nworkers ? nworkers : (uint32_t)parts);
}

/* End of part k of nparts in a stream of total bytes: a 4 KiB boundary
 * (the last part ends at the total). */
static uint64_t rk_cut(uint64_t total, uint32_t k, uint32_t nparts)
{
    return k >= nparts ? total : (uint64_t)(((__uint128_t)total * k / nparts) & ~(uint64_t)4095);
}

/* Post the open run, if any, on worker w; 0 (and the batch's status set)
 * if UCX refused it. */
static int rk_post_run(rk_poster_t *ps, rk_run_t *run, uint32_t w)
{
    const rk_route_t *r = ps->r;
    ucs_status_ptr_t st;

    if (!run->open) {
        return 1;
    }
    run->open = 0;
    if (r->memhs != NULL) {
        ps->p.memh = r->memhs[run->lreg];
    }
    rk_batch_inc(ps->b);
    if (ps->op == RK_OP_GET) {
        st = ucp_get_nbx(ps->eps[w], (void *)(uintptr_t)run->laddr, run->len, run->raddr,
                         ps->rkeys[w][run->rreg], &ps->p);
    } else {
        st = ucp_put_nbx(ps->eps[w], (const void *)(uintptr_t)run->laddr, run->len, run->raddr,
                         ps->rkeys[w][run->rreg], &ps->p);
    }
    if (rk_account(ps->b, st) != UCS_OK) {
        return 0;
    }
    ps->b->posted++;
    ps->wops[w]++;
    return 1;
}

/* Worker w's part is posted: release its pump, kicked before the post
 * and spinning since; a worker with work and no pump is signalled. */
static void rk_part_posted(rk_poster_t *ps, uint32_t w)
{
    const rk_route_t *r = ps->r;

    ps->released++;
    if (r->pumps != NULL && r->pumps[w] != NULL) {
        rk_pump_hold(r->pumps[w], -1);
    } else if (w > 0 && ps->wops[w] > 0) {
        (void)ucp_worker_signal(r->workers[w]); /* (it fails only for a worker without wakeup) */
    }
}

/* The pairs' byte stream cut into nparts parts of about equal bytes (at
 * 4 KiB boundaries of the stream, so a descriptor may be cut); part k is
 * posted on worker top - k, each released as soon as it is posted. Runs
 * contiguous on both sides, in the same regions and the same part, merge
 * into one operation. 0 if UCX refused an operation (posting stops). */
static int rk_stream(rk_poster_t *ps, rk_req_t *q, uint64_t n, uint32_t top, uint32_t nparts,
                     uint64_t nbytes)
{
    rk_run_t run = {0, 0, 0, 0, 0, 0};
    rk_desc_t l, r;
    uint64_t i, off, take, pos = 0, cut = rk_cut(nbytes, 1, nparts);
    uint32_t part = 0, w = top;

    for (i = 0; i < n; ++i) {
        if (!rk_pair(q, i, &l, &r)) {
            /* rk_check passed this pair, and the caller's arrays changed
             * since (the call runs without the interpreter lock): nothing
             * unchecked is posted, the batch fails. */
            rk_record(ps->b, UCS_ERR_INVALID_PARAM);
            return 0;
        }
        for (off = 0; off < l.len;) {
            if (pos >= cut && part + 1 < nparts) {
                /* This part is full: post its last run, release its worker. */
                if (!rk_post_run(ps, &run, w)) {
                    return 0;
                }
                rk_part_posted(ps, w);
                part++;
                w--;
                cut = rk_cut(nbytes, part + 1, nparts);
                continue;
            }
            take = l.len - off;
            if (part + 1 < nparts && take > cut - pos) {
                take = cut - pos;
            }
            if (run.open && l.addr + off == run.laddr + run.len &&
                r.addr + off == run.raddr + run.len && l.reg == run.lreg && r.reg == run.rreg) {
                run.len += take;        /* contiguous on both sides: extend */
            } else {
                if (!rk_post_run(ps, &run, w)) {
                    return 0;
                }
                run.laddr = l.addr + off;
                run.raddr = r.addr + off;
                run.len = take;
                run.lreg = l.reg;
                run.rreg = r.reg;
                run.open = 1;
            }
            off += take;
            pos += take;
        }
    }
    if (!rk_post_run(ps, &run, w)) {
        return 0;
    }
    rk_part_posted(ps, w);
    return 1;
}

/* RK_SPREAD_LEAST: the worker with the fewest bytes queued, the own one
 * on a tie. A polling agent's own worker copies nothing while its caller
 * posts, a lane's pump drains its queue from the first post, so requests
 * go where they will be copied soonest. */
static uint32_t rk_least_queued(rk_ctx_t *ctx, const rk_route_t *r)
{
    uint64_t least = __atomic_load_n(&ctx->queued[0], __ATOMIC_RELAXED), q;
    uint32_t best = 0, w;

    for (w = 1; w < r->nworkers; ++w) {
        q = __atomic_load_n(&ctx->queued[w], __ATOMIC_RELAXED);
        if (q < least) {
            least = q;
            best = w;
        }
    }
    return best;
}

/* Whether the request goes on the route's express endpoints (a FLUSH
 * covers both kinds). */
static int rk_express(const rk_route_t *r, int op, uint64_t nbytes)
{
    return r->xeps != NULL && op != RK_OP_FLUSH && nbytes < r->express_below;
}

/* An endpoint flush counted as one operation of the batch: it completes
 * once every operation posted on the endpoint so far completed remotely.
 * Counted in the endpoint's state (st->flushing) while UCX holds it: the
 * endpoint is not closed under it (rk_ep_wait_flushes). */
static void rk_flush_ep(rk_poster_t *ps, ucp_ep_h ep, rk_ep_state_t *st)
{
    rk_batch_t *b = ps->b;
    rk_flush_ref_t *ref;
    ucs_status_ptr_t r;

    if (b->status != UCS_OK) {
        return;
    }
    /* (Never full: at most two endpoints on each of at most 17 workers.) */
    ref = &b->flushes[b->nflushes < sizeof(b->flushes) / sizeof(b->flushes[0]) ? b->nflushes++ : 0];
    ref->b = b;
    ref->st = st;
    ps->p.op_attr_mask &= ~(uint32_t)(UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FLAG_MULTI_SEND);
    ps->p.cb.send = rk_flush_cb;
    ps->p.user_data = ref;
    rk_batch_inc(b);
    __atomic_fetch_add(&st->flushing, 1, __ATOMIC_ACQ_REL);
    r = ucp_ep_flush_nbx(ep, &ps->p);
    if (!UCS_PTR_IS_PTR(r)) {           /* done in place or refused: no callback */
        __atomic_fetch_sub(&st->flushing, 1, __ATOMIC_ACQ_REL);
    }
    rk_account(b, r);
}

/* Post the checked request on workers top, top - 1, ..., top - nparts + 1;
 * returns the operations posted (flushes not counted). */
static uint64_t rk_post(rk_batch_t *b, const rk_route_t *r, rk_req_t *q, int op, uint64_t n,
                        uint32_t top, uint32_t nparts, uint64_t nbytes, uint64_t *wops)
{
    rk_poster_t ps;
    uint32_t k, w;

    ps.b = b;
    ps.r = r;
    if (rk_express(r, op, nbytes)) {
        ps.eps = r->xeps;
        ps.rkeys = r->xrkeys;
    } else {
        ps.eps = r->eps;
        ps.rkeys = r->rkeys;
    }
    b->notif_ep = ps.eps[0];            /* behind its own operations only */
    ps.op = op;
    ps.wops = wops;
    ps.released = 0;
    for (w = 0; w < r->nworkers; ++w) {
        wops[w] = 0;
    }
    /* Pumps held and kicked first: a kicked pump spins on its worker, taking
     * its lock for every progress call, and on cma each call copies -- a
     * poster contending for that lock would wait out the copy. */
    for (k = 0; k < nparts && r->pumps != NULL; ++k) {
        if (r->pumps[top - k] != NULL) {
            rk_pump_kick(r->pumps[top - k]);
        }
    }
    rk_batch_begin(b, &ps.p, r->memhs);
    rk_stream(&ps, q, n, top, nparts, nbytes);    /* on failure b->status says why */
    for (k = ps.released; k < nparts && r->pumps != NULL; ++k) {  /* parts never reached */
        if (r->pumps[top - k] != NULL) {
            rk_pump_hold(r->pumps[top - k], -1);
        }
    }
    /* A flush per endpoint that carried a part (every worker's for a
     * FLUSH): each completes only its own operations remotely, so the
     * notification, sent on worker 0's endpoint once the count reaches
     * zero, waits for every worker's data to be visible at the target. */
    for (k = 0; k < nparts && (op == RK_OP_FLUSH || (op == RK_OP_PUT && b->has_notif)); ++k) {
        if (op == RK_OP_FLUSH || wops[top - k] > 0) {
            rk_flush_ep(&ps, ps.eps[top - k], r->ep_states[top - k]);
        }
        if (op == RK_OP_FLUSH && r->xeps != NULL) {  /* a FLUSH covers both endpoints */
            rk_flush_ep(&ps, r->xeps[top - k], r->ep_states[top - k]);
        }
    }
    rk_batch_dec(b);                    /* the guard: it may complete now */
    return b->posted;
}

/* rk_batch_t.chain: post the batch's chained read (rk_then_t), whole,
 * on worker w: the one that carried the batch when it went whole (the
 * thread that completed it is progressing that worker now, or is its
 * poster), else the own worker. Called by rk_batch_complete, on whichever
 * thread completed the batch's last operation. A worker's pump is kicked
 * as for a post, unless this is the pump's own thread (held instead:
 * never steered off its own CPU); a worker without one is signalled.
 * 0 if the peer's endpoint on w is being closed: nothing posted. */
static int rk_chain(rk_batch_t *b)
{
    const rk_then_t *t = b->then;
    const rk_route_t *r = t->route;
    rk_req_t q = {r, t->l, t->r, NULL, NULL, t->flags & (RK_IDX_L32 | RK_IDX_R32), 0, 0};
    uint32_t w = b->nparts == 1 ? b->top : 0;
    rk_ep_state_t *st = r->ep_states[w];
    rk_pump_t *pump = r->pumps != NULL ? r->pumps[w] : NULL;
    uint64_t wops[17];
    rk_poster_t ps;

    if (!rk_ep_enter(st)) {
        return 0;
    }
    b->then_sent = 1;
    ps.b = b;
    ps.r = r;
    ps.eps = rk_express(r, RK_OP_GET, t->nbytes) ? r->xeps : r->eps;
    ps.rkeys = rk_express(r, RK_OP_GET, t->nbytes) ? r->xrkeys : r->rkeys;
    ps.op = RK_OP_GET;
    ps.wops = wops;
    ps.released = 0;
    wops[w] = 0;
    if (pump != NULL && rk_pump_tid(pump) == (int)syscall(SYS_gettid)) {
        rk_pump_hold(pump, 1);          /* released by rk_stream once posted */
    } else if (pump != NULL) {
        rk_pump_kick(pump);
    }
    rk_batch_begin(b, &ps.p, r->memhs);
    if (!rk_stream(&ps, &q, t->n, w, 1, t->nbytes) && ps.released == 0 && pump != NULL) {
        rk_pump_hold(pump, -1);
    }
    if (pump == NULL) {
        (void)ucp_worker_signal(r->workers[w]);
    }
    /* Posted: UCX holds its operations, and a close of the endpoint from
     * here on cancels them. Left before the guard: once the batch
     * completes, its slot may be reused. */
    __atomic_fetch_sub(&st->sending, 1, __ATOMIC_RELEASE);
    rk_batch_dec(b);                    /* the guard: it may complete now */
    return 1;
}

/* The chained read's checks: a READ's, on a current route of the same
 * peer, every pair in range; n + 1 when the first two fail, else the
 * position of the first pair that fails, or t->n when all pass. */
static uint64_t rk_then_check(const rk_route_t *r, int op, rk_then_t *t)
{
    rk_req_t q = {t->route, t->l, t->r, NULL, NULL, t->flags & (RK_IDX_L32 | RK_IDX_R32), 0, 0};

    if (op != RK_OP_GET || *t->route->epoch != t->route->built_at || t->route->ctx != r->ctx ||
        t->route->ep_states[0] != r->ep_states[0]) {
        return t->n + 1;
    }
    return rk_check(&q, t->n, &t->nbytes);
}

int64_t rk_submit(const rk_route_t *r, int op, uint64_t n, const void *l, const void *rsel,
                  const void *llen, const void *rlen, uint32_t flags,
                  const char *notif, uint64_t notif_len, uint64_t timeout_ns, rk_then_t *then,
                  uint64_t *out)
{
    rk_req_t q = {r, l, rsel, (const uint64_t *)llen, (const uint64_t *)rlen, flags, 0, 0};
    rk_ctx_t *ctx = r->ctx;
    uint64_t t0 = rk_now_ns(), nbytes, ok, deadline;
    uint32_t w, top, nparts;
    rk_batch_t *b;

    if (*r->epoch != r->built_at) {
        return RK_SUBMIT_STALE;
    }
    for (w = 0; w < r->nworkers; ++w) {     /* UCX fails endpoints asynchronously */
        if (__atomic_load_n(&r->ep_states[w]->failed, __ATOMIC_ACQUIRE)) {
            return RK_SUBMIT_PEER_FAILED;
        }
    }
    if ((flags & RK_NOTIFY) && notif_len > ctx->notif_max) {
        return RK_SUBMIT_NOTIF_SIZE;
    }
    ok = rk_check(&q, n, &nbytes);
    if (ok != n) {
        out[0] = ok;
        return RK_SUBMIT_BAD_PAIR;
    }
    if (then != NULL && (ok = rk_then_check(r, op, then)) != then->n) {
        out[0] = ok;
        return RK_SUBMIT_BAD_THEN;
    }
    b = rk_slot_take(ctx);
    if (b == NULL) {
        return RK_SUBMIT_FULL;
    }
    /* The workers, by the route's policy: every worker gets a flush; a
     * large transfer is striped; a small one goes whole to one worker. */
    nparts = op == RK_OP_FLUSH ? r->nworkers : rk_parts(nbytes, r->nworkers, r->lane_min_bytes);
    top = nparts - 1;
    if (nparts == 1 && r->spread != RK_SPREAD_OFF && r->nworkers > 1) {
        if (r->spread == RK_SPREAD_LEAST) {
            top = rk_least_queued(ctx, r);
        } else if (ctx->live == 0 && r->spread == RK_SPREAD_BUSY) {
            top = 0;                /* alone: the own worker, which its caller drives */
            ctx->cursor = 1;
        } else {
            top = ctx->cursor++ % r->nworkers;
        }
    }
    b->id = ++ctx->next_id;
    b->peer = r->ep_states[0];
    b->posted = 0;
    b->status = UCS_OK;
    b->state = (uint32_t)(b->id << 1);
    b->has_notif = (flags & RK_NOTIFY) != 0;
    b->nflushes = 0;
    b->notif_sent = 0;
    b->notif_data = notif;
    b->notif_len = notif_len;
    b->then = then;
    b->then_sent = 0;
    b->chain = rk_chain;
    b->top = top;
    b->nparts = nparts;
    b->share = nbytes / nparts;
    for (w = 0; w < nparts; ++w) {
        __atomic_fetch_add(&ctx->queued[top - w], b->share, __ATOMIC_RELAXED);
    }
    deadline = timeout_ns != 0 ? timeout_ns : ctx->timeout_ns;
    deadline = deadline > UINT64_MAX - t0 ? UINT64_MAX : t0 + deadline; /* a huge timeout_s: no deadline */
    b->deadline_ns = deadline;
    if (ctx->live == 0 || deadline < ctx->next_deadline_ns) {
        ctx->next_deadline_ns = deadline;
    }
    ctx->live++;
    b->peer->inflight++;
    out[6] = rk_now_ns();
    out[2] = rk_post(b, r, &q, op, n, top, nparts, nbytes, out + 9);
    out[7] = rk_now_ns();
    __atomic_store_n(&ctx->last_call_ns, out[7], __ATOMIC_RELAXED);
    ctx->transfers++;
    ctx->ops_posted += out[2];
    ctx->descs += n;
    ctx->bytes += nbytes;
    out[0] = b->id;
    out[1] = nbytes;
    out[3] = nparts;
    out[4] = top;
    out[5] = t0;
    out[8] = __atomic_load_n(&ctx->done_head, __ATOMIC_ACQUIRE) != ctx->done_tail;
    return (int64_t)(b - ctx->slots);
}
