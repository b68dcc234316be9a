// Ring chunks between nodes on other hosts over plain TCP sockets: the sending thread writes them, and a
// receiving thread, or a replica that waits for them (poll), reads them, as MPI and Gloo do. Sealed
// (net/seal.hpp) between nodes with keys; plain between nodes started --insecure.
//
// Why: through the bridge a chunk crossed four threads (the sender to the bridge thread, which sealed it,
// to ZeroMQ's I/O thread; the receiver's I/O thread to its bridge thread, which opened and added it), and
// on this machine each wake-up costs 10-50 us: a 4 KB all-reduce between two processes took 78-130 us.
// Here the caller seals into its own buffer (plain: writes from the ring's buffer itself) and writes the
// socket; the receiving side reads it straight into a buffer, opens it in place and hands it on; a
// replica waiting for the all-reduce's end spins on the socket itself (a TCP round trip here: ~11 us
// spinning, ~100 us sleeping).
//
// One connection per (job, sending node, receiving node), to the receiving node's ring port. Sealed, the
// pair's sealer numbers what goes on it, so its order is the counters' order, which the opener insists
// on. What goes on the socket:
//   a login: the 56-byte header of a hello (job_id: the job, sender_rank: the sending node's number, no
//            payload) and a trailer (kTrailerBytes), sealed with the pair's key: only a holder of the key
//            can make one, and as it takes the next counter, a recorded one is refused as a replay;
//   then messages: the header (net/wire.hpp), the trailer, and payload_bytes sealed bytes.
// Plain, the same frames with the payload as it is and a trailer without a tag: a login then proves
// nothing (anyone who can reach an --insecure node commands it anyway), and a pair that expects sealed
// messages refuses it ("bad tag"), so a node with keys never takes a plain chunk; and a plain pair
// refuses a tagged one ("a sealed message on a plain link"), so ciphertext is never summed as gradients.
// The receiver checks every header and trailer before it reads a payload: the trailer must name the
// login's job and node, the payload be at most kMaxRingPayload. A stranger gets nothing but a closed
// connection (after 3 s at most, or at once when what it sends is not a login); of more than
// max_pending waiting at once the oldest goes (a node logs in at once, so a flood cannot keep it out).
// A new login of a pair replaces its old connection (a re-formed ring connects afresh; what was unread
// on the old one belonged to the old ring).
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "net/bridge.hpp"
#include "net/seal.hpp"
#include "net/wire.hpp"

namespace ringmaster::net {

// What one sending node sends us in one job: its messages, opened, in order.
class tcp_receiver {
 public:
  using handler = std::function<void(const wire::header&, payload)>;
  // Called on the receiving thread or a poller's when the connection broke the rules (a bad header or
  // tag): the connection is closed (the ring's watchdog then names the silent neighbour, unless the
  // handler fails it at once).
  using error_handler = std::function<void(const std::string&)>;
  // Called (as error_handler) when a connection that logged in closes or is reset while this receiver
  // lives and no new login replaced it: its sender's ring ended before ours (a pause, the job's end, a
  // node gone) or the connection broke between two live nodes (a reset, a firewall, a cable). Whoever
  // runs the job tells these apart; the messages in flight on it are lost either way. It is told what
  // the socket said ("Connection reset by peer", or "closed by its sender").
  using closed_handler = std::function<void(const std::string&)>;

  // As net/shm_link.hpp's shm_receiver::poll: from a thread that waits for this link's messages, takes
  // and hands them on itself, spinning, until done() or `until`. Returns done()'s last answer.
  bool poll(std::chrono::steady_clock::time_point until, const std::function<bool()>& done);
  // Stops its thread and closes its connection; the port forgets the pair.
  ~tcp_receiver();
  tcp_receiver(const tcp_receiver&) = delete;
  tcp_receiver& operator=(const tcp_receiver&) = delete;

  struct impl;
  explicit tcp_receiver(std::shared_ptr<impl> d);

