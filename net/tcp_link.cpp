#include "net/tcp_link.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace ringmaster::net {
namespace {

using clock_type = std::chrono::steady_clock;
constexpr size_t kHead = wire::kHeaderSize + kTrailerBytes;  // what comes before a payload
constexpr int kConnectTries = 20;                            // a port that refuses: ~5 s of tries
constexpr auto kRetryPause = std::chrono::milliseconds(250);
// A tagged message where the pair has no key: the sender seals, this side runs --insecure (or a stranger).
constexpr char kSealedOnPlain[] = "a sealed message on a plain link (is only one side --insecure?)";

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

std::string sys_error(const std::string& what, int e = errno) { return what + ": " + std::strerror(e); }

void set_nodelay(int fd) {
  int one = 1;  // ring messages go at once: Nagle's wait for more would stall every small all-reduce
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}
void signal_fd(int fd) {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(fd, &one, sizeof one);
}
void drain_fd(int fd) {
  uint64_t v;
  [[maybe_unused]] ssize_t n = read(fd, &v, sizeof v);
}

// Where a connected socket's peer is, "ADDRESS:PORT", for logs.
std::string peer_of(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    if (a.ss_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
      inet_ntop(AF_INET, &v4->sin_addr, host, sizeof host);
      port = ntohs(v4->sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
      inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof host);
      port = ntohs(v6->sin6_port);
    }
  }
  return std::string(host) + ":" + std::to_string(port);
}

// "HOST:PORT" or "[V6]:PORT" into its parts. False for anything else.
bool split_host_port(const std::string& text, std::string* host, std::string* port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size() || text.size() - colon > 6) return false;
  *host = text.substr(0, colon);
  *port = text.substr(colon + 1);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  return std::all_of(port->begin(), port->end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Receive buffers, handed on as payloads and taken back when their readers let go: a 1 MiB buffer
// allocated afresh for every segment would cost its page faults each time.
struct buffer_pool {
  std::mutex mu;
  std::vector<std::pair<size_t, float*>> free;  // (floats, buffer)
  ~buffer_pool() {
    for (auto& [n, b] : free) delete[] b;
  }
  static payload take(const std::shared_ptr<buffer_pool>& pool, size_t bytes, float** data) {
    const size_t floats = std::max<size_t>(1, (bytes + sizeof(float) - 1) / sizeof(float));
    float* buf = nullptr;
    size_t cap = 0;
    {
      std::lock_guard<std::mutex> lock(pool->mu);
      for (size_t i = 0; i < pool->free.size(); ++i)
        if (pool->free[i].first >= floats) {
          std::tie(cap, buf) = pool->free[i];
          pool->free.erase(pool->free.begin() + long(i));
          break;
        }
    }
    if (!buf) buf = new float[cap = floats];
    *data = buf;
    auto owner = std::shared_ptr<const void>(buf, [pool, cap](const void* p) noexcept {
      float* b = static_cast<float*>(const_cast<void*>(p));
      try {
        std::lock_guard<std::mutex> lock(pool->mu);
        if (pool->free.size() < 8) return pool->free.emplace_back(cap, b), void();
      } catch (...) {
      }
      delete[] b;
    });
    return payload{buf, bytes, std::move(owner)};
  }
};

// Who expects which pair's connection: shared by the port and its receivers, which may outlive it.
struct registry {
  std::mutex mu;
  std::map<std::pair<uint64_t, uint32_t>, std::weak_ptr<tcp_receiver::impl>> pairs;
};

}  // namespace

// ---- receiver ----

struct tcp_receiver::impl {
  uint64_t job;
  uint32_t sender;
  std::shared_ptr<opener> open;
  handler on_message;
  error_handler on_error;
  std::shared_ptr<buffer_pool> pool = std::make_shared<buffer_pool>();
  std::shared_ptr<registry> reg;
  int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  std::thread thread;
  std::atomic<bool> stop{false}, polling{false};
  // The socket and the message being read: whoever holds `consume` (the thread, a poller, or the port
  // attaching a new connection).
  std::mutex consume;
  std::atomic<int> fd{-1};
  unsigned char head[kHead];
  size_t got = 0;  // bytes of head
  bool in_body = false;
  wire::header h;
  payload body;
  float* body_data = nullptr;
  size_t body_got = 0;

