#include "net/bridge.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <future>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <zmq.hpp>

#include "net/curve.hpp"
#include "net/seal.hpp"

namespace ringmaster::net {
namespace {

thread_local bool t_bridge_thread = false;

// A message built and waiting for its socket to accept it (high-water mark reached).
struct pending {
  zmq::message_t identity;  // ROUTER only
  zmq::message_t header;
  zmq::message_t body;
  zmq::message_t trailer;  // sealed connections (net/seal.hpp)
  bool has_body = false, has_trailer = false;
};

struct connection {
  std::unique_ptr<zmq::socket_t> socket;  // null once disconnected
  std::string endpoint;
  std::deque<pending> backlog;
  int fd = -1;         // ZMQ_FD: readable when the socket has news for us
  bool dirty = true;   // used since last drained: may hold messages ZMQ_FD will not announce again
  // With keys (connections only): the server's key, and a monitor telling us why a handshake failed.
  std::string server_key;
  std::unique_ptr<socket_monitor> monitor;
  int failed_handshakes = 0;  // since the last one that succeeded; reported once
  bool routed = false;           // a listening ROUTER: messages carry the client's routing id first
  std::shared_ptr<sealer> seal;  // a sealed connection: every message sent is sealed with it
};

// A pair whose sealed messages our sealed listener takes, and the node key they prove.
struct sealed_pair {
  std::shared_ptr<opener> open;
  std::string who;
};

constexpr size_t kMaxRefusedKeys = 1024;  // remembered to report each stranger once, bounded

std::string default_name() {
  char host[256] = "host";
  gethostname(host, sizeof host - 1);
  std::random_device rd;
  char b[320];
  std::snprintf(b, sizeof b, "%s:%d:%08x%08x", host, int(getpid()), rd(), rd());
  return b;
}

void release_owner(void*, void* hint) { delete static_cast<std::shared_ptr<const void>*>(hint); }

bool fail(std::string* error, std::string what) {
  if (error) *error = std::move(what);
  return false;
}

}  // namespace

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
  }
  return "fault";
}

struct bridge::impl {
  bridge_options opt;
  message_handler on_message;
  error_handler on_error;

  // Shared with other threads, under mu.
  mutable std::mutex mu;
  bool running = false;
  bool wake_pending = false;
  std::deque<std::function<void()>> queue;
  std::string endpoint;

  std::atomic<std::thread::id> tid{};
  std::atomic<uint64_t> dropped{0};
  std::atomic<bool> quit{false};
  int wake_fd = -1;
  std::thread thread;

  // Bridge thread only (created in start() before the thread exists).
  std::unique_ptr<zmq::context_t> ctx;
  connection listener;  // the ROUTER; socket null without a listen endpoint
  std::vector<connection> peers;
  std::unique_ptr<zap_handler> zap;  // with keys and a listening socket
  // opt.sealed_listener: the plain ROUTER taking sealed messages (an entry of peers, so that it is
  // polled and served like one), its port, and the pairs it takes messages from.
  int sealed_listener = -1;
  int sealed_port = 0;
  std::unique_ptr<socket_monitor> sealed_monitor;  // its connections open now
  int sealed_connections = 0;
  std::map<std::pair<uint64_t, uint32_t>, sealed_pair> openers;
  std::set<std::string> refused;  // client keys already reported as refused
  int monitors = 0;               // monitors made so far: each gets its own inproc name
  // The listener's monitor (with keys): connections open now, and failures to accept one.
  std::unique_ptr<socket_monitor> listen_monitor;
  int open_connections = 0;
  uint64_t accept_failures = 0, overloaded_refusals = 0;
  std::chrono::steady_clock::time_point last_overload_report{};

