/* rdma-kv's C shim: the hot path only.
 *
 * This file is parsed twice: by the C compiler (after <ucp/api/ucp.h>) and
 * by cffi's cdef parser, so it holds declarations only -- no preprocessor
 * lines, no includes, no macros.
 *
 * Ownership: every struct below is allocated and owned by the caller
 * (Python, through ffi.new); the shim only writes into it. The slab of
 * batch records must outlive every operation posted from it, because UCX
 * completion callbacks write into it.
 *
 * Units: core.c (the context, completion, the rings, progress), post.c
 * (the one submit path and its post loop), pump.c (progress threads and
 * the blocking wait). Policy -- which worker, how many parts, whether a
 * pump is steered, which pumps a waiter helps -- is the caller's, passed
 * in through the route and the calls below.
 */

struct rk_ctx;

typedef struct rk_ep_state {
    int32_t status;          /* set by the endpoint error callback */
    int32_t failed;
    struct rk_ctx *ctx;      /* its agent's: the callback counts ep_errors */
    uint64_t inflight;       /* transfers in flight with the peer (own worker's state only; under the agent's lock) */
    int32_t closing;         /* set by rk_ep_quiesce: no notification goes out on the endpoint */
    int32_t sending;         /* notifications being handed to the endpoint now (atomic) */
    int32_t flushing;        /* endpoint flushes posted and not completed (atomic): the
                              * endpoint must not be closed before they complete
                              * (rk_ep_wait_flushes) */
} rk_ep_state_t;

/* An endpoint flush of a transfer in flight: its completion callback's
 * user data (the batch, and the state of the endpoint it flushes). */
typedef struct rk_flush_ref {
    struct rk_batch *b;
    rk_ep_state_t *st;
} rk_flush_ref_t;

struct rk_route;

/* A chained read (rk_submit's then): once every operation of a READ
 * completed without error, n more GETs of the same peer, posted by the
 * thread that completed the last one -- on the worker that carried the
 * read when it went whole (its progress goes on right after), else on the
 * own worker, whose pump is kicked -- on the peer's endpoint there (its
 * express one when the route has it and the read is small): local slot
 * l[i] of route's local list from remote slot r[i] of its remote list
 * (int64, or int32 per RK_IDX_*). The transfer completes when they do.
 * For a read that must be vouched for after it landed: one more round
 * trip of the wire, none of Python. Caller-owned, and with its route and
 * arrays alive until the slot is drained. */
typedef struct rk_then {
    const struct rk_route *route;
    const void *l;
    const void *r;
    uint64_t n;
    uint32_t flags;
    uint64_t nbytes;         /* set by rk_submit */
} rk_then_t;

/* One transfer in flight: a slot of the agent's slab. */
typedef struct rk_batch {
    uint64_t id;             /* the transfer's id (never 0 while in use) */
    struct rk_ctx *ctx;
    ucp_ep_h notif_ep;       /* the peer's endpoint on the agent's own worker */
    rk_ep_state_t *peer;     /* the peer's state there: counts its transfers */
    int64_t pending;         /* operations not completed (+1 while posting); atomic */
    uint64_t posted;         /* operations handed to UCX */
    uint64_t deadline_ns;    /* CLOCK_MONOTONIC; 0 once settled or abandoned */
    int32_t status;          /* first failure, UCS_OK if none */
    uint32_t state;          /* futex word: (uint32_t)(id << 1), | 1 once complete */
    uint32_t waiters;        /* threads asleep on state (rk_await) */
    int32_t abandoned;       /* failed by the agent before UCX completed it */
    int32_t has_notif;
    int32_t notif_sent;
    const void *notif_data;  /* the caller keeps it alive until the slot is drained */
    uint64_t notif_len;
    uint32_t top;            /* its workers: top, top - 1, ..., top - nparts + 1 */
    uint32_t nparts;
    uint64_t share;          /* the bytes it queued on each of them (rk_ctx_t.queued) */
    uint64_t done_ns;        /* CLOCK_MONOTONIC when it was published complete */
    const rk_then_t *then;   /* its chained read, NULL if none */
    int32_t then_sent;       /* 1 once the chained read was handed to UCX: the
                              * batch's own operations all completed */
    int (*chain)(struct rk_batch *b); /* posts then (post.c's; core.c calls it):
                                       * 0 if its endpoint is closing (nothing posted) */
    uint32_t nflushes;       /* flushes posted for it (flushes[0..nflushes)) */
    rk_flush_ref_t flushes[34]; /* at most one per endpoint: 17 workers, 2 endpoints each */
} rk_batch_t;