  ~impl() {
    if (fd >= 0) close(fd);
    if (wake >= 0) close(wake);
  }
  void loop();
  // Under consume: 1 a message was handed on, 0 none is complete yet, -1 the connection is gone.
  int take();
  int read_some(void* into, size_t want, size_t* have);
  // Under consume: a new connection (its login checked) replaces the old one.
  void attach(int s) {
    if (fd >= 0) close(fd);
    fd = s;
    got = body_got = 0;
    in_body = false;
    body = {};
    signal_fd(wake);
  }
  int hang_up() {
    close(fd);
    fd = -1;
    body = {};
    return -1;
  }
  int broken(const std::string& why) {
    hang_up();
    try {
      if (on_error) on_error(std::string(open ? "sealed" : "plain") + " connection from node " + std::to_string(sender) + ": " + why);
    } catch (...) {
    }
    return -1;
  }
};

tcp_receiver::tcp_receiver(std::shared_ptr<impl> d) : d_(std::move(d)) {}

tcp_receiver::~tcp_receiver() {
  {
    std::lock_guard<std::mutex> lock(d_->reg->mu);
    auto it = d_->reg->pairs.find({d_->job, d_->sender});
    if (it != d_->reg->pairs.end() && it->second.lock() == d_) d_->reg->pairs.erase(it);
  }
  d_->stop.store(true);
  signal_fd(d_->wake);
  if (d_->thread.joinable()) d_->thread.join();
  std::lock_guard<std::mutex> lock(d_->consume);
  if (d_->fd >= 0) d_->hang_up();
}

