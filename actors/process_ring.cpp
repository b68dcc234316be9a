#include "actors/process_ring.hpp"

#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "actors/messages.hpp"
#include "actors/reducer.hpp"
#include "actors/ring_links.hpp"
#include "actors/training.hpp"
#include "kernels/fnv1a.hpp"

namespace ringmaster {

using wire::msg_type;

struct process_ring::impl {
  int rank, size, left, right;
  process_ring_options opt;
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  caf::actor red;
  std::shared_ptr<reducer_port> port;  // chunks from the bridge go straight in
  // shared_memory: our segment for the left neighbour's chunks (its thread hands them to port, so it goes
  // before port does), and the right neighbour's, which our link sends through.
  std::unique_ptr<net::shm_receiver> shm_in;
  std::shared_ptr<net::shm_sender> shm_out;
  std::shared_ptr<net::shm_window> window;  // shared_buffer()'s, lent through shm_out
  // Chunks on TCP connections of their own (sealed or plain): our ring port, the receiver of the left
  // neighbour's (its thread hands them to port, so it goes before port does) and our connection to the
  // right neighbour's port.
  bool own_link = false;  // from listen(): a tcp endpoint, tcp_link, and a seal or no keys
  std::unique_ptr<net::tcp_port> tcp_port;
  std::shared_ptr<net::tcp_receiver> tcp_in;
  std::shared_ptr<net::tcp_sender> tcp_out;

  std::mutex mu;  // guards the handshake flags and failure
  std::condition_variable cv;
  bool left_hello = false, right_ack = false, connected = false;
  std::string failure;  // non-empty: the ring is broken
  std::atomic<int> right_peer{-1};
  std::atomic<int> right_ring_port{0};  // from its hello_ack, when it has one
  std::string left_identity;  // bridge thread only
  std::shared_ptr<net::sealer> seal;    // what we send the right neighbour, when chunks are sealed
  std::shared_ptr<net::opener> unseal;  // what the left neighbour sends us

  net::bridge br;  // last: its thread stops before what its callbacks touch goes

