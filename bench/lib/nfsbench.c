/*
 * nfsbench: QD1 latency and throughput of an NFSv3 server through libnfs
 * (no kernel client), for bench/fs.sh's nfs-ganesha column.
 *
 *   nfsbench URL FILE lay SIZE_MIB             lay FILE out (1 MiB writes)
 *   nfsbench URL FILE OP BS SIZE_MIB SECONDS    OP: randread randwrite read write
 *   nfsbench URL DIR meta N                     create + stat + unlink N files
 *
 * URL: nfs://HOST/EXPORT?nfsport=P&mountport=M (no port mapper needed).
 * Prints "iops mean_us MiB/s p50_us p99_us" (meta: "ops/s").
 * Writes are FILE_SYNC (the file is opened O_SYNC) unless NFS_SYNC=0: a
 * write returns once the server made it stable, as ustor's writes do.
 * Build: cc -O2 -o nfsbench nfsbench.c -lnfs
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <nfsc/libnfs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static int cmp(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static void die(struct nfs_context *nfs, const char *what)
{
	fprintf(stderr, "nfsbench: %s: %s\n", what, nfs ? nfs_get_error(nfs) : "");
	exit(1);
}

static int meta(struct nfs_context *nfs, const char *dir, int n)
{
	char p[512];
	struct nfsfh *fh;
	struct nfs_stat_64 st;
	nfs_mkdir(nfs, dir); /* may exist */
	double t = now();
	for (int i = 0; i < n; i++) {
		snprintf(p, sizeof p, "%s/f%d", dir, i);
		if (nfs_creat(nfs, p, 0644, &fh) < 0)
			die(nfs, "creat");
		nfs_close(nfs, fh);
	}
	for (int i = 0; i < n; i++) {
		snprintf(p, sizeof p, "%s/f%d", dir, i);
		if (nfs_stat64(nfs, p, &st) < 0)
			die(nfs, "stat");
	}
	for (int i = 0; i < n; i++) {
		snprintf(p, sizeof p, "%s/f%d", dir, i);
		if (nfs_unlink(nfs, p) < 0)
			die(nfs, "unlink");
	}
	printf("%.0f\n", 3.0 * n / (now() - t));
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 5) {
		fprintf(stderr, "usage: see the comment at the top of nfsbench.c\n");
		return 2;
	}
	struct nfs_context *nfs = nfs_init_context();
	if (!nfs)
		die(NULL, "init");
	struct nfs_url *u = nfs_parse_url_dir(nfs, argv[1]);
	if (!u)
		die(nfs, "url");
	if (nfs_mount(nfs, u->server, u->path) < 0)
		die(nfs, "mount");
	const char *file = argv[2], *op = argv[3];
	if (!strcmp(op, "meta"))
		return meta(nfs, file, atoi(argv[4]));
	int lay = !strcmp(op, "lay");
	uint64_t bs = lay ? 1 << 20 : (uint64_t)atoi(argv[4]) << 10;
	uint64_t size = (uint64_t)atoi(argv[lay ? 4 : 5]) << 20;
	double secs = lay ? 0 : atof(argv[6]);
	int wr = lay || strstr(op, "write"), rnd = !strncmp(op, "rand", 4);
	struct nfsfh *fh;
	const char *sync = getenv("NFS_SYNC");
	int flags = wr ? O_RDWR | O_CREAT : O_RDONLY;
	if (wr && !(sync && !strcmp(sync, "0")))
		flags |= O_SYNC;
	if (nfs_open(nfs, file, flags, &fh) < 0 && nfs_creat(nfs, file, 0644, &fh) < 0)
		die(nfs, "open");
	char *buf = malloc(bs);
	memset(buf, 0x5a, bs);
	if (lay) {
		for (uint64_t o = 0; o < size; o += bs)
			if (nfs_pwrite(nfs, fh, o, bs, buf) != (int)bs)
				die(nfs, "pwrite");
		nfs_close(nfs, fh);
		return 0;
	}
	size_t cap = 1 << 22, n = 0;
	double *lat = malloc(cap * sizeof *lat);
	uint64_t blocks = size / bs, off = 0;
	srandom(1);
	double start = now(), t0;
	while ((t0 = now()) - start < secs && n < cap) {
		if (rnd)
			off = (uint64_t)(random() % blocks) * bs;
		int r = wr ? nfs_pwrite(nfs, fh, off, bs, buf) : nfs_pread(nfs, fh, off, bs, buf);
		if (r != (int)bs)
			die(nfs, wr ? "pwrite" : "pread");
		lat[n++] = now() - t0;
		if (!rnd)
			off = (off + bs) % (blocks * bs);
	}
	double el = now() - start, sum = 0;
	for (size_t i = 0; i < n; i++)
		sum += lat[i];
	qsort(lat, n, sizeof *lat, cmp);
	printf("%.0f %.1f %.1f %.1f %.1f\n", n / el, sum / n * 1e6, n * (double)bs / el / 1048576,
	       lat[n / 2] * 1e6, lat[(size_t)(n * 0.99)] * 1e6);
	nfs_close(nfs, fh);
	nfs_umount(nfs);
	nfs_destroy_context(nfs);
	return 0;
}
