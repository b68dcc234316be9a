// The bridge: set-up, the public calls, and who may connect (net/bridge_io.cpp moves the messages).
#include "net/bridge.hpp"

#include <netdb.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <future>
#include <utility>

#include "net/bridge_impl.hpp"

namespace ringmaster::net {

payload payload::copy_of(std::string_view bytes) {
  auto s = std::make_shared<std::string>(bytes);
  return {s->data(), s->size(), s};
}

payload payload::of(std::shared_ptr<const std::vector<float>> v) {
  if (!v) return {};
  const void* p = v->data();
  const size_t n = v->size() * sizeof(float);
  return {p, n, std::move(v)};
}

const char* fault_name(fault f) {
  switch (f) {
    case fault::malformed: return "malformed message";
    case fault::version_mismatch: return "protocol version mismatch";
    case fault::send_failed: return "send failed";
    case fault::handler_failed: return "handler failed";
    case fault::unauthorized: return "unauthorized client";
    case fault::handshake_failed: return "handshake failed";
    case fault::overloaded: return "overloaded";
    case fault::keys_mismatch: return "keys mismatch";
    case fault::peer_changed: return "peer changed";
    case fault::unreachable: return "unreachable";
  }
  return "fault";
}

bool bridge::impl::once_a_minute(std::chrono::steady_clock::time_point* last) {
  const auto now = std::chrono::steady_clock::now();
  if (*last != std::chrono::steady_clock::time_point{} && now - *last < std::chrono::minutes(1)) return false;
  *last = now;
  return true;
}

void bridge::impl::report_overload(const std::string& what) {
  if (!once_a_minute(&last_overload_report)) return;
  report(fault::overloaded, {}, what + " (" + std::to_string(accept_failures) + " failed accepts, " +
                                    std::to_string(overloaded_refusals) + " clients refused so far; reported at most once a minute)");
}

void bridge::impl::serve_listen_monitor() {
  listen_monitor->drain([this](uint16_t what, uint32_t value) {
    const int fd = int(value);
    if (what == ZMQ_EVENT_ACCEPTED || what == ZMQ_EVENT_DISCONNECTED) {
      // Gone; also when an fd closed and reused comes back before we saw its disconnect.
      if (auto it = connection_address.find(fd); it != connection_address.end()) {
        if (--per_address[it->second] <= 0) per_address.erase(it->second);
        connection_address.erase(it);
      }
    }
    if (what == ZMQ_EVENT_ACCEPTED) {
      sockaddr_storage a{};
      socklen_t len = sizeof a;
      char host[NI_MAXHOST] = "?";
      if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
        ::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof host, nullptr, 0, NI_NUMERICHOST);
      connection_address[fd] = host;
      ++per_address[host];
      // Over the limit: the first few over it stay for the handshake, which tells a client why it is
      // refused ("too many connections"). Past those, a connection is hung up now, before it holds a
      // file descriptor for the handshake's 3 s: a flood of idle connections would otherwise run us out
      // of them, and libzmq retries a failed accept in a busy loop. libzmq sees the hang-up and closes
      // the fd itself; a client's libzmq knocks again later. (Between accepted_here and shutdown the fd
      // could close and be reused, in microseconds, by another connection to our port: that one is then
      // hung up instead, as over the limit from the same count; one of ours elsewhere never is.)
      const int told_why = std::clamp(opt.max_connections / 4, 1, 16);
      if (int(connection_address.size()) > opt.max_connections + told_why && !within_limit(host) && accepted_here(fd))
        ::shutdown(fd, SHUT_RDWR);
    }
    if (what == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH &&
        once_a_minute(&last_mismatch_report)) {
      report(fault::keys_mismatch, {}, opt.keys.empty()
          ? listener.endpoint + ": refused a client that offers CurveZMQ keys: this node runs --insecure (reported at most once a minute)"
          : listener.endpoint + ": refused a client that offers no keys (a launcher or node run --insecure?): this node "
                                "runs with keys (reported at most once a minute)");
    }
    if (what == ZMQ_EVENT_ACCEPT_FAILED) {
      ++accept_failures;
      report_overload(listener.endpoint + ": cannot accept a connection: " + zmq_strerror(int(value)) +
                      (value == EMFILE || value == ENFILE ? " (out of file descriptors; raise ulimit -n)" : ""));
    }
  });
}