  impl(int r, int n, process_ring_options o)
      : rank(r), size(n), left(ring::left(r, n)), right(ring::right(r, n)), opt(std::move(o)), br(secure(opt)) {
    configure(cfg, opt.threads);
    sys = std::make_unique<caf::actor_system>(cfg);
    reducer_config rc;
    rc.rank = r;
    rc.size = n;
    rc.ring.job = opt.job_id;
    rc.ring.segment_elems = std::max<size_t>(1, opt.segment_bytes / sizeof(float));
    rc.ring.small_bytes = opt.small_bytes;
    rc.ring.pair_small_bytes = opt.small_bytes;  // what the caller asked for, whatever the ring size
    rc.timeout = opt.timeout;
    port = spawn_reducer(*sys, rc, &red);
  }
  bool keys() const { return !opt.bridge.keys.empty(); }
  // A segment's stamp: the job and where the receiving rank listens (its tcp port or ipc path, unique on
  // a host while bound, whatever host name or address either side writes), so two rings of one job id on
  // one host (tests, benchmarks) never meet.
  net::shm_stamp stamp(int from, int to, const std::string& receiver_endpoint) const {
    const bool tcp = receiver_endpoint.rfind("tcp://", 0) == 0;
    const std::string where = tcp ? receiver_endpoint.substr(receiver_endpoint.rfind(':') + 1) : receiver_endpoint;
    return {opt.job_id ^ fnv1a64(where.data(), where.size()), from, to};
  }
  // Our segment for the left neighbour's chunks, named by the endpoint we are bound to.
  void make_segment(const std::string& bound) {
    std::string why;
    shm_in = net::shm_receiver::create(stamp(left, rank, bound), &why);
    if (!shm_in) return log("no shared memory for the left neighbour's chunks: " + why);
    shm_in->start(
        [this](const wire::header& h, net::payload p) {
          if (h.type == msg_type::chunk) deliver(*port, from_wire(h, std::move(p)));  // the reducer checks the rest
        },
        [this](const std::string& why) { ringmaster::fail(*port, why); });
    net::shm_receiver* in = shm_in.get();  // lives as long as the port's user, this object
    set_poller(*port, [in](std::chrono::steady_clock::time_point until, const std::function<bool()>& done) {
      return in->poll(until, done);
    }, opt.poll);
  }
  // Offers the right neighbour our window, once both are there. While allreduce() polls the left
  // segment, it also lets go of what the right neighbour has read (else the sender's thread does).
  void lend() {
    if (!window || !shm_out) return;
    shm_out->lend(window);
    if (!shm_in) return;
    set_poller(*port, [in = shm_in.get(), out = shm_out.get()](std::chrono::steady_clock::time_point until,
                                                               const std::function<bool()>& done) {
      return net::poll_reaping(in, *out, until, done);
    }, opt.poll);
  }
  // Our ring port, on the host we listen on, and the receiver of the left neighbour's chunks (opened
  // with unseal; plain without it). False with *error.
  bool open_ring_port(const std::string& endpoint, std::string* error) {
    const std::string host = endpoint.substr(6, endpoint.rfind(':') - 6);
    net::tcp_port_options po;
    po.on_refusal = [this](const std::string& why) { log("ring port: " + why); };
    if (!(tcp_port = net::tcp_port::bind(host, 0, po, error))) return false;
    tcp_in = tcp_port->expect(
        opt.job_id, uint32_t(left), unseal,
        [this](const wire::header& h, net::payload p) { deliver(*port, from_wire(h, std::move(p))); },  // the reducer checks
        [this](const std::string& why) { fail(why); });
    if (!shm_in) {  // a neighbour on this host sends through shared memory: then that is what we poll
      net::tcp_receiver* in = tcp_in.get();  // lives as long as the port's user, this object
      set_poller(*port, [in](std::chrono::steady_clock::time_point until, const std::function<bool()>& done) {
        return in->poll(until, done);
      }, opt.poll);
    }
    return true;
  }
  const std::string& key_of(int r) const {
    return opt.public_keys.empty() ? opt.bridge.keys.public_key : opt.public_keys[size_t(r)];
  }
  // The bridge's options with keys: only the left neighbour may connect.
  net::bridge_options secure(const process_ring_options& o) const {
    net::bridge_options b = o.bridge;
    if (b.keys.empty() || size < 1 || (!o.public_keys.empty() && o.public_keys.size() != size_t(size))) return b;
    const std::string left_key = o.public_keys.empty() ? b.keys.public_key : o.public_keys[size_t(left)];
    b.authorize = [left_key](const std::string& k) { return k == left_key; };
    return b;
  }
  // The pair keys with both neighbours (sealed chunks). False with *error.
  bool make_seals(std::string* error) {
    net::seal_key k;
    if (!net::pair_key(opt.bridge.keys, key_of(right), opt.seal_salt, opt.job_id, uint32_t(rank), uint32_t(right), 0, 0, &k, error))
      return false;
    seal = std::make_shared<net::sealer>(k, opt.job_id, uint32_t(rank));
    net::wipe(k);
    if (!net::pair_key(opt.bridge.keys, key_of(left), opt.seal_salt, opt.job_id, uint32_t(rank), uint32_t(left), 0, 0, &k, error))
      return false;
    unseal = std::make_shared<net::opener>(k, opt.job_id, uint32_t(left));
    net::wipe(k);
    return true;
  }

  ~impl() {
    br.stop();
    set_poller(*port, {}, std::chrono::microseconds(0));  // nobody polls the receiver that goes next
    tcp_out.reset();  // before what its on_error touches (mu, failure)
    tcp_in.reset();
    tcp_port.reset();
    caf::anon_send_exit(red, caf::exit_reason::user_shutdown);
    red = nullptr;
    sys.reset();  // waits for the reducer
  }

