#include "net/log_writer.hpp"

#include <poll.h>
#include <signal.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace ringmaster::net {

struct log_writer::state {
  int fd = -1;
  std::function<void(const std::string&)> sink;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> queue;  // lines, without their newlines
  size_t bytes = 0;
  size_t dropped = 0, dropped_total = 0;
  bool stop = false, done = false, gone = false;

  // Hands `line` to the sink, or writes all of it and a newline, waiting for the stream in short polls
  // so that a stop is seen. False when the stream is gone or broken.
  bool put(const std::string& line) {
    if (sink) {
      try {
        sink(line);
      } catch (...) {  // the sink's trouble, not the logger's
      }
      return true;
    }
    const std::string text = line + '\n';
    for (size_t at = 0; at < text.size();) {
      pollfd p{fd, POLLOUT, 0};
      const int r = ::poll(&p, 1, 200);
      if (r < 0 && errno != EINTR) return false;
      if (r <= 0) {
        std::lock_guard<std::mutex> lock(mu);
        if (stop) return false;  // the drain ran out: what is left stays unwritten
        continue;
      }
      if (p.revents & (POLLERR | POLLNVAL)) return false;
      const ssize_t n = ::write(fd, text.data() + at, text.size() - at);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n <= 0) return false;  // EPIPE (no reader), EBADF, EIO: nothing more can be written
      at += size_t(n);
    }
    return true;
  }

  void run() {
    // A reader that is gone is an EPIPE here, not SIGPIPE for the process (when it does not ignore it):
    // the signal a write raises goes to the writing thread, where it stays pending.
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, nullptr);
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [&] { return stop || !queue.empty(); });
      if (queue.empty() || (stop && sink)) break;  // a sink's owner may be gone once we stop
      std::string line = std::move(queue.front());
      queue.pop_front();
      bytes -= line.size() + 1;
      const size_t lost = queue.empty() ? dropped : 0;  // said once the backlog is written
      if (lost) dropped = 0;
      lock.unlock();
      bool ok = put(line);
      if (ok && lost) ok = put(std::to_string(lost) + " log line" + (lost == 1 ? "" : "s") + " dropped: this log's reader took none for a while");
      lock.lock();
      if (queue.empty()) cv.notify_all();  // a destructor waits for the backlog to go
      if (!ok) {
        gone = true;
        break;
      }
    }
    queue.clear();
    bytes = 0;
    done = true;
    cv.notify_all();
  }
};

log_writer::log_writer(int fd) : s_(std::make_shared<state>()) {
  s_->fd = fd;
  std::thread([s = s_] { s->run(); }).detach();
}

log_writer::log_writer(std::function<void(const std::string&)> sink) : s_(std::make_shared<state>()) {
  s_->sink = std::move(sink);
  std::thread([s = s_] { s->run(); }).detach();
}

log_writer::~log_writer() {
  std::unique_lock<std::mutex> lock(s_->mu);
  // What is queued goes first: to a sink all of it (its owner prints the lines, and waits as its
  // terminal does); to a stream for up to a second (it may be stopped for good).
  const auto drained = [&] { return s_->queue.empty() || s_->done; };
  if (s_->sink) s_->cv.wait(lock, drained);
  else s_->cv.wait_for(lock, std::chrono::seconds(1), drained);
  s_->stop = true;
  s_->cv.notify_all();
  // A sink is its owner's code: the call under way ends before we do, however long it takes.
  if (s_->sink) s_->cv.wait(lock, [&] { return s_->done; });
  else s_->cv.wait_for(lock, std::chrono::milliseconds(300), [&] { return s_->done; });
}

void log_writer::write(const std::string& line) noexcept {
  try {
    std::lock_guard<std::mutex> lock(s_->mu);
    if (s_->gone || s_->stop) return;
    if (s_->bytes + line.size() + 1 > kMostQueued) {
      ++s_->dropped, ++s_->dropped_total;
      return;
    }
    s_->queue.push_back(line);
    s_->bytes += line.size() + 1;
    s_->cv.notify_all();
  } catch (...) {  // out of memory: the line is lost, not the caller
  }
}

size_t log_writer::dropped() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->dropped_total;
}

}  // namespace ringmaster::net
