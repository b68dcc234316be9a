// The bridge's messages: building, sending, receiving and checking them, and the poll loop of its thread.
#include <poll.h>
#include <unistd.h>

#include <cstring>

#include "net/bridge_impl.hpp"

namespace ringmaster::net {

void bridge::impl::build(const wire::header& h, payload& p, pending* out) {
  pending& m = *out;
  const wire::header_bytes hb = wire::encode(h);
  m.header = zmq::message_t(hb.data(), hb.size());
  if (p.size) {
    m.has_body = true;
    if (p.size < opt.copy_below || !p.owner) {
      m.body = zmq::message_t(p.data, p.size);
    } else {
      auto* hint = new std::shared_ptr<const void>(std::move(p.owner));
      m.body = zmq::message_t(const_cast<void*>(p.data), p.size, release_owner, hint);
    }
  }
}

int bridge::impl::try_send(zmq::socket_t& s, pending& m, bool routed) {
  const auto more = zmq::send_flags::dontwait | zmq::send_flags::sndmore;
  const auto last = zmq::send_flags::dontwait;
  try {
    if (routed) {
      if (!s.send(m.identity, more)) return 0;
      // Past the identity frame the message is committed; the rest cannot block.
      s.send(m.header, m.has_body ? more : last);
    } else if (!s.send(m.header, m.has_body ? more : last)) {
      return 0;
    }
    if (m.has_body) s.send(m.body, last);
    return 1;
  } catch (const zmq::error_t& e) {
    errno = e.num();
    return -1;
  }
}

void bridge::impl::send_now(connection& c, pending m, bool routed, const peer_info& to) {
  c.dirty = true;  // a send may consume the socket's notifications: look at it before sleeping
  if (routed) return hold_or_send(c, std::move(m), to);
  if (!c.backlog.empty()) {  // keep the order: behind what is already waiting
    c.backlog.push_back(std::move(m));
    return;
  }
  const int rc = try_send(*c.socket, m, routed);
  if (rc == 0) c.backlog.push_back(std::move(m));
  if (rc < 0) {
    const int err = errno;
    send_failed(c, to, "send to peer " + std::to_string(to.peer) + ": " +
                           (err == EHOSTUNREACH ? std::string("no such peer connected") : zmq_strerror(err)));
  }
}

// Behind the client's held replies, if it has any: each client's replies keep their order, and one that
// does not read (ZeroMQ's queue to it full) holds up only its own, up to the limits; later ones go.
void bridge::impl::hold_or_send(connection& c, pending m, const peer_info& to) {
  auto it = c.held.find(to.identity);
  if (it == c.held.end()) {
    const int rc = try_send(*c.socket, m, true);
    if (rc > 0) return;
    if (rc < 0) {
      const int err = errno;
      return send_failed(c, to, "reply to '" + printable(to.identity) + "': " +
                                    (err == EHOSTUNREACH ? std::string("no such peer connected") : zmq_strerror(err)));
    }
    it = c.held.emplace(to.identity, held_replies{}).first;
  }
  held_replies& h = it->second;
  const size_t bytes = bytes_of(m);
  if (h.queue.size() >= kMaxHeldReplies || h.bytes + bytes > kMaxHeldReplyBytes) {
    if (!h.dropping)
      report(fault::overloaded, to, "client '" + printable(to.identity) + "' does not take its replies: " +
                                        std::to_string(h.queue.size()) + " (" + std::to_string(h.bytes >> 20) +
                                        " MiB) held for it; later ones are dropped until it does");
    h.dropping = true;
    return;
  }
  h.bytes += bytes;
  h.queue.push_back(std::move(m));
}

void bridge::impl::flush_held(connection& c) {
  for (auto it = c.held.begin(); it != c.held.end();) {
    held_replies& h = it->second;
    int rc = 1;
    while (!h.queue.empty() && (rc = try_send(*c.socket, h.queue.front(), true)) > 0) {
      h.bytes -= bytes_of(h.queue.front());
      h.queue.pop_front();
    }
    if (rc < 0) {  // gone: its replies go, with one line
      const int err = errno;
      peer_info to;
      to.identity = it->first;
      send_failed(c, to, "replies held for '" + printable(it->first) + "': " +
                             (err == EHOSTUNREACH ? std::string("no such peer connected") : zmq_strerror(err)) + " (" +
                             std::to_string(h.queue.size()) + " dropped)");
      h.queue.clear();
    }
    it = h.queue.empty() ? c.held.erase(it) : std::next(it);
  }
}

void bridge::impl::flush(connection& c) {
  while (!c.backlog.empty()) {
    const int rc = try_send(*c.socket, c.backlog.front(), c.routed);
    if (rc == 0) return;
    if (rc < 0) send_failed(c, {}, std::string("queued send: ") + zmq_strerror(errno));
    c.backlog.pop_front();
  }
}

void bridge::impl::send_failed(connection& c, peer_info to, std::string message) {
  if (c.failed_sends.empty()) c.failed_since = std::chrono::steady_clock::now(), c.failed_serves = 0;
  c.failed_sends.push_back({fault::send_failed, std::move(to), std::move(message), false});
  c.dirty = true;
}

void bridge::impl::report_failed_sends(connection& c, bool drained) {
  if (c.failed_sends.empty()) return;
  // Behind a flood, kFailedSendWait and a serve that began after the failure (one whose slice a slow
  // handler took whole may not have read what came before it).
  if (!drained && (std::chrono::steady_clock::now() - c.failed_since < kFailedSendWait || c.failed_serves++ == 0)) return;
  c.failed_serves = 0;
  std::vector<bridge_error> failed;
  failed.swap(c.failed_sends);  // a handler may send, and fail, again
  for (bridge_error& e : failed) report(e.kind, std::move(e.from), std::move(e.message));
}

void bridge::impl::do_send(int peer, const wire::header& h, payload p) {
  peer_info to;
  to.peer = peer;
  if (peer < 0 || size_t(peer) >= peers.size() || !peers[peer].socket || peers[peer].routed) {
    report(fault::send_failed, to, "send to unknown or closed peer " + std::to_string(peer));
    return;
  }
  pending m;
  build(h, p, &m);
  send_now(peers[peer], std::move(m), false, to);
}

void bridge::impl::do_reply(const peer_info& to, const wire::header& h, payload p) {
  if (to.peer >= 0) return do_send(to.peer, h, std::move(p));
  if (!listener.socket) return report(fault::send_failed, to, "reply by identity without a listening socket");
  pending m;
  build(h, p, &m);
  m.identity = zmq::message_t(to.identity.data(), to.identity.size());
  send_now(listener, std::move(m), true, to);
}

int bridge::impl::do_connect(const std::string& ep, const std::string& server_key, std::string* error) {
  connection c;
  if (!make_connection(ep, server_key, &c, error)) return -1;
  peers.push_back(std::move(c));
  return int(peers.size() - 1);
}

bool bridge::impl::make_connection(const std::string& ep, const std::string& server_key, connection* out, std::string* error) {
  if (!opt.keys.empty() && !is_key(server_key))
    return fail(error, ep + ": no public key for it (links are encrypted; give its key, or --insecure on both sides)");
  try {
    connection c;
    c.socket = std::make_unique<zmq::socket_t>(*ctx, zmq::socket_type::dealer);
    zmq::socket_t& s = *c.socket;
    set_common_options(s);
    if (ep.find('[') != std::string::npos) s.set(zmq::sockopt::ipv6, 1);  // tcp://[::1]:P
    s.set(zmq::sockopt::routing_id, opt.connection_ids ? opt.name.substr(0, 230) + ":" + random_hex64() : opt.name);
    if (!opt.keys.empty()) {
      s.set(zmq::sockopt::curve_serverkey, server_key);
      s.set(zmq::sockopt::curve_publickey, opt.keys.public_key);
      s.set(zmq::sockopt::curve_secretkey, opt.keys.secret_key);
      c.server_key = server_key;
    }
    // Why a handshake fails is known only to the socket's monitor: a refused key must not look like a
    // node that is not running, nor a port nothing listens on like a node that holds another key.
    if (!opt.keys.empty() || opt.watch_connects) {
      const std::string mon = "inproc://ringmaster-monitor-" + std::to_string(monitors++);
      const int events = ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                         ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                         ZMQ_EVENT_DISCONNECTED | (opt.watch_connects ? ZMQ_EVENT_CONNECTED | ZMQ_EVENT_CONNECT_RETRIED : 0);
      c.monitor = socket_monitor::attach(*ctx, s, mon, events);
    }
    // No ZMQ_IMMEDIATE: a hello sent before the peer has bound waits in the queue and goes out when the
    // (automatic, repeated) connection succeeds, so start-up order does not matter.
    s.connect(ep);
    c.fd = s.get(zmq::sockopt::fd);
    c.endpoint = ep;
    *out = std::move(c);
    return true;
  } catch (const zmq::error_t& e) {
    return fail(error, ep + ": " + e.what());
  }
}

bool bridge::impl::receive_one(connection& c, int peer) {
  zmq::socket_t& s = *c.socket;
  const bool routed = c.routed;
  std::vector<zmq::message_t> parts;
  size_t count = 0;
  for (;;) {
    zmq::message_t m;
    try {
      if (!s.recv(m, count == 0 ? zmq::recv_flags::dontwait : zmq::recv_flags::none)) return false;
    } catch (const zmq::error_t&) {
      return false;
    }
    const bool more = m.more();
    if (++count <= 4) parts.push_back(std::move(m));  // anything longer is dropped anyway
    if (!more) break;
  }
  peer_info from;
  from.peer = routed ? -1 : peer;
  size_t first = 0;
  if (routed) {
    from.identity.assign(parts[0].data<char>(), parts[0].size());
    first = 1;
    // The key the client proved it holds (our ZAP handler made it the User-Id); absent without keys.
    if (!opt.keys.empty() && parts.size() > 1)
      if (const char* user = zmq_msg_gets(parts[1].handle(), "User-Id")) from.key = user;
  } else {
    from.key = c.server_key;
  }
  const size_t frames = count - first;
  wire::frame f[2];
  for (size_t i = 0; i < frames && i < 2; ++i) f[i] = {parts[first + i].data(), parts[first + i].size()};
  wire::header h;
  std::string err;
  switch (wire::check_message(f, frames, &h, &err)) {
    case wire::verdict::accept:
      break;
    case wire::verdict::answer_version: {
      wire::header e;
      e.type = wire::msg_type::error;
      do_reply(from, e, payload::copy_of(err));
      report(fault::version_mismatch, from, err);
      return true;
    }
    case wire::verdict::other_version:
      report(fault::version_mismatch, from, err);
      return true;
    case wire::verdict::malformed:
      report(fault::malformed, from, err);
      return true;
  }
  payload p;
  if (frames == 2) {
    auto body = std::make_shared<zmq::message_t>(std::move(parts[first + 1]));
    p.data = body->data();
    p.size = body->size();
    p.owner = std::move(body);
  }
  // ZeroMQ packs small received messages into a shared buffer at any offset; floats must be aligned
  // (on x86 a misaligned load happens to work, but it is undefined behaviour and breaks elsewhere).
  if (wire::is_tensor_type(h.type) && reinterpret_cast<uintptr_t>(p.data) % alignof(float) != 0) {
    auto copy = std::make_shared<std::vector<float>>(p.size / sizeof(float));
    std::memcpy(copy->data(), p.data, p.size);
    p = payload::of(std::move(copy));
  }
  if (!on_message) return true;
  try {
    on_message(from, h, std::move(p));
  } catch (const std::exception& e) {
    report(fault::handler_failed, from, e.what());
  } catch (...) {
    report(fault::handler_failed, from, "unknown exception");
  }
  return true;
}

bool bridge::impl::queued_ahead() {
  std::lock_guard<std::mutex> lock(mu);
  return !queue.empty();
}

void bridge::impl::run_queue() {
  for (int n = 0;; ++n) {
    std::function<void()> f;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (queue.empty()) {
        wake_pending = false;
        return;
      }
      if (n == 4096) {  // come back after a poll (wake_pending stays set: posters need not write)
        uint64_t one = 1;
        (void)!write(wake_fd, &one, sizeof one);
        return;
      }
      f = std::move(queue.front());
      queue.pop_front();
    }
    f();
  }
}

