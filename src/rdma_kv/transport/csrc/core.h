/* Internal to the shim (not part of the cffi interface): what core.c
 * gives post.c and pump.c, and what pump.c gives post.c. Include after
 * shim.h (which has no include guard: cffi's cdef reads it as it is).
 * Units depend one way: post.c -> pump.c -> core.c. */
#ifndef RDMA_KV_CORE_H
#define RDMA_KV_CORE_H

/* core.c */
void rk_cpu_relax(void);
uint64_t rk_now_ns(void);
/* A free slot of the slab, or NULL. */
rk_batch_t *rk_slot_take(rk_ctx_t *ctx);
/* Request parameters every operation of a batch shares, and the guard
 * count that keeps it from completing while it is being posted. */
void rk_batch_begin(rk_batch_t *b, ucp_request_param_t *p, ucp_mem_h const *memhs);
/* The batch failed with status (the first failure is the one kept). */
void rk_record(rk_batch_t *b, ucs_status_t status);
/* Completion callback of an endpoint flush (user data: its
 * rk_flush_ref_t): counts the endpoint state's flush down, then as
 * rk_op_cb. */
void rk_flush_cb(void *request, ucs_status_t status, void *user_data);
/* One more operation will be handed to UCX (counted before the call). */
void rk_batch_inc(rk_batch_t *b);
/* One operation completed: the last one completes the batch. */
void rk_batch_dec(rk_batch_t *b);
/* After a UCX call preceded by rk_batch_inc: an operation done in place or
 * refused counts down now; a pending one completes through its callback.
 * Returns the status of the call (UCS_OK if pending or done). */
ucs_status_t rk_account(rk_batch_t *b, ucs_status_ptr_t r);
/* A number that changes whenever the context has something to settle
 * (a slot published, a notification, an endpoint error). */
uint64_t rk_ctx_stamp(rk_ctx_t *ctx);
/* Sleep on a futex word while it equals expect, at most timeout_ns (or
 * until woken; spurious returns are the caller's to look again). */
void rk_futex_wait(uint32_t *word, uint32_t expect, uint64_t timeout_ns);
/* Wake every thread asleep on a futex word. */
void rk_futex_wake(uint32_t *word);
/* Announce a send on an endpoint (st: its state), then look whether it is
 * closing: 0 (and nothing announced) if it is; else 1, and the caller
 * takes the announcement back (st->sending) once its call returned. */
int rk_ep_enter(rk_ep_state_t *st);
/* Sleep on a slot's state while it equals expect, at most timeout_ns. */
void rk_slot_sleep(rk_batch_t *b, uint32_t expect, uint64_t timeout_ns);

/* pump.c */
/* A post is about to put work on the pump's worker: keep the pump off it
 * (rk_pump_hold), steer it (when it was started with CPUs to steer to)
 * and wake it now, so that its wake-up overlaps the posting; a kicked pump
 * spins for spin_ns as after an event. */
void rk_pump_kick(rk_pump_t *pump);

#endif