 private:
  std::shared_ptr<impl> d_;
};

struct tcp_port_options {
  // Connections that have not logged in yet, at once; at most an eighth of our file descriptor limit.
  int max_pending = 64;
  std::chrono::milliseconds login_timeout{3000};
  std::chrono::milliseconds refusal_window{10000};  // refusals logged: 5 in each, the rest summed up after it
  // Strangers and broken rules, for the log (from the port's thread). Default: stderr.
  std::function<void(const std::string&)> on_refusal;
  // Testing (ringmaster-node --cut-ring-link-after, --cut-every-ring-link): in each job the first
  // connection (with cut_every, every one) to bring this many messages is cut as the last comes, which is
  // lost (shut down for reading, which reads as a closed connection); 0: never.
  uint64_t cut_after = 0;
  bool cut_every = false;
};

// The listening socket ring chunks from other hosts come to (a node's --ring-port).
class tcp_port {
 public:
  // Binds host:port (host as in an endpoint: an address, [::1], a network interface such as eth0, or "*"
  // for every IPv4 address; port 0: an ephemeral one) and starts the thread that takes logins. nullptr with *error ("127.0.0.1:5602: address already in use").
  static std::unique_ptr<tcp_port> bind(const std::string& host, int port, tcp_port_options o, std::string* error);
  ~tcp_port();  // stops taking logins; receivers still alive keep their connections
  tcp_port(const tcp_port&) = delete;
  tcp_port& operator=(const tcp_port&) = delete;
  int port() const;

  // Messages of job `job` from node `sender`, opened with `open` (the pair's; null: plain, for nodes
  // without keys), go to h on the receiver's own thread or a poller's, one at a time, in order. The
  // receiver lives until the caller drops it; the port forgets the pair then, and a later expect() for
  // the pair replaces it. `open` may be shared by the receivers of one pair over a job (its counters go
  // on); one at a time uses it.
  std::shared_ptr<tcp_receiver> expect(uint64_t job, uint32_t sender, std::shared_ptr<opener> open,
                                       tcp_receiver::handler h, tcp_receiver::error_handler e,
                                       tcp_receiver::closed_handler closed = {});

  struct impl;

 private:
  explicit tcp_port(std::unique_ptr<impl> d);
  std::unique_ptr<impl> d_;
};

// Our side of one pair's connection: what node `sender` of job `job` sends one other node.
class tcp_sender {
 public:
  // Connects to "tcp://HOST:PORT" (a tcp_port) in the background, logs in with `seal` (null: plain),
  // and sends what send() queued meanwhile. A port that cannot be reached is tried 20 times, 250 ms apart (about 5 s
  // when it refuses, up to 25 s when connecting times out); then on_error is called once, from the
  // sender's thread, and messages are dropped. A connection that breaks later drops messages without a
  // word, as a link to a vanished peer does: the job's heartbeats and the ring's watchdog name the node.
  // nullptr with *error for an endpoint that is no tcp://HOST:PORT.
  static std::shared_ptr<tcp_sender> connect(const std::string& endpoint, uint64_t job, uint32_t sender,
                                             std::shared_ptr<sealer> seal, std::function<void(const std::string&)> on_error,
                                             std::string* error);
  // From any thread; sent in the order of the calls. The socket is written at once, and what it cannot
  // take yet goes to the sender's thread. Sealed, send() is done with p's bytes when it returns (they are
  // sealed into a buffer of the sender's); plain, a payload with an owner is written from where it is,
  // zero-copy, and held (its owner) until it has been (one without is copied). False with *error only
  // for a message that can never go (a bad header, a payload over kMaxRingPayload, a cipher failure).
  bool send(const wire::header& h, const payload& p, std::string* error);
  bool sealed() const;
  // Drops what is queued (letting go of plain payloads: nothing reads them afterwards; one another
  // thread is letting go of is let go of before abort returns), closes the connection, ends a connect
  // under way (no connection comes later) and drops what comes later: for a ring that failed while its
  // caller's buffer is still queued here, behind a neighbour that stopped reading.
  void abort();
  // Drops what is still queued and closes the connection, at once: a connect under way ends too, and a
  // host name's lookup (which cannot be cut short) is left to end on the sender's thread, unheard of.
  ~tcp_sender();
  tcp_sender(const tcp_sender&) = delete;
  tcp_sender& operator=(const tcp_sender&) = delete;

  struct impl;
  explicit tcp_sender(std::shared_ptr<impl> d);

 private:
  std::shared_ptr<impl> d_;  // and its thread's, which may end after us (when on_error drops the last sender)
};

}  // namespace ringmaster::net