  wire::header make(msg_type t) const {
    wire::header h;
    h.type = t;
    h.job_id = opt.job_id;
    h.sender_rank = rank;
    return h;
  }

  void log(const std::string& why) {
    if (opt.on_error) opt.on_error({net::fault::malformed, {}, why});
    else std::fprintf(stderr, "ringmaster process_ring rank %d: %s\n", rank, why.c_str());
  }

  // The ring is broken: remember why, wake the caller and stop the reducer (a call in progress fails).
  void fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (failure.empty()) failure = why;
    }
    cv.notify_all();
    ringmaster::fail(*port, why);  // a call in progress fails
  }

  bool connected_now() {
    std::lock_guard<std::mutex> lock(mu);
    return connected;
  }

  void send_abort(const std::string& origin, const std::string& reason) {
    std::string text;
    if (right_peer.load() < 0 || !wire::encode_kv({{"origin", origin}, {"reason", reason}}, &text, nullptr)) return;
    br.send(right_peer.load(), make(msg_type::abort), net::payload::copy_of(text));
  }

  void on_hello(const net::peer_info& from, const wire::header& h, const net::payload& p) {
    wire::kv_map kv;
    std::string err, why;
    if (!wire::decode_kv(p.text(), &kv, &err)) why = "bad hello: " + err;
    else if (h.job_id != opt.job_id)
      why = "hello for job " + std::to_string(h.job_id) + ", this ring runs job " + std::to_string(opt.job_id);
    else if (kv["size"] != std::to_string(size))
      why = "hello from a ring of " + kv["size"].substr(0, 20) + " ranks, this one has " + std::to_string(size);
    else if (h.sender_rank != left)
      why = "hello from rank " + std::to_string(h.sender_rank) + ", expected the left neighbour, rank " + std::to_string(left);
    if (!why.empty()) {
      br.reply(from, make(msg_type::error), net::payload::copy_of(why));
      // Someone else's job is noise; a wrong rank in our own job is a broken ring layout.
      if (h.job_id == opt.job_id && !connected_now()) fail(why);
      else log(why);
      return;
    }
    left_identity = from.identity;
    std::string ack;  // with a ring port: where the left neighbour sends chunks
    if (tcp_port) wire::encode_kv({{"ring_port", std::to_string(tcp_port->port())}}, &ack, nullptr);
    br.reply(from, make(msg_type::hello_ack), net::payload::copy_of(ack));
    {
      std::lock_guard<std::mutex> lock(mu);
      left_hello = true;
    }
    cv.notify_all();
  }

  void on_message(const net::peer_info& from, const wire::header& h, net::payload p) {
    switch (h.type) {
      case msg_type::chunk:
        // Only from the left neighbour's connection (with a ring port, chunks come on their own); the
        // reducer checks job, sender, step and size.
        if (tcp_port || from.peer >= 0 || from.identity.empty() || from.identity != left_identity) {
          log("chunk from rank " + std::to_string(h.sender_rank) + " on a connection that is not our left neighbour's: dropped");
          return;
        }
        deliver(*port, from_wire(h, std::move(p)));
        return;
      case msg_type::hello:
        return on_hello(from, h, p);
      case msg_type::hello_ack:
        if (from.peer == right_peer.load() && h.job_id == opt.job_id) {
          wire::kv_map kv;
          std::string err;
          int port = 0;
          if (wire::decode_kv(p.text(), &kv, &err) && kv.count("ring_port")) {  // checked, never std::stoi
            const std::string& t = kv["ring_port"];
            const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), port);
            if (ec != std::errc() || end != t.data() + t.size() || port < 0 || port > 65535) port = 0;
          }
          right_ring_port.store(port);
          {
            std::lock_guard<std::mutex> lock(mu);
            right_ack = true;
          }
          cv.notify_all();
        }
        return;
      case msg_type::abort: {
        if (h.job_id != opt.job_id || from.identity != left_identity) return;
        wire::kv_map kv;
        std::string err;
        wire::decode_kv(p.text(), &kv, &err);
        const std::string origin = kv.count("origin") ? kv["origin"].substr(0, 20) : "?";
        fail("rank " + origin + " aborted: " + (kv.count("reason") ? kv["reason"] : "no reason given"));
        // Round the ring once, so every rank stops waiting, until it reaches the rank that started it.
        if (origin != std::to_string(right)) send_abort(origin, kv.count("reason") ? kv["reason"] : "");
        return;
      }
      case msg_type::error:
        if (from.peer >= 0 && from.peer == right_peer.load())
          return fail("rank " + std::to_string(right) + " refused us: " + std::string(p.text()));
        if (!from.identity.empty() && from.identity == left_identity)
          return fail("rank " + std::to_string(left) + " reported: " + std::string(p.text()));
        log("error from a peer outside the ring: " + std::string(p.text()));
        return;
      default:
        log(std::string("ignored a message of type ") + wire::type_name(h.type));
    }
  }

  void on_bridge_error(const net::bridge_error& e) {
    // A neighbour in another protocol version can never join: fail the handshake with its message.
    if (e.kind == net::fault::version_mismatch && !connected_now()) fail(e.message);
    // So can one that refuses our key, or that holds another than we expect: say so now, not at the timeout.
    if (e.kind == net::fault::handshake_failed && !e.retrying && !connected_now())
      fail("rank " + std::to_string(right) + ": " + e.message);
    if (opt.on_error) opt.on_error(e);
    else std::fprintf(stderr, "ringmaster process_ring rank %d: %s: %s\n", rank, net::fault_name(e.kind), e.message.c_str());
  }
};

