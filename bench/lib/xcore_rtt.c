/*
 * xcore_rtt: how long a cache line takes to go from one CPU to another
 * and back, right now. Two threads pinned to CPU A and CPU B pass a
 * counter back and forth through one shared cache line (A stores, B sees
 * it and stores, A sees that); each round trip is timed with the TSC and
 * the median of TRIPS round trips is printed in ns (a thread that is
 * descheduled stalls a few trips, not the median).
 *
 * A vhost-user queue at QD1 is this exchange a few times per request (the
 * avail index, the descriptor, the used entry, the status byte), so the
 * backends' QD1 rate follows it. On a VM the figure depends on where the
 * host runs the two vCPUs at the moment (one core complex sharing an L3,
 * or two), which the guest cannot see or choose: bench/vhost.sh records
 * it before every point.
 *
 *   xcore_rtt CPU_A CPU_B [TRIPS] [SECONDS]
 *
 * With SECONDS, prints "t_s median_ns p10_ns p90_ns" for successive
 * windows of TRIPS round trips until SECONDS have passed; without it, one
 * median in ns.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <x86intrin.h>

static _Alignas(64) atomic_long line;
static _Alignas(64) atomic_int quit;

static void pin(int cpu)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    if (pthread_setaffinity_np(pthread_self(), sizeof s, &s) != 0) {
        fprintf(stderr, "xcore_rtt: cannot pin to CPU %d\n", cpu);
        exit(2);
    }
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* B: answers every odd value with the next even one. */
static void *answer(void *arg)
{
    pin(*(int *)arg);
    long want = 1;
    while (!atomic_load_explicit(&quit, memory_order_relaxed)) {
        if (atomic_load_explicit(&line, memory_order_acquire) == want) {
            atomic_store_explicit(&line, want + 1, memory_order_release);
            want += 2;
        }
    }
    return NULL;
}

static int cmp(const void *a, const void *b)
{
    unsigned long x = *(const unsigned long *)a, y = *(const unsigned long *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: xcore_rtt CPU_A CPU_B [TRIPS] [SECONDS]\n");
        return 2;
    }
    int a = atoi(argv[1]), b = atoi(argv[2]);
    long trips = argc > 3 ? atol(argv[3]) : 20000;
    double secs = argc > 4 ? atof(argv[4]) : 0;
    unsigned long *d = malloc(trips * sizeof *d);
    if (!d || trips < 10)
        return 2;
    pthread_t t;
    pthread_create(&t, NULL, answer, &b);
    pin(a);
    /* TSC ticks per ns, over 20 ms. */
    double t0 = now();
    unsigned long c0 = __rdtsc();
    while (now() - t0 < 0.02)
        ;
    double per_ns = (__rdtsc() - c0) / ((now() - t0) * 1e9);
    long v = 0;
    double start = now();
    do {
        double w = now() - start;
        for (long i = 0; i < trips; i++) {
            unsigned long s = __rdtsc();
            atomic_store_explicit(&line, v + 1, memory_order_release);
            while (atomic_load_explicit(&line, memory_order_acquire) != v + 2)
                ;
            v += 2;
            d[i] = __rdtsc() - s;
        }
        qsort(d, trips, sizeof *d, cmp);
        if (secs > 0)
            printf("%.3f %.0f %.0f %.0f\n", w, d[trips / 2] / per_ns, d[trips / 10] / per_ns,
                   d[trips * 9 / 10] / per_ns);
        else
            printf("%.0f\n", d[trips / 2] / per_ns);
        fflush(stdout);
    } while (secs > 0 && now() - start < secs);
    atomic_store(&quit, 1);
    pthread_join(t, NULL);
    return 0;
}
