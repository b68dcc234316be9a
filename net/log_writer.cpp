#include "net/log_writer.hpp"

#include <fcntl.h>
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
  int fd = -1;  // our own duplicate
  std::function<void(const std::string&)> sink;
  std::thread::id thread;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> queue;  // lines, without their newlines
  size_t bytes = 0;
  size_t dropped = 0, dropped_total = 0;
  bool in_flight = false;  // a line taken from the queue and not yet written
  bool stop = false, done = false, gone = false;

  ~state() {
    if (fd >= 0) ::close(fd);
  }

  enum class put_result { written, failed, gone };
  // Hands `line` to the sink, or writes all of it and a newline, waiting for the stream in short polls
  // so that a stop is seen. Only a stream that is gone (no reader, a closed descriptor) ends the writer;
  // other errors (a full disk, EIO) lose the line.
  put_result put(const std::string& line) {
    if (sink) {
      sink(line);
      return put_result::written;
    }
    if (fd < 0) return put_result::gone;
    const std::string text = line + '\n';
    for (size_t at = 0; at < text.size();) {
      pollfd p{fd, POLLOUT, 0};
      const int r = ::poll(&p, 1, 200);
      if (r < 0 && errno != EINTR && errno != EAGAIN) return put_result::failed;
      if (r <= 0) {
        std::lock_guard<std::mutex> lock(mu);
        if (stop) return put_result::failed;  // the drain ran out: what is left stays unwritten
        continue;
      }
      if (p.revents & (POLLERR | POLLNVAL)) return put_result::gone;
      const ssize_t n = ::write(fd, text.data() + at, text.size() - at);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n < 0 && (errno == EPIPE || errno == EBADF)) return put_result::gone;
      if (n <= 0) return put_result::failed;
      at += size_t(n);
    }
    return put_result::written;
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
      in_flight = true;
      lock.unlock();
      put_result got = put_result::failed;
      try {  // out of memory, or the sink's own trouble: the line is lost, not the process
        got = put(line);
        if (got == put_result::written && lost)
          got = put(std::to_string(lost) + " log line" + (lost == 1 ? "" : "s") + " dropped: this log's reader took none for a while");
      } catch (...) {
      }
      lock.lock();
      in_flight = false;
      if (got == put_result::failed) ++dropped, ++dropped_total;
      if (queue.empty()) cv.notify_all();  // a destructor waits for the backlog to go
      if (got == put_result::gone) {
        gone = true;
        break;
      }
    }
    queue.clear();
    bytes = 0;
    sink = nullptr;  // what it holds goes here, before its owner is told we are done
    done = true;
    cv.notify_all();
  }
};

log_writer::log_writer(int fd) : s_(std::make_shared<state>()) {
  s_->fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);  // -1 (a closed fd): the stream is gone from the start
  std::lock_guard<std::mutex> lock(s_->mu);
  std::thread t([s = s_] { s->run(); });
  s_->thread = t.get_id();
  t.detach();
}

log_writer::log_writer(std::function<void(const std::string&)> sink) : s_(std::make_shared<state>()) {
  s_->sink = std::move(sink);
  std::lock_guard<std::mutex> lock(s_->mu);
  std::thread t([s = s_] { s->run(); });
  s_->thread = t.get_id();
  t.detach();
}

log_writer::~log_writer() {
  std::unique_lock<std::mutex> lock(s_->mu);
  if (std::this_thread::get_id() == s_->thread) {  // from within the sink: the loop ends after this line
    s_->stop = true;
    return;
  }
  // What is queued goes first: to a sink all of it (its owner prints the lines, and waits as its
  // terminal does); to a stream for up to a second (it may be stopped for good).
  const auto drained = [&] { return (s_->queue.empty() && !s_->in_flight) || s_->done; };
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
