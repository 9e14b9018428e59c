// Every thread's native stack, for the device's stall watchdog (loop/watchdog.py): Python's own
// tracebacks show where the interpreter's threads are, but not the native threads (the socket
// loop, the tick I/O, torch's workers) nor what a Python thread's C call is waiting in.
//
//   dump(fd, timeout_seconds)  writes to fd, for each thread of the process: a line
//                  "thread TID NAME state S wchan W", then its frames (backtrace_symbols_fd: the
//                  library, the nearest exported symbol and the address). Returns the number of
//                  threads whose frames were taken; a thread that did not answer within the
//                  timeout (blocked signals, or stopped) gets a line saying so.
//
// How: a real-time signal is sent to one thread at a time (tgkill); its handler records that
// thread's return addresses with backtrace() and posts a semaphore the dumping thread waits on
// (bounded). backtrace() is loaded and warmed once before the handler is installed, so the handler
// neither allocates nor takes a lock. The handler is installed with SA_RESTART, so the system
// calls it interrupts are restarted where the kernel allows; epoll_wait and the like report EINTR,
// which every loop of the device retries. One dump runs at a time.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dirent.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <semaphore.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr int MAX_FRAMES = 64;

std::mutex dumping;  // one dump at a time: the handler's buffer is shared
sem_t answered;
void* frames[MAX_FRAMES];
std::atomic<int> frame_count{0};
std::atomic<long> wanted{0};     // the thread asked now; a late handler of an earlier one does nothing
std::atomic<long> answered_by{0};
int stack_signal = 0;

long gettid_() { return syscall(SYS_gettid); }

void on_signal(int) {
  int saved = errno;
  long self = gettid_();
  if (self == wanted.load()) {
    frame_count.store(backtrace(frames, MAX_FRAMES));
    answered_by.store(self);
    sem_post(&answered);
  }
  errno = saved;
}

bool install() {
  static bool done = false;
  if (done) return true;
  void* warm[2];
  backtrace(warm, 2);  // loads libgcc's unwinder now, not inside a signal handler
  if (sem_init(&answered, 0, 0) != 0) return false;
  stack_signal = SIGRTMIN + 7;
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_handler = on_signal;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  if (sigaction(stack_signal, &action, nullptr) != 0) return false;
  done = true;
  return true;
}

std::string read_small(const std::string& path) {
  std::string out;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "?";
  char buf[512];
  ssize_t n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return "?";
  out.assign(buf, size_t(n));
  while (!out.empty() && (out.back() == '\n' || out.back() == '\0')) out.pop_back();
  return out.empty() ? "-" : out;
}

// The state letter of /proc/self/task/TID/stat: after the ") " that closes the name.
std::string thread_state(const std::string& stat) {
  size_t close = stat.rfind(')');
  return close == std::string::npos || close + 2 >= stat.size() ? "?" : stat.substr(close + 2, 1);
}

void write_all(int fd, const std::string& text) {
  size_t pos = 0;
  while (pos < text.size()) {
    ssize_t n = write(fd, text.data() + pos, text.size() - pos);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    pos += size_t(n);
  }
}

bool wait_answer(double timeout) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  long long ns = until.tv_nsec + (long long)(timeout * 1e9);
  until.tv_sec += time_t(ns / 1000000000LL);
  until.tv_nsec = long(ns % 1000000000LL);
  while (sem_timedwait(&answered, &until) != 0) {
    if (errno != EINTR) return false;
  }
  return true;
}

int dump(int fd, double timeout) {
  std::lock_guard<std::mutex> hold(dumping);
  if (!install()) {
    write_all(fd, std::string("native stacks unavailable: ") + strerror(errno) + "\n");
    return 0;
  }
  std::vector<long> tids;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (dirent* entry = readdir(dir)) {
      if (entry->d_name[0] != '.') tids.push_back(strtol(entry->d_name, nullptr, 10));
    }
    closedir(dir);
  }
  long self = gettid_();
  pid_t pid = getpid();
  int taken = 0;
  for (long tid : tids) {
    std::string base = "/proc/self/task/" + std::to_string(tid) + "/";
    write_all(fd, "thread " + std::to_string(tid) + " " + read_small(base + "comm") + " state " +
                      thread_state(read_small(base + "stat")) + " wchan " + read_small(base + "wchan") +
                      (tid == self ? " (the dumping thread)" : "") + "\n");
    int count = 0;
    void* local[MAX_FRAMES];
    if (tid == self) {
      count = backtrace(local, MAX_FRAMES);
    } else {
      while (sem_trywait(&answered) == 0) {
      }  // a late answer of an earlier dump's thread
      wanted.store(tid);
      answered_by.store(0);
      if (syscall(SYS_tgkill, pid, tid, stack_signal) != 0) {
        wanted.store(0);
        write_all(fd, "  (gone)\n");
        continue;
      }
      bool ok = wait_answer(timeout) && answered_by.load() == tid;
      wanted.store(0);
      if (!ok) {
        write_all(fd, "  (did not answer: its signals are blocked, or it is stopped)\n");
        continue;
      }
      count = frame_count.load();
      memcpy(local, frames, sizeof(void*) * size_t(count));
    }
    backtrace_symbols_fd(local, count, fd);
    ++taken;
  }
  return taken;
}

PyObject* py_dump(PyObject*, PyObject* args) {
  int fd;
  double timeout;
  if (!PyArg_ParseTuple(args, "id", &fd, &timeout)) return nullptr;
  int taken;
  Py_BEGIN_ALLOW_THREADS  // the other Python threads run meanwhile
  taken = dump(fd, timeout);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(taken);
}

PyMethodDef methods[] = {
    {"dump", py_dump, METH_VARARGS, "write every thread's native stack to fd; returns the threads taken"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "aotx_stacks", "every thread's native stack", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_aotx_stacks() { return PyModule_Create(&module); }
