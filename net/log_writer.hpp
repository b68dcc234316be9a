// A daemon's log lines, written to a stream (stderr) by a thread of their own, so that no caller ever
// waits on the stream. A daemon's stderr may be a terminal stopped with Ctrl-S, or a pipe whose reader
// stalls (`| less`) or is gone (`| head`): a line written on the bridge thread would then stop the
// node's heartbeats and fail its jobs, or SIGPIPE would end the daemon.
//
// Up to kMostQueued bytes wait; past that, lines are dropped and counted, and the count is written once
// the stream takes lines again. A stream that is gone (EPIPE) takes nothing more, and says nothing.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <memory>
#include <string>

namespace ringmaster::net {

class log_writer {
 public:
  static constexpr size_t kMostQueued = size_t(1) << 20;

  explicit log_writer(int fd = STDERR_FILENO);
  // Waits up to `drain` (1 s) for what is queued to be written; a thread still stuck on the stream then
  // is left to end with the process (it holds its own state).
  ~log_writer();
  log_writer(const log_writer&) = delete;
  log_writer& operator=(const log_writer&) = delete;

  // One line, without its newline. Never blocks on the stream; never throws.
  void write(const std::string& line) noexcept;
  // Lines dropped so far because the stream took none (for tests).
  size_t dropped() const;

  struct state;

 private:
  std::shared_ptr<state> s_;
};

}  // namespace ringmaster::net
