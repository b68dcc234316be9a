// Small helpers shared by the test files: random vectors, running a program and capturing its output and
// exit code, reading a file, free loopback ports, and daemons (ringmaster-node, custom_layer serve) as
// child processes. Header-only and without the ringmaster library, so every test target can use it.
#pragma once
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace ringmaster::test {

// n floats uniform in [lo, hi).
inline std::vector<float> randv(size_t n, std::mt19937& rng, float lo = -1, float hi = 1) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct run_result {
  int status;  // the exit code, or -1 when the program did not exit normally
  std::string out;  // stdout and stderr together
};

// Runs a shell command line with its stderr sent to its stdout.
inline run_result run(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

// A fresh folder /tmp/ringmaster-NAME-XXXXXX (mode 0700), for the test to fill and remove.
inline std::string temp_dir(const std::string& name) {
  std::string tmpl = "/tmp/ringmaster-" + name + "-XXXXXX";
  REQUIRE(mkdtemp(tmpl.data()) != nullptr);
  return tmpl;
}

// A file's contents ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// A loopback port that was free a moment ago and not handed out before in this process (the kernel may
// give a just-closed port out again). A failure ends the test case; success is not counted as an assertion.
inline int free_port() {
  static std::set<int> taken;
  for (;;) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) FAIL("free_port: socket() failed");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
    close(fd);
    if (!ok) FAIL("free_port: cannot bind a loopback socket to port 0");
    if (taken.insert(ntohs(a.sin_port)).second) return ntohs(a.sin_port);
  }
}

inline std::string free_endpoint() { return "tcp://127.0.0.1:" + std::to_string(free_port()); }

// A TCP connection to a loopback port (non-blocking: under way, whatever comes of it); its descriptor, or
// -1. The caller checks, as it may have a thread running that a failed REQUIRE here would leave behind.
inline int loopback_connect(int port, bool nonblocking = false) {
  const int s = socket(AF_INET, SOCK_STREAM | (nonblocking ? SOCK_NONBLOCK : 0), 0);
  if (s < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(uint16_t(port));
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && !nonblocking) {
    close(s);
    return -1;
  }
  return s;
}

// A ZMTP 3.0 client's whole greeting offering `mechanism` ("NULL", "CURVE") sent to 127.0.0.1:port in one
// write, then read until the server hangs up (at most 3 s). A ZeroMQ client sends the mechanism only after
// the server's signature, and one that sees a mismatch first may hang up before the server saw its
// mechanism: this one's is always there. Whether the server hung up.
inline bool zmtp_greeting(int port, const std::string& mechanism) {
  const int s = loopback_connect(port);
  if (s < 0) return false;
  unsigned char g[64] = {0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0};
  std::memcpy(g + 12, mechanism.data(), std::min<size_t>(mechanism.size(), 20));
  timeval tv{3, 0};
  setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  bool closed = send(s, g, sizeof g, MSG_NOSIGNAL) == ssize_t(sizeof g);
  char buf[256];
  for (ssize_t n; closed && (n = recv(s, buf, sizeof buf, 0)) != 0;)
    if (n < 0) closed = false;  // a timeout (or an error): not hung up
  close(s);
  return closed;
}

// A blocking TCP connection to 127.0.0.1:port from another loopback address (127.0.0.2, say: another
// host, as a server counting connections per address sees it); its descriptor, or -1.
inline int loopback_connect_from(const std::string& source, int port) {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (inet_pton(AF_INET, source.c_str(), &a.sin_addr) != 1 || bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(s);
    return -1;
  }
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(uint16_t(port));
  if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(s);
    return -1;
  }
  return s;
}

// A daemon as a child process, `argv... --listen ENDPOINT --devices DEVICES --data DATA_DIR`, killed
// (SIGKILL) when this goes unless stopped before.
struct daemon_process {
  pid_t pid = -1;
  std::string endpoint;
  // log: a file its output goes to (appended to, so a daemon started again adds its second life), or ""
  // for the test's own output.
  daemon_process(std::vector<std::string> argv, const std::string& ep, const std::string& devices,
                 const std::string& data_dir, const std::string& log = "")
      : endpoint(ep) {
    for (const std::string& a : {std::string("--listen"), ep, std::string("--devices"), devices, std::string("--data"), data_dir})
      argv.push_back(a);
    pid = fork();
    if (pid == 0) {
      if (!log.empty()) {
        const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
        if (fd >= 0) dup2(fd, 1), dup2(fd, 2);
      }
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  daemon_process(const daemon_process&) = delete;
  daemon_process& operator=(const daemon_process&) = delete;
  ~daemon_process() { stop(SIGKILL); }
  // Signals it and waits; the wait status (-1 when it was stopped already).
  int stop(int sig) {
    if (pid <= 0) return -1;
    kill(pid, sig);
    int status = 0;
    waitpid(pid, &status, 0);
    pid = -1;
    return status;
  }
};

// Daemons started together; each one is killed when the vector goes, unless stopped before.
using daemons = std::vector<std::unique_ptr<daemon_process>>;

// n daemons on free loopback ports, given a moment to bind (a launcher's hello would wait anyway).
inline daemons start_daemons(int n, const std::vector<std::string>& argv, const std::string& devices,
                             const std::string& data_dir) {
  daemons d;
  for (int i = 0; i < n; ++i) d.push_back(std::make_unique<daemon_process>(argv, free_endpoint(), devices, data_dir));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  return d;
}

inline std::vector<std::string> endpoints(const daemons& d) {
  std::vector<std::string> e;
  for (auto& p : d) e.push_back(p->endpoint);
  return e;
}

// The endpoints joined by commas, as --nodes takes them.
inline std::string node_list(const daemons& d) {
  std::string l;
  for (auto& p : d) l += (l.empty() ? "" : ",") + p->endpoint;
  return l;
}

}  // namespace ringmaster::test