typedef struct rk_ctx {
    /* The slab and its free slots (a stack). Under the agent's lock. */
    rk_batch_t *slots;
    uint32_t *free_slots;
    uint32_t nslots;
    uint32_t nfree;
    uint64_t next_id;
    uint64_t live;              /* transfers in flight, neither drained nor abandoned */
    uint64_t next_deadline_ns;  /* no live transfer's deadline is earlier */
    uint64_t timeout_ns;        /* a transfer's deadline when the caller gives none */
    uint32_t cursor;            /* the worker the next spread request goes to, in turn */
    /* Bytes posted on each worker (own, lanes 1..16) and not yet complete:
     * added by the poster, taken off as a batch is published. Atomic. */
    uint64_t queued[17];
    int32_t closing;            /* set by rk_wake_waiters: rk_await returns at once */
    /* Notifications: an active message am_id, the agent's name as header. */
    uint32_t am_id;
    const char *name;
    uint64_t name_len;
    uint64_t notif_max;
    /* Totals (the agent's stats). */
    uint64_t transfers;
    uint64_t ops_posted;
    uint64_t descs;
    uint64_t bytes;
    /* Completion ring: slots of finished batches. Producers (the poster, for
     * work done in place, and pumps) claim a slot by done_claim, then
     * publish in claim order through done_head (release store). done_cap >=
     * nslots, so it never overflows. The agent drains it (rk_drain). */
    uint32_t *done_ring;
    uint64_t done_cap;
    uint64_t done_head;
    uint64_t done_claim;
    uint64_t done_tail;
    /* Notification ring: fixed-size slots; slot layout is
     * [uint32 header_len][uint32 data_len][header][data]. */
    uint8_t *notif_slots;
    uint64_t notif_slot_size;
    uint64_t notif_nslots;
    uint64_t notif_head;
    uint64_t notif_tail;
    uint64_t notif_dropped_full;
    uint64_t notif_dropped_rndv;
    uint64_t ep_errors;         /* endpoint error callbacks so far (atomic) */
    /* A caller is about (rk_service_wait stands back for it): when one
     * last finished a post (rk_submit) or left rk_await, and how many are
     * inside rk_await. Atomic. */
    uint64_t last_call_ns;
    uint32_t awaiting;
    /* Bumped by every rk_drain that took something: the word a service
     * thread standing back naps on (napping), so that a caller's settle
     * ends its nap at once instead of a timer in the middle of the next
     * transfer. */
    uint32_t settled;
    uint32_t napping;
} rk_ctx_t;

/* Make the slab of nslots records and its free stack (both caller-owned,
 * zeroed) usable; the completion ring must hold at least nslots. */
void rk_ctx_init(rk_ctx_t *ctx, rk_batch_t *slots, uint32_t *free_slots, uint32_t nslots,
                 uint32_t *done_ring, uint64_t done_cap);

enum {
    RK_OP_GET = 0,
    RK_OP_PUT = 1,
    RK_OP_FLUSH = 2
};

/* rk_route_t.spread: where a transfer too small to stripe goes. */
enum {
    RK_SPREAD_OFF = 0,      /* the own worker */
    RK_SPREAD_BUSY = 1,     /* the next worker in turn; the own one while nothing else is in flight */
    RK_SPREAD_ALWAYS = 2,   /* the next worker in turn */
    RK_SPREAD_LEAST = 3     /* the worker with the fewest bytes queued; the own one on a tie */
};

/* rk_submit's flags. */
enum {
    RK_IDX_L32 = 1,     /* the local index array is int32 (else int64) */
    RK_IDX_R32 = 2,     /* the remote index array is int32 */
    RK_LIST = 4,        /* explicit descriptors: addresses and lengths, located by region */
    RK_NOTIFY = 8       /* send the notification once every operation completed */
};

enum {
    RK_SUBMIT_STALE = -1,        /* the route must be rebuilt */
    RK_SUBMIT_PEER_FAILED = -2,  /* an endpoint of the peer failed */
    RK_SUBMIT_BAD_PAIR = -3,     /* out[0]: the first pair that failed its check */
    RK_SUBMIT_FULL = -4,         /* no free slot: nslots transfers in flight */
    RK_SUBMIT_NOTIF_SIZE = -5,   /* the notification is longer than notif_max */
    RK_SUBMIT_BAD_THEN = -6      /* the chained read: out[0] its first pair that failed its check
                                  * (n + 1: not a READ, or another peer or a stale route) */
};

void rk_ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status);

