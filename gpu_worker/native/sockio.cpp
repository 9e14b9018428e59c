// The device's socket thread, with no interpreter lock: the socket loop (accept, read, split frames,
// send); loop/server.py owns the protocol and every reply's content. The module aotx_sockio also
// holds the journal's tick I/O thread (tick_io.cpp, built with this file).
//
// Why native: the system calls of a busy device's sockets (epoll, one recv and one send per request,
// each send waking a client) would take the interpreter's time; this thread makes them on another
// core while the interpreter admits the next tick. See docs/protocol.md ("Ticks") for the contract,
// docs/performance.md for what the move gained.
//
//   Loop(listen_fd, high_water, max_in_flight, max_frame, accept_pause_seconds, uids, gids)
//                  a connection whose peer (SO_PEERCRED) has none of the uids and none of the
//                  gids (sequences of ints) is closed at accept, with a log line naming its
//                  pid, uid and gid; empty sequences allow every peer
//   .fileno()      an eventfd, readable while events wait for take()
//   .start()       start the thread (it serves listen_fd until stop())
//   .take()        [(conn_id, bytes)] a whole frame's payload; (conn_id, None) the peer closed or
//                  the connection failed; (0, str) a warning to log
//   .send([(conn_id, bytes, n)])  queue n reply frames (bytes) per connection, in order (unknown
//                  ids are ignored)
//   .close(conn_id)            drop a connection and whatever it still had to send
//   .pending(conn_id)          bytes queued and not yet sent (-1 for an unknown id)
//   .stats()       {"events": published, not yet taken, "commands": queued, not yet run,
//                  "connections": [(conn_id, requests in flight, bytes queued, reading)]}
//   .stop()        end the thread, close every connection (not the listener: the caller's)
//   .fail_accepts(n, errno)    tests: the next n accept() calls fail with errno
//
//   Syncer         the tick I/O thread (tick_io.cpp), a type of this module
//
//   split(chunks, max_frame)   tests: the frame splitter alone, over a list of byte chunks
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "handle.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

using aotx::construct;
using aotx::Handle;
using aotx::release;
using aotx::unwrap;

constexpr uint64_t LISTENER = 0;  // epoll tags; connection ids start at 2 (0 also marks a log line)
constexpr uint64_t COMMANDS = 1;
constexpr size_t RECV_BYTES = 1 << 16;
constexpr int MAX_EVENTS = 256;

enum Kind { FRAME, CLOSED, LOG };

struct Event {  // thread -> interpreter
  uint64_t conn;
  Kind kind;
  std::string data;
};

struct Command {  // interpreter -> thread
  uint64_t conn;
  bool close;
  uint32_t frames;  // reply frames in data
  std::string data;
};

struct Conn {
  int fd;
  uint32_t events = EPOLLIN;
  std::string in;   // the start of a frame not yet whole
  std::string out;  // bytes not yet sent, from out_pos
  size_t out_pos = 0;
  std::atomic<size_t> queued{0};  // out.size() - out_pos, readable by pending()
  std::atomic<size_t> in_flight{0};  // frames delivered less reply frames queued (not below 0); stats() reads it
  std::atomic<bool> reading{true};   // EPOLLIN is watched (no backpressure); stats() reads it
  uint64_t round = 0;             // the last run_commands() round that queued bytes for it
};

inline uint32_t be32(const char* p) {
  const unsigned char* u = reinterpret_cast<const unsigned char*>(p);
  return (uint32_t(u[0]) << 24) | (uint32_t(u[1]) << 16) | (uint32_t(u[2]) << 8) | uint32_t(u[3]);
}

// Appends each whole frame of data[0, size) to frames; returns the bytes consumed, or -1 with
// *too_big set when a frame's length passes max_frame (refused before its body arrives).
long split_frames(const char* data, size_t size, size_t max_frame, uint64_t conn, std::vector<Event>& frames,
                  uint32_t* too_big) {
  size_t pos = 0;
  while (size - pos >= 4) {
    uint32_t n = be32(data + pos);
    if (n > max_frame) {
      *too_big = n;
      return -1;
    }
    if (size - pos - 4 < n) break;
    frames.push_back(Event{conn, FRAME, std::string(data + pos + 4, n)});
    pos += 4 + size_t(n);
  }
  return long(pos);
}

