// latency_probe: what bounds a small message between two processes on this host, in the same run.
//
// Issue 10 asks a 4 KB all-reduce over TCP in at most 30 us and what bounds it. A two-rank 4 KB all-reduce
// takes one hop (the small-buffer path), so its floor is the one-way latency of the transport under it.
// This probe ping-pongs one message between two processes (forked, pinned to different CPUs) and prints
// the one-way latency of
//   tcp-spin     a plain TCP socket whose reader spins on a non-blocking recv (no thread is woken)
//   tcp-block    the same socket, the reader blocking in recv (the kernel wakes it: here a cross-CPU wake)
//   zeromq       a ZeroMQ DEALER pair, as the bridge uses (a sender's I/O thread, a receiver's I/O thread)
//   bridge       two ringmaster bridges (net/bridge.hpp), answering on their own threads, as ring chunks go
// each in rounds interleaved so that this machine's noise hits all alike, with each one's ratio to
// tcp-block. Only what the transport costs: allreduce_bench measures the all-reduce itself.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "net/bridge.hpp"
#include "tools/cli.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
namespace net = ringmaster::net;
using ringmaster::cli::parse_int;

struct options {
  size_t bytes = 4096;
  int iters = 2000;
  int rounds = 3;
  bool pin = true;
};

const char* kUsage =
    "usage: latency_probe [--bytes N] [--iters N] [--rounds N] [--pin on|off]\n"
    "One message ping-ponged between two processes on this host; prints per transport the one-way\n"
    "latency (half the median round trip over --rounds rounds of --iters, default 3 x 2000) and its ratio\n"
    "to tcp-block, all measured in this run:\n"
    "  tcp-spin   plain TCP, the reader spinning on a non-blocking recv\n"
    "  tcp-block  plain TCP, the reader blocking in recv\n"
    "  zeromq     a ZeroMQ DEALER pair, as ringmaster's bridge uses\n"
    "  bridge     two ringmaster bridges answering on their own threads, as ring chunks go\n"
    "  --bytes N  message size, 1-1048576 (default 4096)\n"
    "  --pin      on: the two processes on CPUs 0 and 1 (default); off: where the OS puts them\n";

// "" or what is wrong with the command line.
std::string parse(int argc, char** argv, options* o, bool* help) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      *help = true;
      return "";
    }
    if (a != "--bytes" && a != "--iters" && a != "--rounds" && a != "--pin") return "unexpected argument " + a;
    if (i + 1 >= argc) return a + " needs a value";
    const std::string v = argv[++i];
    const std::string bad = "bad value for " + a + ": '" + v + "'";
    long n = 0;
    if (a == "--bytes") {
      if (!parse_int(v, 1, 1 << 20, &n)) return bad + " (1-1048576)";
      o->bytes = size_t(n);
    } else if (a == "--iters") {
      if (!parse_int(v, 1, 1000000, &n)) return bad + " (1-1000000)";
      o->iters = int(n);
    } else if (a == "--rounds") {
      if (!parse_int(v, 1, 100, &n)) return bad + " (1-100)";
      o->rounds = int(n);
    } else {
      if (v != "on" && v != "off") return bad + " (on or off)";
      o->pin = v == "on";
    }
  }
  return "";
}

void pin_to(int cpu) {
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu % std::max(1L, cpus), &set);
  sched_setaffinity(0, sizeof set, &set);
}

// ---- plain TCP ----

// Reads or writes n bytes whole; a spinning reader never sleeps in recv. False when the peer is gone.
bool transfer(int fd, char* buf, size_t n, bool reading, bool spin) {
  for (size_t done = 0; done < n;) {
    const ssize_t r = reading ? recv(fd, buf + done, n - done, spin ? MSG_DONTWAIT : 0) : send(fd, buf + done, n - done, MSG_NOSIGNAL);
    if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (r <= 0) return false;
    done += size_t(r);
  }
  return true;
}

void no_delay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// ---- one method: a server in a forked child, a client timing round trips here ----

// The child serves `total` round trips; it tells its endpoint through `out` first. Then it keeps its
// sockets open until `hold` reads end of file (the client has its last answer): closing them at once
// could drop an answer still queued for sending (a large one, over ZeroMQ).
using server_fn = std::function<bool(int out, int total, int hold)>;

// Waits until the other end of the pipe `fd` closes (at most a minute). Always true.
bool hold_until_closed(int fd) {
  pollfd p{fd, POLLIN, 0};
  char c;
  while (poll(&p, 1, 60000) == 1 && read(fd, &c, 1) > 0) {
  }
  return true;
}
// The client times `iters` round trips after `warmup` untimed ones; the seconds, or < 0 on failure.
using client_fn = std::function<double(const std::string& endpoint, int warmup, int iters)>;

