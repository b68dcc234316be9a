#include "tools/tcp_floor.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

namespace ringmaster::tools {
namespace {

using clock_type = std::chrono::steady_clock;

struct fds {
  std::vector<int> all;
  ~fds() {
    for (int fd : all) close(fd);
  }
  int keep(int fd) {
    if (fd >= 0) all.push_back(fd);
    return fd;
  }
};

// One all-reduce of one rank: `steps` steps of n bytes to the next rank while as many come from the one
// before, pipelined byte by byte as the ring's segments are, only finer: byte j of step k+1 may go once
// byte j of step k is in. Spins while either socket moves; after a while without progress it sleeps in
// poll() (more ranks than CPUs). False with *error on a broken socket, after 10 s without progress, or
// when another rank failed.
bool allreduce(int out, int in, const char* s, char* r, size_t n, int steps, const std::atomic<bool>& failed,
               std::string* error) {
  const size_t total = n * size_t(steps);
  size_t sent = 0, got = 0;
  int idle = 0;
  auto last = clock_type::now();
  while (sent < total || got < total) {
    bool moved = false;
    const size_t may_send = std::min(total, n + got);
    if (sent < may_send) {
      const size_t at = sent % n, len = std::min(may_send - sent, n - at);
      const ssize_t k = send(out, s + at, len, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (k > 0) sent += size_t(k), moved = true;
      else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return *error = std::string("send: ") + std::strerror(errno), false;
    }
    if (got < total) {
      const size_t at = got % n, len = std::min(total - got, n - at);
      const ssize_t k = recv(in, r + at, len, MSG_DONTWAIT);
      if (k > 0) got += size_t(k), moved = true;
      else if (k == 0) return *error = "the rank before closed its connection", false;
      else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return *error = std::string("recv: ") + std::strerror(errno), false;
    }
    if (moved) {
      idle = 0;
      last = clock_type::now();
      continue;
    }
    if (failed.load(std::memory_order_relaxed)) return *error = "another rank failed", false;
    if (++idle < 2000) continue;
    pollfd p[2] = {{sent < may_send ? out : -1, POLLOUT, 0}, {got < total ? in : -1, POLLIN, 0}};
    ::poll(p, 2, 100);
    if (clock_type::now() - last > std::chrono::seconds(10)) return *error = "no progress for 10 s", false;
  }
  return true;
}

}  // namespace

double tcp_ring_floor(int ranks, size_t bytes, int iters, int warmup, bool pin, std::string* error) {
  if (ranks < 2 || iters < 1 || warmup < 0) return *error = "at least 2 ranks and 1 iteration", -1;
  const size_t n = size_t(ranks);
  fds owned;
  std::vector<int> listeners(n, -1), out(n, -1), in(n, -1);
  std::vector<sockaddr_in> at(n);
  for (int r = 0; r < ranks; ++r) {
    sockaddr_in& a = at[size_t(r)];
    a = {};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    const int l = owned.keep(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (l < 0 || bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(l, 4) != 0 ||
        getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      return *error = std::string("listening on loopback: ") + std::strerror(errno), -1;
    listeners[size_t(r)] = l;
  }
  // Rank r writes to rank r+1: its connect is taken from the listen backlog by the accept right after.
  for (int r = 0; r < ranks; ++r) {
    const size_t next = size_t((r + 1) % ranks);
    const int s = owned.keep(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (s < 0 || connect(s, reinterpret_cast<const sockaddr*>(&at[next]), sizeof at[next]) != 0)
      return *error = std::string("connecting on loopback: ") + std::strerror(errno), -1;
    const int a = owned.keep(accept4(listeners[next], nullptr, nullptr, SOCK_CLOEXEC));
    if (a < 0) return *error = std::string("accepting on loopback: ") + std::strerror(errno), -1;
    int one = 1;  // as the ring link's sockets: small steps go at once
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(a, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    out[size_t(r)] = s;
    in[next] = a;
  }
  const size_t step = std::max<size_t>(4, (bytes / sizeof(float) + n - 1) / n * sizeof(float));
  const int steps = 2 * (ranks - 1);
  std::barrier<> start(ranks);
  std::atomic<bool> failed{false};
  std::vector<double> seconds(n, 0);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      if (pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(r % std::max(1, int(std::thread::hardware_concurrency())), &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
      }
      std::vector<char> s(step, char(r)), got(step);
      const auto run = [&](int n) {
        for (int i = 0; i < n && !failed.load(); ++i)
          if (!allreduce(out[size_t(r)], in[size_t(r)], s.data(), got.data(), step, steps, failed, &errors[size_t(r)]))
            return void(failed.store(true));
      };
      run(warmup);
      start.arrive_and_wait();  // every rank arrives, failed or not
      const auto t0 = clock_type::now();
      run(iters);
      seconds[size_t(r)] = std::chrono::duration<double>(clock_type::now() - t0).count() / iters;
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (!e.empty() && e != "another rank failed") return *error = e, -1;
  return *std::max_element(seconds.begin(), seconds.end());
}

}  // namespace ringmaster::tools
