// The bridge: the one object per process that owns every ZeroMQ socket.
//
// ZeroMQ sockets are not thread-safe, so all of them live on the bridge's own thread: one ROUTER bound at
// the listen endpoint (peers' DEALERs connect to it) and one DEALER per peer this process connects to.
// Every connection is CurveZMQ (plain text with --insecure). Sealed ring chunks between nodes do not come
// through here: they go over TCP connections of their own (net/tcp_link.hpp).
// Any thread may call the public functions: what must touch a socket is queued and the bridge thread is
// woken (an eventfd polled next to the sockets' ZMQ_FDs). Calls made on the bridge thread itself
// (from a handler) act at once, with no queue and no wake-up, unless work queued by other threads waits
// (then they go behind it, keeping the order of sends): protocols that answer messages from their
// handler (the ring) pay no thread hop per message.
//
// Incoming messages are validated (net/wire.hpp) and handed to the message handler ON THE BRIDGE THREAD,
// payload without a copy. Invalid ones (bad header, wrong number of frames, size mismatch) go to the
// error handler and are dropped; the bridge keeps serving. A hello in another protocol version is
// answered with an `error` message naming both versions.
//
//   bridge b;
//   b.set_handler([](const peer_info& from, const wire::header& h, payload p) { ... });
//   std::string err;
//   if (!b.start("tcp://127.0.0.1:0", &err)) ...;       // b.endpoint(): "tcp://127.0.0.1:41234"
//   int peer = b.connect(other_endpoint, other_key, &err); // other_key: "" without keys
//   b.send(peer, header, payload::of(shared_floats));    // zero-copy, from any thread
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "net/keys.hpp"
#include "net/wire.hpp"

namespace ringmaster::net {

// Bytes plus whatever keeps them alive. Outgoing: large payloads go to ZeroMQ without a copy and `owner`
// is held until ZeroMQ's free function runs (so the bytes must not change until then). Incoming: `owner`
// is the received ZeroMQ message itself.
struct payload {
  const void* data = nullptr;
  size_t size = 0;
  std::shared_ptr<const void> owner;
  // The bytes are lent by the link (net/shm_link.hpp: the sender's ring buffer): let go of owner soon, and
  // copy them before keeping them until later messages of the same link come, which may need the space.
  bool lent = false;

  bool empty() const { return size == 0; }
  std::string_view text() const { return {static_cast<const char*>(data), size}; }
  // Valid when the message is a tensor type: the header's element count was checked against the size,
  // and the bridge hands tensor payloads over aligned for float.
  const float* floats() const { return static_cast<const float*>(data); }

  static payload copy_of(std::string_view bytes);
  static payload of(std::shared_ptr<const std::vector<float>> v);
};

// Who sent a message, enough to answer it with bridge::reply.
struct peer_info {
  int peer = -1;         // our connection's id (from connect()) when it came back on that connection
  std::string identity;  // the sender's routing id when it came in on our listening socket
  // With keys: the sender's public key (Z85), proven by the CurveZMQ handshake (on our listening socket
  // the client's, on a connection the server key we connected with). Empty without keys.
  std::string key;
};

// unauthorized: a client whose key we do not accept tried to connect (reported once per key).
// handshake_failed: a server refused our key on a connection (from.peer says which).
// overloaded: too many connections, or no file descriptors left (reported once a minute at most).
// keys_mismatch: a client at our listener offers keys where we have none, or none where we have keys
// (a side run --insecure by mistake), at most once a minute.
// peer_changed: a peer that let us in before now fails the handshake (started again with another key, or
// none): no fault of our link, for whoever runs the job to weigh; said once until it lets us in again.
// unreachable (bridge_options::watch_connects): no TCP connection after 3 tries (retrying: libzmq goes on);
// said again with retrying false once one is made after all.
enum class fault { malformed, version_mismatch, send_failed, handler_failed, unauthorized, handshake_failed, overloaded, keys_mismatch, peer_changed,
                   unreachable };
const char* fault_name(fault f);

struct bridge_error {
  fault kind = fault::malformed;
  peer_info from;
  std::string message;
  bool retrying = false;  // handshake_failed: libzmq keeps trying, and may get in (a peer at its limit)
};

struct bridge_options {
  std::string name;  // routing id on our connections; empty: "<host>:<pid>:<random>"
  // Each connection its own routing id, name + ":" + 64 random bits. A peer then learns only the id we
  // use with it, so it cannot connect to another of our peers under that id and, as ROUTERs hand an id
  // over to its newest connection, take our link there and read what that peer answers us. Launchers set
  // it; a node cannot, as plans name the routing id its ring chunks come with.
  bool connection_ids = false;
  int io_threads = 1;
  int hwm = 100000;                        // messages queued per connection before sends back up
  int kernel_buffer_bytes = 0;             // SO_SNDBUF / SO_RCVBUF; 0 keeps the OS default
  std::chrono::microseconds spin{0};       // poll without sleeping this long before blocking
  size_t copy_below = 16 * 1024;           // smaller payloads are copied: cheaper than a free callback
  // CurveZMQ. With keys, every socket encrypts and authenticates: connect() needs the server's public
  // key, and a client may complete the handshake on our listening socket only if authorize(its key) says
  // so (called on the bridge thread; a client refused gets no message through, not even a hello). Without
  // keys (empty): plain text, anyone who reaches the port may talk (--insecure).
  key_pair keys;
  std::function<bool(const std::string& client_key)> authorize;
  // At most this many clients connected to our listening socket at once (0: no limit), with keys or
  // without. The first few over it (a quarter of it, 1 to 16) are refused at the handshake, which says
  // why; more are hung up as they are accepted, so a flood holds no file descriptors. An unfinished
  // handshake is dropped after 3 s either way.
  int max_connections = 0;
  // A connection whose peer sends nothing, not even ZMTP's heartbeat answers, this long is closed (a
  // host gone without a word). What we then send that peer is dropped: an application that waits for a
  // silent peer longer than this must say so here, or lose messages a peer back in time expected.
  std::chrono::milliseconds heartbeat_timeout{3000};
  // Watch every connection we make, plain ones too (a launcher's): one whose peer accepts no TCP connection
  // after 3 tries is reported (fault::unreachable, retrying: libzmq goes on trying, and a peer started
  // after us gets in), and a plain one to a peer with keys fails its handshake at once, saying so.
  bool watch_connects = false;
};

class bridge {
 public:
  using message_handler = std::function<void(const peer_info&, const wire::header&, payload)>;
  using error_handler = std::function<void(const bridge_error&)>;

