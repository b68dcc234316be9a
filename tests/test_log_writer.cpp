// net::log_writer: a daemon's log lines never hold up the thread that logs them.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>
#include <thread>

#include "net/log_writer.hpp"

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

namespace {

// All there is to read now (the read end non-blocking).
std::string drain(int fd) {
  std::string got;
  char buf[65536];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) got.append(buf, size_t(n));
  return got;
}

}  // namespace

TEST_CASE("log writer: a reader that takes nothing holds up no caller, and lines past the queue are dropped and counted",
          "[log_writer]") {
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC | O_NONBLOCK) == 0);
  ::fcntl(p[1], F_SETFL, 0);  // blocking, as a daemon's stderr is
  ::fcntl(p[0], F_SETPIPE_SZ, 4096);
  std::string got;
  {
    ringmaster::net::log_writer log(p[1]);
    const std::string line(199, 'x');
    const auto t0 = clock_type::now();
    for (int i = 0; i < 10000; ++i) log.write(line + " " + std::to_string(i));  // 2 MB: twice the queue
    const double took = std::chrono::duration<double>(clock_type::now() - t0).count();
    CHECK(took < 1.0);  // a blocking write would wait here for good
    CHECK(log.dropped() > 4000);
    CHECK(log.dropped() < 6000);
    // The reader comes back: the lines queued are written in order, then what was dropped is said.
    const auto until = clock_type::now() + 10s;
    while (got.find("log lines dropped") == std::string::npos && clock_type::now() < until) {
      got += drain(p[0]);
      std::this_thread::sleep_for(1ms);
    }
    CHECK(got.rfind(line + " 0\n", 0) == 0);
    CHECK(got.find(line + " 100\n") < got.find(line + " 101\n"));
    CHECK(got.find(std::to_string(log.dropped()) + " log lines dropped: this log's reader took none for a while\n") != std::string::npos);
  }
  ::close(p[0]);
  ::close(p[1]);
}

TEST_CASE("log writer: a reader that is gone ends nothing (no SIGPIPE), and the writer's end waits at most about a second",
          "[log_writer]") {
  // SIGPIPE as a daemon's default would have it: the process would end if the writer raised it.
  struct sigaction was {}, dfl {};
  dfl.sa_handler = SIG_DFL;
  REQUIRE(::sigaction(SIGPIPE, &dfl, &was) == 0);
  int p[2];
  REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
  ::close(p[0]);
  {
    ringmaster::net::log_writer log(p[1]);
    for (int i = 0; i < 100; ++i) log.write("to nobody " + std::to_string(i));
    std::this_thread::sleep_for(100ms);
  }
  // A reader there that never reads: the end gives up on the stream after the drain.
  int q[2];
  REQUIRE(::pipe2(q, O_CLOEXEC) == 0);
  ::fcntl(q[0], F_SETPIPE_SZ, 4096);
  const auto t0 = clock_type::now();
  {
    ringmaster::net::log_writer log(q[1]);
    for (int i = 0; i < 1000; ++i) log.write(std::string(100, 'y'));
  }
  const double took = std::chrono::duration<double>(clock_type::now() - t0).count();
  CHECK(took < 2.0);
  ::sigaction(SIGPIPE, &was, nullptr);
  ::close(p[1]);
  ::close(q[0]);
  ::close(q[1]);
}

TEST_CASE("log writer: a sink that blocks holds up no caller, and is handed every line, in order, before the writer ends",
          "[log_writer]") {
  std::vector<std::string> got;
  std::atomic<bool> release{false};
  double took = 0;
  {
    ringmaster::net::log_writer log([&](const std::string& line) {
      while (!release) std::this_thread::sleep_for(1ms);  // a terminal stopped with Ctrl-S
      got.push_back(line);
    });
    const auto t0 = clock_type::now();
    for (int i = 0; i < 100; ++i) log.write("event " + std::to_string(i));
    took = std::chrono::duration<double>(clock_type::now() - t0).count();
    std::thread([&] {
      std::this_thread::sleep_for(1500ms);  // longer than a stream's drain
      release = true;
    }).detach();
  }
  CHECK(took < 0.5);
  REQUIRE(got.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(got[size_t(i)] == "event " + std::to_string(i));
}

TEST_CASE("log writer: a stream that fails a write (a full disk) loses that line only, and the writer may end from within its sink",
          "[log_writer]") {
  {
    const int full = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
    REQUIRE(full >= 0);
    ringmaster::net::log_writer log(full);
    ::close(full);  // the writer keeps its own duplicate
    for (int i = 0; i < 5; ++i) log.write("line " + std::to_string(i));
    const auto until = clock_type::now() + 5s;
    while (log.dropped() < 5 && clock_type::now() < until) std::this_thread::sleep_for(1ms);
    CHECK(log.dropped() == 5);  // each tried and counted: the writer went on (a gone stream counts none)
  }
  // The writer destroyed from within its own sink (its owner torn down there): it waits for nothing.
  std::atomic<bool> ended{false};
  std::unique_ptr<ringmaster::net::log_writer> self;
  self = std::make_unique<ringmaster::net::log_writer>([&](const std::string&) {
    self.reset();
    ended = true;
  });
  self->write("one");
  const auto until = clock_type::now() + 5s;
  while (!ended && clock_type::now() < until) std::this_thread::sleep_for(1ms);
  CHECK(ended);
  CHECK_FALSE(self);
}