  // At most one overload report a minute, saying how often it happened since the last one.
  void report_overload(const std::string& what) {
    const auto now = std::chrono::steady_clock::now();
    if (last_overload_report != std::chrono::steady_clock::time_point{} && now - last_overload_report < std::chrono::minutes(1))
      return;
    last_overload_report = now;
    report(fault::overloaded, {}, what + " (" + std::to_string(accept_failures) + " failed accepts, " +
                                      std::to_string(overloaded_refusals) + " clients refused so far; reported at most once a minute)");
  }

  // ACCEPTED and DISCONNECTED keep the count of open connections; ACCEPT_FAILED is a lack of file
  // descriptors (libzmq retries the accept at once, in its I/O thread, until one is free: we can only
  // say so, once, and refuse clients at the handshake so that their connections close).
  void serve_listen_monitor() {
    listen_monitor->drain([this](uint16_t what, uint32_t value) {
      if (what == ZMQ_EVENT_ACCEPTED) ++open_connections;
      if (what == ZMQ_EVENT_DISCONNECTED && open_connections > 0) --open_connections;
      if (what == ZMQ_EVENT_ACCEPT_FAILED) {
        ++accept_failures;
        report_overload(listener.endpoint + ": cannot accept a connection: " + zmq_strerror(int(value)) +
                        (value == EMFILE || value == ENFILE ? " (out of file descriptors; raise ulimit -n)" : ""));
      }
    });
  }

