/* The closed-loop clients of bench/journal.py, in C so that they take as little as possible of the
 * two cores they share with the device (the same loop in Python took ~30% of a core at 64 clients,
 * about 11 us per request, against ~3 us here: one recv and one send per request).
 *
 *     loadgen SOCKET FRAMES CLIENTS SECONDS REPLIES [TIMES [PACE]]
 *
 * FRAMES holds the requests, each a whole device frame (4-byte big-endian length, then the payload),
 * one after another; each is sent once. CLIENTS connections to the Unix socket SOCKET each send one
 * request, wait for its reply and send the next, until SECONDS have passed or the requests run out;
 * then each waits for its last reply. Every reply frame is written, as received, to REPLIES (the
 * caller checks them after the phase), or, with REPLIES "-", checked here to carry the top-level
 * "status" 202 (a saved receipt; any other ends the run, exit status 1: millions of replies
 * written to a tmpfs were gigabytes of memory); stdout gets "REPLIES_RECEIVED ELAPSED_SECONDS". TIMES,
 * when given, gets each reply's arrival time, in the order of REPLIES: a native double of
 * CLOCK_MONOTONIC seconds (Python's time.monotonic), for bench/checkpoint.py's windows and gaps.
 * stderr gets "sending" once FRAMES is read and every client connected, before the first request
 * (reading a gigabyte of FRAMES takes seconds: a caller that times from the start waits for it).
 * SIGUSR1 ends the run early (each client waits for its last reply, as at SECONDS). A wait of
 * 60 s without any reply is an error. Exit status 1 with one more line on stderr on any error.
 * PACE, when given and above 0, caps the requests sent at PACE a second over all clients (the k-th
 * not before k / PACE seconds from the start): a client whose reply came early waits, parked, for
 * its turn. A paced load spends its frames at a known rate, so a file of them lasts a known time
 * however fast the device answers (bench/checkpoint.py --pace); a pause of the device still shows
 * as a gap between replies, since the parked clients' turns come while it answers no one. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  int fd;
  unsigned char *buf;  /* bytes of the reply being read */
  size_t len, cap;
} Client;

static void die(const char *what) {
  fprintf(stderr, "loadgen: %s: %s\n", what, strerror(errno));
  exit(1);
}

static volatile sig_atomic_t stop_asked = 0;

static void on_usr1(int sig) {
  (void)sig;
  stop_asked = 1;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint32_t be32(const unsigned char *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static unsigned char *read_file(const char *path, size_t *size) {
  FILE *f = fopen(path, "rb");
  struct stat st;
  if (!f || fstat(fileno(f), &st) != 0) die(path);
  unsigned char *data = malloc(st.st_size ? st.st_size : 1);
  if (!data || fread(data, 1, st.st_size, f) != (size_t)st.st_size) die(path);
  fclose(f);
  *size = st.st_size;
  return data;
}

static void send_all(int fd, const unsigned char *p, size_t n) {  /* the socket blocks on send */
  while (n) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      die("send");
    }
    p += k;
    n -= (size_t)k;
  }
}

/* The requests (FRAMES), the next one's offset, how many were sent, and when the run ends. */
static unsigned char *frames;
static size_t frames_size, next;
static long sent;
static double deadline;

/* Whether the run goes on: no SIGUSR1, SECONDS not passed, a request left. */
static int goes_on(void) { return !stop_asked && now() < deadline && next + 4 <= frames_size; }

/* The next request on `fd` if the run goes on: 1, else 0 (the client is done). */
static int send_next(int fd) {
  if (!goes_on()) return 0;
  size_t n = 4 + be32(frames + next);
  send_all(fd, frames + next, n);
  next += n;
  sent++;
  return 1;
}

/* msgpack, as much as a reply frame's top level needs: skip one value at p (end: the frame's end);
 * NULL when it does not fit. */