class Loop {
 public:
  Loop(int listen_fd, size_t high_water, size_t max_in_flight, size_t max_frame, double accept_pause,
       std::vector<long> uids, std::vector<long> gids)
      : listen_fd_(listen_fd), high_water_(high_water), max_in_flight_(max_in_flight), max_frame_(max_frame),
        accept_pause_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(accept_pause))),
        uids_(std::move(uids)), gids_(std::move(gids)) {
    ep_ = epoll_create1(EPOLL_CLOEXEC);
    ready_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    cmd_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (ep_ < 0 || ready_fd_ < 0 || cmd_fd_ < 0) {
      int err = errno;
      close_fds();
      throw std::runtime_error(std::string("sockio: ") + strerror(err));
    }
    if (!watch(EPOLL_CTL_ADD, listen_fd_, EPOLLIN, LISTENER) || !watch(EPOLL_CTL_ADD, cmd_fd_, EPOLLIN, COMMANDS)) {
      int err = errno;
      close_fds();
      throw std::runtime_error(std::string("sockio: cannot watch the listening socket: ") + strerror(err));
    }
  }

  ~Loop() {
    stop();
    close_fds();
  }

  int ready_fd() const { return ready_fd_; }

  void start() {
    if (thread_.joinable() || stopped_) throw std::runtime_error("sockio: the loop was already started");
    running_ = true;
    thread_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "aotx-sockets");  // as top -H and /proc/PID/task/*/comm show it
      run();
    });
  }

  void stop() {
    if (!thread_.joinable()) return;
    running_ = false;
    eventfd_write(cmd_fd_, 1);
    thread_.join();
    stopped_ = true;
    std::lock_guard<std::mutex> hold(mu_);
    for (auto& [id, conn] : conns_) {
      ::close(conn->fd);
      delete conn;
    }
    conns_.clear();
  }

  // The interpreter's side (it holds the GIL; the lock below is held only to move vectors).
  std::vector<Event> take() {
    eventfd_t ignored;
    eventfd_read(ready_fd_, &ignored);  // drained first, then the flag: see notify_interpreter()
    py_signaled_.store(false);
    std::vector<Event> got;
    std::lock_guard<std::mutex> hold(mu_);
    got.swap(events_);
    return got;
  }

  void command(std::vector<Command>&& batch) {
    if (batch.empty()) return;
    {
      std::lock_guard<std::mutex> hold(mu_);
      if (commands_.empty()) {
        commands_.swap(batch);
      } else {
        for (auto& c : batch) commands_.push_back(std::move(c));
      }
    }
    if (!thread_signaled_.exchange(true)) eventfd_write(cmd_fd_, 1);
  }

  long pending(uint64_t id) {
    std::lock_guard<std::mutex> hold(mu_);
    auto it = conns_.find(id);
    return it == conns_.end() ? -1 : long(it->second->queued.load());
  }

  struct Stats {
    size_t events, commands;  // published and not yet taken; queued and not yet run
    std::vector<std::tuple<uint64_t, size_t, size_t, bool>> conns;  // id, in flight, bytes queued, reading
  };

  // A snapshot for the stall watchdog (any thread): the counters are read without stopping the loop.
  Stats stats() {
    std::lock_guard<std::mutex> hold(mu_);
    Stats out{events_.size(), commands_.size(), {}};
    for (auto& [id, conn] : conns_)
      out.conns.emplace_back(id, conn->in_flight.load(), conn->queued.load(), conn->reading.load());
    return out;
  }

  void fail_accepts(int n, int err) {
    fail_accepts_ = n;
    fail_errno_ = err;
  }

 private:
  void close_fds() {
    if (ep_ >= 0) ::close(ep_);
    if (ready_fd_ >= 0) ::close(ready_fd_);
    if (cmd_fd_ >= 0) ::close(cmd_fd_);
    ep_ = ready_fd_ = cmd_fd_ = -1;
  }

  bool watch(int op, int fd, uint32_t events, uint64_t tag) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = tag;
    return epoll_ctl(ep_, op, fd, &ev) == 0;
  }

  void log(const std::string& line) { out_events_.push_back(Event{0, LOG, line}); }

  void run() {
    epoll_event evs[MAX_EVENTS];
    while (running_) {
      int timeout = -1;
      if (paused_) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(resume_at_ - std::chrono::steady_clock::now());
        if (left.count() <= 0) {
          paused_ = false;
          watch(EPOLL_CTL_ADD, listen_fd_, EPOLLIN, LISTENER);
        } else {
          timeout = int(left.count()) + 1;
        }
      }
      int n = epoll_wait(ep_, evs, MAX_EVENTS, timeout);
      if (n < 0) {
        if (errno == EINTR) continue;
        log(std::string("socket loop: epoll_wait failed: ") + strerror(errno));
        publish();
        return;
      }
      for (int i = 0; i < n; ++i) {
        uint64_t tag = evs[i].data.u64;
        uint32_t got = evs[i].events;
        if (tag == LISTENER) {
          accept_all();
        } else if (tag == COMMANDS) {
          run_commands();
        } else {
          auto it = conns_.find(tag);
          if (it == conns_.end()) continue;  // closed earlier in this round
          Conn* conn = it->second;
          bool gone = got & (EPOLLHUP | EPOLLERR);
          if (((got & EPOLLOUT) || gone) && conn->out_pos < conn->out.size() && !flush(tag, conn)) continue;
          if (conn->events & EPOLLIN) {
            if (got & (EPOLLIN | EPOLLHUP | EPOLLERR)) read(tag, conn);
          } else if (gone) {  // not reading it (backpressure) and the peer is gone: nothing to deliver
            drop(tag, conn, true);
          }
        }
      }
      publish();
    }
  }

  void publish() {
    if (out_events_.empty()) return;
    {
      std::lock_guard<std::mutex> hold(mu_);
      if (events_.empty()) {
        events_.swap(out_events_);
      } else {
        for (auto& e : out_events_) events_.push_back(std::move(e));
      }
    }
    out_events_.clear();
    notify_interpreter();
  }

  // One eventfd write per batch the interpreter has not yet been told of. take() drains the
  // eventfd before it clears the flag, so a batch published in between is either taken by that
  // take() or signalled anew; it is never left waiting unsignalled.
  void notify_interpreter() {
    if (!py_signaled_.exchange(true)) eventfd_write(ready_fd_, 1);
  }

  void accept_all() {
    while (true) {
      int fd;
      if (fail_accepts_ > 0) {
        --fail_accepts_;
        fd = -1;
        errno = fail_errno_;
      } else {
        fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      }
      if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) return;
        // EMFILE and the like: stop accepting a while (level-triggered epoll would report the
        // waiting connection again at once); served connections go on.
        char line[200];
        snprintf(line, sizeof line, "accept failed, pausing new connections for %.1f s: [Errno %d] %s",
                 std::chrono::duration<double>(accept_pause_).count(), errno, strerror(errno));
        log(line);
        epoll_ctl(ep_, EPOLL_CTL_DEL, listen_fd_, nullptr);
        paused_ = true;
        resume_at_ = std::chrono::steady_clock::now() + accept_pause_;
        return;
      }
      if (!peer_allowed(fd)) {
        ::close(fd);
        continue;
      }
      Conn* conn = new Conn();
      conn->fd = fd;
      uint64_t id = next_id_++;
      {
        std::lock_guard<std::mutex> hold(mu_);
        conns_[id] = conn;
      }
      watch(EPOLL_CTL_ADD, fd, EPOLLIN, id);
    }
  }

  // The peer's credentials as the kernel recorded them at connect (SO_PEERCRED): allowed when
  // its uid or its gid is one of the configured ones. A refusal is logged and the caller closes.
  bool peer_allowed(int fd) {
    if (uids_.empty() && gids_.empty()) return true;
    struct ucred cred;
    socklen_t len = sizeof cred;
    char line[200];
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      snprintf(line, sizeof line, "refused a connection: its peer's credentials cannot be read: [Errno %d] %s",
               errno, strerror(errno));
      log(line);
      return false;
    }
    if (std::find(uids_.begin(), uids_.end(), long(cred.uid)) != uids_.end() ||
        std::find(gids_.begin(), gids_.end(), long(cred.gid)) != gids_.end())
      return true;
    snprintf(line, sizeof line, "refused a connection from pid %ld uid %ld gid %ld: not an allowed uid or gid",
             long(cred.pid), long(cred.uid), long(cred.gid));
    log(line);
    return false;
  }

  void drop(uint64_t id, Conn* conn, bool tell) {
    {  // gone from the map before the peer can see the close: pending() is -1 once it has
      std::lock_guard<std::mutex> hold(mu_);
      conns_.erase(id);
    }
    epoll_ctl(ep_, EPOLL_CTL_DEL, conn->fd, nullptr);
    ::close(conn->fd);
    delete conn;
    if (tell) out_events_.push_back(Event{id, CLOSED, std::string()});
  }

  void read(uint64_t id, Conn* conn) {
    ssize_t r = recv(conn->fd, buf_, RECV_BYTES, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (r <= 0) {
      drop(id, conn, true);
      return;
    }
    const char* data = buf_;
    size_t size = size_t(r);
    if (!conn->in.empty()) {  // a frame was cut: join it with what came now
      conn->in.append(buf_, size);
      data = conn->in.data();
      size = conn->in.size();
    }
    uint32_t too_big = 0;
    size_t before = out_events_.size();
    long used = split_frames(data, size, max_frame_, id, out_events_, &too_big);
    if (used < 0) {
      log("closing connection: frame of " + std::to_string(too_big) + " bytes exceeds " + std::to_string(max_frame_));
      drop(id, conn, true);
      return;
    }
    if (data == buf_) {
      if (size_t(used) < size) conn->in.assign(buf_ + used, size - used);  // the usual read holds whole frames
    } else {
      conn->in.erase(0, size_t(used));
    }
    conn->in_flight.fetch_add(out_events_.size() - before);
    update_events(id, conn);
  }

  // Stop reading a connection while too many of its requests wait for replies or too many reply
  // bytes wait for room: a client that sends without reading gets backpressure, not a device
  // that grows without bound. Poll for room while replies wait.
  void update_events(uint64_t id, Conn* conn) {
    size_t queued = conn->out.size() - conn->out_pos;
    bool reading = queued <= high_water_ && conn->in_flight.load() < max_in_flight_;
    conn->reading.store(reading);
    uint32_t want = (reading ? EPOLLIN : 0) | (queued ? EPOLLOUT : 0);
    if (want != conn->events) {
      conn->events = want;
      watch(EPOLL_CTL_MOD, conn->fd, want, id);
    }
  }

  // Sends what the connection has queued; false when it failed (and is gone).
  bool flush(uint64_t id, Conn* conn) {
    while (conn->out_pos < conn->out.size()) {
      ssize_t s = send(conn->fd, conn->out.data() + conn->out_pos, conn->out.size() - conn->out_pos, MSG_NOSIGNAL);
      if (s < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) break;
        if (errno == EINTR) continue;
        drop(id, conn, true);
        return false;
      }
      conn->out_pos += size_t(s);
    }
    if (conn->out_pos == conn->out.size()) {
      conn->out.clear();
      conn->out_pos = 0;
    } else if (conn->out_pos > (1 << 20) && conn->out_pos * 2 > conn->out.size()) {
      conn->out.erase(0, conn->out_pos);  // keep the queue from growing by what was sent
      conn->out_pos = 0;
    }
    conn->queued.store(conn->out.size() - conn->out_pos);
    update_events(id, conn);
    return true;
  }

  void run_commands() {
    eventfd_t ignored;
    eventfd_read(cmd_fd_, &ignored);
    thread_signaled_.store(false);
    {
      std::lock_guard<std::mutex> hold(mu_);
      cmds_.swap(commands_);
    }
    std::vector<uint64_t> touched;
    ++round_;
    for (auto& c : cmds_) {
      auto it = conns_.find(c.conn);
      if (it == conns_.end()) continue;
      Conn* conn = it->second;
      if (c.close) {
        drop(c.conn, conn, false);
        continue;
      }
      if (conn->round != round_) {
        conn->round = round_;
        touched.push_back(c.conn);
      }
      conn->out.append(c.data);
      conn->in_flight.store(conn->in_flight.load() - std::min<size_t>(conn->in_flight.load(), c.frames));
    }
    cmds_.clear();
    for (uint64_t id : touched) {  // one send per connection, however many replies it got
      auto it = conns_.find(id);
      if (it != conns_.end()) flush(id, it->second);
    }
  }

  const int listen_fd_;
  const size_t high_water_, max_in_flight_, max_frame_;
  const std::chrono::steady_clock::duration accept_pause_;
  const std::vector<long> uids_, gids_;
  int ep_ = -1, ready_fd_ = -1, cmd_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> running_{false}, py_signaled_{false}, thread_signaled_{false};
  bool stopped_ = false;
  std::mutex mu_;                                // guards events_, commands_ and conns_' membership
  std::vector<Event> events_;                    // published, not yet taken
  std::vector<Command> commands_;                // queued by the interpreter, not yet run
  std::unordered_map<uint64_t, Conn*> conns_;    // changed by the thread only
  // the thread's own
  std::vector<Event> out_events_;
  std::vector<Command> cmds_;
  uint64_t next_id_ = 2;
  uint64_t round_ = 0;
  bool paused_ = false;
  std::chrono::steady_clock::time_point resume_at_;
  std::atomic<int> fail_accepts_{0}, fail_errno_{0};
  char buf_[RECV_BYTES];
};