struct method {
  const char* name;
  server_fn serve;
  client_fn time;
};

std::vector<method> methods(const options& o) {
  const size_t n = o.bytes;
  const auto tcp = [n](bool spin) {
    return method{
        spin ? "tcp-spin" : "tcp-block",
        [n, spin](int out, int total, int hold) {
          const int l = socket(AF_INET, SOCK_STREAM, 0);
          sockaddr_in a{};
          a.sin_family = AF_INET;
          a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          socklen_t len = sizeof a;
          if (l < 0 || bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(l, 1) != 0 ||
              getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) != 0)
            return false;
          const std::string ep = std::to_string(ntohs(a.sin_port));
          if (write(out, ep.data(), ep.size()) != ssize_t(ep.size())) return false;
          close(out);
          const int fd = accept(l, nullptr, nullptr);
          if (fd < 0) return false;
          no_delay(fd);
          std::vector<char> buf(n);
          for (int i = 0; i < total; ++i)
            if (!transfer(fd, buf.data(), n, true, spin) || !transfer(fd, buf.data(), n, false, spin)) return false;
          return hold_until_closed(hold);
        },
        [n, spin](const std::string& ep, int warmup, int iters) {
          long port = 0;
          if (!parse_int(ep, 1, 65535, &port)) return -1.0;
          const int fd = socket(AF_INET, SOCK_STREAM, 0);
          sockaddr_in a{};
          a.sin_family = AF_INET;
          a.sin_port = htons(uint16_t(port));
          a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
          if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return -1.0;
          no_delay(fd);
          std::vector<char> buf(n, 'x');
          clock_type::time_point t0;
          for (int i = -warmup; i < iters; ++i) {
            if (i == 0) t0 = clock_type::now();
            if (!transfer(fd, buf.data(), n, false, spin) || !transfer(fd, buf.data(), n, true, spin)) return -1.0;
          }
          const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
          close(fd);
          return s;
        }};
  };
  const method zeromq{
      "zeromq",
      [n](int out, int total, int hold) {
        zmq::context_t ctx(1);
        zmq::socket_t s(ctx, zmq::socket_type::dealer);
        s.set(zmq::sockopt::linger, 0);
        s.set(zmq::sockopt::rcvtimeo, 10000);
        s.bind("tcp://127.0.0.1:*");
        const std::string ep = s.get(zmq::sockopt::last_endpoint);
        if (write(out, ep.data(), ep.size()) != ssize_t(ep.size())) return false;
        close(out);
        zmq::message_t m;
        for (int i = 0; i < total; ++i) {
          if (!s.recv(m) || m.size() != n) return false;
          s.send(m, zmq::send_flags::none);
        }
        return hold_until_closed(hold);
      },
      [n](const std::string& ep, int warmup, int iters) {
        zmq::context_t ctx(1);
        zmq::socket_t s(ctx, zmq::socket_type::dealer);
        s.set(zmq::sockopt::linger, 0);
        s.set(zmq::sockopt::rcvtimeo, 10000);
        s.connect(ep);
        std::vector<char> buf(n, 'x');
        zmq::message_t m;
        clock_type::time_point t0;
        for (int i = -warmup; i < iters; ++i) {
          if (i == 0) t0 = clock_type::now();
          s.send(zmq::buffer(buf), zmq::send_flags::none);
          if (!s.recv(m)) return -1.0;
        }
        return std::chrono::duration<double>(clock_type::now() - t0).count();
      }};
  // Bridges: the server's handler answers on its thread; the client's sends the next ping from its own,
  // so no other thread is woken per message (as the ring answers chunks from the handler).
  const auto ping = [n](int64_t step) {
    ringmaster::wire::header h;
    h.type = ringmaster::wire::msg_type::chunk;
    h.job_id = 1;
    h.step = step;
    h.sender_rank = 0;
    h.elements = n / sizeof(float);
    return h;
  };
  const method bridge{
      "bridge",
      [ping](int out, int total, int hold) {
        std::mutex mu;
        std::condition_variable cv;
        int answered = 0;
        net::bridge b;
        b.set_handler([&](const net::peer_info& from, const ringmaster::wire::header& h, net::payload p) {
          b.reply(from, ping(h.step), std::move(p));
          std::lock_guard<std::mutex> lock(mu);
          if (++answered == total) cv.notify_all();
        });
        b.set_error_handler([](const net::bridge_error& e) { std::fprintf(stderr, "latency_probe: bridge: %s\n", e.message.c_str()); });
        std::string error;
        if (!b.start("tcp://127.0.0.1:0", &error)) return false;
        const std::string ep = b.endpoint();
        if (write(out, ep.data(), ep.size()) != ssize_t(ep.size())) return false;
        close(out);
        std::unique_lock<std::mutex> lock(mu);
        if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return answered == total; })) return false;
        lock.unlock();
        return hold_until_closed(hold);
      },
      [ping](const std::string& ep, int warmup, int iters) {
        std::mutex mu;
        std::condition_variable cv;
        int got = 0;  // answers so far: the first `warmup` untimed
        int peer = -1;
        clock_type::time_point t0, t1;
        net::bridge b;
        const net::payload body = net::payload::copy_of(std::string(ping(0).elements * sizeof(float), 'x'));
        b.set_handler([&](const net::peer_info&, const ringmaster::wire::header&, net::payload) {
          std::lock_guard<std::mutex> lock(mu);
          if (++got == warmup) t0 = clock_type::now();
          if (got < warmup + iters) return void(b.send(peer, ping(got), body));
          t1 = clock_type::now();
          cv.notify_all();
        });
        b.set_error_handler([](const net::bridge_error& e) { std::fprintf(stderr, "latency_probe: bridge: %s\n", e.message.c_str()); });
        std::string error;
        if (!b.start("", &error) || (peer = b.connect(ep, &error)) < 0) return std::fprintf(stderr, "latency_probe: bridge: %s\n", error.c_str()), -1.0;
        b.send(peer, ping(0), body);
        std::unique_lock<std::mutex> lock(mu);
        if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return got >= warmup + iters; })) return -1.0;
        return std::chrono::duration<double>(t1 - t0).count();
      }};
  if (n % sizeof(float)) return {tcp(true), tcp(false), zeromq};  // bridge messages carry floats
  return {tcp(true), tcp(false), zeromq, bridge};
}