connection* bridge::impl::conn(int id) {
  connection* c = id < 0 ? &listener : &peers[size_t(id)];
  return c->socket ? c : nullptr;
}

void bridge::impl::serve(int id) {
  connection* c = conn(id);
  if (!c) return;
  c->dirty = false;
  if (!c->backlog.empty()) flush(*c);
  if (!c->held.empty()) flush_held(*c);
  // At most 64 messages or a slice of time, then the other connections get their turn: a launcher whose
  // handler took 150 ms for each 16 MB piece of one node's weights read 64 of them (10 s) before the
  // other nodes' heartbeats, and took those nodes for lost.
  const auto until = std::chrono::steady_clock::now() + kServeSlice;
  bool drained = false;
  for (int n = 0; n < 64 && (n == 0 || std::chrono::steady_clock::now() < until); ++n) {
    c = conn(id);  // a handler may have disconnected it (and may have connected more: c moved)
    if (!c || !receive_one(*c, id)) {
      drained = true;
      break;
    }
  }
  if (!(c = conn(id))) return;  // disconnected: what failed on it is moot
  if (!drained) c->dirty = true;
  report_failed_sends(*c, drained);
}

void bridge::impl::loop() {
  tid.store(std::this_thread::get_id());
  t_bridge_thread = true;
  std::vector<pollfd> fds;
  // Connection of fds[i]: -1 the listener, >= 0 a peer, -2 the wake-up fd, -3 the ZAP handler,
  // <= kMonitorBase - p peer p's monitor.
  constexpr int kMonitorBase = -4;
  std::vector<int> ids;
  if (listener.socket) listener.fd = listener.socket->get(zmq::sockopt::fd);
  while (!quit.load(std::memory_order_acquire)) {
    bool busy = false;
    // Served every pass (each is a few failing non-blocking reads): their ZMQ_FDs, like the sockets',
    // announce only changes, which a pass may have consumed.
    if (listen_monitor) serve_listen_monitor();
    if (zap) zap->serve([this](const zap_handler::request& r) { return admit(r); });
    for (int id = 0; id < int(peers.size()); ++id)
      if (peers[size_t(id)].monitor) serve_monitor(id);
    for (int id = -1; id < int(peers.size()); ++id) {
      connection* c = conn(id);
      if (c && (c->dirty || c->waiting())) serve(id);
    }
    // Apart: a later connection's handler may have sent on an earlier one (a reply through the listener).
    for (int id = -1; id < int(peers.size()); ++id) {
      const connection* c = conn(id);
      busy |= c && (c->dirty || c->waiting());
    }
    fds.clear();
    ids.clear();
    fds.push_back({wake_fd, POLLIN, 0});
    ids.push_back(-2);
    if (zap) {
      fds.push_back({zap->fd(), POLLIN, 0});
      ids.push_back(-3);
    }
    if (listen_monitor) {
      fds.push_back({listen_monitor->fd(), POLLIN, 0});
      ids.push_back(-3);
    }
    for (int id = 0; id < int(peers.size()); ++id)
      if (peers[size_t(id)].monitor) {
        fds.push_back({peers[size_t(id)].monitor->fd(), POLLIN, 0});
        ids.push_back(kMonitorBase - id);
      }
    for (int id = -1; id < int(peers.size()); ++id)
      if (connection* c = conn(id)) {
        fds.push_back({c->fd, POLLIN, 0});
        ids.push_back(id);
      }
    // A backlog waits for ZeroMQ to make room: check back soon rather than trust a notification.
    const bool backlog_only = busy && [&] {
      for (int id = -1; id < int(peers.size()); ++id)
        if (connection* c = conn(id); c && c->dirty) return false;
      return true;
    }();
    int timeout = busy ? (backlog_only ? 1 : 0) : -1;
    int rc = 0;
    if (timeout != 0 && opt.spin.count() > 0) {
      const auto until = std::chrono::steady_clock::now() + opt.spin;
      do rc = ::poll(fds.data(), fds.size(), 0);
      while (rc == 0 && std::chrono::steady_clock::now() < until);
    }
    if (rc == 0) rc = ::poll(fds.data(), fds.size(), timeout);
    if (rc < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      if (ids[i] == -2) {
        uint64_t n;
        (void)!read(wake_fd, &n, sizeof n);
        run_queue();
      } else if (ids[i] <= -3) {
        // The ZAP handler and monitors are served at the top of the loop.
      } else if (connection* c = conn(ids[i])) {
        c->dirty = true;
      }
    }
  }
  {
    // Also when poll() failed for good: later calls must fail rather than queue work for nobody.
    std::lock_guard<std::mutex> lock(mu);
    running = false;
  }
  // Close every socket here, on their own thread; linger 0 drops what is unsent. A drain sends what
  // is queued first, and lets the context's end wait that long for ZeroMQ to deliver it.
  if (const int drain = drain_ms.load(std::memory_order_acquire); drain > 0) {
    run_queue();
    for (connection& c : peers)
      if (c.socket) c.socket->set(zmq::sockopt::linger, drain);
    if (listener.socket) listener.socket->set(zmq::sockopt::linger, drain);
  }
  listener.backlog.clear();
  listener.held.clear();
  listener.socket.reset();
  for (connection& c : peers) {
    c.socket.reset();
    c.monitor.reset();
  }
  peers.clear();
  listen_monitor.reset();
  zap.reset();
}

}  // namespace ringmaster::net
