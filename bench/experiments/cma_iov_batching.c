/* What UCX's CMA transport pays for one syscall per operation.
 *
 * UCX posts each RMA get as its own operation, and over CMA each becomes
 * its own process_vm_readv of one iovec; the scale curves' cma-t2 bar
 * joins a thread's whole share of requests into calls of up to IOV_MAX
 * (1024) iovecs. This reads the same random 32 KiB blocks (64 requests
 * of 16 blocks per rep, from a forked child's copy of a 128 MiB pool) on
 * one thread three ways, taking turns rep by rep: one iovec per call (as
 * UCX's CMA does), 16 per call (one request per call) and 1024 per call
 * (what cma-t2 does with 64 requests in flight).
 *
 *     gcc -O2 -o /tmp/cma_iov bench/experiments/cma_iov_batching.c && /tmp/cma_iov [reps]
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BLK 32768
#define POOL 4096
#define NB 1024   /* blocks per rep: 64 requests of 16 */

static double now(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    static const int per_call[3] = {1, 16, 1024};
    int reps = argc > 1 ? atoi(argv[1]) : 300, fds[2], r, m, i, k;
    double spent[3] = {0, 0, 0};
    struct iovec l[NB], rm[NB];
    char *pool = aligned_alloc(4096, (size_t)POOL * BLK), *local = aligned_alloc(4096, (size_t)NB * BLK), c;
    pid_t child;

    memset(pool, 1, (size_t)POOL * BLK);
    memset(local, 0, (size_t)NB * BLK);
    if (pipe(fds) != 0) {
        return 1;
    }
    child = fork();
    if (child == 0) {                   /* the remote: the pool at the same address */
        return read(fds[0], &c, 1) == 1 ? 0 : 1;
    }
    srand(1);
    for (r = 0; r < 3 * reps; ++r) {
        m = r % 3;
        for (i = 0; i < NB; ++i) {
            l[i].iov_base = local + (size_t)i * BLK;
            l[i].iov_len = BLK;
            rm[i].iov_base = pool + (size_t)(rand() % POOL) * BLK;
            rm[i].iov_len = BLK;
        }
        double t = now();
        for (i = 0; i < NB; i += per_call[m]) {
            k = per_call[m];
            if (process_vm_readv(child, &l[i], k, &rm[i], k, 0) != (ssize_t)k * BLK) {
                perror("process_vm_readv");
                return 1;
            }
        }
        spent[m] += now() - t;
    }
    for (m = 0; m < 3; ++m) {
        printf("%4d iovecs per call: %5.2f GB/s (x%.2f of 1024 per call)\n", per_call[m],
               (double)NB * BLK * reps / spent[m] / 1e9, spent[2] / spent[m]);
    }
    if (write(fds[1], "x", 1) != 1) {
        return 1;
    }
    waitpid(child, NULL, 0);
    return 0;
}
