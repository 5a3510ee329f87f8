/* Internal to the shim (not part of the cffi interface): what shim.c's
 * posting code needs from pump.c. Include after shim.h (which has no
 * include guard: cffi's cdef reads it as it is). */
#ifndef RDMA_KV_PUMP_H
#define RDMA_KV_PUMP_H

static inline void rk_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A transfer is about to be striped onto this lane's worker: bind the
 * pump to the CPUs its creator had minus the caller's current CPU (see
 * pump.c) and wake it now, so that its wake-up (an interrupt to an idle
 * CPU: tens of microseconds on a VM) overlaps the posting; a kicked pump
 * spins for spin_ns as after an event. A striped rk_post_indexed holds each
 * lane it uses off its worker, kicks it, and releases it once that part is
 * posted. */
void rk_pump_kick(rk_pump_t *pump);

#endif
