/* What this machine charges to wake an idle CPU, the way a lane is woken.
 *
 * A lane's progress thread sleeps in epoll_wait on its worker's event fd;
 * the poster wakes it with ucp_worker_signal, an eventfd write. This probe
 * does exactly that with no UCX in between: a sleeper pinned to one CPU
 * blocks in epoll_wait on an eventfd, a poster pinned to another CPU waits
 * GAP microseconds (the machine goes idle, as between two requests), then
 * writes the eventfd. Per rep it records the poster's write syscall and the
 * time from just before the write to the sleeper's return from epoll_wait.
 *
 *   cc -O2 -pthread bench/wake_latency.c -o /tmp/wake_latency
 *   /tmp/wake_latency [REPS [GAP_US ...]]      (default: 201 reps, gaps 100 1000 20000)
 *
 * Prints one JSON object: for each gap, p10 / median / p90 of both, in us.
 * Needs two CPUs in its affinity mask (it uses the first two). bench/wake_latency.py
 * builds and runs it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_REPS 100000
#define STOP 0x7fffffffull

static int efd, epfd, cpu_sleeper;
static uint64_t woke_ns; /* written by the sleeper, atomically */

static uint64_t now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int pin(int cpu)
{
    cpu_set_t set;

    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static void *sleeper(void *arg)
{
    struct epoll_event ev;
    uint64_t value, stamp;

    (void)arg;
    if (pin(cpu_sleeper) != 0) {
        fprintf(stderr, "wake_latency: cannot pin the sleeper to CPU %d\n", cpu_sleeper);
        exit(2);
    }
    for (;;) {
        if (epoll_wait(epfd, &ev, 1, -1) < 1) {
            continue;  /* EINTR */
        }
        /* Stamped on waking, published only once the fd is drained: were
         * it published before the read, the poster's next write could
         * land in between, that read would take it too, and nothing would
         * wake the sleeper again (a gap of 0 did exactly that). */
        stamp = now_ns();
        if (read(efd, &value, sizeof(value)) == (ssize_t)sizeof(value) && value >= STOP) {
            return NULL;
        }
        __atomic_store_n(&woke_ns, stamp, __ATOMIC_RELEASE);
    }
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

static void quantiles(double *v, int n, const char *name, int last)
{
    qsort(v, (size_t)n, sizeof(*v), cmp);
    printf("\"%s\": {\"p10\": %.2f, \"median\": %.2f, \"p90\": %.2f}%s", name, v[n / 10], v[n / 2],
           v[(9 * n) / 10], last ? "" : ", ");
}

int main(int argc, char **argv)
{
    static double write_us[MAX_REPS], wake_us[MAX_REPS];
    int default_gaps[] = {100, 1000, 20000}, *gaps = default_gaps, ngaps = 3;
    int reps = argc > 1 ? atoi(argv[1]) : 201, cpus[2], found = 0, g, i;
    struct epoll_event ev;
    cpu_set_t mask;
    pthread_t thread;
    uint64_t one = 1, stop = STOP, t0, t1, deadline;

    if (reps < 10 || reps > MAX_REPS) {
        fprintf(stderr, "wake_latency: REPS must be 10..%d, got %s\n", MAX_REPS, argv[1]);
        return 2;
    }
    if (argc > 2) {
        ngaps = argc - 2;
        gaps = calloc((size_t)ngaps, sizeof(*gaps));
        if (gaps == NULL) {
            perror("wake_latency: calloc");
            return 2;
        }
        for (g = 0; g < ngaps; ++g) {
            gaps[g] = atoi(argv[g + 2]);
            if (gaps[g] < 0 || gaps[g] > 1000000) {
                fprintf(stderr, "wake_latency: GAP_US must be 0..1000000, got %s\n", argv[g + 2]);
                return 2;
            }
        }
    }
    if (sched_getaffinity(0, sizeof(mask), &mask) != 0) {
        perror("wake_latency: sched_getaffinity");
        return 2;
    }
    for (i = 0; i < CPU_SETSIZE && found < 2; ++i) {
        if (CPU_ISSET(i, &mask)) {
            cpus[found++] = i;
        }
    }
    if (found < 2) {
        fprintf(stderr, "wake_latency: needs two CPUs in its affinity mask, has %d\n", CPU_COUNT(&mask));
        return 2;
    }
    cpu_sleeper = cpus[1];
    efd = eventfd(0, EFD_NONBLOCK);
    epfd = epoll_create1(0);
    memset(&ev, 0, sizeof(ev));
    ev.events = EPOLLIN;
    if (efd < 0 || epfd < 0 || epoll_ctl(epfd, EPOLL_CTL_ADD, efd, &ev) != 0) {
        perror("wake_latency: eventfd/epoll");
        return 2;
    }
    if (pin(cpus[0]) != 0 || pthread_create(&thread, NULL, sleeper, NULL) != 0) {
        fprintf(stderr, "wake_latency: cannot pin the poster to CPU %d or start the sleeper\n", cpus[0]);
        return 2;
    }
    usleep(100000);
    printf("{\"poster_cpu\": %d, \"sleeper_cpu\": %d, \"reps\": %d, \"gaps\": {", cpus[0], cpus[1], reps);
    for (g = 0; g < ngaps; ++g) {
        for (i = 0; i < reps; ++i) {
            if (gaps[g] > 0) {
                usleep((useconds_t)gaps[g]);
            }
            __atomic_store_n(&woke_ns, 0, __ATOMIC_RELEASE);
            t0 = now_ns();
            if (write(efd, &one, sizeof(one)) != (ssize_t)sizeof(one)) {
                perror("wake_latency: eventfd write");
                return 2;
            }
            t1 = now_ns();
            deadline = t0 + 1000000000ull;  /* a wake-up that takes 1 s is a broken machine */
            while (__atomic_load_n(&woke_ns, __ATOMIC_ACQUIRE) == 0) {
                if (now_ns() > deadline) {
                    fprintf(stderr, "wake_latency: the sleeper did not wake within 1 s\n");
                    return 3;
                }
            }
            write_us[i] = (double)(t1 - t0) / 1e3;
            wake_us[i] = (double)(__atomic_load_n(&woke_ns, __ATOMIC_ACQUIRE) - t0) / 1e3;
        }
        printf("%s\"%d\": {", g ? ", " : "", gaps[g]);
        quantiles(write_us, reps, "write_us", 0);
        quantiles(wake_us, reps, "wake_us", 1);
        printf("}");
    }
    printf("}}\n");
    if (write(efd, &stop, sizeof(stop)) == (ssize_t)sizeof(stop)) {
        pthread_join(thread, NULL);
    }
    return 0;
}
