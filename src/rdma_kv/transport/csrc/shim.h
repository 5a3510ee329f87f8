/* rdma-kv's C shim: the hot path only.
 *
 * This file is parsed twice: by the C compiler (after <ucp/api/ucp.h>) and
 * by cffi's cdef parser, so it holds declarations only -- no preprocessor
 * lines, no includes, no macros.
 *
 * Ownership: every struct below is allocated and owned by the caller
 * (Python, through ffi.new); the shim only writes into it. A batch must stay
 * alive until its `done` flag is set, because UCX completion callbacks
 * write into it.
 */

typedef struct rk_ctx {
    /* Completion ring: ids of finished batches, written by the shim. The
     * caller keeps at most done_cap batches in flight, so it never
     * overflows. Completions may be pushed by two threads at once (the
     * poster, for work done in place, and a pump): a producer claims a slot
     * by done_claim, then publishes in claim order through done_head
     * (release store; read it with rk_done_head). */
    uint64_t *done_ring;
    uint64_t done_cap;
    uint64_t done_head;
    uint64_t done_claim;
    /* Notification ring: fixed-size slots; slot layout is
     * [uint32 header_len][uint32 data_len][header][data]. */
    uint8_t *notif_slots;
    uint64_t notif_slot_size;
    uint64_t notif_nslots;
    uint64_t notif_head;
    uint64_t notif_tail;
    uint64_t notif_dropped_full;
    uint64_t notif_dropped_rndv;
    uint64_t ep_errors;     /* endpoint error callbacks so far (atomic) */
} rk_ctx_t;

typedef struct rk_batch {
    uint64_t id;
    rk_ctx_t *ctx;
    ucp_ep_h ep;
    /* Operations not completed yet (+1 while posting). Atomic: on a pumped
     * worker completions run on the pump's thread while the poster posts. */
    int64_t pending;
    uint64_t posted;        /* operations handed to UCX */
    int32_t status;         /* first failure, UCS_OK if none */
    int32_t done;           /* 1 once every operation (and notification) completed */
    int32_t has_notif;      /* send an AM notification once the batch completed */
    int32_t notif_sent;
    uint32_t am_id;
    const void *notif_header;
    uint64_t notif_header_len;
    const void *notif_data;
    uint64_t notif_data_len;
} rk_batch_t;

typedef struct rk_ep_state {
    int32_t status;          /* set by the endpoint error callback */
    int32_t failed;
    rk_ctx_t *ctx;           /* its agent's: the callback counts ep_errors */
} rk_ep_state_t;

enum {
    RK_OP_GET = 0,
    RK_OP_PUT = 1
};

/* Index arrays (lidx, ridx) are int64, or int32 where idx32 has the bit:
 * int32 block tables (NIXL's, many engines') are read as they are. */
enum {
    RK_IDX_L32 = 1,
    RK_IDX_R32 = 2
};

void rk_ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status);

/* A C thread progressing one worker; see rk_pump_start below. */
typedef struct rk_pump rk_pump_t;

/* Check a transfer by index before anything is posted: every lidx[i] in
 * [0, nl), every ridx[i] in [0, nr) and, when llen_tab and rlen_tab are
 * given (lengths not uniform), llen_tab[lidx[i]] == rlen_tab[ridx[i]].
 * *nbytes receives the sum of the paired lengths (0 when llen_tab is NULL:
 * the caller multiplies). Returns n when every pair passes, else the
 * position of the first pair that does not. */
uint64_t rk_check_indexed(uint64_t n, const void *lidx, const void *ridx, uint32_t idx32,
                          uint64_t nl, uint64_t nr, const uint64_t *llen_tab,
                          const uint64_t *rlen_tab, uint64_t *nbytes);

/* The workers one transfer may be striped over (lanes.py): index w = 0 is
 * the poster's own worker, 1.. its lanes. eps[w] is the endpoint to the
 * peer on worker w, rkeys[w] the peer's remote keys unpacked on it,
 * pumps[w] the pump progressing worker w (NULL: none). */
typedef struct rk_stripe {
    ucp_ep_h const *eps;
    ucp_rkey_h const *const *rkeys;
    ucp_worker_h const *workers;
    rk_pump_t *const *pumps;
} rk_stripe_t;