void bridge::impl::report(fault kind, peer_info from, std::string message, bool retrying) {
  if (kind != fault::send_failed) dropped.fetch_add(1, std::memory_order_relaxed);
  bridge_error e{kind, std::move(from), std::move(message), retrying};
  if (!on_error) {
    std::fprintf(stderr, "ringmaster bridge: %s: %s\n", fault_name(e.kind), e.message.c_str());
    return;
  }
  try {
    on_error(e);
  } catch (...) {
    // An error handler that throws must not take the bridge thread down with it.
  }
}

void bridge::impl::set_common_options(zmq::socket_t& s) {
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::sndhwm, opt.hwm);
  s.set(zmq::sockopt::rcvhwm, opt.hwm);
  // A forged size must not make ZeroMQ allocate more than the wire format allows.
  s.set(zmq::sockopt::maxmsgsize, int64_t(wire::kMaxPayloadBytes + wire::kHeaderSize));
  if (opt.kernel_buffer_bytes > 0) {
    s.set(zmq::sockopt::sndbuf, opt.kernel_buffer_bytes);
    s.set(zmq::sockopt::rcvbuf, opt.kernel_buffer_bytes);
  }
  // ZMTP heartbeats notice a dead peer even on an idle connection.
  s.set(zmq::sockopt::heartbeat_ivl, 1000);
  s.set(zmq::sockopt::heartbeat_timeout, int(opt.heartbeat_timeout.count()));
}

zap_handler::verdict bridge::impl::admit(const zap_handler::request& r) {
  // libzmq sends a connection's ACCEPTED event before its handshake asks us: the events since the loop
  // last looked are counted first, or a client over the limit could slip in (CI saw a third of 2 admitted).
  if (listen_monitor) serve_listen_monitor();
  if (r.null) {  // without keys (a socket with keys never asks for a NULL client): counted, not checked
    if (!opt.keys.empty()) return {"400", "not authorized"};
    return within_limit(r.address) ? zap_handler::verdict{"200", "OK"} : zap_handler::verdict{"500", "too many connections"};
  }
  return admit(r.key, r.address);
}

bool bridge::impl::accepted_here(int fd) const {
  // The fd came in a monitor event: it may have closed and been reused since. Only a TCP connection on
  // our listening port is touched (an outgoing connection of ours has another local port).
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (listen_port <= 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return false;
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&a)->sin_port) == listen_port;
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&a)->sin6_port) == listen_port;
  return false;
}

bool bridge::impl::within_limit(const std::string& address) {
  const int open = int(connection_address.size());
  if (opt.max_connections <= 0 || open <= opt.max_connections) return true;
  const int share = std::max(1, opt.max_connections / 4);
  int counted = 0;
  for (const auto& [from, n] : per_address) counted += from == address ? n : std::min(n, share);
  if (counted <= opt.max_connections) return true;
  ++overloaded_refusals;
  report_overload(listener.endpoint + ": " + std::to_string(open) + " connections, over the limit of " +
                  std::to_string(opt.max_connections) + ": refusing new clients");
  return false;
}

zap_handler::verdict bridge::impl::admit(const std::string& key, const std::string& address) {
  bool ok = false;
  try {
    ok = opt.authorize && opt.authorize(key);
  } catch (...) {
    ok = false;
  }
  if (!ok) {
    if (refused.size() >= kMaxRefusedKeys) refused.clear();
    if (refused.insert(key).second)
      report(fault::unauthorized, {}, "refused a client at " + address + ": its key " + key +
                                          " is not authorized (further attempts with this key are not logged)");
    return {"400", "not authorized"};
  }
  if (!within_limit(address)) return {"500", "too many connections"};  // not 400, which reads as "your key is refused"
  return {"200", "OK"};
}

