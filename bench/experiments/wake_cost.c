/* What waking a sleeping thread costs the waker, on this host.
 *
 * rdma-kv's shipped reader (progress="thread") kicks the lane's pump before
 * posting: ucp_worker_signal writes to the worker's eventfd, which the pump
 * sleeps on (poll) once idle. A lone request finds the pump asleep, so its
 * call pays for the wake. This times the eventfd write three ways, taking
 * turns rep by rep, the waker on CPU 0 and the other thread on CPU 1:
 *
 *   idle   nobody polls the eventfd (the write alone);
 *   awake  the other thread spins, polling the eventfd with a zero timeout
 *          (a pump still spinning after recent work);
 *   asleep the other thread sleeps in poll() on it, and has slept 2 ms
 *          (a pump gone to sleep; its CPU idle).
 *
 * For each: the waker's write() (median, p90), and for "asleep" the time
 * until the sleeper runs again. The other thread is seen in a mode before
 * the timed write. No UCX, no rdma-kv.
 *
 *   cc -O2 -pthread -o /tmp/wake_cost bench/experiments/wake_cost.c
 *   /tmp/wake_cost [reps]
 */
#define _GNU_SOURCE
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

enum { IDLE, AWAKE, ASLEEP, NMODES };
static const char *const names[NMODES] = {"idle", "awake", "asleep"};

static int efd;
static volatile int mode = -1, seen = -1, stop;
static volatile uint64_t woke_ns;

static uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void pin(int cpu)
{
    cpu_set_t set;

    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static void drain(void)
{
    uint64_t v;

    if (read(efd, &v, sizeof(v)) < 0) {
        /* EAGAIN: nothing to drain */
    }
}

static void *other(void *arg)
{
    struct pollfd pfd = {.fd = efd, .events = POLLIN};

    (void)arg;
    pin(1);
    while (!stop) {
        int m = mode;

        seen = m;                       /* the mode this turn runs in */
        if (m == AWAKE) {
            if (poll(&pfd, 1, 0) > 0) {
                woke_ns = now_ns();
                drain();
            }
        } else if (m == ASLEEP) {
            if (poll(&pfd, 1, 100) > 0) {
                woke_ns = now_ns();
                drain();
            }
        } else {
            usleep(100);
        }
    }
    return NULL;
}

static int cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    int reps = argc > 1 ? atoi(argv[1]) : 400, r, m;
    uint64_t *write_ns[NMODES], *wake_ns, one = 1, t0, t1;
    pthread_t th;

    efd = eventfd(0, EFD_NONBLOCK);
    for (m = 0; m < NMODES; ++m) {
        write_ns[m] = calloc((size_t)reps, sizeof(uint64_t));
    }
    wake_ns = calloc((size_t)reps, sizeof(uint64_t));
    pin(0);
    pthread_create(&th, NULL, other, NULL);
    for (r = 0; r < reps; ++r) {
        for (m = 0; m < NMODES; ++m) {
            mode = m;
            while (seen != m) {         /* out of the last mode's poll (untimed) */
                if (write(efd, &one, sizeof(one)) < 0) {
                    return 1;
                }
                usleep(50);
            }
            usleep(1000);
            drain();
            usleep(2000);       /* asleep: the other CPU idles meanwhile */
            woke_ns = 0;
            t0 = now_ns();
            if (write(efd, &one, sizeof(one)) < 0) {
                return 1;
            }
            t1 = now_ns();
            write_ns[m][r] = t1 - t0;
            if (m == ASLEEP) {
                while (woke_ns == 0 && now_ns() - t0 < 200000000u) {
                }
                wake_ns[r] = woke_ns ? woke_ns - t0 : 0;
            }
            usleep(200);
            drain();
        }
    }
    stop = 1;
    pthread_join(th, NULL);
    for (m = 0; m < NMODES; ++m) {
        qsort(write_ns[m], (size_t)reps, sizeof(uint64_t), cmp);
        printf("%-7s write(): median %6.2f us, p90 %6.2f us\n", names[m],
               write_ns[m][reps / 2] / 1e3, write_ns[m][reps * 9 / 10] / 1e3);
    }
    qsort(wake_ns, (size_t)reps, sizeof(uint64_t), cmp);
    printf("asleep  write() -> sleeper running: median %6.2f us, p90 %6.2f us\n",
           wake_ns[reps / 2] / 1e3, wake_ns[reps * 9 / 10] / 1e3);
    return 0;
}