int tcp_receiver::impl::read_some(void* into, size_t want, size_t* have) {
  while (*have < want) {
    const ssize_t n = recv(fd, static_cast<char*>(into) + *have, want - *have, MSG_DONTWAIT);
    if (n > 0) {
      *have += size_t(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    return hang_up();  // closed by the sender (a re-formed ring, a node gone): the ring's watchdog speaks
  }
  return 1;
}

int tcp_receiver::impl::take() {
  if (fd < 0) return -1;
  try {
    if (!in_body) {
      if (int r = read_some(head, kHead, &got); r <= 0) return r;
      std::string err;
      if (!wire::decode(head, wire::kHeaderSize, &h, &err)) return broken("bad header: " + err);
      if (h.type != wire::msg_type::chunk) return broken(std::string("a ") + wire::type_name(h.type) + ", not a ring chunk");
      trailer t;
      read_trailer(head + wire::kHeaderSize, kTrailerBytes, &t);
      if (t.job != job || t.sender != sender)
        return broken("a message from node " + std::to_string(t.sender) + " of job " + std::to_string(t.job));
      if (!open && !untagged(head + wire::kHeaderSize)) return broken(kSealedOnPlain);
      if (h.payload_bytes > kMaxRingPayload)
        return broken("a payload of " + std::to_string(h.payload_bytes) + " bytes, over the limit of " +
                      std::to_string(kMaxRingPayload));
      body = h.payload_bytes ? buffer_pool::take(pool, size_t(h.payload_bytes), &body_data) : payload{};
      body_got = 0;
      in_body = true;
    }
    unsigned char none[1];  // no payload
    if (!h.payload_bytes) body_data = reinterpret_cast<float*>(none);
    if (int r = read_some(body_data, size_t(h.payload_bytes), &body_got); r <= 0) return r;
    in_body = false;
    got = 0;
    std::string err;
    if (open && !open->open(head, wire::kHeaderSize, body_data, size_t(h.payload_bytes), head + wire::kHeaderSize, &err))
      return broken(err);
    on_message(h, std::move(body));
    body = {};
    return 1;
  } catch (const std::exception& e) {
    return broken(std::string("handing on a message failed: ") + e.what());
  } catch (...) {
    return broken("handing on a message failed");
  }
}

void tcp_receiver::impl::loop() {
  while (!stop.load()) {
    if (!polling.load()) {
      std::unique_lock<std::mutex> lock(consume, std::try_to_lock);
      if (lock.owns_lock())
        while (take() > 0 && !stop.load()) {
        }
    }
    // While a poller reads the socket, sleep on the wake-up alone: it signals it when it stops.
    pollfd fds[2] = {{wake, POLLIN, 0}, {polling.load() ? -1 : fd.load(), POLLIN, 0}};
    ::poll(fds, 2, 200);
    if (fds[0].revents) drain_fd(wake);
  }
}

bool tcp_receiver::poll(std::chrono::steady_clock::time_point until, const std::function<bool()>& done) {
  impl& d = *d_;
  std::unique_lock<std::mutex> lock(d.consume, std::try_to_lock);
  if (!lock.owns_lock() || d.fd < 0) return done();  // the thread reads (or nothing comes): let it
  d.polling.store(true);
  struct hand_back {  // however this ends (done() may throw)
    impl& d;
    std::unique_lock<std::mutex>& lock;
    ~hand_back() {
      d.polling.store(false);
      lock.unlock();
      signal_fd(d.wake);
    }
  } give_back{d, lock};
  bool finished = done();
  for (uint32_t idle = 0; !finished && !d.stop.load(std::memory_order_relaxed);) {
    const int n = d.take();
    if (n < 0) break;
    if (n > 0) {
      finished = done();
      continue;
    }
    if ((++idle & 15) == 0 && ((finished = done()) || clock_type::now() >= until)) break;
    cpu_relax();
  }
  return finished;
}

// ---- port ----

struct tcp_port::impl {
  tcp_port_options opt;
  int listen_fd = -1;
  int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  int port = 0;
  std::shared_ptr<registry> reg = std::make_shared<registry>();
  std::thread thread;
  std::atomic<bool> stop{false};
  struct pending {
    int fd;
    unsigned char buf[kHead];
    size_t got;
    clock_type::time_point deadline;
  };
  std::deque<pending> waiting;
  clock_type::time_point fd_shortage_said{};  // out of file descriptors: said once a minute
  // Refusals said: at most kRefusalLines per opt.refusal_window, the rest counted and summed up once the
  // window is over (a flood of strangers must not flood the log, nor whoever prints it).
  static constexpr int kRefusalLines = 5;
  clock_type::time_point window{};
  int lines = 0;
  uint64_t unsaid = 0;

  ~impl() {
    for (auto& p : waiting) close(p.fd);
    if (listen_fd >= 0) close(listen_fd);
    if (wake >= 0) close(wake);
  }
  void refuse(std::string why) {
    const auto now = clock_type::now();
    if (now - window >= opt.refusal_window) {
      window = now;
      lines = 0;
    }
    if (lines++ >= kRefusalLines) {
      ++unsaid;
      return;
    }
    if (unsaid) {
      why += " (and " + std::to_string(unsaid) + " more refusals not logged before)";
      unsaid = 0;
    }
    say(why);
  }
  // Once a window is over, what it did not say is summed up at once, not with the next refusal (which
  // may come long after a flood has ended). From the loop, at least once a second.
  void sum_up() {
    if (!unsaid || clock_type::now() - window < opt.refusal_window) return;
    say(std::to_string(unsaid) + " more refusals not logged in " + std::to_string(opt.refusal_window.count()) + " ms");
    unsaid = 0;
    window = clock_type::now();
    lines = 1;
  }
  void say(const std::string& line) {
    try {
      if (opt.on_refusal) opt.on_refusal(line);
      else std::fprintf(stderr, "ringmaster ring port %d: %s\n", port, line.c_str());
    } catch (...) {
    }
  }
  void loop();
  void accept_one();
  // A whole login came: hand the connection to its pair's receiver, or close it. False: try again soon
  // (the receiver is busy).
  bool login(pending& p);
};

void tcp_port::impl::accept_one() {
  const int s = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (s < 0) {
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // The connection stays in the backlog and the socket readable: pause, do not spin on it.
      if (clock_type::now() - fd_shortage_said > std::chrono::minutes(1))
        refuse(sys_error("cannot accept a connection")), fd_shortage_said = clock_type::now();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return;
  }
  set_nodelay(s);
  // Full: the longest waiting goes. A node logs in as soon as it is connected, so strangers who open
  // connections and say nothing push out each other, not it (as libzmq's handshake timeout would not).
  if (waiting.size() >= size_t(std::max(1, opt.max_pending))) {
    close(waiting.front().fd);
    waiting.pop_front();
    refuse("closed a connection before it logged in: more than " + std::to_string(opt.max_pending) + " waited at once");
  }
  waiting.push_back({s, {}, 0, clock_type::now() + opt.login_timeout});
}

bool tcp_port::impl::login(pending& p) {
  wire::header h;
  std::string err;
  trailer t;
  read_trailer(p.buf + wire::kHeaderSize, kTrailerBytes, &t);
  if (!wire::decode(p.buf, wire::kHeaderSize, &h, &err) || h.type != wire::msg_type::hello || h.payload_bytes != 0 ||
      h.sender_rank < 0 || t.job != h.job_id || t.sender != uint32_t(h.sender_rank)) {
    close(p.fd);
    refuse("a connection that did not log in as a node: " + (err.empty() ? "no login" : err));
    return true;
  }
  std::shared_ptr<tcp_receiver::impl> r;
  {
    std::lock_guard<std::mutex> lock(reg->mu);
    if (auto it = reg->pairs.find({t.job, t.sender}); it != reg->pairs.end()) r = it->second.lock();
  }
  if (!r) {
    close(p.fd);
    refuse("a login as node " + std::to_string(t.sender) + " of a job this node does not run");
    return true;
  }
  // The receiver's lock: its thread or a poller may hold it while a stream of messages lasts. Then the
  // login waits for the next turn of our loop (a logged-in peer must not stall every other login).
  std::unique_lock<std::mutex> lock(r->consume, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (!r->open && !untagged(p.buf + wire::kHeaderSize)) {
    close(p.fd);
    refuse("a login as node " + std::to_string(t.sender) + ": " + kSealedOnPlain);
    return true;
  }
  unsigned char none[1];  // no payload
  if (r->open && !r->open->open(p.buf, wire::kHeaderSize, none, 0, p.buf + wire::kHeaderSize, &err)) {
    close(p.fd);
    refuse("a login as node " + std::to_string(t.sender) + " that failed: " + err);
    return true;
  }
  // A sender connects once per ring, so a second login of a pair is someone else's (plain, anyone's) or a
  // sender that lost its connection: either way the ring's chunks may go missing, which is worth a line.
  if (r->fd >= 0)
    refuse("node " + std::to_string(t.sender) + " of job " + std::to_string(t.job) + " logged in again from " + peer_of(p.fd) +
           ": its earlier connection is closed");
  r->attach(p.fd);
  return true;
}

void tcp_port::impl::loop() {
  std::vector<pollfd> fds;
  while (!stop.load()) {
    fds.clear();
    fds.push_back({wake, POLLIN, 0});
    fds.push_back({listen_fd, POLLIN, 0});
    auto now = clock_type::now();
    int timeout = 1000;
    for (auto& p : waiting) {
      // A whole login waits for its receiver's turn (login): its socket is not read meanwhile (what came
      // after the login is the receiver's), and it keeps its place however long that takes.
      const bool whole = p.got == kHead;
      fds.push_back({whole ? -1 : p.fd, POLLIN, 0});
      if (whole) timeout = 1;
      else timeout = std::min<int>(timeout, int(std::chrono::duration_cast<std::chrono::milliseconds>(p.deadline - now).count()) + 1);
    }
    ::poll(fds.data(), fds.size(), std::max(0, timeout));
    if (fds[0].revents) drain_fd(wake);
    now = clock_type::now();
    // The logins first (fds[2...] follow `waiting` as it was), then new connections.
    std::deque<pending> still;
    for (size_t i = 0; i < waiting.size(); ++i) {
      pending& p = waiting[i];
      bool gone = false;
      if (fds[i + 2].revents && p.got < kHead) {
        const ssize_t n = recv(p.fd, p.buf + p.got, kHead - p.got, MSG_DONTWAIT);
        if (n > 0) p.got += size_t(n);
        gone = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
        if (gone) close(p.fd);
      }
      if (!gone && p.got == kHead && login(p)) continue;
      if (gone) continue;
      if (p.got < kHead && now >= p.deadline) {
        close(p.fd);
        refuse("a connection sent no login within " + std::to_string(opt.login_timeout.count()) + " ms");
        continue;
      }
      still.push_back(p);
    }
    waiting.swap(still);
    if (fds[1].revents & POLLIN) accept_one();
    sum_up();
  }
}

tcp_port::tcp_port(std::unique_ptr<impl> d) : d_(std::move(d)) {}

// The first IPv4 (else IPv6) address of the network interface `name` ("eth0"), as ZeroMQ binds to one;
// "" when there is no such interface.
static std::string interface_address(const std::string& name) {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return "";
  std::string v4, v6;
  for (ifaddrs* i = all; i; i = i->ifa_next) {
    if (!i->ifa_addr || name != i->ifa_name) continue;
    char text[INET6_ADDRSTRLEN] = "";
    if (i->ifa_addr->sa_family == AF_INET && v4.empty())
      v4 = inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof text) ? text : "";
    if (i->ifa_addr->sa_family == AF_INET6 && v6.empty())
      v6 = inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, text, sizeof text) ? text : "";
  }
  freeifaddrs(all);
  return v4.empty() ? v6 : v4;
}

std::unique_ptr<tcp_port> tcp_port::bind(const std::string& endpoint_host, int port, tcp_port_options o, std::string* error) {
  std::string host = endpoint_host;  // as in an endpoint: [::1] is ::1
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  auto d = std::make_unique<impl>();
  d->opt = std::move(o);
  // Strangers' waiting connections take at most an eighth of our file descriptors: the rest stay for
  // the node's own links and files, however many connect.
  if (rlimit fds{}; getrlimit(RLIMIT_NOFILE, &fds) == 0 && fds.rlim_cur != RLIM_INFINITY)
    d->opt.max_pending = int(std::max<rlim_t>(1, std::min<rlim_t>(rlim_t(std::max(1, d->opt.max_pending)), fds.rlim_cur / 8)));
  const std::string at = host + ":" + std::to_string(port);
  if (d->wake < 0) return *error = sys_error("eventfd"), nullptr;
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  const bool any = host == "*" || host.empty();
  if (any) hints.ai_family = AF_INET;  // as ZeroMQ's "*": every IPv4 address
  if (int e = getaddrinfo(any ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &found); e != 0) {
    const std::string address = any ? "" : interface_address(host);  // tcp://eth0:P, as ZeroMQ takes it
    if (address.empty() || getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &found) != 0)
      return *error = at + ": " + gai_strerror(e) + " (neither a host address nor a network interface)", nullptr;
  }
  std::string why = "no address";
  for (addrinfo* a = found; a && d->listen_fd < 0; a = a->ai_next) {
    const int s = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (s < 0) continue;
    int one = 1;
    setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s, a->ai_addr, a->ai_addrlen) == 0 && listen(s, 64) == 0) d->listen_fd = s;
    else why = errno == EADDRINUSE ? "address already in use" : std::strerror(errno), close(s);
  }
  freeaddrinfo(found);
  if (d->listen_fd < 0) return *error = at + ": " + why, nullptr;
  sockaddr_storage bound{};
  socklen_t len = sizeof bound;
  getsockname(d->listen_fd, reinterpret_cast<sockaddr*>(&bound), &len);
  d->port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  try {
    d->thread = std::thread([p = d.get()] { p->loop(); });
    pthread_setname_np(d->thread.native_handle(), "rm-tcp-port");
  } catch (const std::exception& e) {
    return *error = std::string("cannot start the ring port's thread: ") + e.what(), nullptr;
  }
  return std::unique_ptr<tcp_port>(new tcp_port(std::move(d)));
}