/* The post loop, the only one: every batch of operations is posted here
 * (rk_submit calls it for prepared lists, the agent for explicit lists,
 * with identity indices over the lists as tables). Descriptor i is local
 * slot lidx[i] (address laddr_tab[], length len_tab[], region lreg_tab[]
 * or 0 when NULL) paired with remote slot ridx[i] (raddr_tab[], rreg_tab[]
 * or 0 when NULL); runs contiguous on both sides within the same regions
 * merge into one operation, and everything is gathered, merged and posted
 * in one pass. The caller has checked the pairs (rk_check_indexed) and
 * decided nparts (rk_stripe_parts); memhs may be NULL.
 *
 * nparts <= 1: posted on batch->ep with rkeys (stripe unused, may be
 * NULL); with flush set, an endpoint flush follows the operations and is
 * counted as one (for PUT + notification: remote completion before
 * notifying).
 *
 * nparts > 1: striped over the first nparts workers of stripe (rkeys
 * unused): the byte stream of the pairs (nbytes in all) is cut into nparts
 * parts of about equal bytes at 4 KiB boundaries (a descriptor may be
 * cut), each posted on its worker -- the lanes' first (each lane's pump
 * held off its worker and kicked before anything is posted, released once
 * its part is posted; a lane without a pump is signalled then), the own
 * worker's last. One batch:
 * it completes when every operation on every worker has (the count is
 * atomic; the pumps complete operations on their threads). With flush
 * set, an endpoint flush is posted on every worker's endpoint that carried
 * a part (counted as an operation each, not in worker_ops). A notification
 * in the batch record is sent on batch->ep (worker 0's endpoint) once
 * every operation, flushes included, completed; the last may complete on
 * a lane's pump, so worker 0 must then be UCS_THREAD_MODE_MULTI.
 *
 * worker_ops[w] receives the operations posted on worker w (NULL allowed
 * when nparts <= 1). Returns the number of operations posted (flushes
 * not counted); stops at the first error (batch->status). */
uint64_t rk_post_indexed(rk_batch_t *batch, int op, uint64_t n,
                         const void *lidx, const void *ridx, uint32_t idx32,
                         const uint64_t *laddr_tab, const uint64_t *raddr_tab,
                         const uint64_t *len_tab, const uint32_t *lreg_tab,
                         const uint32_t *rreg_tab, ucp_mem_h const *memhs,
                         ucp_rkey_h const *rkeys, const rk_stripe_t *stripe,
                         uint32_t nparts, uint64_t nbytes, uint64_t *worker_ops,
                         int flush);

/* A route: what a prepared transfer between one local and one remote list
 * needs, gathered once by the agent (prepared.py) so that a request is one
 * C call. Valid while *epoch == built_at: the agent moves its epoch when a
 * peer is added, replaced, failed or removed and when its own regions
 * change. ep_states[w] is the peer's endpoint state on worker w (0: the
 * agent's, 1..: its lanes'), checked per request because UCX fails an
 * endpoint asynchronously. */
typedef struct rk_route {
    const uint64_t *laddr;
    const uint64_t *llen;
    const uint32_t *lreg;
    uint64_t nl;
    const uint64_t *raddr;
    const uint64_t *rlen;
    const uint32_t *rreg;
    uint64_t nr;
    uint64_t uniform;            /* the one length of both lists, 0: not uniform */
    ucp_mem_h const *memhs;      /* NULL: none */
    rk_ctx_t *ctx;               /* the agent's */
    ucp_ep_h ep;                 /* the peer's endpoint on the agent's worker */
    ucp_rkey_h const *rkeys;     /* the peer's remote keys, unpacked on it */
    const rk_stripe_t *stripe;   /* NULL: no lanes */
    uint32_t nworkers;           /* 1 + lanes */
    uint64_t lane_min_bytes;     /* a striped part is at least this large */
    rk_ep_state_t *const *ep_states;
    const uint64_t *epoch;
    uint64_t built_at;
} rk_route_t;

enum {
    RK_SUBMIT_STALE = -1,        /* the route must be rebuilt */
    RK_SUBMIT_PEER_FAILED = -2,  /* an endpoint of the peer failed */
    RK_SUBMIT_BAD_PAIR = -3      /* out[0]: the first pair that failed the check */
};

/* How many workers carry a transfer of nbytes: nbytes / lane_min_bytes,
 * at most nworkers; 1 (not striped) below two parts. */
uint32_t rk_stripe_parts(uint64_t nbytes, uint32_t nworkers, uint64_t lane_min_bytes);

