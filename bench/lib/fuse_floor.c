/*
 * fuse_floor: the cost of the kernel's FUSE crossing alone, for
 * bench/fs.sh. One file, "bench.dat", held in this process's memory; reads
 * and writes copy to and from it and nothing else happens (no network, no
 * persistence). Whatever a FUSE file system does beyond this is its own.
 *
 *   fuse_floor SIZE_MIB MOUNTPOINT [-s] [fuse options]
 * Build: cc -O2 -o fuse_floor fuse_floor.c $(pkg-config --cflags --libs fuse3)
 */
#define FUSE_USE_VERSION 31
#include <errno.h>
#include <fuse.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static char *data;
static size_t size;

static int is_file(const char *p)
{
	return !strcmp(p, "/bench.dat");
}

static int f_getattr(const char *p, struct stat *st, struct fuse_file_info *fi)
{
	(void)fi;
	memset(st, 0, sizeof *st);
	if (!strcmp(p, "/")) {
		st->st_mode = S_IFDIR | 0755;
		st->st_nlink = 2;
		return 0;
	}
	if (!is_file(p))
		return -ENOENT;
	st->st_mode = S_IFREG | 0644;
	st->st_nlink = 1;
	st->st_size = size;
	return 0;
}

static int f_readdir(const char *p, void *buf, fuse_fill_dir_t fill, off_t off,
		     struct fuse_file_info *fi, enum fuse_readdir_flags fl)
{
	(void)p, (void)off, (void)fi, (void)fl;
	fill(buf, ".", NULL, 0, 0);
	fill(buf, "..", NULL, 0, 0);
	fill(buf, "bench.dat", NULL, 0, 0);
	return 0;
}

static int f_open(const char *p, struct fuse_file_info *fi)
{
	(void)fi;
	return is_file(p) ? 0 : -ENOENT;
}

static int f_read(const char *p, char *buf, size_t n, off_t off, struct fuse_file_info *fi)
{
	(void)p, (void)fi;
	if ((size_t)off >= size)
		return 0;
	if (n > size - off)
		n = size - off;
	memcpy(buf, data + off, n);
	return n;
}

static int f_write(const char *p, const char *buf, size_t n, off_t off, struct fuse_file_info *fi)
{
	(void)p, (void)fi;
	if ((size_t)off >= size)
		return -EFBIG;
	if (n > size - off)
		n = size - off;
	memcpy(data + off, buf, n);
	return n;
}

static int f_truncate(const char *p, off_t len, struct fuse_file_info *fi)
{
	(void)p, (void)len, (void)fi;
	return 0;
}

static const struct fuse_operations ops = {
	.getattr = f_getattr,
	.readdir = f_readdir,
	.open = f_open,
	.read = f_read,
	.write = f_write,
	.truncate = f_truncate,
};

int main(int argc, char **argv)
{
	if (argc < 3)
		return 2;
	size = (size_t)atoi(argv[1]) << 20;
	data = calloc(1, size);
	return fuse_main(argc - 1, argv + 1, &ops, NULL);
}