tcp_port::~tcp_port() {
  d_->stop.store(true);
  signal_fd(d_->wake);
  if (d_->thread.joinable()) d_->thread.join();
}

int tcp_port::port() const { return d_->port; }

std::shared_ptr<tcp_receiver> tcp_port::expect(uint64_t job, uint32_t sender, std::shared_ptr<opener> open,
                                               tcp_receiver::handler h, tcp_receiver::error_handler e) {
  auto d = std::make_shared<tcp_receiver::impl>();
  d->job = job;
  d->sender = sender;
  d->open = std::move(open);
  d->on_message = std::move(h);
  d->on_error = std::move(e);
  d->reg = d_->reg;
  auto r = std::make_shared<tcp_receiver>(d);
  try {
    d->thread = std::thread([p = d.get()] { p->loop(); });
    pthread_setname_np(d->thread.native_handle(), "rm-tcp-recv");
  } catch (const std::exception& x) {  // no thread: nothing is read but by pollers; the watchdog names it
    if (d->on_error) d->on_error(std::string("cannot start the receiving thread: ") + x.what());
  }
  std::lock_guard<std::mutex> lock(d_->reg->mu);
  d_->reg->pairs[{job, sender}] = d;
  return r;
}

// ---- sender ----

struct tcp_sender::impl {
  std::string endpoint, host, port;
  uint64_t job = 0;
  uint32_t sender = 0;
  std::shared_ptr<sealer> seal;  // null: plain
  uint64_t plain_count = 0;      // plain: the trailers' count (what a sealer would number)
  std::function<void(const std::string&)> on_error;
  struct frame {
    std::unique_ptr<unsigned char[]> data;
    size_t cap = 0, size = 0, sent = 0;
    payload ext;  // plain: the payload, written from where it is (after data's size bytes), held till then
    size_t total() const { return size + ext.size; }
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<frame> queue;     // waiting for the socket, in order (the login first)
  std::vector<frame> spares;  // written frames' buffers, for the next sends (a backed-up socket
                              // must not cost a fresh 1 MiB allocation, and its page faults, a chunk)
  // Plain payloads written or dropped, let go of only once mu is free: letting go may end an all-reduce
  // (net/ring_driver.hpp counts its buffer's readers), and whoever waits for that may send at once.
  std::vector<payload> written;
  int letting_go = 0;             // threads in let_go with mu unlocked: abort() waits for them, on let_go_done
  std::condition_variable let_go_done;  // (not cv: the sender's thread waits there, and need not wake each time)
  int fd = -1;
  bool connected = false, dead = false, stop = false;
  bool looking_up = false;  // the thread waits for getaddrinfo, which nothing can cut short
  std::thread thread;
  // Signalled when our owner goes: a connect still waiting (up to a second, for a host that does not
  // answer) ends at once, so dropping a sender never holds up its owner's thread (a node's bridge thread,
  // whose heartbeats must go on while a ring re-forms).
  int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);

