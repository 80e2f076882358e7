// Deadlines that need no Python interpreter lock (C ABI, loaded through ctypes by
// commopt/comm/deadline.py).
//
// A call into a library that holds the GIL while it blocks (a pybind11 function waiting on a
// lock that another thread holds during a network call) freezes every Python thread of the
// process, the communication watchdog included. A deadline armed here is watched by a plain
// native thread: if it is still armed when it expires, that thread writes its message to
// stderr, waits two seconds (peers whose clocks ran out too can say so) and ends the process
// with the deadline's exit code.
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;

struct Deadline {
  Clock::time_point at;
  std::string message;
  int exit_code;
};

struct State {
  std::mutex mu;
  std::condition_variable cv;
  std::map<int64_t, Deadline> armed;
  int64_t next_token = 1;
  bool started = false;
};

// Never destroyed: the watcher thread may still wait on it while the process exits.
State& state() {
  static State* s = new State();
  return *s;
}

void write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w <= 0) return;
    data += w;
    n -= static_cast<size_t>(w);
  }
}

void watch() {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  for (;;) {
    if (s.armed.empty()) {
      s.cv.wait(lock);
      continue;
    }
    auto first = s.armed.begin();
    for (auto it = s.armed.begin(); it != s.armed.end(); ++it) {
      if (it->second.at < first->second.at) first = it;
    }
    if (Clock::now() >= first->second.at) {
      std::string message = first->second.message;
      int code = first->second.exit_code;
      lock.unlock();
      write_all(2, message.data(), message.size());
      std::this_thread::sleep_for(std::chrono::seconds(2));
      ::_exit(code);
    }
    s.cv.wait_until(lock, first->second.at);
  }
}

}  // namespace

extern "C" {

// Arms a deadline ``seconds`` from now; returns its token (> 0), or -1 when the watcher
// thread cannot start. ``message`` (``length`` bytes) is copied.
int64_t commopt_deadline_arm(double seconds, const char* message, int64_t length, int exit_code) {
  State& s = state();
  std::lock_guard<std::mutex> guard(s.mu);
  if (!s.started) {
    try {
      std::thread(watch).detach();
    } catch (...) {
      return -1;
    }
    s.started = true;
  }
  auto wait = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  int64_t token = s.next_token++;
  s.armed[token] = Deadline{Clock::now() + wait, std::string(message, static_cast<size_t>(length)),
                            exit_code};
  s.cv.notify_all();
  return token;
}

// Disarms the deadline of ``token`` (nothing happens for an unknown one).
void commopt_deadline_disarm(int64_t token) {
  State& s = state();
  std::lock_guard<std::mutex> guard(s.mu);
  s.armed.erase(token);
  s.cv.notify_all();
}

// How many deadlines are armed (for tests).
int64_t commopt_deadline_count() {
  State& s = state();
  std::lock_guard<std::mutex> guard(s.mu);
  return static_cast<int64_t>(s.armed.size());
}

}  // extern "C"