process_ring::process_ring(int rank, int size, process_ring_options options)
    : d_(std::make_unique<impl>(rank, size, std::move(options))) {
  d_->br.set_handler([d = d_.get()](const net::peer_info& f, const wire::header& h, net::payload p) {
    d->on_message(f, h, std::move(p));
  });
  d_->br.set_error_handler([d = d_.get()](const net::bridge_error& e) { d->on_bridge_error(e); });
}

process_ring::~process_ring() = default;

int process_ring::rank() const { return d_->rank; }
int process_ring::size() const { return d_->size; }
std::string process_ring::endpoint() const { return d_->br.endpoint(); }
bool process_ring::through_shared_memory() const { return d_->shm_out != nullptr; }

bool process_ring::listen(const std::string& endpoint, std::string* error) {
  auto failed = [error](std::string why) {
    if (error) *error = std::move(why);
    return false;
  };
  if (d_->size < 1 || d_->rank < 0 || d_->rank >= d_->size)
    return failed("rank " + std::to_string(d_->rank) + " of " + std::to_string(d_->size));
  if (d_->br.running()) return failed("listen called twice");
  const bool sealed = d_->keys() && !d_->opt.seal_salt.empty();
  if (sealed && endpoint.rfind("tcp://", 0) != 0) return failed("sealed chunks need a tcp:// endpoint, not " + endpoint);
  if (sealed && !d_->opt.tcp_link) return failed("sealed chunks go to ring ports only: tcp_link must be on");
  d_->own_link = d_->size > 1 && d_->opt.tcp_link && endpoint.rfind("tcp://", 0) == 0 && (sealed || !d_->keys());
  if (d_->own_link && (d_->opt.segment_bytes > net::kMaxRingPayload || d_->opt.small_bytes > net::kMaxRingPayload))
    return failed("chunks to a ring port are at most " + std::to_string(net::kMaxRingPayload) + " bytes: segment_bytes " +
                  std::to_string(d_->opt.segment_bytes) + ", small_bytes " + std::to_string(d_->opt.small_bytes));
  if (d_->opt.shared_memory && (d_->opt.segment_bytes > net::kShmMaxPayload || d_->opt.small_bytes > net::kShmMaxPayload))
    return failed("shared-memory chunks are at most " + std::to_string(net::kShmMaxPayload) + " bytes: segment_bytes " +
                  std::to_string(d_->opt.segment_bytes) + ", small_bytes " + std::to_string(d_->opt.small_bytes));
  if (d_->keys() && !d_->opt.public_keys.empty() && d_->opt.public_keys.size() != size_t(d_->size))
    return failed(std::to_string(d_->opt.public_keys.size()) + " public keys for a ring of " + std::to_string(d_->size));
  if (d_->keys() && !d_->opt.seal_salt.empty() && d_->size > 1 && !d_->make_seals(error)) return false;
  // The segment exists before any hello is answered: the left neighbour looks for it once we have. With
  // a port of our choosing, before the bridge starts; with port 0, once it is bound (then nobody knows
  // where we listen, so nobody says hello, until listen() has returned).
  const bool any_port = endpoint.rfind("tcp://", 0) == 0 && endpoint.substr(endpoint.rfind(':') + 1) == "0";
  const bool shm = d_->opt.shared_memory && d_->size > 1;
  if (shm && !any_port) d_->make_segment(endpoint);
  // The ring port before the bridge answers any hello, which names it (its thread reads tcp_port).
  if (d_->own_link && !d_->open_ring_port(endpoint, error)) return false;
  if (!d_->br.start(endpoint, error)) return false;
  if (shm && any_port) d_->make_segment(d_->br.endpoint());  // its poller replaces the ring port's
  return true;
}

