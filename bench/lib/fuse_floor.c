/*
 * fuse_floor: the cost of the kernel's FUSE crossing alone, for
 * bench/fs.sh. One file, "bench.dat", held in this process's memory; reads
 * and writes copy to and from it and nothing else happens (no network, no
 * persistence). Whatever a FUSE file system does beyond this is its own.
 *
 * With FLOOR_TCP=1 in the environment ("floor_tcp"), the file lives in a
 * trivial peer process instead, forked at start and reached over one
 * loopback TCP connection (TCP_NODELAY, blocking sockets): a write sends a
 * 16-byte header and its payload (one sendmsg) and waits for a 4-byte reply, a read
 * sends the header and receives the bytes straight into FUSE's buffer.
 * That is the FUSE floor plus one TCP round trip and two process wake-ups
 * and nothing else: the least any networked FUSE file system pays here.
 *
 *   [FLOOR_TCP=1] fuse_floor SIZE_MIB MOUNTPOINT [-s] [fuse options]
 * Build: cc -O2 -o fuse_floor fuse_floor.c $(pkg-config --cflags --libs fuse3)
 */
#define FUSE_USE_VERSION 31
#include <errno.h>
#include <fuse.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/stat.h>
#include <unistd.h>

static char *data;
static size_t size;
/* The connection to the peer (floor_tcp), or -1. */
static int peer = -1;

/* A request to the peer: op ('r' or 'w'), length, offset. */
struct hdr {
	uint32_t op, len;
	uint64_t off;
};

static int io_all(int fd, void *b, size_t n, int wr)
{
	char *p = b;

	while (n > 0) {
		ssize_t k = wr ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);

		if (k <= 0)
			return -EIO;
		p += k;
		n -= k;
	}
	return 0;
}

/* The peer: answers requests from `data` until the connection ends. */
static void serve_peer(int fd)
{
	struct hdr h;
	uint32_t ok = 0;

	while (io_all(fd, &h, sizeof h, 0) == 0) {
		if (h.off > size || h.len > size - h.off)
			_exit(1);
		if (h.op == 'w') {
			if (io_all(fd, data + h.off, h.len, 0) || io_all(fd, &ok, sizeof ok, 1))
				break;
		} else if (io_all(fd, data + h.off, h.len, 1)) {
			break;
		}
	}
	_exit(0);
}

/* Forks the peer and connects to it over 127.0.0.1; the fd, or -1. */
static int start_peer(void)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t al = sizeof a;
	int one = 1, l = socket(AF_INET, SOCK_STREAM, 0), c;

	if (l < 0 || bind(l, (void *)&a, sizeof a) || listen(l, 1) || getsockname(l, (void *)&a, &al))
		return -1;
	if (fork() == 0) {
		c = accept(l, NULL, NULL);
		if (c < 0)
			_exit(1);
		setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
		serve_peer(c);
	}
	close(l);
	c = socket(AF_INET, SOCK_STREAM, 0);
	if (c < 0 || connect(c, (void *)&a, sizeof a))
		return -1;
	setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	return c;
}

/* One request to the peer; `buf` is sent (write) or filled (read). */
static int peer_call(uint32_t op, char *buf, size_t n, off_t off)
{
	struct hdr h = { .op = op, .len = n, .off = off };
	uint32_t ok;

	/* A write's header and payload leave with one sendmsg, as ustor's do. */
	struct iovec iov[2] = { { &h, sizeof h }, { buf, op == 'w' ? n : 0 } };
	struct msghdr m = { .msg_iov = iov, .msg_iovlen = 2 };
	size_t left = sizeof h + iov[1].iov_len;

	while (left > 0) {
		ssize_t k = sendmsg(peer, &m, MSG_NOSIGNAL);

		if (k <= 0)
			return -EIO;
		left -= k;
		while (m.msg_iovlen > 0 && (size_t)k >= m.msg_iov->iov_len) {
			k -= m.msg_iov->iov_len;
			m.msg_iov++;
			m.msg_iovlen--;
		}
		if (m.msg_iovlen > 0) {
			m.msg_iov->iov_base = (char *)m.msg_iov->iov_base + k;
			m.msg_iov->iov_len -= k;
		}
	}
	if (op == 'w')
		return io_all(peer, &ok, sizeof ok, 0);
	return io_all(peer, buf, n, 0);
}

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
	if (peer >= 0) {
		int e = peer_call('r', buf, n, off);

		return e ? e : (int)n;
	}
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
	if (peer >= 0) {
		int e = peer_call('w', (char *)buf, n, off);

		return e ? e : (int)n;
	}
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
	const char *tcp;

	if (argc < 3)
		return 2;
	size = (size_t)atoi(argv[1]) << 20;
	data = calloc(1, size);
	tcp = getenv("FLOOR_TCP");
	if (tcp && *tcp && strcmp(tcp, "0") && (peer = start_peer()) < 0)
		return 1;
	return fuse_main(argc - 1, argv + 1, &ops, NULL);
}