  ~impl() {
    if (fd >= 0) close(fd);
    if (wake >= 0) close(wake);
  }
  // Under mu: a frame of `bytes` bytes, a spare one if one is large enough.
  frame make_frame(size_t bytes) {
    frame f;
    for (size_t i = spares.size(); i-- > 0;)
      if (spares[i].cap >= bytes) {
        f = std::move(spares[i]);
        spares.erase(spares.begin() + long(i));
        break;
      }
    if (f.cap < bytes) f = {std::unique_ptr<unsigned char[]>(new unsigned char[bytes]), bytes, 0, 0, {}};
    f.size = bytes;
    f.sent = 0;
    return f;
  }
  // Under mu: writes queued frames until the socket takes no more. 1 all written, 0 the socket is full,
  // -1 the connection broke.
  int flush() {
    while (!queue.empty()) {
      frame& f = queue.front();
      while (f.sent < f.total()) {
        iovec io[2];
        int parts = 0;
        if (f.sent < f.size) io[parts++] = {f.data.get() + f.sent, f.size - f.sent};
        const size_t into_ext = f.sent > f.size ? f.sent - f.size : 0;
        if (f.ext.size > into_ext) io[parts++] = {const_cast<char*>(static_cast<const char*>(f.ext.data)) + into_ext, f.ext.size - into_ext};
        msghdr m{};
        m.msg_iov = io;
        m.msg_iovlen = size_t(parts);
        const ssize_t n = ::sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) f.sent += size_t(n);
        else if (n < 0 && errno == EINTR) continue;
        else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        else return -1;
      }
      if (f.ext.owner) written.push_back(std::move(f.ext));
      f.ext = {};
      if (spares.size() < 8) spares.push_back(std::move(f));
      queue.pop_front();
    }
    return 1;
  }
  // The trailer after the header at `frame`, and n payload bytes from `in` to `out`: sealed, or plain.
  bool wrap(unsigned char* frame, const void* in, void* out, size_t n) {
    if (seal) return seal->seal(frame, wire::kHeaderSize, in, out, n, frame + wire::kHeaderSize);
    write_trailer({job, sender, plain_count++}, frame + wire::kHeaderSize);
    if (n) std::memcpy(out, in, n);
    return true;
  }
  // The connection is gone (or never came): what waits is dropped, and so is what comes.
  void give_up() {
    dead = true;
    for (frame& f : queue)
      if (f.ext.owner) written.push_back(std::move(f.ext));
    queue.clear();
  }
  // Under lock: lets go of the written payloads with mu unlocked for the while.
  void let_go(std::unique_lock<std::mutex>& lock) {
    if (written.empty()) return;
    std::vector<payload> done;
    done.swap(written);
    ++letting_go;
    ++letting_go_here;
    lock.unlock();
    done.clear();
    lock.lock();
    --letting_go_here;
    if (--letting_go == 0) let_go_done.notify_all();
  }
  // This thread's let_go calls under way (of any sender): a release that calls abort() must not wait for itself.
  static thread_local int letting_go_here;
  int connect_once(std::string* why);
  void run();
};

