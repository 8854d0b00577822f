/*
 * rbd_floor: the librados floor of an RBD client at QD1 (issue 22). One
 * thread reads or writes 4 KiB at random offsets of an image's data
 * objects with rados_aio_read / rados_aio_write, one I/O at a time, with
 * nothing else around it: no bdev layer, no reactor, no timer. It maps an
 * offset to an object the way ustor's direct path does
 * (`<block_name_prefix>.<object number, 16 hex digits>`), so it is what any
 * client that calls librados' C API at QD1 pays, and bounds what ustor's
 * direct path can reach against fio's rbd engine.
 *
 * How the submitting thread learns of a completion:
 *   cb    a completion callback (librados runs it on its io_context_pool
 *         thread) sets a word and wakes the thread with FUTEX_WAKE; the
 *         thread sleeps in FUTEX_WAIT: the hand-offs of ustor's direct path
 *         (messenger -> io_context_pool -> submitter);
 *   wait  no callback: rados_aio_wait_for_complete. librados' messenger
 *         marks the completion done and signals its condition variable
 *         itself and defers to io_context_pool only when a callback is
 *         set, so this skips a hand-off; a thread serving other work (a
 *         reactor) cannot block this way.
 * Connection options: ustor's defaults (librados_thread_count=1,
 * ms_async_op_threads=1, no admin socket), then any `key=value` given.
 *
 *   rbd_floor PREFIX IMAGE_BYTES OBJECT_BYTES read|write cb|wait SECONDS [key=value...]
 *
 * Prints `iops=... lat_avg_us=... loop_cpu_us_per_io=...` (the process's
 * CPU over the I/O loop only; bench/rbd.sh measures the whole process with
 * /usr/bin/time like every other tool). CEPH_CONF names the cluster.
 */
#include <rados/librados.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static _Atomic unsigned done;

static void on_complete(rados_completion_t c, void *arg)
{
    (void)c;
    (void)arg;
    atomic_store(&done, 1);
    syscall(SYS_futex, &done, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static double cpu(void)
{
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

static void die(const char *what, int r)
{
    fprintf(stderr, "rbd_floor: %s: %d\n", what, r);
    exit(1);
}

int main(int argc, char **argv)
{
    if (argc < 7) {
        fprintf(stderr, "usage: rbd_floor PREFIX IMAGE_BYTES OBJECT_BYTES read|write cb|wait SECONDS [k=v...]\n");
        return 2;
    }
    const char *prefix = argv[1];
    unsigned long long size = strtoull(argv[2], NULL, 0), obj = strtoull(argv[3], NULL, 0);
    int wr = !strcmp(argv[4], "write"), cb = !strcmp(argv[5], "cb");
    double secs = atof(argv[6]);
    rados_t cl;
    rados_ioctx_t io;
    int r;
    if ((r = rados_create2(&cl, "ceph", "client.admin", 0)) < 0)
        die("rados_create2", r);
    rados_conf_read_file(cl, NULL);
    rados_conf_set(cl, "librados_thread_count", "1");
    rados_conf_set(cl, "ms_async_op_threads", "1");
    rados_conf_set(cl, "admin_socket", "");
    for (int i = 7; i < argc; i++) {
        char *eq = strchr(argv[i], '=');
        if (!eq)
            die(argv[i], -22);
        *eq = 0;
        if ((r = rados_conf_set(cl, argv[i], eq + 1)) < 0)
            die(argv[i], r);
    }
    if ((r = rados_connect(cl)) < 0)
        die("rados_connect", r);
    if ((r = rados_ioctx_create(cl, "rbd", &io)) < 0)
        die("rados_ioctx_create", r);
    char *buf = aligned_alloc(4096, 4096);
    memset(buf, 0x5a, 4096);
    char oid[96];
    unsigned long long x = 88172645463325252ULL;
    long n = 0;
    double c0 = cpu(), t0 = now();
    while (now() - t0 < secs) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        unsigned long long off = x % size & ~4095ULL;
        snprintf(oid, sizeof oid, "%s.%016llx", prefix, off / obj);
        rados_completion_t c;
        atomic_store(&done, 0);
        if ((r = rados_aio_create_completion2(NULL, cb ? on_complete : NULL, &c)) < 0)
            die("rados_aio_create_completion2", r);
        r = wr ? rados_aio_write(io, oid, c, buf, 4096, off % obj) : rados_aio_read(io, oid, c, buf, 4096, off % obj);
        if (r < 0)
            die("submit", r);
        if (cb) {
            while (!atomic_load(&done))
                syscall(SYS_futex, &done, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
        } else {
            rados_aio_wait_for_complete(c);
        }
        r = rados_aio_get_return_value(c);
        if (r < 0 || (!wr && r != 4096))
            die("I/O", r);
        rados_aio_release(c);
        n++;
    }
    double dt = now() - t0, dc = cpu() - c0;
    printf("iops=%.1f lat_avg_us=%.1f loop_cpu_us_per_io=%.2f\n", n / dt, dt * 1e6 / n, dc * 1e6 / n);
    rados_ioctx_destroy(io);
    rados_shutdown(cl);
    return 0;
}