void bridge::impl::serve_monitor(int id) {
  peers[size_t(id)].monitor->drain([this, id](uint16_t what, uint32_t value) {
    connection& c = peers[size_t(id)];
    if (what == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
      c.failed_handshakes = 0;
      c.handshook = c.connected = true;
      return;
    }
    if (what == ZMQ_EVENT_DISCONNECTED && std::exchange(c.connected, false)) return;  // a peer gone, or restarted
    peer_info from;
    from.peer = id;
    if (what == ZMQ_EVENT_CONNECTED) {
      if (!std::exchange(c.tcp_up, true) && c.refused >= 3)  // said unreachable before: no longer
        report(fault::unreachable, from, c.endpoint + " accepts connections now", false);
      return;
    }
    if (what == ZMQ_EVENT_CONNECT_RETRIED) {  // refused, or no route: is anything listening there?
      if (!c.tcp_up && ++c.refused == 3)
        report(fault::unreachable, from, c.endpoint + " accepts no connection (nothing listens there, or it cannot be reached)", true);
      return;
    }
    const bool keyed = !c.server_key.empty();
    if (c.failed_handshakes < 0) return;  // reported already
    // A peer that let us in before and now refuses us, or hangs up, or runs without keys, was started
    // again (a killed node back on its port, with another key or none): it is no longer in this job, which
    // is its launcher's to say (elastic jobs go on without it, and tell their user why it cannot rejoin).
    // Failing our side here would end the job for a loss it survives. Only "too many connections" is
    // still a handshake failure of ours.
    const bool changed = c.handshook && !(what == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH && value == 500);
    auto say = [&](const std::string& before, const std::string& after, bool retrying) {
      c.failed_handshakes = -1;
      if (changed) report(fault::peer_changed, from, c.endpoint + " let us in before, and now " + after, true);
      else report(fault::handshake_failed, from, c.endpoint + " " + before, retrying);
    };
    // libzmq does not try again after this: say it now. (Plain sockets have a monitor only with
    // watch_connects, a launcher's; a plain node meeting a node with keys is told so when its ring gives up.)
    if (what == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL && value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
      if (keyed) say("runs --insecure and we use keys: run both sides with --insecure, or neither", "runs without keys (--insecure)", false);
      else say("uses keys and we run --insecure: run both sides with --insecure, or neither", "uses keys now", false);
    } else if (what == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH && value == 500) {  // our ZAP handler's "too many"
      say("has too many connections open and refused ours", "", true);
    } else if (what == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
      // 400 is ZAP's "denied", what a node says of a key it does not know; another is worth naming.
      const std::string status = value == 400 ? "" : " (ZAP status " + std::to_string(value) + ")";
      say("refused our key" + status + ": add our key.pub to its authorized_keys (if it is there, the file may be refused: see the node's log)",
          "refuses our key" + status + ": its authorized_keys lacks it", false);
    } else if (!keyed && ++c.failed_handshakes == 3) {
      say("hangs up during the handshake: it uses keys and we run --insecure (run both sides with --insecure, or neither), or "
          "it is flooded with connections", "hangs up during the handshake: it uses keys now, or is flooded with connections", false);
    } else if (keyed && ++c.failed_handshakes == 3) {
      say("hangs up during the handshake: it does not hold the key we expect, it runs without keys (--insecure), or it is "
          "flooded with connections (far over its --max-connections)",
          "hangs up during the handshake: it holds another key than the one we know for it (a new key folder?), runs "
          "without keys (--insecure), or is flooded with connections", false);
    }
  });
}

bridge::bridge(bridge_options options) : d_(std::make_unique<impl>()) {
  d_->opt = std::move(options);
  if (d_->opt.name.empty()) d_->opt.name = default_name();
}

bridge::~bridge() { stop(); }

bool bridge::set_handler(message_handler h) {
  std::lock_guard<std::mutex> lock(d_->mu);
  if (d_->running || d_->thread.joinable()) return false;
  d_->on_message = std::move(h);
  return true;
}

bool bridge::set_error_handler(error_handler h) {
  std::lock_guard<std::mutex> lock(d_->mu);
  if (d_->running || d_->thread.joinable()) return false;
  d_->on_error = std::move(h);
  return true;
}