bool process_ring::start(const std::vector<std::string>& endpoints, std::string* error) {
  if (endpoints.size() != size_t(d_->size)) {
    if (error) *error = std::to_string(endpoints.size()) + " endpoints for a ring of " + std::to_string(d_->size);
    return false;
  }
  return listen(endpoints[size_t(d_->rank)], error) && connect(endpoints, error);
}

bool process_ring::connect(const std::vector<std::string>& endpoints, std::string* error) {
  auto failed = [error](std::string why) {
    if (error) *error = std::move(why);
    return false;
  };
  if (endpoints.size() != size_t(d_->size))
    return failed(std::to_string(endpoints.size()) + " endpoints for a ring of " + std::to_string(d_->size));
  if (!d_->br.running()) return failed("connect before listen");
  if (d_->size == 1) {
    std::lock_guard<std::mutex> lock(d_->mu);
    d_->connected = true;
    return true;
  }
  const std::string& right_ep = endpoints[size_t(d_->right)];
  const int peer = d_->br.connect(right_ep, d_->keys() ? d_->key_of(d_->right) : "", error);
  if (peer < 0) return false;
  d_->right_peer.store(peer);
  std::string text;
  wire::encode_kv({{"rank", std::to_string(d_->rank)}, {"size", std::to_string(d_->size)}}, &text, nullptr);
  if (!d_->br.send(peer, d_->make(msg_type::hello), net::payload::copy_of(text), error)) return false;

  std::unique_lock<std::mutex> lock(d_->mu);
  const bool ok = d_->cv.wait_for(lock, d_->opt.handshake_timeout, [this] {
    return !d_->failure.empty() || (d_->left_hello && d_->right_ack);
  });
  if (!d_->failure.empty()) return failed(d_->failure);
  if (!ok) {
    std::string missing;
    if (!d_->right_ack) missing = "no answer from the right neighbour, rank " + std::to_string(d_->right) + " at " + right_ep;
    if (!d_->left_hello)
      missing += std::string(missing.empty() ? "" : "; ") + "no hello from the left neighbour, rank " +
                 std::to_string(d_->left) + " at " + endpoints[size_t(d_->left)];
    return failed("handshake timed out after " + std::to_string(d_->opt.handshake_timeout.count()) + " ms: " + missing);
  }
  lock.unlock();
  // Chunks go to the right neighbour's ring port (sealed, or plain), or on the handshake's connection.
  bool missing = false;
  std::string why;
  if (d_->opt.shared_memory && (d_->shm_out = net::shm_sender::open(d_->stamp(d_->rank, d_->right, right_ep), &why, &missing))) {
    join(*d_->port, make_shm_link(d_->shm_out));
    d_->lend();
  } else if (const int port = d_->right_ring_port.load(); d_->seal || (port > 0 && !d_->keys())) {
    if (port <= 0) return failed("rank " + std::to_string(d_->right) + " at " + right_ep + " has no ring port");
    d_->tcp_out = net::tcp_sender::connect(right_ep.substr(0, right_ep.rfind(':') + 1) + std::to_string(port), d_->opt.job_id,
                                           uint32_t(d_->rank), d_->seal,
                                           [d = d_.get()](const std::string& e) { d->fail("rank " + std::to_string(d->right) + ": " + e); },
                                           error);
    if (!d_->tcp_out) return false;
    join(*d_->port, make_tcp_link(d_->tcp_out));
  } else {
    join(*d_->port, make_bridge_link(&d_->br, peer));
  }
  if (d_->opt.shared_memory && !d_->shm_out && !missing) d_->log("no shared memory with the right neighbour: " + why);
  lock.lock();
  if (!d_->failure.empty()) return failed(d_->failure);
  d_->connected = true;
  return true;
}