/* Before the agent closes its endpoint to a peer: from now on a completing
 * transfer sends no notification on it, and one being handed to it on
 * another thread (a lane's pump completes the last part) has returned.
 * A transfer whose notification is dropped so completes with
 * UCS_ERR_CANCELED. Returns within one ucp_am_send_nbx call. */
void rk_ep_quiesce(rk_ep_state_t *state);

/* Before the agent closes an endpoint: progress worker until no flush
 * posted on an endpoint of state is outstanding, for at most timeout_ns;
 * returns how many still are (0: the endpoint may be closed). UCX 1.22
 * keeps a flush that resumes from the worker's progress queue on a
 * pointer to its endpoint that a forced close does not clear: closed
 * under it, the endpoint is freed and the next progress call of the
 * worker reads the freed endpoint (ucp_ep_flush_progress, SIGSEGV). */
int32_t rk_ep_wait_flushes(ucp_worker_h worker, rk_ep_state_t *state, uint64_t timeout_ns);

/* What one thread needs to progress one worker; see rk_pump_new below. */
typedef struct rk_pump rk_pump_t;

/* One side of a route. A prepared list (addressed by index): addr, len and
 * reg (NULL: region 0 for all) of its n descriptors. Explicit descriptors
 * (RK_LIST): the side's regions sorted by base, [base, end) and their
 * index (order), where each descriptor is looked up. */
typedef struct rk_side {
    const uint64_t *addr;
    const uint64_t *len;
    const uint32_t *reg;
    uint64_t n;
    const uint64_t *base;
    const uint64_t *end;
    const uint32_t *order;
    uint64_t nregions;
} rk_side_t;

/* A route: everything a transfer to one peer needs, gathered once by the
 * agent so that a request is one C call. Worker w = 0 is the agent's own,
 * 1.. its lanes: eps[w], rkeys[w], workers[w], pumps[w] (NULL: none) and
 * ep_states[w] are the peer's endpoint, remote keys and endpoint state on
 * worker w. Valid while *epoch == built_at: the agent moves its epoch when
 * a peer is added, replaced, failed or removed and when its regions
 * change. lane_min_bytes and spread are the agent's policy: a transfer of
 * at least two lane_min_bytes parts is striped over that many workers;
 * a smaller one goes whole to one worker, chosen by spread (RK_SPREAD_*).
 * xeps[w] and xrkeys[w] (NULL: none) are a second endpoint to the peer on
 * worker w, its express endpoint, and its keys: a request of fewer than
 * express_below bytes is posted there, so that it does not queue behind a
 * large one's operations on the first (UCX serves a worker's endpoints in
 * turn, an endpoint's operations in order). */
typedef struct rk_route {
    rk_ctx_t *ctx;
    uint32_t nworkers;
    ucp_ep_h const *eps;
    ucp_rkey_h const *const *rkeys;
    ucp_ep_h const *xeps;
    ucp_rkey_h const *const *xrkeys;
    uint64_t express_below;
    ucp_worker_h const *workers;
    rk_pump_t *const *pumps;
    rk_ep_state_t *const *ep_states;
    ucp_mem_h const *memhs;      /* NULL: none */
    const uint64_t *epoch;
    uint64_t built_at;
    uint64_t lane_min_bytes;
    uint32_t spread;
    uint64_t uniform;            /* the one length of both prepared lists, 0: not uniform */
    rk_side_t local;
    rk_side_t remote;
} rk_route_t;

/* One request, the only way anything is posted: check it, take a slot
 * (id, deadline = now + timeout_ns or ctx->timeout_ns when 0, the
 * notification of notif_len bytes with RK_NOTIFY), choose its workers and
 * post it -- gathered, merged (runs contiguous on both sides in the same
 * regions become one operation) and posted in one pass.
 *
 * By index (flags without RK_LIST): pair i is local slot l[i] with remote
 * slot r[i] of the route's prepared lists (int64, or int32 per RK_IDX_*);
 * llen and rlen unused. Explicit (RK_LIST): l, r are uint64 addresses,
 * llen, rlen their lengths, located in the route's regions.
 *
 * Workers: below two parts of lane_min_bytes the whole request goes to
 * one worker (by the route's spread rule, RK_SPREAD_*); otherwise its
 * byte stream is cut into parts of about equal bytes at 4 KiB boundaries
 * (a descriptor may be cut), the lanes' parts posted first, each lane's
 * pump held off its worker and kicked before, released after. A WRITE
 * with RK_NOTIFY, and RK_OP_FLUSH (n = 0, every worker), add an endpoint
 * flush per endpoint used, counted as operations. Completion of the last
 * operation (on any thread) posts the chained read (then), and once that
 * completed sends the notification on the own worker's endpoint, then
 * publishes the slot on the completion ring.
 *
 * then (NULL: none; a READ's only) is checked here like the request and
 * posted once the request completed (rk_then_t).
 *
 * Returns the slot (>= 0), or a negative RK_SUBMIT_* with nothing posted.
 * out[0] the id, [1] the bytes, [2] the operations, [3] the workers used,
 * [4] the worker of a whole request, [5] the clock at the call, [6] and
 * [7] before and after the post loop (ns), [8] 1 if anything is on the
 * completion ring, [9 + w] the operations on worker w. */