static const unsigned char *skip(const unsigned char *p, const unsigned char *end, int depth) {
  if (p >= end || depth > 8) return NULL;
  unsigned char t = *p++;
  size_t n = 0, items = 0;
  if (t <= 0x7f || t >= 0xe0 || t == 0xc0 || t == 0xc2 || t == 0xc3) return p;
  if ((t & 0xe0) == 0xa0) n = t & 0x1f;                          /* fixstr */
  else if ((t & 0xf0) == 0x80) items = 2 * (size_t)(t & 0x0f);   /* fixmap */
  else if ((t & 0xf0) == 0x90) items = t & 0x0f;                 /* fixarray */
  else if (t == 0xcc || t == 0xd0) n = 1;
  else if (t == 0xcd || t == 0xd1) n = 2;
  else if (t == 0xce || t == 0xd2 || t == 0xca) n = 4;
  else if (t == 0xcf || t == 0xd3 || t == 0xcb) n = 8;
  else if (t == 0xd9 || t == 0xc4) { if (p + 1 > end) return NULL; n = p[0]; p += 1; }
  else if (t == 0xda || t == 0xc5) { if (p + 2 > end) return NULL; n = (size_t)p[0] << 8 | p[1]; p += 2; }
  else if (t == 0xdb || t == 0xc6) { if (p + 4 > end) return NULL; n = be32(p); p += 4; }
  else if (t == 0xdc || t == 0xde) {
    if (p + 2 > end) return NULL;
    items = ((size_t)p[0] << 8 | p[1]) * (t == 0xde ? 2 : 1);
    p += 2;
  } else if (t == 0xdd || t == 0xdf) {
    if (p + 4 > end) return NULL;
    items = (size_t)be32(p) * (t == 0xdf ? 2 : 1);
    p += 4;
  } else return NULL;  /* ext types: not in a reply */
  if (n > (size_t)(end - p)) return NULL;
  p += n;
  while (p && items--) p = skip(p, end, depth + 1);
  return p;
}

/* The top-level "status" of a reply frame's payload: a map with a positive int there (else -1). */
static long reply_status(const unsigned char *p, const unsigned char *end) {
  size_t pairs;
  if (p < end && (*p & 0xf0) == 0x80) pairs = *p++ & 0x0f;
  else if (p + 3 <= end && *p == 0xde) { pairs = (size_t)p[1] << 8 | p[2]; p += 3; }
  else return -1;
  while (pairs--) {
    const unsigned char *key = p;
    if (!(p = skip(p, end, 0))) return -1;
    int is_status = p - key == 7 && memcmp(key, "\xa6status", 7) == 0;
    if (is_status && p < end && *p <= 0x7f) return *p;
    if (is_status && p + 2 <= end && *p == 0xcc) return p[1];
    if (is_status && p + 3 <= end && *p == 0xcd) return (long)p[1] << 8 | p[2];
    if (is_status || !(p = skip(p, end, 0))) return -1;
  }
  return -1;
}