// ---- the Python type ------------------------------------------------------------------

using PyLoop = Handle<Loop>;

PyObject* events_to_list(std::vector<Event>& events) {
  PyObject* list = PyList_New(Py_ssize_t(events.size()));
  if (!list) return nullptr;
  for (size_t i = 0; i < events.size(); ++i) {
    Event& e = events[i];
    PyObject* data;
    if (e.kind == FRAME) {
      data = PyBytes_FromStringAndSize(e.data.data(), Py_ssize_t(e.data.size()));
    } else if (e.kind == LOG) {
      data = PyUnicode_DecodeUTF8(e.data.data(), Py_ssize_t(e.data.size()), "replace");
    } else {
      data = Py_NewRef(Py_None);
    }
    PyObject* item = data ? Py_BuildValue("(KN)", (unsigned long long)e.conn, data) : nullptr;
    if (!item) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, Py_ssize_t(i), item);
  }
  return list;
}

// A Python sequence of ints (or nullptr: none) into out; false with an exception set otherwise.
bool longs(PyObject* seq, const char* what, std::vector<long>& out) {
  if (!seq) return true;
  PyObject* fast = PySequence_Fast(seq, what);
  if (!fast) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
    out.push_back(v);
  }
  Py_DECREF(fast);
  return true;
}