int64_t rk_submit(const rk_route_t *route, int op, uint64_t n, const void *l, const void *r,
                  const void *llen, const void *rlen, uint32_t flags,
                  const char *notif, uint64_t notif_len, uint64_t timeout_ns, rk_then_t *then,
                  uint64_t *out);

/* Move up to max finished slots off the completion ring and free them;
 * out[2i] = slot | (uint32_t)status << 32, out[2i + 1] = its done_ns (out
 * holds 2 * max). Under the agent's lock. */
uint64_t rk_drain(rk_ctx_t *ctx, uint64_t *out, uint64_t max);

/* What the agent has to settle, in one look (rk_look's bits). */
enum {
    RK_LOOK_DONE = 1,       /* completions on the ring */
    RK_LOOK_NOTIF = 2,      /* notifications on their ring, or drops since dropped_seen */
    RK_LOOK_ERRORS = 4,     /* endpoint errors since errors_seen */
    RK_LOOK_DUE = 8         /* a live transfer's deadline has passed (or may have) */
};

/* Which of the agent's settling steps have anything to do now: so that a
 * settle after one completion costs one call, not one look per step.
 * Under the agent's lock. */
uint32_t rk_look(rk_ctx_t *ctx, uint64_t errors_seen, uint64_t dropped_seen);

/* Slots whose deadline has passed (at most max into out), once now_ns
 * reaches the earliest deadline; 0 otherwise. Under the agent's lock. */
uint64_t rk_expired(rk_ctx_t *ctx, uint64_t now_ns, uint32_t *out, uint64_t max);

/* The agent failed the slot's transfer before UCX completed it: it stops
 * counting as live, its waiters wake; the slot is freed once UCX hands it
 * back through the ring. Under the agent's lock. */
void rk_abandon(rk_ctx_t *ctx, uint32_t slot);

/* Call ucp_worker_progress until it reports no event or max_rounds calls
 * were made. Returns the number of events progressed. */
uint64_t rk_progress(ucp_worker_h worker, uint64_t max_rounds);

/* A pump: what one thread needs to progress one worker (created with
 * UCS_THREAD_MODE_MULTI, so other threads may post on it meanwhile)
 * without the Python interpreter lock: an agent's own worker in
 * progress="thread" mode, and every lane's. Its thread is the caller's
 * (pump.py: a Python thread that makes the creator's CUDA context current,
 * then calls rk_pump_run, which cffi calls without the interpreter lock).
 * It progresses without sleeping until spin_ns have passed since the last
 * event, then arms the worker and sleeps on its event fd (ucp_worker_signal
 * wakes it). Whenever the watched context changes during its progress (a
 * batch published, a notification received, an endpoint error), it wakes
 * whoever settles it: ucp_worker_signal(wake_worker) when not NULL (a
 * polling owner sleeps on its worker's fd), and an 8-byte write to wake_fd
 * when >= 0 (an eventfd a Python thread sleeps on). steer_cpus (NULL:
 * never steer) is a CPU mask of steer_words words: when kicked, the pump's
 * thread is bound to those CPUs minus the kicker's. NULL if out of memory. */
rk_pump_t *rk_pump_new(ucp_worker_h worker, int efd, rk_ctx_t *watch,
                       ucp_worker_h wake_worker, int wake_fd, uint64_t spin_ns,
                       const uint64_t *steer_cpus, uint32_t steer_words);

/* The pump's loop, on the calling thread; returns
 * once rk_pump_stop was called (within one progress call plus its wake-up). */
void rk_pump_run(rk_pump_t *pump);

/* Ask the pump's loop to return, and wake it. */
void rk_pump_stop(rk_pump_t *pump);

/* Free the pump, once its loop has returned (or never ran). */
void rk_pump_free(rk_pump_t *pump);

/* Add delta (+1 / -1) to the pump's hold count: while it is above zero the
 * pump does not progress its worker (a post holds each worker it posts on;
 * tests hold a pump to stand for one that is never scheduled). */