thread_local int tcp_sender::impl::letting_go_here = 0;

int tcp_sender::impl::connect_once(std::string* why) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stop || dead) return -1;
    looking_up = true;
  }
  const int e = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  {
    std::lock_guard<std::mutex> lock(mu);
    looking_up = false;
    if (stop || dead) {  // our owner went (or aborted) while we looked: no connection to anyone now
      if (e == 0) freeaddrinfo(found);
      return -1;
    }
  }
  if (e != 0) return *why = gai_strerror(e), -1;
  int s = -1;
  for (addrinfo* a = found; a && s < 0; a = a->ai_next) {
    s = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (s < 0) {
      *why = std::strerror(errno);  // no file descriptor left, say
      continue;
    }
    int err = 0;
    if (::connect(s, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {  // wait up to a second for it, or until our owner goes
        pollfd p[2] = {{s, POLLOUT, 0}, {wake, POLLIN, 0}};
        socklen_t len = sizeof err;
        int n;
        do n = ::poll(p, 2, 1000);
        while (n < 0 && errno == EINTR);
        if (p[1].revents) err = ECANCELED;
        else err = n > 0 && getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len) == 0 ? err : ETIMEDOUT;
      }
    }
    if (err != 0) *why = std::strerror(err), close(s), s = -1;
  }
  freeaddrinfo(found);
  if (s >= 0) set_nodelay(s);
  return s;
}