int PyLoop_init(PyLoop* self, PyObject* args, PyObject*) {
  int listen_fd;
  Py_ssize_t high_water, max_in_flight, max_frame;
  double accept_pause;
  PyObject* uid_seq = nullptr;
  PyObject* gid_seq = nullptr;
  if (!PyArg_ParseTuple(args, "innnd|OO", &listen_fd, &high_water, &max_in_flight, &max_frame, &accept_pause,
                        &uid_seq, &gid_seq))
    return -1;
  if (high_water <= 0 || max_in_flight <= 0 || max_frame <= 0 || accept_pause < 0) {
    PyErr_SetString(PyExc_ValueError, "high_water, max_in_flight and max_frame must be positive, "
                                      "accept_pause not negative");
    return -1;
  }
  std::vector<long> uids, gids;
  if (!longs(uid_seq, "uids", uids) || !longs(gid_seq, "gids", gids)) return -1;
  return construct(self, "Loop", listen_fd, size_t(high_water), size_t(max_in_flight), size_t(max_frame),
                   accept_pause, std::move(uids), std::move(gids));
}

Loop* get(PyLoop* self) { return unwrap(self, "Loop not initialised"); }

PyObject* PyLoop_fileno(PyLoop* self, PyObject*) {
  Loop* loop = get(self);
  return loop ? PyLong_FromLong(loop->ready_fd()) : nullptr;
}