// One timed run of m: the server forked (on CPU 1 when pinning), the client here (CPU 0). Seconds per
// round trip, or < 0 with *error.
double run_once(const method& m, const options& o, std::string* error) {
  const int warmup = std::max(10, o.iters / 10);
  int fds[2], hold[2];
  if (pipe(fds) != 0) return *error = "pipe failed", -1;
  if (pipe(hold) != 0) return close(fds[0]), close(fds[1]), *error = "pipe failed", -1;
  const pid_t child = fork();
  if (child < 0) return *error = "fork failed", -1;
  if (child == 0) {
    close(fds[0]);
    close(hold[1]);
    alarm(120);  // whatever happens to the client
    if (o.pin) pin_to(1);
    _exit(m.serve(fds[1], warmup + o.iters, hold[0]) ? 0 : 1);
  }
  close(fds[1]);
  close(hold[0]);
  std::string ep;
  char buf[256];
  pollfd p{fds[0], POLLIN, 0};
  for (ssize_t r; poll(&p, 1, 10000) == 1 && (r = read(fds[0], buf, sizeof buf)) > 0;) ep.append(buf, size_t(r));
  close(fds[0]);
  double s = -1;
  if (ep.empty()) *error = std::string(m.name) + ": the server process did not start";
  else if ((s = m.time(ep, warmup, o.iters)) < 0) *error = std::string(m.name) + ": a round trip failed";
  close(hold[1]);  // every answer is in: the server may close its sockets
  if (s < 0) kill(child, SIGKILL);
  int status = 0;
  waitpid(child, &status, 0);
  if (s >= 0 && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    *error = std::string(m.name) + ": the server process failed";
    s = -1;
  }
  return s < 0 ? -1 : s / o.iters;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  bool help = false;
  const std::string err = parse(argc, argv, &o, &help);
  if (help) return std::fputs(kUsage, stdout), 0;
  if (!err.empty()) return std::fprintf(stderr, "latency_probe: %s\n%s", err.c_str(), kUsage), 2;
  if (o.pin) pin_to(0);
  const std::vector<method> ms = methods(o);
  std::vector<std::vector<double>> us(ms.size());
  std::printf("# latency_probe: %zu bytes, %d rounds of %d round trips, processes %s\n", o.bytes, o.rounds, o.iters,
              o.pin ? "on CPUs 0 and 1" : "unpinned");
  for (int r = 0; r < o.rounds; ++r)
    for (size_t k = 0; k < ms.size(); ++k) {
      std::string error;
      const double s = run_once(ms[k], o, &error);
      if (s < 0) return std::fprintf(stderr, "latency_probe: %s\n", error.c_str()), 1;
      us[k].push_back(s * 1e6);
    }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double base = median(us[1]);  // tcp-block
  std::printf("# transport   one_way_us  round_trip_us  vs_tcp_block  (medians; one_way_us each round)\n");
  for (size_t k = 0; k < ms.size(); ++k) {
    const double rt = median(us[k]);
    std::printf("%-12s %11.1f %14.1f %13.2f  ", ms[k].name, rt / 2, rt, rt / base);
    for (double x : us[k]) std::printf(" %.1f", x / 2);
    std::printf("\n");
  }
  return 0;
}
