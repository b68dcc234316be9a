#include "net/tcp_link.hpp"
#include "net/spin.hpp"
#include "net/tcp_io.hpp"

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
using tcp_io::kHead;
using tcp_io::set_nodelay;
using tcp_io::signal_fd;
// A tagged message where the pair has no key: the sender seals, this side runs --insecure (or a stranger).
constexpr char kSealedOnPlain[] = "a sealed message on a plain link (is only one side --insecure?)";

std::string sys_error(const std::string& what, int e = errno) { return what + ": " + std::strerror(e); }

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
  uint64_t cut_after = 0;               // tcp_port_options::cut_after, cut_every
  bool cut_every = false;
  std::atomic<uint64_t> cut_job{0};     // the last job one was cut in
};

}  // namespace

// ---- receiver ----

struct tcp_receiver::impl {
  uint64_t job;
  uint32_t sender;
  std::shared_ptr<opener> open;
  handler on_message;
  error_handler on_error;
  closed_handler on_closed;
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
  uint64_t handed = 0;  // messages handed on (for tcp_port_options::cut_after)

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
  // The connection closed or broke (err: errno, 0 for an orderly close) under a live receiver.
  int lost(int err) {
    hang_up();
    if (on_closed && !stop.load()) try {
        on_closed(err ? std::string(std::strerror(err)) : "closed by its sender");
      } catch (...) {
      }
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
    const int err = n < 0 ? errno : 0;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) return 0;
    return lost(err);  // closed by the sender (its ring ended, a node gone) or broken between us
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
    if (reg->cut_after && ++handed == reg->cut_after && (reg->cut_every || reg->cut_job.exchange(job) != job)) {
      ::shutdown(fd, SHUT_RD);  // testing: as if the connection broke as this message came (it is lost)
      body = {};
      return 1;
    }
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
  return spin_taking([&d] { return d.take(); }, done, until, d.stop, 16);
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
  d->reg->cut_after = d->opt.cut_after;
  d->reg->cut_every = d->opt.cut_every;
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
                                               tcp_receiver::handler h, tcp_receiver::error_handler e,
                                               tcp_receiver::closed_handler closed) {
  auto d = std::make_shared<tcp_receiver::impl>();
  d->job = job;
  d->sender = sender;
  d->open = std::move(open);
  d->on_message = std::move(h);
  d->on_error = std::move(e);
  d->on_closed = std::move(closed);
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

}  // namespace ringmaster::net
