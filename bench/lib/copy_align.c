/*
 * copy_align: how fast the kernel copies 1 MiB between user memory and a
 * tmpfs page as a function of the user buffer's offset in its page (for
 * bench/RESULTS-fs.md, "Why a 1 MiB write took 2 ms"). pread copies from
 * the page (offset 0) to the buffer at +off: the destination is `off`
 * bytes ahead of the source modulo 4 KiB; pwrite copies from the buffer at
 * 4096 - off to the page: again `off` bytes ahead.
 *
 *   cc -O2 -o copy_align copy_align.c && taskset -c 1 ./copy_align
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void)
{
	static const int offs[] = { 0, 1, 4, 8, 12, 16, 20, 24, 28, 31, 40, 56, 63, 72, 80, 100 };
	size_t n = 1 << 20;
	int fd = open("/dev/shm/copy_align.t", O_RDWR | O_CREAT | O_TRUNC, 0600);
	char *b;

	if (fd < 0 || posix_memalign((void **)&b, 4096, n + 8192))
		return 1;
	memset(b, 1, n + 8192);
	if (pwrite(fd, b, n, 0) != (ssize_t)n)
		return 1;
	for (size_t i = 0; i < sizeof offs / sizeof *offs; i++) {
		int o = offs[i];
		double t = now(), r, w;

		for (int k = 0; k < 200; k++)
			if (pread(fd, b + o, n, 0) != (ssize_t)n)
				return 1;
		r = (now() - t) / 200 * 1e6;
		t = now();
		for (int k = 0; k < 200; k++)
			if (pwrite(fd, b + 4096 - o, n, 0) != (ssize_t)n)
				return 1;
		w = (now() - t) / 200 * 1e6;
		printf("dst %3d bytes ahead of src mod 4 KiB: page->user %7.1f us, user->page %7.1f us per MiB\n",
		       o, r, w);
	}
	unlink("/dev/shm/copy_align.t");
	return 0;
}
