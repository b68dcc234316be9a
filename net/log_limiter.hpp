// At most `lines` log lines of each kind per window, the rest counted and summed up in one line once the
// window is over: whoever can reach a daemon's port (or a job's launcher) decides how often its
// complaints come, and a dead or hostile peer must not flood the log. One thread only.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>

namespace ringmaster::net {

class log_limiter {
 public:
  using clock = std::chrono::steady_clock;
  explicit log_limiter(std::function<void(const std::string&)> out, int lines = 5, std::chrono::seconds window = std::chrono::seconds(10))
      : out_(std::move(out)), lines_(lines), window_(window) {}

  // Logs `line` unless `kind` had its lines in this window: then it is counted, and said once it is over.
  void log(const std::string& kind, const std::string& line) {
    budget& b = kinds_[kind];
    roll_over(kind, b, clock::now());
    if (++b.lines > lines_) return void(++b.suppressed);
    out_(line);
  }
  // Sums up the windows that are over now (call it now and then: the next line of a kind may never come).
  void tick(clock::time_point now = clock::now()) {
    for (auto& [kind, b] : kinds_)
      if (b.suppressed > 0) roll_over(kind, b, now);
  }

 private:
  struct budget {
    clock::time_point since{};
    int lines = 0;
    uint64_t suppressed = 0;
  };
  void roll_over(const std::string& kind, budget& b, clock::time_point now) {
    if (now - b.since <= window_) return;
    if (b.suppressed > 0)
      out_("not logged: " + std::to_string(b.suppressed) + " more lines of '" + kind + "' in the last " + std::to_string(window_.count()) + " s");
    b = {now, 0, 0};
  }

  std::function<void(const std::string&)> out_;
  int lines_;
  std::chrono::seconds window_;
  std::map<std::string, budget> kinds_;  // by kind: net::fault_name(), or "refused job", "ignored"
};

}  // namespace ringmaster::net