namespace {

// libzmq 4.3 unlinks whatever is at an ipc:// path before it binds: a file that is not a socket, or the
// socket of a daemon running now (which then serves no one). Bind only where nothing is, or where a
// socket is left over from a process that is gone (connecting to it is refused).
bool check_ipc_path(const std::string& path, std::string* error) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0)
    return errno == ENOENT ? true : fail(error, "ipc://" + path + ": " + std::strerror(errno));
  if (!S_ISSOCK(st.st_mode))
    return fail(error, "ipc://" + path + ": a file that is not a socket is there; it is left alone (choose another path)");
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.size() >= sizeof a.sun_path) return true;  // ZeroMQ says "File name too long"
  std::memcpy(a.sun_path, path.data(), path.size());
  // Not blocking: a listener whose queue is full (a stopped or wedged daemon) would hold connect() for ever.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return fail(error, std::string("socket: ") + std::strerror(errno));
  const bool live = ::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0 || errno == EAGAIN;
  const int err = errno;
  ::close(fd);
  if (live) return fail(error, "ipc://" + path + ": another process is listening there (stop it, or choose another path)");
  if (err != ECONNREFUSED && err != ENOENT) return fail(error, "ipc://" + path + ": " + std::strerror(err));  // ENOENT: gone since
  return true;
}

}  // namespace

bool bridge::start(const std::string& listen_endpoint, std::string* error) {
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    if (d_->running || d_->thread.joinable()) return fail(error, "bridge already started");
  }
  const bool keys = !d_->opt.keys.empty();
  if (keys && (!curve_available() || !is_key(d_->opt.keys.public_key) || !is_key(d_->opt.keys.secret_key)))
    return fail(error, curve_available() ? "bad key pair (Z85, 40 characters each)" : "this libzmq has no CurveZMQ; use --insecure");
  // A start that fails part way closes what it opened, every socket before the context (whose end waits
  // for its sockets), so the ports are free again and nothing hangs.
  auto undo = [this](std::string* error, const std::string& why) {
    d_->listen_monitor.reset();
    d_->listener.socket.reset();
    d_->zap.reset();
    d_->ctx.reset();
    if (d_->wake_fd >= 0) close(d_->wake_fd);
    d_->wake_fd = -1;
    std::lock_guard<std::mutex> lock(d_->mu);
    d_->endpoint.clear();
    d_->listener.endpoint.clear();
    return why.empty() ? false : fail(error, why);
  };
  try {
    d_->ctx = std::make_unique<zmq::context_t>(d_->opt.io_threads);
    if (!listen_endpoint.empty()) {
      // The handler first: a listener bound without one would let any key in. Without keys it only
      // counts clients against max_connections.
      d_->zap = std::make_unique<zap_handler>(*d_->ctx);
      d_->listener.socket = std::make_unique<zmq::socket_t>(*d_->ctx, zmq::socket_type::router);
      d_->set_common_options(*d_->listener.socket);
      // ZeroMQ takes IPv4 only unless told; told for every socket, it would name IPv4 ends ::ffff:a.b.c.d.
      if (listen_endpoint.find('[') != std::string::npos) d_->listener.socket->set(zmq::sockopt::ipv6, 1);
      if (keys) {
        d_->listener.socket->set(zmq::sockopt::curve_server, 1);
        d_->listener.socket->set(zmq::sockopt::curve_secretkey, d_->opt.keys.secret_key);
      }
      d_->listener.socket->set(zmq::sockopt::zap_domain, "ringmaster");
      // A stranger's half-open handshake holds a file descriptor: not for long. (It also counts towards
      // max_connections until then: libzmq's monitor cannot tell which connection finished its handshake.
      // Against a client from another address one address counts at most a quarter of the limit, so it
      // takes strangers on 4 hosts, each opening max_connections / 12 connections a second, to crowd
      // clients out.)
      d_->listener.socket->set(zmq::sockopt::handshake_ivl, 3000);
      d_->listen_monitor = socket_monitor::attach(*d_->ctx, *d_->listener.socket, "inproc://ringmaster-listener",
                                                  ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_ACCEPT_FAILED |
                                                      ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL);
      d_->listener.socket->set(zmq::sockopt::router_mandatory, 1);  // unroutable replies are errors, not silence
      d_->listener.socket->set(zmq::sockopt::router_handover, 1);   // a peer that reconnects keeps its identity
      const bool ipc_path = listen_endpoint.rfind("ipc://", 0) == 0 && listen_endpoint.size() > 6 && listen_endpoint[6] != '@';
      if (ipc_path && listen_endpoint != "ipc://*" && !check_ipc_path(listen_endpoint.substr(6), error)) return undo(nullptr, "");
      try {
        d_->listener.socket->bind(listen_endpoint);
      } catch (const zmq::error_t& e) {
        return undo(error, listen_endpoint + ": " + (e.num() == EADDRINUSE ? "address already in use" : e.what()));
      }
      d_->listener.routed = true;
      std::lock_guard<std::mutex> lock(d_->mu);
      d_->endpoint = d_->listener.socket->get(zmq::sockopt::last_endpoint);
      d_->listener.endpoint = d_->endpoint;
      if (ipc_path) ::lstat(d_->endpoint.c_str() + 6, &d_->ipc_file);  // its own path (ipc://*: one ZeroMQ chose)
      if (d_->endpoint.rfind("tcp://", 0) == 0) {  // ZeroMQ's own text: "tcp://HOST:PORT"
        const std::string port = d_->endpoint.substr(d_->endpoint.rfind(':') + 1);
        std::from_chars(port.data(), port.data() + port.size(), d_->listen_port);
      }
    }
  } catch (const zmq::error_t& e) {
    return undo(error, listen_endpoint + ": " + e.what());
  }
  d_->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (d_->wake_fd < 0) return undo(error, std::string("eventfd: ") + std::strerror(errno));
  d_->quit = false;
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    d_->running = true;
  }
  // The sockets move to the new thread; creating the thread is the memory barrier ZeroMQ asks for.
  try {
    d_->thread = std::thread([this] { d_->loop(); });
  } catch (const std::system_error& e) {  // no thread to be had (a process at its limit)
    {
      std::lock_guard<std::mutex> lock(d_->mu);
      d_->running = false;
    }
    return undo(error, std::string("cannot start the bridge's thread: ") + e.what());
  }
  return true;
}