void rk_pump_hold(rk_pump_t *pump, int delta);

/* Progress the pump's worker on the calling thread (at most max_rounds
 * rounds, as rk_progress) if the pump is not progressing it right now and
 * its agent is not closing; returns the events handled, 0 if the pump was
 * or the agent is closing. While the caller helps, it holds the pump (the
 * pump keeps off the worker): the agent's close sets closing, then waits
 * for every pump's hold to be 0 before it stops one or destroys a worker. */
uint64_t rk_pump_help(rk_pump_t *pump, uint64_t max_rounds);

/* The pump thread's kernel thread id (/proc/self/task/<tid>); 0 until its
 * loop started. */
int rk_pump_tid(const rk_pump_t *pump);

/* What the pump is doing, for a transfer that outlived its deadline:
 * out[0] its hold count, out[1] 1 while in ucp_worker_progress, out[2] 1
 * while asleep on its worker's fd (2 while it dozes instead, the fd waking
 * it with nothing to progress), out[3] when it or a waiter that took
 * its worker last progressed the worker (rk_now_ns; 0 before), out[4] the
 * callers blocked in rk_await that took its worker (it naps meanwhile). */
void rk_pump_state(rk_pump_t *pump, uint64_t *out);

/* Block until the transfer `id` in `slot` completed or was abandoned (1),
 * or timeout_ns passed (0). Meanwhile it progresses each of the nhelp
 * pumps' workers that its pump is not progressing (rk_pump_help). With
 * take_first it takes the first pump's worker (the agent's own) as soon
 * as that pump is not progressing it, and progresses it while there is
 * work: that pump naps meanwhile instead of spinning on its hold (on few
 * CPUs the spin took one from this caller, or from a lane copying its
 * part). Once spin_ns pass with nothing to do, it gives the worker back
 * to its pump, awake, and sleeps on the slot (woken by the completion),
 * looking again every millisecond. A wait that ends with the worker
 * taken wakes the pump only if other transfers are in flight. Call
 * without the agent's lock. */
int rk_await(rk_ctx_t *ctx, uint32_t slot, uint64_t id, rk_pump_t *const *help, uint32_t nhelp,
             uint32_t take_first, uint64_t spin_ns, uint64_t timeout_ns);

/* The service thread's sleep (progress="thread"), without the interpreter
 * lock: on wake_fd (the agent's eventfd, which its pumps write) until
 * something is unsettled -- completions or notifications on the rings, or
 * ep_errors != errors_seen -- and no caller is about to settle it, or a
 * transfer's deadline is due (one posted during the wait may have a
 * shorter timeout than the wait: seen at the next look): 1; or until
 * timeout_ns pass or the agent is closing: 0. A caller is about
 * while one is in rk_await, or posted or left rk_await within delay_ns;
 * then what is unsettled is left to it for at most delay_ns. An endpoint
 * error returns at once. It also looks at the nhelp pumps, every stale_ns
 * while transfers are in flight and every idle_ns otherwise, and
 * progresses the worker of each that has not progressed it for stale_ns
 * (rk_pump_help; when idle, only one with events waiting on its fd): a
 * pump given no CPU (runnable but not scheduled, or bound to a CPU the
 * scheduler keeps busy) holds up nothing, neither this agent's transfers
 * nor a peer's reads, writes and flushes that this agent's worker must
 * answer, much longer than that. Not once closing is set. */
int rk_service_wait(rk_ctx_t *ctx, int wake_fd, uint64_t errors_seen, uint64_t delay_ns,
                    uint64_t timeout_ns, rk_pump_t *const *help, uint32_t nhelp, uint64_t stale_ns,
                    uint64_t idle_ns);

/* The agent is closing: every rk_await returns (now, or at its next
 * look) and helps no pump from here on. */
void rk_wake_waiters(rk_ctx_t *ctx);

/* Install the notification receive handler for am_id on the worker. */
ucs_status_t rk_set_notif_handler(ucp_worker_h worker, uint32_t am_id,
                                  rk_ctx_t *ctx);

/* Progress until request completes or timeout_ns passes, then free it;
 * returns its status (UCS_INPROGRESS if it did not complete in time, in
 * which case it is still freed: UCX releases it on completion). Bounded by
 * time, not by progress calls: an endpoint's close waits on its peer, and
 * a peer given no CPU lets a spinning caller run through any count of
 * rounds in a fraction of a second. */
ucs_status_t rk_wait_request(ucp_worker_h worker, ucs_status_ptr_t request,
                             uint64_t timeout_ns);