  explicit bridge(bridge_options options = {});
  ~bridge();  // stop()
  bridge(const bridge&) = delete;
  bridge& operator=(const bridge&) = delete;

  // Handlers run on the bridge thread; set them before start() (afterwards these return false). Without
  // an error handler, errors are printed to stderr.
  bool set_handler(message_handler h);
  bool set_error_handler(error_handler h);

  // Binds the listening ROUTER (tcp://HOST:PORT, port 0 for an ephemeral one, or ipc://PATH; empty: no
  // listening socket) and starts the bridge thread. False, with e.g. "tcp://127.0.0.1:5601: address
  // already in use" in *error, if it cannot.
  bool start(const std::string& listen_endpoint, std::string* error);
  // Joins the bridge thread; queued and unsent messages are dropped (linger 0). Idempotent. With a
  // drain, what is queued is sent first, and closing waits up to `drain` for ZeroMQ to hand every
  // message to its peer (an abort to every node as a launcher ends: it must not be lost).
  void stop(std::chrono::milliseconds drain = std::chrono::milliseconds(0));
  bool running() const;
  // The endpoint actually bound (the real port when asked for port 0); empty before start().
  std::string endpoint() const;
  const std::string& name() const;

  // Connects a DEALER to a peer's listening endpoint; with keys, `server_key` is the public key the peer
  // must prove it holds. Returns the peer id (>= 0) or -1 with *error. The connection completes in the
  // background; messages sent meanwhile wait in its queue.
  int connect(const std::string& endpoint, const std::string& server_key, std::string* error = nullptr);
  int connect(const std::string& endpoint, std::string* error = nullptr) { return connect(endpoint, "", error); }

  // Closes a connection, dropping what is still queued on it (their payload owners are released).
  void disconnect(int peer);
  // Replaces a connection's socket by a new one to the same endpoint and key, under the same peer id (what
  // is queued on it is dropped; its counts of refused connections and failed handshakes start afresh).
  // libzmq does not try a handshake again once the peer refused our key, or keys at all: a peer fixed
  // since (its authorized_keys) lets the new one in.
  void reconnect(int peer);

  // Sends on a connection from connect(). The header's payload_bytes is set from the payload. Returns
  // false with *error if the header is invalid or the bridge is not running; failures later on the
  // bridge thread (unknown peer, unroutable) go to the error handler.
  bool send(int peer, wire::header h, payload p = {}, std::string* error = nullptr);
  // Answers a message: back on our connection if it came on one, else through the ROUTER by identity.
  bool reply(const peer_info& to, wire::header h, payload p = {}, std::string* error = nullptr);

  // Runs f on the bridge thread (at once when called there). False if the bridge is not running.
  bool post(std::function<void()> f);
  bool on_bridge_thread() const;
  // Whether this thread is some bridge's thread (whose own bookkeeping may be what runs a payload's
  // owner's destructor: work that sends must not start from there).
  static bool on_any_bridge_thread();

  // Incoming messages dropped as invalid so far.
  uint64_t dropped() const;

 private:
  struct impl;
  std::unique_ptr<impl> d_;
};

}  // namespace ringmaster::net