void bridge::stop(std::chrono::milliseconds drain) {
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    if (!d_->running && !d_->thread.joinable()) return;
    d_->running = false;
  }
  d_->drain_ms.store(int(std::clamp<int64_t>(drain.count(), 0, 60000)), std::memory_order_release);
  d_->quit.store(true, std::memory_order_release);
  // stop() from a handler: the loop ends when the handler returns; a later stop() (or the destructor,
  // from another thread) joins.
  if (on_bridge_thread()) return;
  if (d_->thread.joinable()) {
    uint64_t one = 1;
    (void)!write(d_->wake_fd, &one, sizeof one);
    d_->thread.join();
  }
  d_->queue.clear();  // closures holding payloads that never went out
  d_->ctx.reset();    // after every socket closed: at once with linger 0, else once sent or drained
  // libzmq 4.3 leaves a bound ipc:// socket file behind. Ours goes; one another process has put there
  // since (after someone removed ours) stays, even on our inode number.
  const std::string& ep = d_->listener.endpoint;
  struct stat now {};
  if (ep.rfind("ipc://", 0) == 0 && ep.size() > 6 && ep[6] != '@' && ::lstat(ep.c_str() + 6, &now) == 0 &&
      now.st_ino == d_->ipc_file.st_ino && now.st_dev == d_->ipc_file.st_dev && S_ISSOCK(now.st_mode) &&
      now.st_ctim.tv_sec == d_->ipc_file.st_ctim.tv_sec && now.st_ctim.tv_nsec == d_->ipc_file.st_ctim.tv_nsec)  // inodes are reused
    ::unlink(ep.c_str() + 6);
  d_->ipc_file = {};
  d_->listener.endpoint.clear();
  if (d_->wake_fd >= 0) close(d_->wake_fd);
  d_->wake_fd = -1;
  d_->tid.store(std::thread::id());
}