float* process_ring::shared_buffer(size_t floats, std::string* error) {
  if (!d_->opt.shared_memory) return *error = "shared_memory is off", nullptr;
  if (d_->window) return *error = "a ring has one shared buffer", nullptr;
  if (!(d_->window = net::shm_window::create(floats * sizeof(float), error))) return nullptr;
  d_->lend();
  return d_->window->floats();
}

bool process_ring::buffer_read_in_place() const {
  return d_->window && d_->shm_out && d_->shm_out->lending() == net::shm_sender::window_state::taken &&
         d_->shm_out->references() > 0;
}

std::string process_ring::allreduce(float* buf, size_t len) {
  if (d_->size == 1) return "";
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    if (!d_->failure.empty()) return "ring failed earlier: " + d_->failure;
    if (!d_->connected) return "allreduce before connect";
  }
  // Every send that still reads `buf` holds the guard: the call returns only once all have let go.
  auto guard = std::make_shared<int>(0);
  std::weak_ptr<int> watch = guard;
  // The all-reduce runs on the bridge thread as chunks come; this thread waits for its end only.
  struct waiter {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::string error;
  };
  auto w = std::make_shared<waiter>();  // shared: an end after we gave up finds it alive
  reduce(*d_->port, tensor_view{buf, len, std::move(guard), nullptr}, 0, len, [w](const std::string& e) {
    {
      std::lock_guard<std::mutex> lock(w->mu);
      w->done = true;
      w->error = e;
    }
    w->cv.notify_all();
  });
  poll_briefly(*d_->port, [&w] {  // until the answer is in: then the wait below does not sleep
    std::lock_guard<std::mutex> lock(w->mu);
    return w->done;
  });
  std::string why;
  {
    std::unique_lock<std::mutex> lock(w->mu);
    // The reducer's watchdog ends a stuck call after opt.timeout; this is only a backstop.
    if (!w->cv.wait_for(lock, d_->opt.timeout * 3 + std::chrono::seconds(5), [&] { return w->done; }))
      why = "all-reduce got no answer from its reducer";
    else
      why = w->error;
  }
  if (why.empty()) return "";
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    if (d_->failure.empty()) d_->failure = why;
    why = d_->failure;
  }
  d_->send_abort(std::to_string(d_->rank), why);  // the others stop waiting too
  d_->fail(why);
  // Let what is queued drain for a moment, then cut the connection, which frees every queued message.
  const auto wait_released = [&](std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (!watch.expired() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return watch.expired();
  };
  if (!wait_released(std::chrono::seconds(1))) {
    d_->br.disconnect(d_->right_peer.load());
    if (d_->tcp_out) d_->tcp_out->abort();  // plain, it holds the buffer's queued sends itself
    if (!wait_released(std::chrono::seconds(5))) return why + " (and sends from the buffer are still in flight: keep it alive)";
  }
  return why;
}

}  // namespace ringmaster