void tcp_sender::impl::run() {
  std::string why;
  int s = -1;
  std::unique_lock<std::mutex> lock(mu);
  for (int attempt = 0; attempt < kConnectTries && s < 0; ++attempt) {
    if (attempt > 0 ? cv.wait_for(lock, kRetryPause, [this] { return stop || dead; }) : stop || dead) return;
    lock.unlock();
    s = connect_once(&why);
    lock.lock();
    if (stop || dead) {  // our owner went, or aborted: nobody to tell, nothing to send (checked under the
      if (s >= 0) close(s);  // same lock that then takes the connection, so an abort never misses one)
      return;
    }
  }
  if (s < 0) {
    give_up();
    let_go(lock);
    if (stop) return;  // our owner is going: nobody to tell
    lock.unlock();
    if (on_error)
      on_error("cannot reach " + endpoint + " (a ring port) after " + std::to_string(kConnectTries) + " tries (" + why +
               "): is it open (ringmaster-node --ring-port) in the firewall?");
    return;
  }
  fd = s;
  connected = true;
  for (;;) {
    cv.wait(lock, [this] { return stop || !queue.empty(); });
    if (stop) return;
    const int r = flush();
    if (r < 0) give_up();  // the other side went: the job's heartbeats and watchdog say who
    let_go(lock);
    if (r < 0) return;
    if (r == 0) {
      lock.unlock();
      pollfd p{s, POLLOUT, 0};
      ::poll(&p, 1, 100);
      lock.lock();
    }
  }
}

tcp_sender::tcp_sender(std::shared_ptr<impl> d) : d_(std::move(d)) {}

std::shared_ptr<tcp_sender> tcp_sender::connect(const std::string& endpoint, uint64_t job, uint32_t sender,
                                                std::shared_ptr<sealer> seal, std::function<void(const std::string&)> on_error,
                                                std::string* error) {
  auto d = std::make_shared<impl>();
  d->endpoint = endpoint;
  if (endpoint.rfind("tcp://", 0) != 0 || !split_host_port(endpoint.substr(6), &d->host, &d->port))
    return *error = "not a tcp://HOST:PORT endpoint: " + endpoint, nullptr;
  d->job = job;
  d->sender = sender;
  d->seal = std::move(seal);
  d->on_error = std::move(on_error);
  // The login, made (sealed) here so that it takes the counter before any message does.
  wire::header h;
  h.type = wire::msg_type::hello;
  h.job_id = job;
  h.sender_rank = int32_t(sender);
  const auto hb = wire::encode(h);
  impl::frame f = d->make_frame(kHead);
  std::memcpy(f.data.get(), hb.data(), hb.size());
  unsigned char* none = f.data.get() + kHead;  // no payload
  if (sender > uint32_t(INT32_MAX) || !d->wrap(f.data.get(), none, none, 0))
    return *error = "cannot make the login", nullptr;
  d->queue.push_back(std::move(f));
  auto s = std::shared_ptr<tcp_sender>(new tcp_sender(std::move(d)));
  try {
    s->d_->thread = std::thread([p = s->d_] { p->run(); });
    pthread_setname_np(s->d_->thread.native_handle(), "rm-tcp-send");
  } catch (const std::exception& e) {
    return *error = std::string("cannot start the sending thread: ") + e.what(), nullptr;
  }
  return s;
}

