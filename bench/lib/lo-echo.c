/* The floor under a QD1 request over loopback TCP: a bare echo with the
 * sizes of one iSCSI QD1 write (REQ bytes in: the SCSI Command with its
 * immediate data; RESP bytes out: the SCSI Response), no protocol work.
 *
 *   lo-echo server PORT REQ RESP spin|block
 *   lo-echo client PORT REQ RESP SECONDS [spin]
 *
 * The server answers one connection: it reads REQ bytes (busy-polling
 * recv(MSG_DONTWAIT) in "spin", as a polling target does; blocking recv in
 * "block"), then sends RESP bytes with one send. The client sends REQ with
 * one send and blocks in recv for RESP (with "spin": busy-polls
 * recv(MSG_DONTWAIT), as ustor's initiator does at QD1 on a CPU of its
 * own), and prints the round trips' count, mean and p99 in microseconds.
 * Pin each side with taskset. Build: cc -O2 -o lo-echo lo-echo.c
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Reads exactly n bytes; spin: recv(MSG_DONTWAIT) until they are there. */
static int read_n(int fd, char *buf, size_t n, int spin) {
  size_t got = 0;
  while (got < n) {
    ssize_t k = recv(fd, buf + got, n - got, spin ? MSG_DONTWAIT : 0);
    if (k == 0) return -1;
    if (k < 0) {
      if (spin) continue;
      return -1;
    }
    got += (size_t)k;
  }
  return 0;
}

static void nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int main(int argc, char **argv) {
  if (argc != 6 && !(argc == 7 && strcmp(argv[1], "client") == 0)) {
    fprintf(stderr, "usage: lo-echo server|client PORT REQ RESP spin|block|SECONDS [spin]\n");
    return 2;
  }
  int port = atoi(argv[2]);
  size_t req = (size_t)atol(argv[3]), resp = (size_t)atol(argv[4]);
  char *buf = calloc(1, req > resp ? req : resp);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (strcmp(argv[1], "server") == 0) {
    int spin = strcmp(argv[5], "spin") == 0, one = 1;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1)) {
      perror("bind/listen");
      return 1;
    }
    int c = accept(l, NULL, NULL);
    nodelay(c);
    while (read_n(c, buf, req, spin) == 0)
      if (send(c, buf, resp, MSG_NOSIGNAL) != (ssize_t)resp) break;
    return 0;
  }
  double secs = atof(argv[5]);
  int cspin = argc == 7 && strcmp(argv[6], "spin") == 0;
  /* The server may not listen yet: retry for up to 5 s. */
  int c = -1;
  for (int i = 0; i < 500; i++) {
    c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, (struct sockaddr *)&a, sizeof a) == 0) break;
    close(c);
    c = -1;
    usleep(10000);
  }
  if (c < 0) {
    perror("connect");
    return 1;
  }
  nodelay(c);
  size_t cap = 4 << 20, n = 0;
  double *lat = malloc(cap * sizeof *lat), t0 = now_us(), end = t0 + secs * 1e6;
  /* Warm-up: the first 1000 round trips are not counted. */
  for (int i = 0; i < 1000; i++)
    if (send(c, buf, req, 0) != (ssize_t)req || read_n(c, buf, resp, cspin)) return 1;
  for (double t = now_us(); t < end && n < cap;) {
    if (send(c, buf, req, 0) != (ssize_t)req || read_n(c, buf, resp, cspin)) return 1;
    double t1 = now_us();
    lat[n++] = t1 - t;
    t = t1;
  }
  double sum = 0;
  for (size_t i = 0; i < n; i++) sum += lat[i];
  qsort(lat, n, sizeof *lat, cmp);
  printf("round_trips=%zu mean_us=%.1f p50_us=%.1f p99_us=%.1f\n", n, sum / n, lat[n / 2],
         lat[n * 99 / 100]);
  return 0;
}
