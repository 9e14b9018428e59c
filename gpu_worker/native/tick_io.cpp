// The journal's tick I/O thread, with no interpreter lock: each tick's write and fdatasync, one after
// another in the order requested (storage/committer.py owns the ticks). A Python thread would need the
// interpreter lock to start and to report each fdatasync; a native thread needs neither, and takes the
// tick's write off the interpreter too. docs/journal.md ("Group commit") has the contract. Built into
// the aotx_sockio module with sockio.cpp (gpu_worker/native/__init__.py), as its type Syncer:
//
//   Syncer()       a thread that runs ticks' I/O one after another, in the order requested
//   .fileno()      an eventfd, readable while results wait to be taken
//   .request(fd, data)  queue: write all of data to fd (bytes may be empty), then fdatasync(fd)
//   .result()      the oldest request's errno (0: written and durable), None while it runs;
//                  after a failure every request queued behind it, and any made before the
//                  failure is taken, reports ECANCELED without touching the file
//   .close()       finish the requests queued, end the thread
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "handle.h"

namespace {

// write(2) until all of data is written (a short write is followed by another call, which reports
// the real error), then fdatasync(2). Returns 0 or the errno of the call that failed.
int write_and_sync(int fd, const std::string& data) {
  size_t pos = 0;
  while (pos < data.size()) {
    ssize_t n = ::write(fd, data.data() + pos, data.size() - pos);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    pos += size_t(n);
  }
  while (fdatasync(fd) != 0) {
    if (errno != EINTR) return errno;
  }
  return 0;
}

class Syncer {
 public:
  Syncer() {
    // a semaphore: each result posted adds one, each result taken reads one
    ready_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC | EFD_SEMAPHORE);
    if (ready_fd_ < 0) throw std::runtime_error(std::string("sockio: ") + strerror(errno));
    thread_ = std::thread([this] {
      pthread_setname_np(pthread_self(), "aotx-tick-io");
      run();
    });
  }

  ~Syncer() {
    stop();
    ::close(ready_fd_);
  }

  int ready_fd() const { return ready_fd_; }

  // Queues one tick's I/O behind those already queued; they run one after another, in order.
  // While a failure waits to be taken, a new request is cancelled at once (ECANCELED).
  bool request(int fd, std::string data) {
    std::lock_guard<std::mutex> hold(mu_);
    if (stopping_) return false;
    if (failed_) {
      post(ECANCELED);
    } else {
      todo_.push_back(Request{fd, std::move(data)});
      wake_.notify_one();
    }
    return true;
  }

  // The oldest request's errno (0: written and durable); -1 while it runs or waits; -2 when
  // nothing was requested.
  int result() {
    std::lock_guard<std::mutex> hold(mu_);
    if (done_.empty()) return todo_.empty() && !running_ ? -2 : -1;
    uint64_t one;
    (void)!::read(ready_fd_, &one, sizeof one);
    int err = done_.front();
    done_.pop_front();
    if (err && err != ECANCELED) failed_ = false;  // taken: what is requested from now on runs
    return err;
  }

  void stop() {
    {
      std::lock_guard<std::mutex> hold(mu_);
      stopping_ = true;
      wake_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct Request {
    int fd;
    std::string data;
  };

  void post(int err) {  // mu_ held
    done_.push_back(err);
    eventfd_write(ready_fd_, 1);
  }

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [this] { return !todo_.empty() || stopping_; });
      if (todo_.empty()) return;  // stopping, nothing left to do
      Request request = std::move(todo_.front());
      todo_.pop_front();
      running_ = true;
      lock.unlock();
      int err = write_and_sync(request.fd, request.data);
      lock.lock();
      running_ = false;
      post(err);
      if (err) {
        // Nothing queued behind a failure may run: its fdatasync could report as durable the
        // data of the write that failed (docs/journal.md). Cancel it, in order, and whatever is
        // requested until the failure is taken.
        failed_ = true;
        for (size_t i = 0; i < todo_.size(); ++i) post(ECANCELED);
        todo_.clear();
      }
    }
  }

  int ready_fd_ = -1;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Request> todo_;  // requested, not yet started
  std::deque<int> done_;      // results not yet taken, oldest first
  bool running_ = false, stopping_ = false, failed_ = false;
};

// ---- Syncer's Python type ------------------------------------------------------------------

using PySyncer = aotx::Handle<Syncer>;

int PySyncer_init(PySyncer* self, PyObject* args, PyObject*) {
  if (!PyArg_ParseTuple(args, "")) return -1;
  return aotx::construct(self, "Syncer");
}

Syncer* get_syncer(PySyncer* self) { return aotx::unwrap(self, "Syncer closed or not initialised"); }

PyObject* PySyncer_fileno(PySyncer* self, PyObject*) {
  Syncer* syncer = get_syncer(self);
  return syncer ? PyLong_FromLong(syncer->ready_fd()) : nullptr;
}

PyObject* PySyncer_request(PySyncer* self, PyObject* args) {
  Syncer* syncer = get_syncer(self);
  int fd;
  Py_buffer data;
  if (!syncer || !PyArg_ParseTuple(args, "iy*", &fd, &data)) return nullptr;
  bool queued = syncer->request(fd, std::string(static_cast<const char*>(data.buf), size_t(data.len)));
  PyBuffer_Release(&data);
  if (!queued) {
    PyErr_SetString(PyExc_RuntimeError, "the tick I/O thread is stopping");
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* PySyncer_result(PySyncer* self, PyObject*) {
  Syncer* syncer = get_syncer(self);
  if (!syncer) return nullptr;
  int err = syncer->result();
  if (err == -2) {
    PyErr_SetString(PyExc_RuntimeError, "no tick I/O was requested");
    return nullptr;
  }
  if (err == -1) Py_RETURN_NONE;
  return PyLong_FromLong(err);
}

PyObject* PySyncer_close(PySyncer* self, PyObject*) {
  aotx::release(self);
  Py_RETURN_NONE;
}

PyMethodDef syncer_methods[] = {
    {"fileno", (PyCFunction)PySyncer_fileno, METH_NOARGS, "eventfd readable once the requested I/O is done"},
    {"request", (PyCFunction)PySyncer_request, METH_VARARGS, "queue: write all of data to fd, then fdatasync(fd)"},
    {"result", (PyCFunction)PySyncer_result, METH_NOARGS, "the oldest request's errno (0: durable), None while it runs"},
    {"close", (PyCFunction)PySyncer_close, METH_NOARGS, "finish the queued requests and end the thread"},
    {nullptr, nullptr, 0, nullptr}};

PyTypeObject SyncerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

}  // namespace

int aotx::add_tick_io(PyObject* module) {
  return add_type<Syncer>(module, SyncerType, "Syncer", "aotx_sockio.Syncer",
                          "The device's tick I/O thread: write, then fdatasync.", (initproc)PySyncer_init,
                          syncer_methods);
}
