// The bridge's insides (net/bridge.hpp), shared by its two halves: net/bridge.cpp (set-up, the public
// calls, who may connect) and net/bridge_io.cpp (building, sending and receiving messages, the poll loop).
// Private to them: nothing else includes it.
#pragma once
#include "net/bridge.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <zmq.hpp>

#include "net/curve.hpp"

namespace ringmaster::net {
namespace detail {

inline thread_local bool t_bridge_thread = false;

// A message built and waiting for its socket to accept it (high-water mark reached).
struct pending {
  zmq::message_t identity;  // ROUTER only
  zmq::message_t header;
  zmq::message_t body;
  bool has_body = false;
};

// Replies a listening socket holds for one client that does not take them (ZeroMQ's queue to it is
// full): at most this many, and this many bytes; later ones are dropped, reported once per client.
inline constexpr size_t kMaxHeldReplies = 4096;
inline constexpr size_t kMaxHeldReplyBytes = size_t(256) << 20;

// A listening socket's replies waiting for one client.
struct held_replies {
  std::deque<pending> queue;
  size_t bytes = 0;
  bool dropping = false;  // over the limits: dropped replies were reported
};

struct connection {
  std::unique_ptr<zmq::socket_t> socket;  // null once disconnected
  std::string endpoint;
  std::deque<pending> backlog;
  // A listening ROUTER's replies wait per client: one that does not read must not hold up the others.
  std::map<std::string, held_replies> held;
  int fd = -1;         // ZMQ_FD: readable when the socket has news for us
  bool dirty = true;   // used since last drained: may hold messages ZMQ_FD will not announce again
  // Connections only: the server's key (with keys), and a monitor telling us why a handshake failed (with
  // keys, or bridge_options::watch_connects).
  std::string server_key;
  std::unique_ptr<socket_monitor> monitor;
  int failed_handshakes = 0;  // since the last one that succeeded; reported once
  bool handshook = false;     // a handshake succeeded once: a later refusal is a peer started again
  bool connected = false;     // since that success: its connection's end is no failed handshake
  bool tcp_up = false;        // a TCP connection was made once (bridge_options::watch_connects)
  int refused = 0;            // tries to make one that failed before that
  bool routed = false;        // a listening ROUTER: messages carry the client's routing id first
  // Sends that failed, said once what the socket holds now is read (bridge::impl::send_failed).
  std::vector<bridge_error> failed_sends;
  std::chrono::steady_clock::time_point failed_since{};
  int failed_serves = 0;  // serves since, that ended before the socket was read to its end
  bool waiting() const { return !backlog.empty() || !held.empty() || !failed_sends.empty(); }
};

// Strangers remembered to report each once; past this many the memory starts afresh (the node's log then
// holds them to a few lines per 10 s, as every fault).
inline constexpr size_t kMaxRefusedKeys = 1024;

// 64 random bits as 16 hex digits.
inline std::string random_hex64() {
  std::random_device rd;
  char b[17];
  std::snprintf(b, sizeof b, "%08x%08x", rd(), rd());
  return b;
}

inline std::string default_name() {
  char host[256] = "host";
  gethostname(host, sizeof host - 1);
  host[200] = '\0';  // a routing id is at most 255 bytes, with room for a connection's own suffix
  return std::string(host) + ":" + std::to_string(getpid()) + ":" + random_hex64();
}

// A routing id (any bytes a client chose) fit for a log line: other than printable ASCII as \xNN.
inline std::string printable(const std::string& id) {
  static const char hex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char ch : id.substr(0, 64)) {
    if (ch >= 0x20 && ch < 0x7f && ch != '\\') out += char(ch);
    else out += {'\\', 'x', hex[ch >> 4], hex[ch & 15]};
  }
  return id.size() > 64 ? out + "..." : out;
}

inline size_t bytes_of(const pending& m) { return m.identity.size() + m.header.size() + m.body.size(); }

inline void release_owner(void*, void* hint) { delete static_cast<std::shared_ptr<const void>*>(hint); }

inline bool fail(std::string* error, std::string what) {
  if (error) *error = std::move(what);
  return false;
}

}  // namespace detail
using namespace detail;

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
  std::atomic<int> drain_ms{0};  // stop(drain): what is queued goes out, and closing waits this long for it
  int wake_fd = -1;
  std::thread thread;

  // Bridge thread only (created in start() before the thread exists).
  std::unique_ptr<zmq::context_t> ctx;
  connection listener;  // the ROUTER; socket null without a listen endpoint
  struct stat ipc_file{};  // the socket file an ipc:// listener made: removed at stop only while it is still that one
  std::vector<connection> peers;
  std::unique_ptr<zap_handler> zap;  // with keys and a listening socket
  std::set<std::string> refused;  // client keys already reported as refused
  int monitors = 0;               // monitors made so far: each gets its own inproc name
  // The listener's monitor (with keys or without): connections open now, and failures to accept one.
  std::unique_ptr<socket_monitor> listen_monitor;
  // Open connections (fd -> the address it comes from, as the monitor names connections by their fd),
  // and how many each address holds: one address may fill at most a quarter of max_connections for a client from elsewhere, so
  // a stranger on one host holding half-open handshakes cannot crowd the launchers out.
  std::map<int, std::string> connection_address;
  std::map<std::string, int> per_address;
  uint64_t accept_failures = 0, overloaded_refusals = 0;
  int listen_port = 0;  // the listener's TCP port (0: ipc, or none)
  std::chrono::steady_clock::time_point last_overload_report{};
  std::chrono::steady_clock::time_point last_mismatch_report{};  // a client with keys where we have none, or the reverse

  // Whether a report last made at *last may be made again (a minute later); if so, *last becomes now.
  static bool once_a_minute(std::chrono::steady_clock::time_point* last);
  // At most one overload report a minute, saying how often it happened since the last one.
  void report_overload(const std::string& what);
  // ACCEPTED and DISCONNECTED keep the count of open connections, and a TCP connection over the limit
  // (within_limit) is hung up as it is accepted; ACCEPT_FAILED is a lack of file descriptors (libzmq
  // retries the accept at once, in its I/O thread, until one is free: we can only say so, once, and
  // refuse clients so that their connections close). HANDSHAKE_FAILED_PROTOCOL with a mechanism mismatch
  // is a client run --insecure at a node with keys, or the reverse: logged at most once a minute (a
  // client with keys is told too, by its own monitor).
  void serve_listen_monitor();
  // Whether fd is still a connection accepted on our TCP listening port.
  bool accepted_here(int fd) const;
  void report(fault kind, peer_info from, std::string message, bool retrying = false);
  void set_common_options(zmq::socket_t& s);
  // Large payloads go without a copy (their owner is held until ZeroMQ lets go of them).
  void build(const wire::header& h, payload& p, pending* out);
  // One non-blocking attempt. ZeroMQ takes a multipart message whole or not at all (the high-water mark
  // is checked on the first frame), so EAGAIN on the first frame leaves nothing half-sent.
  // Returns 1 sent, 0 would block, -1 failed (errno).
  static int try_send(zmq::socket_t& s, pending& m, bool routed);
  void send_now(connection& c, pending m, bool routed, const peer_info& to);
  void flush(connection& c);
  // A send on c that failed. A peer that sent its last word and closed at once ("finished", say) makes
  // a send to it fail while that word is still unread: the failure is said only once what c holds now
  // has been handled (or after kFailedSendWait, behind a flood), so that its handler hears the word first.
  void send_failed(connection& c, peer_info to, std::string message);
  void report_failed_sends(connection& c, bool drained);
  void hold_or_send(connection& c, pending m, const peer_info& to);  // a reply on the listening socket
  void flush_held(connection& c);
  // A client more from `address` on the listening socket is within max_connections (else said): its
  // address's connections count whole, each other address's up to a quarter of the limit.
  bool within_limit(const std::string& address);
  void do_send(int peer, const wire::header& h, payload p);
  void do_reply(const peer_info& to, const wire::header& h, payload p);
  int do_connect(const std::string& ep, const std::string& server_key, std::string* error);
  // A DEALER connecting to ep (with its monitor), for do_connect and reconnect.
  bool make_connection(const std::string& ep, const std::string& server_key, connection* c, std::string* error);
  zap_handler::verdict admit(const zap_handler::request& r);
  // Who may finish a handshake on our listening socket: a client whose key opt.authorize accepts,
  // while there is room.
  zap_handler::verdict admit(const std::string& key, const std::string& address);
  // A connection's handshake news: a server that refuses our key says so (ZAP status 400); one that
  // cannot read our hello (it holds another key, or runs without keys) just hangs up, again and again.
  void serve_monitor(int id);
  // Reads one whole multipart message. Returns false when nothing is waiting.
  bool receive_one(connection& c, int peer);
  // Work other threads queued and the bridge thread has not run yet. What the bridge thread itself sends
  // then goes behind it, so sends to one peer leave in the order they were made, whichever thread made
  // them (a ring's rounds depend on it).
  bool queued_ahead();
  // One item at a time, so that what is still queued stays visible to queued_ahead() while an item runs.
  // A bounded batch: sockets are polled again in between, however fast other threads post.
  void run_queue();
  bool enqueue(std::function<void()> f);  // runs f on the bridge thread after what is queued (false: stopped)
  connection* conn(int id);
  // Sends what waits and reads what has come, a bounded batch (64 messages, or kServeSlice of handlers'
  // time) so one busy peer cannot starve the others. Leaves the connection dirty if it stopped early, so
  // the loop comes back without sleeping.
  static constexpr std::chrono::milliseconds kServeSlice{2};
  static constexpr std::chrono::milliseconds kFailedSendWait{200};
  void serve(int id);
  // poll() on the sockets' ZMQ_FDs and the wake-up eventfd. ZMQ_FD only announces changes, so a
  // socket is served until it reports "nothing more" (a recv that would block, which also re-arms its
  // ZMQ_FD) before the thread may sleep. This costs a few system calls per message where zmq_poll
  // spends about ten (two passes, each asking every socket for ZMQ_EVENTS); small all-reduces are
  // dominated by such costs.
  void loop();
};

}  // namespace ringmaster::net