/* One prepared request on a route, in a batch record whose id, ctx and ep
 * are set here once the route is found current (the rest zeroed, or a
 * notification filled in by the caller): check every index pair (as
 * rk_check_indexed), then post it with rk_post_indexed over
 * rk_stripe_parts workers (the agent's own alone, or striped over the
 * lanes), with the endpoint flushes of `flush` (a WRITE that notifies). Returns the operations posted, or a negative RK_SUBMIT_* with
 * nothing posted. out[0] receives the bytes, out[1] the workers used,
 * out[2 + w] the operations on worker w. */
int64_t rk_submit(const rk_route_t *route, rk_batch_t *batch, uint64_t id, int op, uint64_t n,
                  const void *lidx, const void *ridx, uint32_t idx32, int flush,
                  uint64_t *out);

/* Call ucp_worker_progress until it reports no event or max_rounds calls
 * were made. Returns the number of events progressed. */
uint64_t rk_progress(ucp_worker_h worker, uint64_t max_rounds);

/* done_head with acquire ordering: every ring slot below it, and the
 * batch records they name, are fully written. */
uint64_t rk_done_head(rk_ctx_t *ctx);

/* cuCtxSetCurrent's shape: CUresult (*)(CUcontext). The agent hands in
 * libcuda's function (found with dlsym at run time), so the shim has no
 * link-time CUDA dependency. */
typedef int (*rk_cu_set_ctx_t)(void *ctx);

/* A pump: a C thread that progresses one worker (created with
 * UCS_THREAD_MODE_MULTI, so other threads may post on it meanwhile) without
 * the Python interpreter lock: an agent's own worker in progress="thread"
 * mode, and every lane's. It progresses without sleeping until spin_ns have
 * passed since the last event, then arms the worker and sleeps on its event
 * fd (ucp_worker_signal wakes it). Whenever the watched context changes
 * during its progress (a batch published, a notification received, an
 * endpoint error), it wakes whoever settles it: ucp_worker_signal(wake_worker)
 * when not NULL (a polling owner sleeps on its worker's fd), and an 8-byte
 * write to wake_fd when >= 0 (an eventfd a Python thread sleeps on).
 * With set_ctx not NULL the thread first calls set_ctx(cu_ctx), making the
 * creator's CUDA context current (UCX's CUDA transports call the driver
 * during progress); rk_pump_start returns once it has. NULL if the thread
 * cannot start or set_ctx failed (its result in *cu_status, else 0). */
rk_pump_t *rk_pump_start(ucp_worker_h worker, int efd, rk_ctx_t *watch,
                         ucp_worker_h wake_worker, int wake_fd,
                         uint64_t spin_ns, rk_cu_set_ctx_t set_ctx,
                         void *cu_ctx, int *cu_status);

/* Stop the pump's thread, join it and free the pump (bounded by one
 * progress call plus its wake-up). */
void rk_pump_stop(rk_pump_t *pump);

/* Add delta (+1 / -1) to the pump's hold count: while it is above zero the
 * pump does not progress its worker (a striped post holds each lane it
 * posts on; tests hold a pump to stand for one that is never scheduled). */
void rk_pump_hold(rk_pump_t *pump, int delta);

/* Progress the pump's worker on the calling thread (at most max_rounds
 * rounds, as rk_progress) if the pump is not progressing it right now;
 * returns the events handled, 0 if the pump was. While the caller helps,
 * the pump keeps off the worker (as while a poster holds it). A poller
 * whose own worker is idle calls it: a lane's part then moves on the
 * poller's CPU instead of waiting for the pump's thread to be woken and
 * scheduled. */
uint64_t rk_pump_help(rk_pump_t *pump, uint64_t max_rounds);

/* The pump thread's kernel thread id (/proc/self/task/<tid>); set before
 * rk_pump_start returns. */
int rk_pump_tid(const rk_pump_t *pump);

/* Install the notification receive handler for am_id on the worker. */
ucs_status_t rk_set_notif_handler(ucp_worker_h worker, uint32_t am_id,
                                  rk_ctx_t *ctx);

/* Progress until request completes or max_rounds, then free it; returns
 * its status (UCS_INPROGRESS if it did not complete in time, in which case
 * it is still freed: UCX releases it on completion). */
ucs_status_t rk_wait_request(ucp_worker_h worker, ucs_status_ptr_t request,
                             uint64_t max_rounds);
