// A daemon's log lines, written to a stream (stderr) by a thread of their own, so that no caller ever
// waits on the stream. A daemon's stderr may be a terminal stopped with Ctrl-S, or a pipe whose reader
// stalls (`| less`) or is gone (`| head`): a line written on the bridge thread would then stop the
// node's heartbeats and fail its jobs, or SIGPIPE would end the daemon.
//
// Up to kMostQueued bytes wait; past that, lines are dropped and counted, and the count is written once
// the backlog is. A line the stream fails to take (a full disk) is dropped and counted the same way; a
// stream that is gone (EPIPE, a closed descriptor) takes nothing more, and says nothing.
// With a sink instead of a stream, the thread hands it the lines (a launcher's events, which its user
// prints): the bridge thread that says them never waits on the user's terminal.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

namespace ringmaster::net {

class log_writer {
 public:
  static constexpr size_t kMostQueued = size_t(1) << 20;

  // Writes to its own duplicate of fd (the caller may close fd whenever it likes).
  explicit log_writer(int fd = STDERR_FILENO);
  // Each line goes to `sink` (which may block; it is called from one thread, in order).
  explicit log_writer(std::function<void(const std::string&)> sink);
  // Waits up to a second for what is queued to be written; a thread still stuck on the stream then is
  // left to end with the process (it holds its own state). A sink is handed every line queued first,
  // however long that takes (from within the sink itself: what is left is dropped, nothing is waited for).
  ~log_writer();
  log_writer(const log_writer&) = delete;
  log_writer& operator=(const log_writer&) = delete;

  // One line, without its newline. Never blocks on the stream; never throws.
  void write(const std::string& line) noexcept;
  // Lines dropped so far: past the queue's bound, or not taken by the stream (for tests).
  size_t dropped() const;

 private:
  struct state;
  std::shared_ptr<state> s_;
};

}  // namespace ringmaster::net
