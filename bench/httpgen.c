/* The closed-loop HTTP clients of bench/http.py, in C so that they take as little as possible of
 * the two cores they share with the systems measured: the same loop in Python on uvloop took
 * ~37 us of CPU a request, this one ~28 us (most of that is the kernel's loopback TCP, which no
 * client avoids). One keep-alive HTTP/1.1 connection per client, one request at a time.
 *
 *     httpgen PORT CLIENTS_FILE EXPECT WARMUP SECONDS LATENCIES
 *
 * CLIENTS_FILE holds one client per record: a text line "START KEY HEAD BODY" (START: the first
 * sequence number, KEY: 16 hex digits, HEAD and BODY: byte counts), then HEAD bytes of request
 * line and headers (each ending in CRLF, no Content-Length, no blank line), then BODY bytes. A
 * client with no body sends HEAD and a blank line every time. A client with a body sends it with
 * its Content-Length, "{SEQ}" in it replaced by the request's sequence number (START, START + 1,
 * ...) and "{KEY}" by KEY followed by the sequence number as 16 hex digits (a distinct operation
 * key per request). Every reply must carry status EXPECT and a Content-Length; anything else
 * (another status, a chunked reply, a closed connection, 10 s without a reply) prints one line
 * on stderr (the request's path, the status and the reply's first 2,000 bytes) and exits 1.
 *
 * Clients send until WARMUP + SECONDS have passed since the start, then each waits for its last
 * reply. Each reply completed in the window after WARMUP appends its latency (a little-endian
 * double, seconds) to LATENCIES; stdout gets one line "CPU NEXT_1 NEXT_2 ...": this process's CPU
 * over the run, as a share of one core, and each client's next unused sequence number. */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  int fd;
  long seq;                       /* of the request in flight */
  char key[17];
  const char *head, *body;        /* the request's template */
  size_t head_len, body_len;
  char *req;                      /* the request being sent */
  size_t req_cap;
  char *buf;                      /* bytes of the reply being read */
  size_t len, cap;
  double sent;
} Client;

