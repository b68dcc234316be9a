// train_bench --nodes N (the options and the local mode: tools/train_bench.cpp).
//
// With --nodes N it measures training across processes instead: it starts N ringmaster-node daemons on
// loopback ports (child processes, one CPU replica each; stopped at the end and on every error path), and
// per model trains with train_remote over them and with N replicas in this process, same global batch,
// steps and seed, on the same Fashion-MNIST samples (nodes read their own data, so not synthetic):
//   local        samples/s of N replicas in one process;
//   nodes        samples/s of N replicas on N node daemons, as users run them: keys, commands over
//                CurveZMQ, ring chunks through shared memory (net/shm_link.hpp), the daemons being on
//                one host;
//   nodes/local  the cost of crossing processes;
//   insecure     the same over daemons started --insecure, and nodes/insecure the cost of keys;
//   tcp          the same with shared memory off (remote_options::shared_memory), so ring chunks take the
//                network as between hosts: sealed with AES-128-OCB (net/seal.hpp) over TCP;
//   tcp insecure the same over daemons started --insecure (plain chunks on the same link), and tcp/insecure
//                the cost of encryption;
//   curve/insecure  ring chunks over CurveZMQ through the bridges instead (remote_options::ring_ports false).
// Both are timed over the epochs after the first (no evaluation), rounds interleaved, medians reported.
//
//   train_bench --nodes 2                         # both default MLPs, 2 nodes x 1 replica x 64
//   train_bench --nodes 2 --models 784-64-10 --repeat 5
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "actors/remote_job.hpp"
#include "actors/training.hpp"
#include "tools/train_bench.hpp"

using namespace ringmaster;
using clk = std::chrono::steady_clock;

// ---- --nodes N: training across processes ----------------------------------------------------------
// N ringmaster-node daemons on loopback, one CPU replica each, against N replicas in this process, on
// the same data (the nodes read Fashion-MNIST; synthetic samples cannot reach them).

namespace {

// A port nobody listens on now: bind port 0 and ask. Another program may take it before the daemon binds
// it, so node_daemons::start retries with a fresh port when the daemon cannot start.
int free_port(std::string* error) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) {
    *error = std::string("socket: ") + std::strerror(errno);
    return -1;
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    *error = std::string("cannot find a free loopback port: ") + std::strerror(errno);
    ::close(fd);
    return -1;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// Everything written to an open file so far (a daemon's log, whose name is already unlinked).
std::string read_fd(int fd) {
  std::string out;
  char buf[65536];
  for (off_t at = 0;;) {
    const ssize_t n = ::pread(fd, buf, sizeof buf, at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return out;
    out.append(buf, size_t(n));
    at += n;
  }
}

// The last few lines of a daemon's log, indented, for error messages.
std::string log_tail(int fd, size_t lines = 8) {
  std::vector<std::string> all;
  std::istringstream in(read_fd(fd));
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) all.push_back(line);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i)
    out += (out.empty() ? "    " : "\n    ") + all[i];
  return out.empty() ? "    (its log is empty)" : out;
}