tcp_sender::~tcp_sender() {
  bool detach = d_->thread.get_id() == std::this_thread::get_id();
  std::vector<payload> held;
  std::function<void(const std::string&)> on_error;
  std::shared_ptr<sealer> seal;
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    d_->stop = true;
    if (d_->fd >= 0) shutdown(d_->fd, SHUT_RDWR);  // a poll for room returns at once
    // A host name's lookup may take as long as a dead DNS server makes it: the thread is left to end
    // on its own (it holds d_, sees `stop` and sends nothing), and what it held is let go of here.
    if (d_->looking_up) {
      detach = true;
      d_->give_up();
      held.swap(d_->written);
      on_error.swap(d_->on_error);  // and whatever it holds
      seal.swap(d_->seal);          // and the pair's keys (after `stop` the thread seals nothing)
    }
  }
  held.clear();
  on_error = nullptr;
  seal = nullptr;
  d_->cv.notify_all();
  signal_fd(d_->wake);  // and so does a connect under way
  // From its own thread (on_error dropped the last of us): it ends once on_error returns, holding d_.
  if (detach) d_->thread.detach();
  else if (d_->thread.joinable()) d_->thread.join();
}

bool tcp_sender::sealed() const { return d_->seal != nullptr; }

void tcp_sender::abort() {
  impl& d = *d_;
  std::unique_lock<std::mutex> lock(d.mu);  // a write under way (flush holds mu) ends first
  d.give_up();
  if (d.fd >= 0) shutdown(d.fd, SHUT_RDWR);
  d.let_go(lock);
  // Payloads another thread took out of `written` are let go of before we return (unless it is this
  // thread, releasing one that led here).
  if (impl::letting_go_here == 0) d.let_go_done.wait(lock, [&d] { return d.letting_go == 0; });
  lock.unlock();
  d.cv.notify_all();    // a connect's retry pause ends
  signal_fd(d.wake);    // and so does a connect under way
}

bool tcp_sender::send(const wire::header& h, const payload& p, std::string* error) {
  if (p.size > kMaxRingPayload)
    return *error = "a message of " + std::to_string(p.size) + " bytes, over the limit of " +
                    std::to_string(kMaxRingPayload), false;
  wire::header w = h;
  w.payload_bytes = p.size;
  if (!wire::validate(w, error)) return false;
  const auto hb = wire::encode(w);
  impl& d = *d_;
  std::unique_lock<std::mutex> lock(d.mu);
  if (d.dead || d.stop) return true;  // dropped, as a connection to a vanished peer drops it
  // Plain, a payload with an owner is written from where it is (zero-copy, as through the bridge).
  const bool in_place = !d.seal && p.owner && p.size > 0;
  impl::frame f = d.make_frame(in_place ? kHead : kHead + p.size);
  std::memcpy(f.data.get(), hb.data(), hb.size());
  if (in_place) {
    write_trailer({d.job, d.sender, d.plain_count++}, f.data.get() + wire::kHeaderSize);
    f.ext = p;
  } else if (!d.wrap(f.data.get(), p.data, f.data.get() + kHead, p.size)) {
    return *error = "sealing failed", false;
  }
  const bool idle = d.queue.empty();
  d.queue.push_back(std::move(f));
  if (idle && d.connected) {  // written here, on the caller's thread: no wake-up of ours
    if (const int r = d.flush(); r != 0) {
      if (r < 0) d.give_up();
      d.let_go(lock);
      return true;
    }
    d.let_go(lock);
  }
  d.cv.notify_one();
  return true;
}

}  // namespace ringmaster::net