bool bridge::running() const {
  std::lock_guard<std::mutex> lock(d_->mu);
  return d_->running;
}

std::string bridge::endpoint() const {
  std::lock_guard<std::mutex> lock(d_->mu);
  return d_->endpoint;
}

const std::string& bridge::name() const { return d_->opt.name; }

bool bridge::on_any_bridge_thread() { return t_bridge_thread; }

bool bridge::on_bridge_thread() const { return d_->tid.load() == std::this_thread::get_id(); }

uint64_t bridge::dropped() const { return d_->dropped.load(); }

bool bridge::post(std::function<void()> f) {
  if (on_bridge_thread() && !d_->queued_ahead()) {
    f();
    return true;
  }
  return d_->enqueue(std::move(f));
}

bool bridge::impl::enqueue(std::function<void()> f) {
  std::lock_guard<std::mutex> lock(mu);
  if (!running) return false;
  queue.push_back(std::move(f));
  if (!wake_pending) {  // one wake-up per batch of posts
    wake_pending = true;
    uint64_t one = 1;
    (void)!write(wake_fd, &one, sizeof one);
  }
  return true;
}

int bridge::connect(const std::string& endpoint, const std::string& server_key, std::string* error) {
  if (on_bridge_thread()) return d_->do_connect(endpoint, server_key, error);
  auto done = std::make_shared<std::promise<std::pair<int, std::string>>>();
  auto result = done->get_future();
  if (!post([this, endpoint, server_key, done] {
        std::string err;
        const int id = d_->do_connect(endpoint, server_key, &err);
        done->set_value({id, err});
      })) {
    fail(error, "bridge not running");
    return -1;
  }
  // The bridge thread runs queued work between polls; it never blocks, so this wait is short.
  if (result.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    fail(error, endpoint + ": bridge thread did not answer");
    return -1;
  }
  auto [id, err] = result.get();
  if (id < 0) fail(error, err);
  return id;
}

void bridge::disconnect(int peer) {
  post([this, peer] {
    if (peer >= 0 && size_t(peer) < d_->peers.size()) {
      d_->peers[peer].backlog.clear();
      d_->peers[peer].socket.reset();
      d_->peers[peer].monitor.reset();
    }
  });
}

void bridge::reconnect(int peer) {
  // Queued even on the bridge thread: a caller's handler may run while this connection's monitor is read.
  d_->enqueue([this, peer] {
    if (peer < 0 || size_t(peer) >= d_->peers.size() || !d_->peers[size_t(peer)].socket) return;
    d_->report_failed_sends(d_->peers[size_t(peer)], true);  // said before they go with the old socket
    connection& old = d_->peers[size_t(peer)];  // (a handler above may have connected more)
    connection fresh;
    std::string error;
    peer_info to;
    to.peer = peer;
    if (!d_->make_connection(old.endpoint, old.server_key, &fresh, &error))
      return d_->report(fault::send_failed, to, "connecting anew: " + error);
    fresh.handshook = old.handshook;  // a later refusal is still a peer that let us in before
    old = std::move(fresh);
  });
}

bool bridge::send(int peer, wire::header h, payload p, std::string* error) {
  h.payload_bytes = p.size;
  if (!wire::validate(h, error)) return false;
  if (on_bridge_thread() && !d_->queued_ahead()) {
    d_->do_send(peer, h, std::move(p));
    return true;
  }
  if (!post([this, peer, h, p = std::move(p)]() mutable { d_->do_send(peer, h, std::move(p)); }))
    return fail(error, "bridge not running");
  return true;
}

bool bridge::reply(const peer_info& to, wire::header h, payload p, std::string* error) {
  h.payload_bytes = p.size;
  if (!wire::validate(h, error)) return false;
  if (on_bridge_thread() && !d_->queued_ahead()) {
    d_->do_reply(to, h, std::move(p));
    return true;
  }
  if (!post([this, to, h, p = std::move(p)]() mutable { d_->do_reply(to, h, std::move(p)); }))
    return fail(error, "bridge not running");
  return true;
}

}  // namespace ringmaster::net