// CPU time (user + system) of another process so far, seconds; 0 when it cannot be read.
double proc_cpu(pid_t pid) {
  const std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos) return 0;
  std::istringstream in(stat.substr(paren + 1));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {  // fields 14 and 15 (1-based): utime, stime
    if (i == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (i == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  return double(utime + stime) / double(sysconf(_SC_CLK_TCK));
}

// The daemons this program started. Stopped (SIGTERM, then SIGKILL after a grace period, and reaped) by
// stop() or the destructor, so that every return path, error or not, leaves no child behind; and each
// child asks the kernel for SIGTERM should this program die without stopping them (PR_SET_PDEATHSIG).
class node_daemons {
 public:
  node_daemons() = default;
  node_daemons(const node_daemons&) = delete;
  node_daemons& operator=(const node_daemons&) = delete;
  ~node_daemons() { stop(); }

  // Starts n daemons one after the other (each holds its port before the next one looks for a free
  // one) and waits until each logs that it listens. False with *error (and nothing left running).
  // insecure: the daemons run --insecure (no keys, no encryption); else they use ~/.ringmaster, as we do.
  // ring_poll_us: their --ring-poll-us; -1: their default.
  bool start(const std::string& bin, const std::string& data_dir, int n, bool insecure, int ring_poll_us, std::string* error) {
    insecure_ = insecure;
    ring_poll_us_ = ring_poll_us;
    if (::access(bin.c_str(), X_OK) != 0) {
      *error = "cannot run the node daemon " + bin + ": " + std::strerror(errno) +
               " (build the ringmaster-node target, or give --node-bin PATH)";
      return false;
    }
    for (int i = 0; i < n; ++i) {
      if (!start_one(bin, data_dir, i, error)) {
        stop();
        return false;
      }
    }
    return true;
  }

  std::vector<std::string> endpoints() const {
    std::vector<std::string> out;
    for (const child& c : children_) out.push_back(c.endpoint);
    return out;
  }

  // CPU seconds used by all daemons so far.
  double cpu_seconds() const {
    double s = 0;
    for (const child& c : children_) s += proc_cpu(c.pid);
    return s;
  }

  // Every daemon's log tail, for when a job fails.
  std::string logs() const {
    std::string out;
    for (const child& c : children_) out += "  node " + c.endpoint + ":\n" + log_tail(c.log_fd) + "\n";
    return out;
  }

  void stop() {
    for (child& c : children_)
      if (c.pid > 0) ::kill(c.pid, SIGTERM);
    // A node finishing a job's teardown needs a moment; one that hangs is killed.
    const auto deadline = clk::now() + std::chrono::seconds(10);
    for (child& c : children_) {
      while (c.pid > 0) {
        int status = 0;
        const pid_t w = ::waitpid(c.pid, &status, WNOHANG);
        if (w == c.pid || (w < 0 && errno != EINTR)) c.pid = -1;
        else if (clk::now() > deadline) {
          std::fprintf(stderr, "train_bench: node %s did not stop within 10 s of SIGTERM; killing it\n",
                       c.endpoint.c_str());
          ::kill(c.pid, SIGKILL);
          ::waitpid(c.pid, &status, 0);
          c.pid = -1;
        } else {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
      if (c.log_fd >= 0) ::close(c.log_fd);
    }
    children_.clear();
  }

 private:
  struct child {
    pid_t pid = -1;
    std::string endpoint;
    int log_fd = -1;  // the daemon's stdout and stderr: a file in /tmp, unlinked once the daemon has it open
  };

  bool insecure_ = false;
  int ring_poll_us_ = -1;

  bool start_one(const std::string& bin, const std::string& data_dir, int index, std::string* error) {
    constexpr int kTries = 5;
    for (int attempt = 1; attempt <= kTries; ++attempt) {
      const int port = free_port(error);
      if (port < 0) return false;
      child c;
      c.endpoint = "tcp://127.0.0.1:" + std::to_string(port);
      char log[] = "/tmp/train_bench-node-XXXXXX";
      const int log_fd = ::mkostemp(log, O_CLOEXEC);  // not inherited by later daemons; dup2 clears the flag
      if (log_fd < 0) {
        *error = std::string("cannot create a log file in /tmp: ") + std::strerror(errno);
        return false;
      }
      // Everything the child needs is built before fork: between fork and exec only async-signal-safe calls.
      const std::string name = "node" + std::to_string(index);
      std::vector<std::string> args = {bin,         "--listen", c.endpoint, "--name",   name,
                                       "--devices", "cpu:1",    "--data",   data_dir};
      if (insecure_) args.push_back("--insecure");
      if (ring_poll_us_ >= 0) args.insert(args.end(), {"--ring-poll-us", std::to_string(ring_poll_us_)});
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(&a[0]);
      argv.push_back(nullptr);
      const pid_t parent = ::getpid();
      const pid_t pid = ::fork();
      if (pid < 0) {
        *error = std::string("fork: ") + std::strerror(errno);
        ::close(log_fd);
        ::unlink(log);
        return false;
      }
      c.log_fd = log_fd;
      if (pid == 0) {
        ::prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (::getppid() != parent) ::_exit(1);  // the parent died before prctl took effect
        const int null_fd = ::open("/dev/null", O_RDONLY);
        if (null_fd >= 0) ::dup2(null_fd, STDIN_FILENO);
        ::dup2(log_fd, STDOUT_FILENO);
        ::dup2(log_fd, STDERR_FILENO);
        ::execv(argv[0], argv.data());
        ::_exit(127);
      }
      // Unlinked now: both processes hold it open, and nothing stays in /tmp however this program ends.
      ::unlink(log);
      c.pid = pid;
      // Listening once it logs so (the line comes after the bind); gone if it exits first.
      const auto deadline = clk::now() + std::chrono::seconds(20);
      int status = 0;
      while (true) {
        if (read_fd(c.log_fd).find("listening on") != std::string::npos) {
          children_.push_back(c);
          return true;
        }
        const pid_t w = ::waitpid(pid, &status, WNOHANG);
        if (w == pid) break;
        if (clk::now() > deadline) {
          children_.push_back(c);  // stopped by the caller's stop()
          *error = "node " + c.endpoint + " did not report listening within 20 s; its log:\n" + log_tail(c.log_fd);
          return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      const std::string tail = log_tail(c.log_fd);
      ::close(c.log_fd);
      if (WIFEXITED(status) && WEXITSTATUS(status) == 127) {
        *error = "could not execute " + bin;
        return false;
      }
      *error = "node " + c.endpoint + " could not start (" +
               (WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                  : "signal " + std::to_string(WTERMSIG(status))) +
               "):\n" + tail;
      // Status 1 is "could not start", usually the port taken meanwhile: try another port.
      if (!(WIFEXITED(status) && WEXITSTATUS(status) == 1) || attempt == kTries) return false;
      std::fprintf(stderr, "train_bench: node %d on port %d could not start (attempt %d of %d), trying another port\n",
                   index, port, attempt, kTries);
    }
    return false;
  }

  std::vector<child> children_;
};

// ringmaster-node next to this program (the build directory, or wherever both were installed).
std::string default_node_bin() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "ringmaster-node";
  std::string self(buf, size_t(n));
  const size_t slash = self.rfind('/');
  return (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/ringmaster-node";
}

// Samples/s over every epoch but the first (warm-up: first touches of memory, thread start, connections).
double steady_rate(const train_result& r) {
  double samples = 0, seconds = 0;
  for (size_t e = r.history.size() > 1 ? 1 : 0; e < r.history.size(); ++e) {
    samples += double(r.history[e].samples);
    seconds += r.history[e].seconds;
  }
  return seconds > 0 ? samples / seconds : 0;
}

// Where the replicas' time went, per replica and step (all epochs), in milliseconds and shares.
void print_breakdown(const std::string& what, const train_result& r, int replicas, int64_t steps, double rate) {
  const double total = r.wait_batch + r.compute + r.wait_ring + r.update;
  const double per = 1e3 / double(std::max<int64_t>(1, steps * replicas));
  std::printf("#   %-28s %9.0f samples/s; per replica-step: compute %.3f ms (%.0f%%), update %.3f ms (%.0f%%), "
              "ring wait %.3f ms (%.0f%%; for a slower replica's forward/backward %.0f%%), batch wait %.3f ms (%.0f%%)\n",
              what.c_str(), rate, r.compute * per, 100 * r.compute / total, r.update * per, 100 * r.update / total,
              r.wait_ring * per, 100 * r.wait_ring / total, 100 * r.wait_slower / total, r.wait_batch * per,
              100 * r.wait_batch / total);
}

}  // namespace

namespace ringmaster::train_bench {

int nodes_main(const std::vector<std::string>& models, int nodes, int per_replica, int steps, int repeat,
               const std::string& data_dir, std::string node_bin, int ring_poll_us) {
  std::string err;
  auto whole = std::make_shared<dataset>();
  if (!load_mnist(data_dir, "train", 256, whole.get(), &err)) {  // 256 classes: as the nodes load it
    std::fprintf(stderr, "train_bench: %s\n", err.c_str());
    return 2;
  }
  const int global_batch = per_replica * nodes;
  // Epochs of at most kSteps steps over the first samples, the same on both sides (limit_train).
  const int64_t steps_per_epoch = std::min<int64_t>(kSteps, int64_t(whole->count) / global_batch);
  if (steps_per_epoch < 1) {
    std::fprintf(stderr, "train_bench: global batch %d is larger than the %zu samples in %s\n", global_batch,
                 whole->count, data_dir.c_str());
    return 2;
  }
  const int64_t limit = steps_per_epoch * global_batch;
  truncate(*whole, size_t(limit));
  std::shared_ptr<const dataset> data = whole;

  if (node_bin.empty()) node_bin = default_node_bin();
  // Two sets of daemons: encrypted (CurveZMQ, the default) and --insecure, so both are measured in one run.
  node_daemons daemons, plain_daemons;
  if (!daemons.start(node_bin, data_dir, nodes, false, ring_poll_us, &err) ||
      !plain_daemons.start(node_bin, data_dir, nodes, true, ring_poll_us, &err)) {
    std::fprintf(stderr, "train_bench: %s\n", err.c_str());
    return 1;
  }
  const std::vector<std::string> endpoints = daemons.endpoints();
  const int cores = int(std::max(1u, std::thread::hardware_concurrency()));
  std::printf("# train_bench --nodes %d: %d ringmaster-node daemons on loopback (cpu:1 each) against %d replicas in "
              "one process; batch %d per replica, %d cores, Adam, %s (first %lld samples, %lld steps per epoch)\n",
              nodes, nodes, nodes, per_replica, cores, data_dir.c_str(), (long long)limit,
              (long long)steps_per_epoch);
  std::printf("# samples/s over the epochs after the first; medians of %d rounds, local and nodes interleaved\n",
              repeat);
  std::printf("# nodes: keys, commands over CurveZMQ, ring chunks through shared memory (one host); insecure: the "
              "same, daemons run --insecure; tcp: shared memory off, ring chunks sealed (AES-128-OCB) over TCP; tcp "
              "insecure: that, --insecure; curve: ring chunks over CurveZMQ\n");
  std::printf("# %-16s %9s %9s %11s %9s %14s %9s %12s %12s %14s\n", "model", "local", "nodes", "nodes/local", "insecure",
              "nodes/insecure", "tcp", "tcp insecure", "tcp/insecure", "curve/insecure");
  for (const std::string& m : models) {
    train_config c;
    c.model = m;
    c.replicas = nodes;
    if (ring_poll_us >= 0) c.ring_poll = std::chrono::microseconds(ring_poll_us);  // else each side's default
    c.global_batch = global_batch;
    c.evaluate = false;
    c.train = data;
    auto md = build_model(c, &err);
    if (!md) {
      std::fprintf(stderr, "train_bench: %s: %s\n", m.c_str(), err.c_str());
      return 2;
    }
    if (std::string e = check_config(c, *md, c.replicas); !e.empty()) {
      std::fprintf(stderr, "train_bench: %s: %s\n", m.c_str(), e.c_str());
      return 2;
    }
    const double flops_per_sample = 6 * macs_per_sample(*md);
    // Measured steps: --steps, else about 2e11 flops (a second or two of compute), at least two epochs.
    const int64_t n = steps ? steps : int64_t(std::max(200.0, 2e11 / (flops_per_sample * global_batch)));
    c.epochs = 1 + std::max<int64_t>(1, (n + steps_per_epoch - 1) / steps_per_epoch);  // + the warm-up epoch
    const int64_t total_steps = c.epochs * steps_per_epoch;
    remote_options ro;
    ro.nodes = endpoints;
    ro.replicas_per_node = 1;
    ro.limit_train = limit;
    remote_options tcp = ro;
    tcp.shared_memory = false;
    remote_options plain = tcp;
    plain.nodes = plain_daemons.endpoints();
    plain.insecure = true;
    remote_options curve = tcp;
    curve.ring_ports = false;
    remote_options open = ro;
    open.nodes = plain_daemons.endpoints();
    open.insecure = true;
    const remote_options* opts[] = {nullptr, &ro, &tcp, &plain, &curve, &open};
    const char* names[] = {"local", "nodes", "tcp nodes", "tcp insecure nodes", "tcp curve nodes", "insecure nodes"};

    std::vector<double> rates[6], local_cpus, remote_cpus;
    for (int k = 0; k < repeat; ++k) {
      for (const int kind : {0, 1, 5, 2, 3, 4}) {
        const bool remote = kind > 0;
        const node_daemons& ds = kind == 3 || kind == 5 ? plain_daemons : daemons;
        const double c0 = process_cpu(), n0 = remote ? ds.cpu_seconds() : 0;
        train_result r = kind == 0 ? train(c) : train_remote(c, *opts[kind]);
        const double cpu = process_cpu() - c0 + (remote ? ds.cpu_seconds() - n0 : 0);
        if (!r.ok) {
          std::fprintf(stderr, "train_bench: %s, %s: %s\n", md->label().c_str(), names[kind], r.error.c_str());
          if (remote) std::fprintf(stderr, "%s", ds.logs().c_str());
          return 1;  // the daemons are stopped on the way out
        }
        const double rate = steady_rate(r);
        rates[kind].push_back(rate);
        if (kind < 2) (remote ? remote_cpus : local_cpus).push_back(double(r.train_samples) / std::max(1e-9, cpu));
        print_breakdown(md->label() + " " + names[kind] + " round " + std::to_string(k + 1), r, nodes, total_steps, rate);
      }
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
    const double local = median(rates[0]), remote = median(rates[1]), sealed = median(rates[2]),
                 insecure = median(rates[3]), over_curve = median(rates[4]), open_rate = median(rates[5]);
    std::printf("#   %s samples per CPU-second (whole job, every process): local %.0f, nodes %.0f\n",
                md->label().c_str(), median(local_cpus), median(remote_cpus));
    std::printf("  %-16s %9.0f %9.0f %11.2f %9.0f %14.2f %9.0f %12.0f %12.2f %14.2f\n", md->label().c_str(), local, remote,
                ratio(remote, local), open_rate, ratio(remote, open_rate), sealed, insecure, ratio(sealed, insecure),
                ratio(over_curve, insecure));
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace ringmaster::train_bench