  void report(fault kind, peer_info from, std::string message) {
    if (kind != fault::send_failed) dropped.fetch_add(1, std::memory_order_relaxed);
    bridge_error e{kind, std::move(from), std::move(message)};
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

  void set_common_options(zmq::socket_t& s) {
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
    s.set(zmq::sockopt::heartbeat_timeout, 3000);
  }

  // With a sealer, the payload is encrypted into a new frame (it would be copied by CurveZMQ anyway) and a
  // trailer frame follows. False if sealing failed.
  bool build(const wire::header& h, payload& p, sealer* seal, pending* out) {
    pending& m = *out;
    const wire::header_bytes hb = wire::encode(h);
    m.header = zmq::message_t(hb.data(), hb.size());
    if (seal) {
      m.has_body = p.size > 0;
      if (m.has_body) m.body = zmq::message_t(p.size);
      m.trailer = zmq::message_t(kTrailerBytes);
      m.has_trailer = true;
      return seal->seal(hb.data(), hb.size(), p.data, m.has_body ? m.body.data() : nullptr, p.size,
                        static_cast<unsigned char*>(m.trailer.data()));
    }
    if (p.size) {
      m.has_body = true;
      if (p.size < opt.copy_below || !p.owner) {
        m.body = zmq::message_t(p.data, p.size);
      } else {
        auto* hint = new std::shared_ptr<const void>(std::move(p.owner));
        m.body = zmq::message_t(const_cast<void*>(p.data), p.size, release_owner, hint);
      }
    }
    return true;
  }

  // One non-blocking attempt. ZeroMQ takes a multipart message whole or not at all (the high-water mark
  // is checked on the first frame), so EAGAIN on the first frame leaves nothing half-sent.
  // Returns 1 sent, 0 would block, -1 failed (errno).
  static int try_send(zmq::socket_t& s, pending& m, bool routed) {
    const auto more = zmq::send_flags::dontwait | zmq::send_flags::sndmore;
    const auto last = zmq::send_flags::dontwait;
    try {
      if (routed) {
        if (!s.send(m.identity, more)) return 0;
        // Past the identity frame the message is committed; the rest cannot block.
        s.send(m.header, m.has_body || m.has_trailer ? more : last);
      } else if (!s.send(m.header, m.has_body || m.has_trailer ? more : last)) {
        return 0;
      }
      if (m.has_body) s.send(m.body, m.has_trailer ? more : last);
      if (m.has_trailer) s.send(m.trailer, last);
      return 1;
    } catch (const zmq::error_t& e) {
      errno = e.num();
      return -1;
    }
  }

  void send_now(connection& c, pending m, bool routed, const peer_info& to) {
    c.dirty = true;  // a send may consume the socket's notifications: look at it before sleeping
    if (!c.backlog.empty()) {  // keep the order: behind what is already waiting
      c.backlog.push_back(std::move(m));
      return;
    }
    const int rc = try_send(*c.socket, m, routed);
    if (rc == 0) c.backlog.push_back(std::move(m));
    if (rc < 0) {
      const int err = errno;
      report(fault::send_failed, to,
             (routed ? "reply to '" + to.identity + "'" : "send to peer " + std::to_string(to.peer)) + ": " +
                 (err == EHOSTUNREACH ? std::string("no such peer connected") : zmq_strerror(err)));
    }
  }

  void flush(zmq::socket_t& s, std::deque<pending>& backlog, bool routed) {
    while (!backlog.empty()) {
      const int rc = try_send(s, backlog.front(), routed);
      if (rc == 0) return;
      if (rc < 0) report(fault::send_failed, {}, std::string("queued send: ") + zmq_strerror(errno));
      backlog.pop_front();
    }
  }

  void do_send(int peer, const wire::header& h, payload p) {
    peer_info to;
    to.peer = peer;
    if (peer < 0 || size_t(peer) >= peers.size() || !peers[peer].socket || peers[peer].routed) {
      report(fault::send_failed, to, "send to unknown or closed peer " + std::to_string(peer));
      return;
    }
    if (peers[peer].seal && p.size > kMaxSealedPayload)
      return report(fault::send_failed, to, "a sealed message of " + std::to_string(p.size) + " bytes, over the sealed port's " +
                                                std::to_string(kMaxSealedPayload));
    pending m;
    if (!build(h, p, peers[peer].seal.get(), &m)) return report(fault::send_failed, to, "sealing a message failed");
    send_now(peers[peer], std::move(m), false, to);
  }

  void do_reply(const peer_info& to, const wire::header& h, payload p) {
    if (to.peer >= 0) return do_send(to.peer, h, std::move(p));
    if (!listener.socket) return report(fault::send_failed, to, "reply by identity without a listening socket");
    pending m;
    build(h, p, nullptr, &m);
    m.identity = zmq::message_t(to.identity.data(), to.identity.size());
    send_now(listener, std::move(m), true, to);
  }

  int do_connect(const std::string& ep, const std::string& server_key, std::shared_ptr<sealer> seal,
                 std::string* error) {
    if (!seal && !opt.keys.empty() && !is_key(server_key)) {
      fail(error, ep + ": no public key for it (links are encrypted; give its key, or --insecure on both sides)");
      return -1;
    }
    try {
      connection c;
      c.socket = std::make_unique<zmq::socket_t>(*ctx, zmq::socket_type::dealer);
      zmq::socket_t& s = *c.socket;
      set_common_options(s);
      if (seal) {  // plain ZeroMQ: the messages are sealed, and a routing id on it would prove nothing
        s.set(zmq::sockopt::plain_username, seal->user());
        s.set(zmq::sockopt::plain_password, seal->token());
        s.set(zmq::sockopt::maxmsgsize, int64_t(64));  // nothing is meant to come back: little may
        s.set(zmq::sockopt::rcvhwm, 16);
        c.seal = std::move(seal);
      } else {
        s.set(zmq::sockopt::routing_id, opt.name);
      }
      if (!opt.keys.empty()) {
        if (!c.seal) {
          s.set(zmq::sockopt::curve_serverkey, server_key);
          s.set(zmq::sockopt::curve_publickey, opt.keys.public_key);
          s.set(zmq::sockopt::curve_secretkey, opt.keys.secret_key);
          c.server_key = server_key;
        }
        // Why a handshake fails is known only to the socket's monitor: a refused key must not look like
        // a node that is not running.
        const std::string mon = "inproc://ringmaster-monitor-" + std::to_string(monitors++);
        const int events = ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                           ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                           ZMQ_EVENT_DISCONNECTED;
        c.monitor = socket_monitor::attach(*ctx, s, mon, events);
      }
      // No ZMQ_IMMEDIATE: a hello sent before the peer has bound waits in the queue and goes out when the
      // (automatic, repeated) connection succeeds, so start-up order does not matter.
      s.connect(ep);
      c.fd = s.get(zmq::sockopt::fd);
      c.endpoint = ep;
      peers.push_back(std::move(c));
      return int(peers.size() - 1);
    } catch (const zmq::error_t& e) {
      fail(error, ep + ": " + e.what());
      return -1;
    }
  }

  zap_handler::verdict admit(const zap_handler::request& r) {
    return r.sealed_port ? admit_sealed(r.user, r.password, r.address) : admit(r.key, r.address);
  }

  // A client of the sealed listener logs in as a pair we expect ("JOB:SENDER") with its token.
  zap_handler::verdict admit_sealed(const std::string& user, const std::string& token, const std::string& address) {
    const char* p = user.data();
    const char* end = p + user.size();
    uint64_t job = 0;
    uint32_t sender = 0;
    auto r = std::from_chars(p, end, job);
    const bool ok = r.ec == std::errc() && r.ptr != end && *r.ptr == ':' &&
                    (r = std::from_chars(r.ptr + 1, end, sender)).ec == std::errc() && r.ptr == end;
    auto it = ok ? openers.find({job, sender}) : openers.end();
    if (it == openers.end() || !it->second.open->admits(token)) {
      if (refused.size() < kMaxRefusedKeys && refused.insert("sealed " + address).second)
        report(fault::unauthorized, {}, "refused a client at " + address + " on the sealed port: it is no node of a job "
                                        "here (further attempts from this address are not logged)");
      return {"400", "not authorized"};
    }
    if (opt.max_connections > 0 && sealed_connections > opt.max_connections) {
      ++overloaded_refusals;
      report_overload("sealed port " + std::to_string(sealed_port) + ": " + std::to_string(sealed_connections) +
                      " connections, over the limit of " + std::to_string(opt.max_connections) + ": refusing new ones");
      return {"500", "too many connections"};
    }
    return {"200", "OK"};
  }

  // Who may finish a handshake on our listening socket: a client whose key opt.authorize accepts,
  // while there is room.
  zap_handler::verdict admit(const std::string& key, const std::string& address) {
    bool ok = false;
    try {
      ok = opt.authorize && opt.authorize(key);
    } catch (...) {
      ok = false;
    }
    if (!ok) {
      if (refused.size() < kMaxRefusedKeys && refused.insert(key).second)
        report(fault::unauthorized, {}, "refused a client at " + address + ": its key " + key +
                                            " is not authorized (further attempts with this key are not logged)");
      return {"400", "not authorized"};
    }
    if (opt.max_connections > 0 && open_connections > opt.max_connections) {
      ++overloaded_refusals;
      report_overload(listener.endpoint + ": " + std::to_string(open_connections) + " connections, over the limit of " +
                      std::to_string(opt.max_connections) + ": refusing new clients");
      return {"500", "too many connections"};  // not 400, which reads as "your key is refused"
    }
    return {"200", "OK"};
  }

  // A connection's handshake news: a server that refuses our key says so (ZAP status 400); one that
  // cannot read our hello (it holds another key, or runs without keys) just hangs up, again and again.
  void serve_monitor(int id) {
    peers[size_t(id)].monitor->drain([this, id](uint16_t what, uint32_t value) {
      connection& c = peers[size_t(id)];
      if (what == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
        c.failed_handshakes = 0;
        return;
      }
      if (c.failed_handshakes < 0) return;  // reported already
      peer_info from;
      from.peer = id;
      if (what == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH && value == 500) {  // our ZAP handler's "too many"
        c.failed_handshakes = -1;
        report(fault::handshake_failed, from, c.endpoint + " has too many connections open and refused ours");
      } else if (what == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH && c.seal) {
        c.failed_handshakes = -1;
        report(fault::handshake_failed, from, c.endpoint + " (a sealed port) refused our login (status " +
                                                  std::to_string(value) + "): it does not expect us in this job");
      } else if (what == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
        c.failed_handshakes = -1;
        report(fault::handshake_failed, from, c.endpoint + " refused our key (status " + std::to_string(value) +
                                                  "): add our key.pub to its authorized_keys");
      } else if (++c.failed_handshakes == 3) {
        c.failed_handshakes = -1;
        report(fault::handshake_failed, from, c.endpoint + " hangs up during the handshake: it does not hold the key "
                                                  "we expect, or it runs without keys (--insecure)");
      }
    });
  }

  // A message on the sealed listener: [identity] header [payload] trailer. Finds the pair from the trailer,
  // checks the tag and the counter and decrypts the payload in place; from->key becomes the node key the
  // pair's key proves.
  bool open_sealed(std::vector<zmq::message_t>& parts, size_t count, peer_info* from, std::string* error) {
    if (count < 3 || count > 4) return fail(error, std::to_string(count - 1) + " frames, expected 2 or 3");
    trailer t;
    zmq::message_t& last = parts[count - 1];
    if (!read_trailer(last.data(), last.size(), &t)) return fail(error, "no trailer");
    if (parts[1].size() != wire::kHeaderSize) return fail(error, "a header of " + std::to_string(parts[1].size()) + " bytes");
    auto it = openers.find({t.job, t.sender});
    if (it == openers.end())
      return fail(error, "from node " + std::to_string(t.sender) + " of job " + std::to_string(t.job) + ", which we do not expect");
    zmq::message_t* body = count == 4 ? &parts[2] : nullptr;
    if (!it->second.open->open(parts[1].data(), parts[1].size(), body ? body->data() : nullptr, body ? body->size() : 0,
                               last.data(), error))
      return false;
    from->key = it->second.who;
    from->sealed = true;
    from->sealed_sender = int(t.sender);
    return true;
  }

  // The sealed listener: plain ZeroMQ on opt.sealed_port (or an ephemeral port) of the listener's address.
  // An ephemeral one that cannot be bound is done without: peers send over CurveZMQ, slower but as safe.
  // False with *error only when the port asked for cannot be bound.
  bool bind_sealed_listener(std::string* error) {
    const std::string ep = listener.endpoint;
    const size_t colon = ep.rfind(':');
    connection c;
    c.socket = std::make_unique<zmq::socket_t>(*ctx, zmq::socket_type::router);
    set_common_options(*c.socket);
    c.socket->set(zmq::sockopt::maxmsgsize, int64_t(kMaxSealedPayload));  // sealed payloads are ring segments
    c.socket->set(zmq::sockopt::handshake_ivl, 3000);
    // Clients log in (PLAIN) with a pair's token through the ZAP handler, which also holds them to
    // max_connections. Few messages queued per connection: a sender waits for us, as TCP would make it.
    c.socket->set(zmq::sockopt::plain_server, 1);
    c.socket->set(zmq::sockopt::zap_domain, zap_handler::kSealedDomain);
    c.socket->set(zmq::sockopt::rcvhwm, 64);
    const std::string at = ep.substr(0, colon + 1) + std::to_string(opt.sealed_port);
    try {
      c.socket->bind(at);
    } catch (const zmq::error_t& e) {
      if (opt.sealed_port == 0) return true;
      return fail(error, at + " (the sealed port): " + (e.num() == EADDRINUSE ? std::string("address already in use") : e.what()));
    }
    sealed_monitor = socket_monitor::attach(*ctx, *c.socket, "inproc://ringmaster-sealed-listener",
                                            ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED);
    c.endpoint = c.socket->get(zmq::sockopt::last_endpoint);
    c.routed = true;
    sealed_port = std::atoi(c.endpoint.substr(c.endpoint.rfind(':') + 1).c_str());
    c.fd = c.socket->get(zmq::sockopt::fd);
    peers.push_back(std::move(c));
    sealed_listener = int(peers.size() - 1);
    return true;
  }

  // Reads one whole multipart message. Returns false when nothing is waiting.
  bool receive_one(connection& c, int peer) {
    zmq::socket_t& s = *c.socket;
    const bool routed = c.routed;
    const bool sealed = peer >= 0 && peer == sealed_listener;
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
    if (c.seal) {  // a sealed connection only sends: whatever its server says is not to be trusted
      dropped.fetch_add(1);
      return true;
    }
    peer_info from;
    from.peer = routed ? -1 : peer;
    size_t first = 0;
    if (routed) {
      from.identity.assign(parts[0].data<char>(), parts[0].size());
      first = 1;
      // The key the client proved it holds (our ZAP handler made it the User-Id); absent without keys.
      if (!sealed && !opt.keys.empty() && parts.size() > 1)
        if (const char* user = zmq_msg_gets(parts[1].handle(), "User-Id")) from.key = user;
    } else {
      from.key = c.server_key;
    }
    size_t frames = count - first;
    if (sealed) {  // nothing unauthenticated goes further than the trailer
      std::string err;
      if (!open_sealed(parts, count, &from, &err)) {
        report(fault::malformed, from, "sealed message: " + err);
        return true;
      }
      --frames;
    }
    wire::frame f[2];
    for (size_t i = 0; i < frames && i < 2; ++i) f[i] = {parts[first + i].data(), parts[first + i].size()};
    wire::header h;
    std::string err;
    switch (wire::check_message(f, frames, &h, &err)) {
      case wire::verdict::accept:
        break;
      case wire::verdict::answer_version: {
        if (sealed) {  // answers go out on the listener: not to a sealed connection
          report(fault::version_mismatch, from, err);
          return true;
        }
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

  // Work other threads queued and the bridge thread has not run yet. What the bridge thread itself sends
  // then goes behind it, so sends to one peer leave in the order they were made, whichever thread made
  // them (a ring's rounds depend on it).
  bool queued_ahead() {
    std::lock_guard<std::mutex> lock(mu);
    return !queue.empty();
  }

  // One item at a time, so that what is still queued stays visible to queued_ahead() while an item runs.
  // A bounded batch: sockets are polled again in between, however fast other threads post.
  void run_queue() {
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

  connection* conn(int id) {
    connection* c = id < 0 ? &listener : &peers[size_t(id)];
    return c->socket ? c : nullptr;
  }

  // Sends what waits and reads what has come, a bounded batch so one busy peer cannot starve the
  // others. Leaves the connection dirty if it stopped early, so the loop comes back without sleeping.
  void serve(int id) {
    connection* c = conn(id);
    if (!c) return;
    c->dirty = false;
    if (!c->backlog.empty()) flush(*c->socket, c->backlog, c->routed);
    for (int n = 0; n < 64; ++n) {
      c = conn(id);  // a handler may have disconnected it
      if (!c || !receive_one(*c, id)) return;
    }
    c->dirty = true;
  }

  // poll() on the sockets' ZMQ_FDs and the wake-up eventfd. ZMQ_FD only announces changes, so a
  // socket is served until it reports "nothing more" (a recv that would block, which also re-arms its
  // ZMQ_FD) before the thread may sleep. This costs a few system calls per message where zmq_poll
  // spends about ten (two passes, each asking every socket for ZMQ_EVENTS); small all-reduces are
  // dominated by such costs.
  void loop() {
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
      if (sealed_monitor)
        sealed_monitor->drain([this](uint16_t what, uint32_t) {
          if (what == ZMQ_EVENT_ACCEPTED) ++sealed_connections;
          if (what == ZMQ_EVENT_DISCONNECTED && sealed_connections > 0) --sealed_connections;
        });
      if (zap) zap->serve([this](const zap_handler::request& r) { return admit(r); });
      for (int id = 0; id < int(peers.size()); ++id)
        if (peers[size_t(id)].monitor) serve_monitor(id);
      for (int id = -1; id < int(peers.size()); ++id) {
        connection* c = conn(id);
        if (c && (c->dirty || !c->backlog.empty())) serve(id);
        c = conn(id);
        busy |= c && (c->dirty || !c->backlog.empty());
      }
      fds.clear();
      ids.clear();
      fds.push_back({wake_fd, POLLIN, 0});
      ids.push_back(-2);
      if (zap) {
        fds.push_back({zap->fd(), POLLIN, 0});
        ids.push_back(-3);
      }
      for (auto* m : {listen_monitor.get(), sealed_monitor.get()})
        if (m) {
          fds.push_back({m->fd(), POLLIN, 0});
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
    // Close every socket here, on their own thread; linger 0 drops what is unsent.
    listener.backlog.clear();
    listener.socket.reset();
    for (connection& c : peers) {
      c.socket.reset();
      c.monitor.reset();
    }
    peers.clear();
    listen_monitor.reset();
    sealed_monitor.reset();
    sealed_listener = -1;
    sealed_connections = 0;
    openers.clear();
    zap.reset();
  }
};

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

bool bridge::start(const std::string& listen_endpoint, std::string* error) {
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    if (d_->running || d_->thread.joinable()) return fail(error, "bridge already started");
  }
  const bool keys = !d_->opt.keys.empty();
  if (keys && (!curve_available() || !is_key(d_->opt.keys.public_key) || !is_key(d_->opt.keys.secret_key)))
    return fail(error, curve_available() ? "bad key pair (Z85, 40 characters each)" : "this libzmq has no CurveZMQ; use --insecure");
  try {
    d_->ctx = std::make_unique<zmq::context_t>(d_->opt.io_threads);
    if (!listen_endpoint.empty()) {
      if (keys) {  // the handler first: a listener bound without one would let any key in
        d_->zap = std::make_unique<zap_handler>(*d_->ctx);
      }
      d_->listener.socket = std::make_unique<zmq::socket_t>(*d_->ctx, zmq::socket_type::router);
      d_->set_common_options(*d_->listener.socket);
      if (keys) {
        d_->listener.socket->set(zmq::sockopt::curve_server, 1);
        d_->listener.socket->set(zmq::sockopt::curve_secretkey, d_->opt.keys.secret_key);
        d_->listener.socket->set(zmq::sockopt::zap_domain, "ringmaster");
        // A stranger's half-open handshake holds a file descriptor: not for long. (It also counts towards
        // max_connections until then: libzmq's monitor cannot tell which connection finished its handshake,
        // so a flood of strangers can crowd clients out at about max_connections / 3 connections a second.)
        d_->listener.socket->set(zmq::sockopt::handshake_ivl, 3000);
        d_->listen_monitor = socket_monitor::attach(*d_->ctx, *d_->listener.socket, "inproc://ringmaster-listener",
                                                    ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_ACCEPT_FAILED);
      }
      d_->listener.socket->set(zmq::sockopt::router_mandatory, 1);  // unroutable replies are errors, not silence
      d_->listener.socket->set(zmq::sockopt::router_handover, 1);   // a peer that reconnects keeps its identity
      try {
        d_->listener.socket->bind(listen_endpoint);
      } catch (const zmq::error_t& e) {
        std::string why = e.num() == EADDRINUSE ? "address already in use" : e.what();
        d_->listen_monitor.reset();
        d_->listener.socket.reset();
        d_->zap.reset();
        d_->ctx.reset();
        return fail(error, listen_endpoint + ": " + why);
      }
      d_->listener.routed = true;
      std::lock_guard<std::mutex> lock(d_->mu);
      d_->endpoint = d_->listener.socket->get(zmq::sockopt::last_endpoint);
      d_->listener.endpoint = d_->endpoint;
    }
    if (keys && d_->opt.sealed_listener && d_->endpoint.rfind("tcp://", 0) == 0 && !d_->bind_sealed_listener(error)) {
      d_->sealed_monitor.reset();
      d_->peers.clear();
      d_->listen_monitor.reset();
      d_->listener.socket.reset();
      d_->zap.reset();
      d_->ctx.reset();
      return false;
    }
  } catch (const zmq::error_t& e) {
    d_->listen_monitor.reset();
    d_->listener.socket.reset();
    d_->zap.reset();
    d_->ctx.reset();
    return fail(error, listen_endpoint + ": " + e.what());
  }
  d_->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (d_->wake_fd < 0) {
    d_->listen_monitor.reset();
    d_->listener.socket.reset();
    d_->zap.reset();
    d_->ctx.reset();
    return fail(error, std::string("eventfd: ") + std::strerror(errno));
  }
  d_->quit = false;
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    d_->running = true;
  }
  // The sockets move to the new thread; creating the thread is the memory barrier ZeroMQ asks for.
  d_->thread = std::thread([this] { d_->loop(); });
  return true;
}

void bridge::stop() {
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    if (!d_->running && !d_->thread.joinable()) return;
    d_->running = false;
  }
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
  d_->ctx.reset();    // after every socket closed: returns at once with linger 0
  // libzmq 4.3 leaves a bound ipc:// socket file behind (it unlinks a stale one at bind time instead).
  const std::string ipc = "ipc://";
  const std::string& ep = d_->listener.endpoint;
  if (ep.rfind(ipc, 0) == 0 && ep.size() > ipc.size() && ep[ipc.size()] != '@') unlink(ep.c_str() + ipc.size());
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
  std::lock_guard<std::mutex> lock(d_->mu);
  if (!d_->running) return false;
  d_->queue.push_back(std::move(f));
  if (!d_->wake_pending) {  // one wake-up per batch of posts
    d_->wake_pending = true;
    uint64_t one = 1;
    (void)!write(d_->wake_fd, &one, sizeof one);
  }
  return true;
}

int bridge::connect(const std::string& endpoint, const std::string& server_key, std::string* error) {
  return connect_any(endpoint, server_key, nullptr, error);
}

int bridge::connect_sealed(const std::string& endpoint, std::shared_ptr<sealer> seal, std::string* error) {
  if (!seal) {
    fail(error, endpoint + ": no sealer");
    return -1;
  }
  return connect_any(endpoint, "", std::move(seal), error);
}

int bridge::connect_any(const std::string& endpoint, const std::string& server_key, std::shared_ptr<sealer> seal,
                        std::string* error) {
  if (on_bridge_thread()) return d_->do_connect(endpoint, server_key, std::move(seal), error);
  auto done = std::make_shared<std::promise<std::pair<int, std::string>>>();
  auto result = done->get_future();
  if (!post([this, endpoint, server_key, seal, done] {
        std::string err;
        const int id = d_->do_connect(endpoint, server_key, seal, &err);
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

int bridge::sealed_port() const { return d_->sealed_port; }

void bridge::add_opener(uint64_t job, uint32_t sender, std::shared_ptr<opener> open, std::string who) {
  post([this, job, sender, open = std::move(open), who = std::move(who)]() mutable {
    d_->openers[{job, sender}] = {std::move(open), std::move(who)};
  });
}

void bridge::remove_openers(uint64_t job) {
  post([this, job] {
    auto& o = d_->openers;
    o.erase(o.lower_bound({job, 0}), o.upper_bound({job, UINT32_MAX}));
  });
}

void bridge::disconnect(int peer) {
  post([this, peer] {
    if (peer >= 0 && size_t(peer) < d_->peers.size() && peer != d_->sealed_listener) {
      d_->peers[peer].backlog.clear();
      d_->peers[peer].socket.reset();
      d_->peers[peer].monitor.reset();
    }
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