int main(int argc, char **argv) {
  if (argc < 6 || argc > 8) {
    fprintf(stderr, "usage: loadgen SOCKET FRAMES CLIENTS SECONDS REPLIES [TIMES [PACE]]\n");
    return 2;
  }
  int clients = atoi(argv[3]);
  double seconds = atof(argv[4]);
  frames = read_file(argv[2], &frames_size);
  int check = strcmp(argv[5], "-") == 0;  /* check each reply here instead of writing it */
  FILE *out = check ? NULL : fopen(argv[5], "wb");
  if ((!check && !out) || clients < 1) die("arguments");
  static char outbuf[1 << 20];
  if (out) setvbuf(out, outbuf, _IOFBF, sizeof outbuf);
  FILE *times = argc >= 7 ? fopen(argv[6], "wb") : NULL;
  if (argc >= 7 && !times) die(argv[6]);
  double pace = argc == 8 ? atof(argv[7]) : 0.0;  /* requests a second over all clients; 0: unpaced */

  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(argv[1]) >= sizeof addr.sun_path) {
    errno = ENAMETOOLONG;
    die(argv[1]);
  }
  strcpy(addr.sun_path, argv[1]);
  int ep = epoll_create1(0);
  if (ep < 0) die("epoll_create1");
  Client *cs = calloc(clients, sizeof *cs);
  for (int i = 0; i < clients; i++) {
    cs[i].fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (cs[i].fd < 0 || connect(cs[i].fd, (struct sockaddr *)&addr, sizeof addr) != 0) die("connect");
    cs[i].cap = 4096;
    cs[i].buf = malloc(cs[i].cap);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &cs[i]};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, cs[i].fd, &ev) != 0) die("epoll_ctl");
  }

  struct sigaction sa = {.sa_handler = on_usr1};
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGUSR1, &sa, NULL) != 0) die("sigaction");
  long received = 0;
  int in_flight = 0, parked = 0;  /* in flight: clients with a request out or parked for their turn */
  Client **waiting = calloc(clients, sizeof *waiting);  /* the parked clients */
  fputs("sending\n", stderr);  /* read and connected: a caller may time from here */
  double start = now();
  deadline = start + seconds;
  for (int i = 0; i < clients && send_next(cs[i].fd); i++) in_flight++;
  struct epoll_event events[256];
  double last_reply = start;
  while (in_flight) {
    /* the parked clients whose turn has come send; past SECONDS (or SIGUSR1), or with no frame
     * left, they are done */
    while (parked) {
      if (goes_on() && sent >= pace * (now() - start)) break;
      if (!send_next(waiting[--parked]->fd)) in_flight--;
    }
    if (!in_flight) break;
    int wait_ms = 1000;
    if (parked) {  /* until the next turn */
      double turn = start + (sent + 1) / pace - now();
      wait_ms = turn > 0 ? (int)(turn * 1000) + 1 : 0;
    }
    int ready = epoll_wait(ep, events, 256, wait_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      die("epoll_wait");
    }
    if (ready == 0 && in_flight > parked && now() - last_reply > 60) {
      errno = ETIMEDOUT;
      die("no reply within 60 s");
    }
    for (int e = 0; e < ready; e++) {
      Client *c = events[e].data.ptr;
      if (c->cap - c->len < 65536) {
        c->cap = c->len + 65536;
        c->buf = realloc(c->buf, c->cap);
      }
      ssize_t k = recv(c->fd, c->buf + c->len, c->cap - c->len, MSG_DONTWAIT);
      if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (k <= 0) {
        if (k == 0) errno = ECONNRESET;
        die("recv");
      }
      c->len += (size_t)k;
      size_t used = 0;
      while (c->len - used >= 4 && c->len - used >= 4 + (size_t)be32(c->buf + used)) {
        size_t n = 4 + be32(c->buf + used);
        if (out) {
          fwrite(c->buf + used, 1, n, out);
        } else {
          long status = reply_status(c->buf + used + 4, c->buf + used + n);
          if (status != 202) {
            fprintf(stderr, "loadgen: reply %ld answered status %ld; its first bytes:", received + 1, status);
            for (size_t b = 4; b < n && b < 260; b++) fprintf(stderr, " %02x", c->buf[used + b]);
            fputc('\n', stderr);
            exit(1);
          }
        }
        if (times) {
          double t = now();
          fwrite(&t, sizeof t, 1, times);
        }
        used += n;
        received++;
        last_reply = now();
        if (pace > 0) {
          waiting[parked++] = c;  /* (sends at the loop's top, in its turn) */
        } else if (!send_next(c->fd)) {
          in_flight--;
        }
      }
      memmove(c->buf, c->buf + used, c->len - used);
      c->len -= used;
    }
  }
  double elapsed = now() - start;
  if (out && fclose(out) != 0) die(argv[5]);
  if (times && fclose(times) != 0) die(argv[6]);
  printf("%ld %.6f\n", received, elapsed);
  return 0;
}