PyObject* PyLoop_start(PyLoop* self, PyObject*) {
  Loop* loop = get(self);
  if (!loop) return nullptr;
  try {
    loop->start();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* PyLoop_stop(PyLoop* self, PyObject*) {
  Loop* loop = get(self);
  if (!loop) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  loop->stop();
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* PyLoop_take(PyLoop* self, PyObject*) {
  Loop* loop = get(self);
  if (!loop) return nullptr;
  std::vector<Event> events = loop->take();
  return events_to_list(events);
}

bool conn_id(PyObject* obj, uint64_t* id) {
  unsigned long long v = PyLong_AsUnsignedLongLong(obj);
  if (v == (unsigned long long)-1 && PyErr_Occurred()) return false;
  *id = v;
  return true;
}

PyObject* PyLoop_send(PyLoop* self, PyObject* items) {
  Loop* loop = get(self);
  if (!loop) return nullptr;
  PyObject* seq = PySequence_Fast(items, "send() takes a list of (conn_id, bytes, frames)");
  if (!seq) return nullptr;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::vector<Command> batch;
  batch.reserve(size_t(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
    uint64_t id;
    char* data;
    Py_ssize_t size;
    long frames = -1;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 || !conn_id(PyTuple_GET_ITEM(item, 0), &id) ||
        PyBytes_AsStringAndSize(PyTuple_GET_ITEM(item, 1), &data, &size) < 0 ||
        ((frames = PyLong_AsLong(PyTuple_GET_ITEM(item, 2))) < 0)) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "send() takes a list of (conn_id, bytes, frames)");
      Py_DECREF(seq);
      return nullptr;
    }
    batch.push_back(Command{id, false, uint32_t(frames), std::string(data, size_t(size))});
  }
  Py_DECREF(seq);
  loop->command(std::move(batch));
  Py_RETURN_NONE;
}

PyObject* PyLoop_close(PyLoop* self, PyObject* arg) {
  Loop* loop = get(self);
  uint64_t id;
  if (!loop || !conn_id(arg, &id)) return nullptr;
  std::vector<Command> batch;
  batch.push_back(Command{id, true, 0, std::string()});
  loop->command(std::move(batch));
  Py_RETURN_NONE;
}

PyObject* PyLoop_pending(PyLoop* self, PyObject* arg) {
  Loop* loop = get(self);
  uint64_t id;
  if (!loop || !conn_id(arg, &id)) return nullptr;
  return PyLong_FromLong(loop->pending(id));
}

PyObject* PyLoop_stats(PyLoop* self, PyObject*) {
  Loop* loop = get(self);
  if (!loop) return nullptr;
  Loop::Stats stats;
  Py_BEGIN_ALLOW_THREADS
  stats = loop->stats();
  Py_END_ALLOW_THREADS
  PyObject* conns = PyList_New(Py_ssize_t(stats.conns.size()));
  if (!conns) return nullptr;
  for (size_t i = 0; i < stats.conns.size(); ++i) {
    auto& [id, in_flight, queued, reading] = stats.conns[i];
    PyObject* row = Py_BuildValue("(KnnO)", (unsigned long long)id, Py_ssize_t(in_flight), Py_ssize_t(queued),
                                  reading ? Py_True : Py_False);
    if (!row) {
      Py_DECREF(conns);
      return nullptr;
    }
    PyList_SET_ITEM(conns, Py_ssize_t(i), row);
  }
  return Py_BuildValue("{s:n,s:n,s:N}", "events", Py_ssize_t(stats.events), "commands", Py_ssize_t(stats.commands),
                       "connections", conns);
}

PyObject* PyLoop_fail_accepts(PyLoop* self, PyObject* args) {
  Loop* loop = get(self);
  int n, err;
  if (!loop || !PyArg_ParseTuple(args, "ii", &n, &err)) return nullptr;
  loop->fail_accepts(n, err);
  Py_RETURN_NONE;
}

PyMethodDef loop_methods[] = {
    {"fileno", (PyCFunction)PyLoop_fileno, METH_NOARGS, "eventfd readable while events wait for take()"},
    {"start", (PyCFunction)PyLoop_start, METH_NOARGS, "start the I/O thread"},
    {"stop", (PyCFunction)PyLoop_stop, METH_NOARGS, "stop the thread and close every connection"},
    {"take", (PyCFunction)PyLoop_take, METH_NOARGS, "[(conn_id, bytes | None | str)] since the last take()"},
    {"send", (PyCFunction)PyLoop_send, METH_O, "queue [(conn_id, bytes, frames)] for sending, in order"},
    {"close", (PyCFunction)PyLoop_close, METH_O, "close a connection, dropping what it had to send"},
    {"pending", (PyCFunction)PyLoop_pending, METH_O, "bytes queued for a connection, -1 if unknown"},
    {"stats", (PyCFunction)PyLoop_stats, METH_NOARGS,
     "{events, commands, connections: [(id, in flight, bytes queued, reading)]}: a snapshot for the watchdog"},
    {"fail_accepts", (PyCFunction)PyLoop_fail_accepts, METH_VARARGS, "tests: fail the next n accept() calls"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject LoopType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* split(PyObject*, PyObject* args) {
  PyObject* chunks;
  Py_ssize_t max_frame;
  if (!PyArg_ParseTuple(args, "On", &chunks, &max_frame)) return nullptr;
  PyObject* seq = PySequence_Fast(chunks, "split() takes a list of bytes");
  if (!seq) return nullptr;
  std::vector<Event> frames;
  std::string in;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    char* data;
    Py_ssize_t size;
    if (PyBytes_AsStringAndSize(PySequence_Fast_GET_ITEM(seq, i), &data, &size) < 0) {
      Py_DECREF(seq);
      return nullptr;
    }
    in.append(data, size_t(size));
    uint32_t too_big = 0;
    long used = split_frames(in.data(), in.size(), size_t(max_frame), 2, frames, &too_big);
    if (used < 0) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_ValueError, "frame of %u bytes exceeds %zd", too_big, max_frame);
      return nullptr;
    }
    in.erase(0, size_t(used));
  }
  Py_DECREF(seq);
  PyObject* list = PyList_New(Py_ssize_t(frames.size()));
  if (!list) return nullptr;
  for (size_t i = 0; i < frames.size(); ++i) {
    PyObject* b = PyBytes_FromStringAndSize(frames[i].data.data(), Py_ssize_t(frames[i].data.size()));
    if (!b) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, Py_ssize_t(i), b);
  }
  return list;
}

PyMethodDef module_methods[] = {
    {"split", split, METH_VARARGS, "tests: split a list of byte chunks into frame payloads"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "aotx_sockio", "The device's native I/O threads: sockets (sockio.cpp) and tick I/O (tick_io.cpp).", -1,
                          module_methods};

}  // namespace

PyMODINIT_FUNC PyInit_aotx_sockio(void) {
  PyObject* m = PyModule_Create(&module_def);
  if (!m) return nullptr;
  if (aotx::add_type<Loop>(m, LoopType, "Loop", "aotx_sockio.Loop", "The device's socket I/O thread.",
                           (initproc)PyLoop_init, loop_methods) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  if (aotx::add_tick_io(m) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
