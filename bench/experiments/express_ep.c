/* Does a small read queued behind a large one on the same UCX worker wait
 * for all of it, and does a second endpoint to the same peer let it pass?
 * One process, two workers of one context (reader, target), CMA between
 * them (UCX_TLS=cma,self,...). Per round: post BIG bytes of 512 KiB gets on
 * endpoint A, then SMALL bytes of 512 KiB gets on endpoint A (same) or B
 * (a second endpoint to the same target worker), progress until both
 * completed, and record the big one's post -> completion callback and the
 * small one's post -> the return of the progress call that completed it.
 *
 *   UCX=$(.venv/bin/python -c "import libucx, os; print(os.path.dirname(libucx.__file__))")
 *   cc -O2 express_ep.c -I$UCX/include -L$UCX/lib -lucp -lucs -Wl,-rpath,$UCX/lib -o express_ep
 *   UCX_NET_DEVICES=lo UCX_RNDV_THRESH=inf ./express_ep [rounds] [big MiB] [small KiB]
 *
 * MULTI=1 posts with UCP_OP_ATTR_FLAG_MULTI_SEND and PEER=1 creates the
 * endpoints with UCP_ERR_HANDLING_MODE_PEER, as rdma-kv does.
 *
 * Prints, per mode, the medians in microseconds. An experiment: not part
 * of the library (docs/benchmarks/history.md, 2026-11-28). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>

#define SEG (512u << 10)
#define CHECK(x) do { ucs_status_t s_ = (x); if (s_ != UCS_OK) { fprintf(stderr, "%s: %s\n", #x, ucs_status_string(s_)); exit(1); } } while (0)

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

typedef struct { int left; double done_at; } group_t;

static void done_cb(void *req, ucs_status_t st, void *user)
{
    group_t *g = user;
    if (st != UCS_OK) { fprintf(stderr, "get failed: %s\n", ucs_status_string(st)); exit(1); }
    if (--g->left == 0) g->done_at = now_us();
    ucp_request_free(req);
}

static void post(ucp_ep_h ep, ucp_rkey_h rkey, char *dst, uint64_t src, size_t bytes, group_t *g)
{
    ucp_request_param_t p;
    size_t off;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    if (getenv("MULTI")) p.op_attr_mask |= UCP_OP_ATTR_FLAG_MULTI_SEND;
    p.cb.send = done_cb;
    p.user_data = g;
    for (off = 0; off < bytes; off += SEG) {
        ucs_status_ptr_t r;
        g->left++;
        r = ucp_get_nbx(ep, dst + off, SEG, src + off, rkey, &p);
        if (r == NULL) { if (--g->left == 0) g->done_at = now_us(); }
        else if (UCS_PTR_IS_ERR(r)) { fprintf(stderr, "ucp_get_nbx: %s\n", ucs_status_string(UCS_PTR_STATUS(r))); exit(1); }
    }
}

static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 30;
    size_t big = (size_t)(argc > 2 ? atoi(argv[2]) : 24) << 20, small = (size_t)(argc > 3 ? atoi(argv[3]) : 512) << 10;
    ucp_params_t cp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA};
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
    ucp_context_h ctx; ucp_worker_h rw, tw; ucp_address_t *taddr; size_t taddr_len;
    ucp_mem_map_params_t mp; ucp_mem_h tmemh, rmemh; void *rkbuf; size_t rklen;
    ucp_ep_h ep[2]; ucp_rkey_h rkey[2];
    char *src = aligned_alloc(4096, big + small), *dst = aligned_alloc(4096, big + small);
    double *t_small[2], *t_big[2];
    int mode, i, k;

    memset(src, 7, big + small); memset(dst, 0, big + small);
    CHECK(ucp_init(&cp, NULL, &ctx));
    CHECK(ucp_worker_create(ctx, &wp, &rw));
    CHECK(ucp_worker_create(ctx, &wp, &tw));
    CHECK(ucp_worker_get_address(tw, &taddr, &taddr_len));
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = src; mp.length = big + small;
    CHECK(ucp_mem_map(ctx, &mp, &tmemh));
    mp.address = dst;
    CHECK(ucp_mem_map(ctx, &mp, &rmemh));
    CHECK(ucp_rkey_pack(ctx, tmemh, &rkbuf, &rklen));
    for (k = 0; k < 2; k++) {
        ucp_ep_params_t ep_p = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = taddr};
        if (getenv("PEER")) {
            ep_p.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
            ep_p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        }
        CHECK(ucp_ep_create(rw, &ep_p, &ep[k]));
        CHECK(ucp_ep_rkey_unpack(ep[k], rkbuf, &rkey[k]));
    }
    for (i = 0; i < 200; i++) { ucp_worker_progress(rw); ucp_worker_progress(tw); }
    for (mode = 0; mode < 2; mode++) {
        t_small[mode] = calloc(rounds, sizeof(double)); t_big[mode] = calloc(rounds, sizeof(double));
    }
    for (i = 0; i < rounds; i++) {
        for (mode = 0; mode < 2; mode++) {   /* 0: same endpoint, 1: a second one; alternating */
            group_t gb = {0, 0}, gs = {0, 0};
            double t0 = now_us(), t1;
            post(ep[0], rkey[0], dst, (uint64_t)(uintptr_t)src, big, &gb);
            t1 = now_us();
            post(ep[mode], rkey[mode], dst + big, (uint64_t)(uintptr_t)(src + big), small, &gs);
            double seen = 0;
            while (gb.left > 0 || gs.left > 0) {
                ucp_worker_progress(rw);
                if (gs.left == 0 && seen == 0) seen = now_us();  /* when the caller could know */
            }
            t_big[mode][i] = gb.done_at - t0;
            t_small[mode][i] = seen - t1;
        }
    }
    for (mode = 0; mode < 2; mode++) {
        qsort(t_small[mode], rounds, sizeof(double), cmp); qsort(t_big[mode], rounds, sizeof(double), cmp);
        printf("%-22s small %zu KiB: p50 %8.0f us p90 %8.0f | big %zu MiB: p50 %8.0f us\n",
               mode ? "second endpoint" : "same endpoint", small >> 10, t_small[mode][rounds / 2],
               t_small[mode][rounds * 9 / 10], big >> 20, t_big[mode][rounds / 2]);
    }
    return 0;
}