static void die(const char *what) {
  fprintf(stderr, "httpgen: %s: %s\n", what, strerror(errno));
  exit(1);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static char *read_file(const char *path, size_t *size) {
  FILE *f = fopen(path, "rb");
  struct stat st;
  if (!f || fstat(fileno(f), &st) != 0) die(path);
  char *data = malloc(st.st_size + 1);
  if (!data || fread(data, 1, st.st_size, f) != (size_t)st.st_size) die(path);
  fclose(f);
  data[st.st_size] = 0;
  *size = st.st_size;
  return data;
}

static void reserve(char **p, size_t *cap, size_t need) {
  if (*cap >= need) return;
  *cap = need * 2;
  *p = realloc(*p, *cap);
  if (!*p) die("realloc");
}

/* The client's next request, built in c->req; returns its length. */
static size_t build(Client *c) {
  if (!c->body_len) {
    reserve(&c->req, &c->req_cap, c->head_len + 2);
    memcpy(c->req, c->head, c->head_len);
    memcpy(c->req + c->head_len, "\r\n", 2);
    return c->head_len + 2;
  }
  char body[8192], seq[24], key[40];
  int seq_len = snprintf(seq, sizeof seq, "%ld", c->seq);
  int key_len = snprintf(key, sizeof key, "%s%016lx", c->key, (unsigned long)c->seq);
  size_t n = 0;
  for (size_t i = 0; i < c->body_len;) {
    const char *put = NULL;
    size_t put_len = 0, skip = 1;
    if (c->body[i] == '{' && i + 5 <= c->body_len && !memcmp(c->body + i, "{SEQ}", 5)) {
      put = seq, put_len = seq_len, skip = 5;
    } else if (c->body[i] == '{' && i + 5 <= c->body_len && !memcmp(c->body + i, "{KEY}", 5)) {
      put = key, put_len = key_len, skip = 5;
    } else {
      put = c->body + i, put_len = 1;
    }
    if (n + put_len > sizeof body) {
      errno = E2BIG;
      die("request body");
    }
    memcpy(body + n, put, put_len);
    n += put_len;
    i += skip;
  }
  char length[48];
  int length_len = snprintf(length, sizeof length, "Content-Length: %zu\r\n\r\n", n);
  reserve(&c->req, &c->req_cap, c->head_len + length_len + n);
  memcpy(c->req, c->head, c->head_len);
  memcpy(c->req + c->head_len, length, length_len);
  memcpy(c->req + c->head_len + length_len, body, n);
  return c->head_len + length_len + n;
}

static void send_next(Client *c) {  /* the socket blocks on send: a request is one short write */
  size_t n = build(c);
  const char *p = c->req;
  c->sent = now();
  while (n) {
    ssize_t k = send(c->fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      die("send");
    }
    p += k;
    n -= (size_t)k;
  }
}

static void refuse(const Client *c, const char *why, size_t body_at, size_t body_len) {
  const char *path = memchr(c->head, ' ', c->head_len);
  const char *end = path ? memchr(path + 1, ' ', c->head_len - (path + 1 - c->head)) : NULL;
  int path_len = path && end ? (int)(end - path - 1) : 0;
  size_t show = body_len < 2000 ? body_len : 2000;
  fprintf(stderr, "%.*s answered %s: %.*s\n", path_len, path ? path + 1 : "", why, (int)show, c->buf + body_at);
  exit(1);
}

/* Length of the complete reply at the start of c->buf, or 0 while it is incomplete. */
static size_t reply_length(const Client *c, int expect) {
  char *head_end = memmem(c->buf, c->len, "\r\n\r\n", 4);
  if (!head_end) return 0;
  size_t head_len = head_end - c->buf + 4;
  *head_end = 0;  /* (the head as a string; its bytes are not used again) */
  int status = 0;
  if (sscanf(c->buf, "HTTP/1.%*d %d", &status) != 1) refuse(c, "a reply that is not HTTP", 0, c->len);
  long length = -1;
  for (char *line = strstr(c->buf, "\r\n"); line; line = strstr(line + 2, "\r\n")) {
    if (!strncasecmp(line + 2, "content-length:", 15)) length = strtol(line + 17, NULL, 10);
    if (!strncasecmp(line + 2, "transfer-encoding:", 18)) refuse(c, "a chunked reply", 0, 0);
  }
  if (length < 0) refuse(c, "a reply without Content-Length", 0, 0);
  if (c->len < head_len + (size_t)length) {
    *head_end = '\r';
    return 0;
  }
  if (status != expect) {
    char why[32];
    snprintf(why, sizeof why, "%d", status);
    refuse(c, why, head_len, (size_t)length);
  }
  return head_len + (size_t)length;
}

int main(int argc, char **argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: httpgen PORT CLIENTS_FILE EXPECT WARMUP SECONDS LATENCIES\n");
    return 2;
  }
  int port = atoi(argv[1]), expect = atoi(argv[3]);
  double warmup = atof(argv[4]), seconds = atof(argv[5]);
  size_t spec_size;
  char *spec = read_file(argv[2], &spec_size), *at = spec, *spec_end = spec + spec_size;
  FILE *out = fopen(argv[6], "wb");
  if (!out) die(argv[6]);
  static char outbuf[1 << 20];
  setvbuf(out, outbuf, _IOFBF, sizeof outbuf);

  int clients = 0, cap = 64;
  Client *cs = calloc(cap, sizeof *cs);
  while (at < spec_end) {
    long start;
    size_t head_len, body_len;
    int used;
    char key[17];
    if (sscanf(at, "%ld %16s %zu %zu\n%n", &start, key, &head_len, &body_len, &used) != 4 ||
        strlen(key) != 16 || at + used + head_len + body_len > spec_end) {
      errno = EINVAL;
      die(argv[2]);
    }
    if (clients == cap) cs = realloc(cs, (cap *= 2) * sizeof *cs);
    Client *c = &cs[clients++];
    memset(c, 0, sizeof *c);
    c->seq = start;
    memcpy(c->key, key, 17);
    c->head = at + used, c->head_len = head_len;
    c->body = c->head + head_len, c->body_len = body_len;
    at = (char *)c->body + body_len;
  }
  if (!clients) {
    errno = EINVAL;
    die(argv[2]);
  }

  struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  int ep = epoll_create1(0);
  if (ep < 0) die("epoll_create1");
  double start = now(), window_start = start + warmup, window_end = start + warmup + seconds;
  int in_flight = 0;
  for (int i = 0; i < clients; i++) {
    Client *c = &cs[i];
    int one = 1;
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&addr, sizeof addr) != 0) die("connect");
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->cap = 65536;
    c->buf = malloc(c->cap);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev) != 0) die("epoll_ctl");
    send_next(c);
    in_flight++;
  }
  struct epoll_event events[256];
  while (in_flight) {
    int ready = epoll_wait(ep, events, 256, 10000);
    if (ready < 0) {
      if (errno == EINTR) continue;
      die("epoll_wait");
    }
    if (ready == 0) {
      errno = ETIMEDOUT;
      die("no reply within 10 s");
    }
    for (int e = 0; e < ready; e++) {
      Client *c = events[e].data.ptr;
      if (c->cap - c->len < 4096) {
        c->cap *= 2;
        c->buf = realloc(c->buf, c->cap);
        if (!c->buf) die("realloc");
      }
      ssize_t k = recv(c->fd, c->buf + c->len, c->cap - c->len - 1, MSG_DONTWAIT);
      if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (k <= 0) {
        if (k == 0) errno = ECONNRESET;
        die("the server closed a connection");
      }
      c->len += (size_t)k;
      size_t n = reply_length(c, expect);
      if (!n) continue;
      if (n != c->len) {
        errno = EPROTO;
        die("bytes after the reply (one request is in flight per connection)");
      }
      c->len = 0;
      double t = now();
      if (t >= window_start && t < window_end) {
        double latency = t - c->sent;
        fwrite(&latency, sizeof latency, 1, out);
      }
      c->seq++;
      if (t < window_end) {
        send_next(c);
      } else {
        close(c->fd);
        in_flight--;
      }
    }
  }
  if (fclose(out) != 0) die(argv[6]);
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  double cpu = ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
  printf("%.4f", cpu / (now() - start));
  for (int i = 0; i < clients; i++) printf(" %ld", cs[i].seq);
  printf("\n");
  return 0;
}
