#include "actors/node_service.hpp"

#include <malloc.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "actors/data_cache.hpp"
#include "actors/job_plan.hpp"
#include "actors/node_job.hpp"
#include "kernels/host_memory.hpp"
#include "net/bridge.hpp"
#include "net/log_limiter.hpp"
#include "net/log_writer.hpp"
#include "net/shm_link.hpp"

namespace ringmaster {

// Data threads of stopped jobs still loading, past which a new job is refused for now (each holds a copy
// of the data it loads).
constexpr int kMaxDataThreads = 2;

namespace {
std::string seconds_text(std::chrono::milliseconds d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", double(d.count()) / 1000.0);
  return text;
}
}  // namespace

// Serving: the bridge, hellos, what each message means, the heartbeat ticker, and stopping. A job's own
// work is node_job's; loading data is data_cache's.
struct node_service::impl {
  node_options opt;
  // stderr, unless opt.log takes the lines: written by a thread of its own (net/log_writer.hpp). Last to go.
  std::unique_ptr<net::log_writer> out = opt.log ? nullptr : std::make_unique<net::log_writer>();
  std::vector<std::string> slots;  // one device per replica this node offers
  caf::actor_system_config sys_cfg;
  std::unique_ptr<caf::actor_system> sys;
  int workers = 1;  // sys's threads, at most one per core
  // Keys, loaded before the bridge is made (start() reports key_error).
  std::string key_dir, key_error;
  net::key_pair keys;
  const std::string host = net::host_id();  // in hello_ack: nodes with equal ones share memory
  net::authorized_keys authorized;  // KEY_DIR/authorized_keys, read again at handshakes and ticks (bridge thread)
  // Since when the running job's launcher may not command us: its job ends once that held kRevokeSettle (a
  // file written in place is empty a moment). (*) Read afresh meanwhile: a stat of the whole file, then a
  // read just after it was emptied, would stand until its (coarse, ms) times change.
  std::optional<std::chrono::steady_clock::time_point> revoked_since;
  static constexpr std::chrono::seconds kRevokeSettle{1};
  net::bridge br;
  // Ring chunks from other hosts' nodes, sealed with the keys we share with them (plain with --insecure).
  // After br: its thread logs through it.
  std::unique_ptr<net::tcp_port> ring_port;
  data_cache data;
  std::thread ticker;
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopping = false;
  std::atomic<int> jobs_done{0};
  std::optional<std::chrono::steady_clock::time_point> trim_at;  // bridge thread: when to give memory back
  std::chrono::steady_clock::time_point trimmed{};                 // and when it last did
  // Bridge thread: the last tick, and how long this node itself did not run during the job (a tick long
  // after the one before: SIGSTOP, a starved host), a silence of the launcher's it may not blame on it.
  std::chrono::steady_clock::time_point last_tick{};
  std::chrono::milliseconds not_running{0};
  std::atomic<bool> busy{false};
  std::unique_ptr<node_job> job;  // at most one; touched only on the bridge thread
  // Bridge thread: the routing id of the last job's launcher, and of one whose failed sends were said.
  std::string last_launcher, unreachable_launcher;
  // The jobs taken lately, with the life this node had in each (plan_node::life): a plan for one of them
  // delivered again would start the same sealing keys' counters (net/seal.hpp) from 0, reusing nonces;
  // it is refused. Bounded: job ids are random 64-bit numbers.
  std::set<std::pair<uint64_t, int>> past_jobs;
  std::deque<std::pair<uint64_t, int>> past_order;
  // The bridge's complaints and refusals, a few lines of each kind per window (bridge thread only).
  net::log_limiter limited{[this](const std::string& line) { log(line); }};
  void log_limited(const std::string& kind, const std::string& line) { limited.log(kind, line); }
  void log_fault(const net::bridge_error& e) {
    const bool dropped = e.kind == net::fault::malformed || e.kind == net::fault::version_mismatch ||
                         e.kind == net::fault::handler_failed || e.kind == net::fault::send_failed;
    // The bridge names our own endpoint first in what it says of the listener; our lines name it already.
    const std::string own = br.endpoint() + ": ";
    const std::string what = name() == br.endpoint() && e.message.rfind(own, 0) == 0 ? e.message.substr(own.size()) : e.message;
    log_limited(net::fault_name(e.kind),
                (dropped ? std::string("dropped a message (") + net::fault_name(e.kind) + "): " : std::string()) + what);
  }

  explicit impl(node_options o) : opt(std::move(o)), br(bridge_options()), data(opt.data_dir) {}

  net::bridge_options bridge_options() {
    net::bridge_options bo;
    bo.name = opt.name;
    // Two I/O threads: libzmq gives each new connection the least loaded one, so the launcher's (heartbeats,
    // reports) does not wait behind the ring's, whose messages are encrypted whole, one at a time.
    bo.io_threads = 2;
    bo.max_connections = opt.max_connections;  // --insecure too: a stranger's clients count as anyone's
    // Replies ZeroMQ queues for one client before ours hold them (bounded, net/bridge_impl.hpp): a client
    // that sends and never reads must not make it queue 100,000 (~70 MB). 10,000 are seconds of a
    // launcher's reports.
    bo.hwm = 10000;
    // A launcher stopped (SIGSTOP, a debugger, a starved host) keeps its job for launcher_timeout: its
    // connection must outlast that, or what the job sends it meanwhile is lost and the job goes on
    // regardless. Past it the job ends, and the launcher finds out why once it runs again.
    bo.heartbeat_timeout = opt.launcher_timeout + std::chrono::seconds(2);
    if (opt.insecure) return bo;
    key_dir = opt.key_dir.empty() ? net::default_key_dir() : opt.key_dir;
    if (!net::load_or_create_keys(key_dir, &keys, &key_error)) return bo;
    authorized = net::authorized_keys(key_dir + "/authorized_keys");
    if (key_error = authorized.refresh(); !key_error.empty()) return bo;
    bo.keys = keys;
    bo.authorize = [this](const std::string& key) { return authorized_key(key); };
    return bo;
  }

  // Reads authorized_keys again if it may have changed (at each handshake, and each tick: a key revoked, or
  // a file fixed, counts for connections already open too). Until a file refused is fixed only our own key
  // commands us; said once per distinct error, not per read.
  void refresh_authorized() {
    const std::string was = authorized.error();
    const std::string& error = authorized.refresh();
    if (!error.empty() && error != was) log("authorized_keys refused, no other key may command this node until it is fixed: " + error);
    if (error.empty() && !was.empty())
      log("authorized_keys read again: " + std::to_string(authorized.size()) + (authorized.size() == 1 ? " key" : " keys"));
  }

  // Whether a key may command this node: its own, or one in authorized_keys. A running job's nodes that
  // send us ring chunks through the bridge get through the handshake too, but only to send those.
  bool commander(const std::string& key) const { return key == keys.public_key || authorized.contains(key); }

  // On the bridge thread, for each client's handshake: our own key (a launcher sharing our key
  // directory), an authorized launcher's, or that of a running job's node that sends us chunks through
  // the bridge (node_job::sends_through_bridge; the others send them to our ring port or through shared
  // memory, and have no business on this port).
  bool authorized_key(const std::string& key) {
    refresh_authorized();
    if (commander(key) || (job && job->sends_through_bridge(key))) return true;
    if (job)  // say why, not only that its key is not authorized (the bridge's line)
      for (const plan_node& n : job->plan().nodes)
        if (n.key == key)
          return log_limited("refused node", "refused node " + n.endpoint + " of job " + std::to_string(job->id()) +
                                                 " at this port: its ring chunks come to our ring port or through shared memory"),
                 false;
    return false;
  }

  std::string name() const { return opt.name.empty() ? br.endpoint() : opt.name; }

  void log(const std::string& line) {
    char ts[32];
    std::time_t t = std::time(nullptr);
    std::strftime(ts, sizeof ts, "%H:%M:%S", std::localtime(&t));
    std::string msg = std::string(ts) + " ringmaster-node " + name() + ": " + line;
    if (opt.log) opt.log(msg);
    else out->write(msg);
  }

  node_context context() {
    return {sys.get(), &br, name(), opt.devices, slots, opt.make_backend, opt.layers, [this](const std::string& l) { log(l); }, keys,
            ring_port.get(), [this](const net::bridge_error& e) { log_fault(e); }, opt.stall_after_steps, opt.stall_at_join_pause, opt.ring_poll, workers,
            {opt.lie_in_states, opt.lie_in_sums, opt.slow_states, opt.lie_in_steps}};
  }

  void send_kv(const net::peer_info& to, wire::msg_type type, uint64_t job_id, const wire::kv_map& kv) {
    std::string text, err;
    if (!wire::encode_kv(kv, &text, &err)) {  // never silent: the peer would wait for nothing
      log(std::string("could not send a ") + wire::type_name(type) + " reply: " + err);
      if (!wire::encode_kv({{"error", "node " + name() + ": its reply did not fit a control message"}}, &text, &err)) return;
      type = wire::msg_type::error;
    }
    wire::header h;
    h.type = type;
    h.job_id = job_id;
    br.reply(to, h, net::payload::copy_of(text));
  }

  // invalid: the job itself is bad (its model or settings), not this node's state; the launcher says so.
  // Rate-limited: anyone may send plans; but a job this node took and could not start is always logged.
  void refuse(const net::peer_info& from, uint64_t job_id, const std::string& why, bool invalid = false, bool taken = false) {
    const std::string line = "refused job " + std::to_string(job_id) + ": " + why;
    if (taken) log(line);
    else log_limited("refused job", line);
    send_kv(from, wire::msg_type::error, job_id, {{"error", "node " + name() + ": " + why}, {"invalid", invalid ? "1" : "0"}});
  }

  // Tells the running job's launcher that signal `why` stops this node: now, or (grace_ms > 0) once the
  // launcher drops the job, within grace_ms. The steps it did go first.
  void tell_stopping(const std::string& why, int64_t grace_ms) {
    job->flush_reports(std::chrono::milliseconds(200));
    wire::kv_map kv{{"reason", "node " + name() + (grace_ms ? " is being" : " was") + " stopped" + (why.empty() ? "" : " (" + why + ")")},
                    {"stopped", why}};
    if (grace_ms) kv["grace_ms"] = std::to_string(grace_ms);
    send_kv(job->launcher(), wire::msg_type::abort, job->id(), kv);
  }

  void end_job(const std::string& why) {
    if (!job) return;
    log("job " + std::to_string(job->id()) + " ended: " + why);
    last_launcher = job->launcher().identity;
    job.reset();
    revoked_since.reset();
    not_running = std::chrono::milliseconds(0);
    busy = false;
    ++jobs_done;
    trim_at = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  }

  // First half of a job's setup: read the plan, take the job slot, and load the data on a data thread,
  // which then posts the second half back here.
  void setup(const net::peer_info& from, const wire::header& h, const net::payload& p) {
    // Which job, and whose, is none of the asker's business. Before the plan is read: a flood of large
    // plans must not keep this thread from the running job's heartbeats.
    if (job) {
      const int64_t free_in = free_in_ms();  // a launcher stopped with kill -9 leaves its job here a while
      return refuse(from, h.job_id, std::string("busy with another job") +
                                        (free_in < 0 ? "" : ", whose launcher fell silent: dropped within " + std::to_string(free_in) + " ms"));
    }
    job_plan plan;
    std::string error;
    if (!from_json(p.text(), &plan, &error)) return refuse(from, h.job_id, error, true);  // "job plan: ..."
    if (plan.job_id != h.job_id)
      return refuse(from, h.job_id, "job plan: 'job' is " + std::to_string(plan.job_id) + ", the message's job is " +
                                        std::to_string(h.job_id), true);
    // Jobs stopped while their data loaded leave data threads behind, each holding its copy of the data:
    // a launcher that starts and stops jobs in a loop must not pile them up.
    if (data.loading() >= kMaxDataThreads) return refuse(from, plan.job_id, "busy loading the data of jobs stopped before they ran");
    // A node may join a job it left (reform.hpp) in a new life (new pair keys), or without sealing.
    const bool known = plan.recipient >= 0 && size_t(plan.recipient) < plan.nodes.size();
    const int life = known ? plan.nodes[size_t(plan.recipient)].life : 0;
    const bool seals = !plan.seal_salt.empty() && known && plan.nodes[size_t(plan.recipient)].ring_port != 0;
    if (past_jobs.count({plan.job_id, life}) && (seals || plan.generation == 0))
      return refuse(from, plan.job_id, "this node already ran a job with this id", true);
    if (!opt.insecure && (plan.recipient < 0 || size_t(plan.recipient) >= plan.nodes.size() ||
                          plan.nodes[size_t(plan.recipient)].key != keys.public_key))
      return refuse(from, h.job_id, "the job plan names another key for this node", true);
    bool invalid = false;
    if (std::string why = check_plan(plan, context(), &invalid); !why.empty()) return refuse(from, plan.job_id, why, invalid);
    past_jobs.insert({plan.job_id, life});
    past_order.push_back({plan.job_id, life});
    if (past_order.size() > 4096) {
      past_jobs.erase(past_order.front());
      past_order.pop_front();
    }
    job = std::make_unique<node_job>(context(), from, std::move(plan));
    not_running = std::chrono::milliseconds(0);  // a stop while a failed job's data loaded is not this one's
    busy = true;
    const job_plan& jp = job->plan();
    // The data thread builds the model too, and makes its first weights: seconds for a big one.
    data.load_job(jp.limit_train, jp.limit_test, jp.evaluate,
                  [this, plan = jp, ctx = context(), cancelled = job->cancelled()](std::shared_ptr<const dataset> train,
                                                                                   std::shared_ptr<const dataset> test, uint32_t print,
                                                                                   std::string err, bool bad_files) {
                    std::shared_ptr<const job_model> prepared;
                    bool invalid = bad_files;  // as the launcher's own --data would be: exit 2
                    if (train && !cancelled->load()) prepared = prepare_model(plan, ctx, train, test, *cancelled, &err, &invalid);
                    if (cancelled->load()) return;  // nobody waits for it
                    br.post([this, id = plan.job_id, train, test, print, prepared, err, invalid] {
                      start_job(id, train, test, print, prepared, err, invalid);
                    });
                  });
  }

  // Second half, once the data is loaded and the model prepared: the job spawns its ranks.
  void start_job(uint64_t id, std::shared_ptr<const dataset> train, std::shared_ptr<const dataset> test, uint32_t train_data,
                 std::shared_ptr<const job_model> prepared, std::string error, bool invalid) {
    if (!job || job->id() != id || job->running()) return;  // aborted while loading
    const net::peer_info launcher = job->launcher();
    try {  // e.g. out of memory: refuse the job, keep the daemon
      if (train && prepared) {
        wire::kv_map ack;
        job->start(*prepared, train, test, train_data, &ack);
        return send_kv(launcher, wire::msg_type::job_ack, id, ack);
      }
    } catch (const std::exception& e) {
      error = std::string("could not start the job: ") + e.what();
    }
    if (job->running()) {
      end_job("could not start: " + error);
    } else {
      job.reset();
      busy = false;
    }
    refuse(launcher, id, error, invalid, true);
  }

  // The launcher lost a node or one rejoins, and re-forms the ring (elastic jobs, actors/reform.hpp), or it
  // stops the job (for=hold, then for=stop; any job). `at`: after which step.
  void pause(const net::peer_info& from, const wire::header& h, const net::payload& p) {
    wire::kv_map kv;
    std::string error;
    auto number = [&kv](const char* key, int64_t lo, int64_t hi, int64_t* out) {
      const std::string& v = kv[key];
      auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), *out);
      return !v.empty() && ec == std::errc() && end == v.data() + v.size() && *out >= lo && *out <= hi;
    };
    // The job's launcher sent it: a malformed one is its bug, and it hears so (the job goes on as it was).
    auto refuse = [&](const std::string& why) {
      log_limited("ignored", "ignored " + why);
      send_kv(from, wire::msg_type::error, h.job_id, {{"error", "node " + name() + " ignored " + why}});
    };
    int64_t gen = 0, at = -1;
    if (!wire::decode_kv(p.text(), &kv, &error) || !number("gen", 1, 1 << 20, &gen))
      return refuse("a pause without a good generation ('" + kv["gen"].substr(0, 20) + "')");
    if (kv.count("at") && !number("at", 0, INT64_MAX, &at))
      return refuse("a pause with a bad step ('" + kv["at"].substr(0, 20) + "')");
    job->pause(int(gen), at, kv["for"]);
  }

  void reform(const net::peer_info& from, const wire::header& h, const net::payload& p) {
    job_plan next;
    std::string error;
    bool dropped = false;
    try {  // e.g. out of memory: the job ends, the daemon lives on
      if (from_json(p.text(), &next, &error) && next.job_id == h.job_id && job->reform(std::move(next), &error, &dropped))
        return send_kv(from, wire::msg_type::job_ack, h.job_id, {{"generation", std::to_string(job->plan().generation)}});
    } catch (const std::exception& e) {
      error = e.what();
    }
    if (dropped) return end_job("this node has no rank in the re-formed ring");
    if (error.empty()) error = "the re-formed plan is for another job";
    send_kv(from, wire::msg_type::error, h.job_id, {{"error", "node " + name() + ": cannot join the re-formed ring: " + error}});
    end_job("cannot join the re-formed ring: " + error);
  }

  // A job whose launcher has fallen silent (crashed: a live one heartbeats every 100 ms): in how many ms we
  // drop it (then a tick); -1 when there is no such job.
  int64_t free_in_ms() const {
    if (!job || job->launcher_silence() < std::chrono::milliseconds(500)) return -1;
    return std::max<int64_t>(0, (opt.launcher_timeout - job->launcher_silence()).count()) + opt.heartbeat.count();
  }

  // Who we are, and whether we are busy, and when free: a launcher started at once waits for that.
  wire::kv_map hello_ack() const {
    wire::kv_map kv{{"name", name()}, {"id", br.name()}, {"devices", opt.devices}, {"ring_port", std::to_string(ring_port ? ring_port->port() : 0)},
                    {"host", host}, {"version", std::to_string(wire::kProtocolVersion)}, {"busy", job ? "1" : "0"},
                    {"launcher_timeout_ms", std::to_string(opt.launcher_timeout.count())}};
    if (const int64_t ms = free_in_ms(); ms >= 0) kv["free_in_ms"] = std::to_string(ms);
    return kv;
  }

  void on_message(const net::peer_info& from, const wire::header& h, net::payload p) {
    using wire::msg_type;
    // The running job's launcher is heard until its job ends (a second after its key is shut out: see tick).
    if (!opt.insecure && h.type != msg_type::chunk && !commander(from.key) && !(job && job->from_launcher(from))) {
      log_fault({net::fault::unauthorized, from, std::string("ignored a message of type ") + wire::type_name(h.type) +
                                                     " from a key that may not command this node (not in authorized_keys; a job's node may send ring chunks only)"});
      return;
    }
    const bool ours = job && h.job_id == job->id();
    const bool launcher = ours && job->from_launcher(from);  // only the job's launcher steers it
    if (launcher) job->heard();
    switch (h.type) {
      case msg_type::hello:
        send_kv(from, msg_type::hello_ack, h.job_id, hello_ack());
        return;
      case msg_type::job:
        setup(from, h, p);
        return;
      case msg_type::start:
        if (launcher) job->run_rank(h.sender_rank);
        return;
      case msg_type::weights:
        if (launcher) job->send_weights(h.sender_rank);
        return;
      case msg_type::weights_sum:
        if (launcher) job->send_weights_sum(h.sender_rank);
        return;
      case msg_type::abort:
        if (launcher) {
          wire::kv_map kv;
          std::string error;
          wire::decode_kv(p.text(), &kv, &error);
          end_job(kv.count("reason") ? kv["reason"] : "aborted by the launcher");
        }
        return;
      case msg_type::chunk:  // its job field names the ring: the job's, or a re-formed one's
        if (job && job->takes_ring(h.job_id)) job->route_chunk(from, h, std::move(p));  // else a late chunk
        return;
      case msg_type::pause:
        if (launcher) pause(from, h, p);
        return;
      case msg_type::reform:
        if (launcher) reform(from, h, p);
        return;
      case msg_type::checkpoint:
        if (launcher && h.elements == 0 && p.empty()) return job->send_state(h.sender_rank);  // a request
        if (launcher) {
          std::string error;
          bool complete = false;
          if (!job->take_state(h, p, &error, &complete)) {
            refuse(from, h.job_id, error);
            end_job("a state it was sent did not fit: " + error);
          } else if (complete && job->plan().generation > 0) {  // a node joining a ring: the launcher waits for this
            send_kv(from, msg_type::job_ack, h.job_id, {{"generation", std::to_string(job->plan().generation)}});
          }
        }
        return;
      case msg_type::heartbeat:
        return;
      default:
        log_fault({net::fault::unauthorized, from, std::string("ignored a message of type ") + wire::type_name(h.type)});
    }
  }

  void tick() {
    const auto now = std::chrono::steady_clock::now();
    const auto gap = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_tick);
    if (job && last_tick != std::chrono::steady_clock::time_point{} && gap > opt.heartbeat + opt.launcher_timeout / 2) {
      // The launcher's silence meanwhile was ours: it gets its time afresh (a launcher that dropped us
      // meanwhile says so in a message that is already here).
      not_running += gap;
      log("this node did not run for " + seconds_text(gap) + " (stopped, or its host starved): the launcher gets " +
          seconds_text(opt.launcher_timeout) + " from now to be heard");
      job->heard();
    }
    last_tick = now;
    if (!opt.insecure) {
      refresh_authorized();
      // A launcher whose key was revoked loses its job, told why, once that has held for kRevokeSettle.
      if (!job || commander(job->launcher().key)) {
        revoked_since.reset();
      } else if (authorized.read_again(), !revoked_since) {  // read afresh at each tick meanwhile (*)
        revoked_since = now;
      } else if (now - *revoked_since >= kRevokeSettle) {
        const std::string why = "the launcher's key " + job->launcher().key + " may no longer command this node (" +
                                (authorized.error().empty() ? "not in its authorized_keys"
                                                            : "its authorized_keys is refused, and lets no key but the node's own in until fixed: " + authorized.error()) + ")";
        send_kv(job->launcher(), wire::msg_type::error, job->id(), {{"error", "node " + name() + ": " + why}});
        return end_job(why);
      }
    }
    // Lines held back in a window that is over are summed up now, not with the next one (which may never come).
    limited.tick(now);
    // A second after a job ends (its actors have let go of its buffers by then), and every 30 s while
    // idle, the heap goes back to the system: a long-lived daemon should not keep a job's peak, nor what
    // strangers made it hold (replies queued for clients that do not read, say).
    if (!job && (trim_at ? now >= *trim_at : now - trimmed > std::chrono::seconds(30))) {
      malloc_trim(0);
      trim_at.reset();
      trimmed = now;
    }
    if (!job) return;
    if (job->launcher_gone(opt.launcher_timeout)) {
      // Said to it too: a launcher that was only stopped (SIGSTOP, a starved host) learns why, once it runs.
      const std::string why = "the launcher stopped answering for " + std::to_string(opt.launcher_timeout.count()) + " ms" +
                              (not_running.count() ? " (after this node itself did not run for " + seconds_text(not_running) + ")" : "");
      send_kv(job->launcher(), wire::msg_type::abort, job->id(), {{"reason", "node " + name() + " dropped the job: " + why}});
      return end_job(why);
    }
    wire::header h;
    h.type = wire::msg_type::heartbeat;
    h.job_id = job->id();
    br.reply(job->launcher(), h);
  }
};

node_service::node_service(node_options options) : d_(std::make_unique<impl>(std::move(options))) {}

node_service::~node_service() { stop(); }

bool node_service::start(std::string* error) {
  if (!d_->key_error.empty()) return *error = d_->key_error, false;
  if (!parse_devices(d_->opt.devices, &d_->slots, error)) return false;
  // Every device offered must work now, not fail a job later: make each backend once.
  for (const std::string& dev : d_->slots) {
    if (dev == "cpu") continue;
    std::string why;
    if (!make_backend_with(d_->opt.make_backend, dev, &why)) {
      *error = "--devices " + d_->opt.devices + ": " + dev + ": " + why;
      return false;
    }
  }
  const int workers = workers_for(d_->opt.threads, int(d_->slots.size()));
  configure(d_->sys_cfg, workers);
  d_->workers = std::min(workers, cpu_cores());
  d_->sys = std::make_unique<caf::actor_system>(d_->sys_cfg);
  impl* d = d_.get();
  d->br.set_handler([d](const net::peer_info& from, const wire::header& h, net::payload p) {
    d->on_message(from, h, std::move(p));
  });
  d->br.set_error_handler([d](const net::bridge_error& e) {
    // A launcher killed (kill -9) is no longer connected, and what the job still sends it fails message by
    // message: said once, in words, not each send with the launcher's routing id.
    const std::string& to = e.from.identity;
    // A report the job's launcher never gets leaves its accounting short for good (a step, an epoch, a
    // checkpoint it waits on): the job cannot go on right, and ends now, saying why.
    if ((e.kind == net::fault::send_failed || e.kind == net::fault::overloaded) && d->job && !to.empty() && to == d->job->launcher().identity)
      return d->end_job(e.kind == net::fault::send_failed ? "its launcher's connection broke (what the job sent it was lost)"
                                                         : "its launcher did not take what the job sent it (some of it was dropped)");
    if (e.kind == net::fault::send_failed && !to.empty() && to == d->last_launcher) {
      if (d->unreachable_launcher != to) d->log("the launcher of the job that ended is not connected: what was left to send it is dropped");
      d->unreachable_launcher = to;
      return;
    }
    d->log_fault(e);
    // A link of the ring that cannot be made fails the job now, naming why, not at the ring's watchdog.
    if (e.kind == net::fault::handshake_failed && !e.retrying && d->job) d->job->link_failed(e.from.peer, e.message);
  });
  const size_t authorized = d->authorized.size();  // before the bridge thread may read the file again
  // The ring port, on the host the bridge listens on (tcp only: ring chunks between hosts), before
  // the bridge answers any hello, which names it.
  if (const std::string& ep = d->opt.listen; ep.rfind("tcp://", 0) == 0) {
    net::tcp_port_options po;
    po.cut_after = d->opt.cut_ring_link_after, po.cut_every = d->opt.cut_every_ring_link;
    po.on_refusal = [d](const std::string& why) {  // the bridge drops it once it has stopped
      d->br.post([d, why] { d->log_fault({net::fault::unauthorized, {}, "ring port: " + why}); });
    };
    if (!(d->ring_port = net::tcp_port::bind(ep.substr(6, ep.rfind(':') - 6), d->opt.ring_port, po, error))) {
      *error = "the ring port " + *error;  // "the ring port 127.0.0.1:5602: address already in use"
      d->sys.reset();
      return false;
    }
  }
  if (!d->br.start(d->opt.listen, error)) {
    d->ring_port.reset();
    d->sys.reset();
    return false;
  }
  d->ticker = std::thread([d] {
    std::unique_lock<std::mutex> lock(d->stop_mu);
    while (!d->stop_cv.wait_for(lock, d->opt.heartbeat, [d] { return d->stopping; }))
      d->br.post([d] { d->tick(); });
  });
  d->log("listening on " + d->br.endpoint() +
         (d->ring_port ? std::string(" (ring chunks from other hosts on port ") + std::to_string(d->ring_port->port()) +
                             (d->opt.insecure ? ", plain)" : ", sealed)")
                       : "") +
         ", offering " + d->opt.devices + ", data from " + d->opt.data_dir);
  // Under Slurm, systemd or a container the group's limit, not the machine's memory, decides which jobs fit.
  if (const memory_bound usable = usable_memory(); !usable.group.empty())
    d->log("memory: " + describe(usable) + "; a job needing more than half of it is refused");
  // Segments a daemon killed with SIGKILL left behind (their memory stays reserved until removed).
  if (const int swept = net::sweep_segments())
    d->log("removed " + std::to_string(swept) + " shared-memory segment(s) of processes that are gone");
  if (d->opt.insecure)
    d->log("--insecure: no keys, no encryption; anyone who can reach " + d->br.endpoint() + " can command this node");
  else
    d->log("key " + d->keys.public_key + " (" + d->key_dir + "/key.pub); serving launchers with this key or one of the " +
           std::to_string(authorized) + " in " + d->key_dir + "/authorized_keys");
  return true;
}

void node_service::stop(const std::string& why) {
  if (!d_ || !d_->sys) return;
  if (std::lock_guard<std::mutex> lock(d_->stop_mu); std::exchange(d_->stopping, true)) return;  // once
  d_->stop_cv.notify_all();
  if (d_->ticker.joinable()) d_->ticker.join();
  impl* d = d_.get();
  std::promise<void> done;
  bool told = false;
  if (d->br.post([d, &done, &told, why] {
        // The launcher hears it from us, not from silence: a stopped node is not a lost network.
        if (d->job) told = true, d->tell_stopping(why, 0);
        d->end_job("the node is shutting down");
        done.set_value();
      }))
    done.get_future().wait();
  if (told) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // linger 0: let the abort leave
  d->br.stop();  // no job of ours is set up any more: the ring port goes next
  d->ring_port.reset();
  d->data.join();
  d->log("stopped");
  d->sys.reset();  // waits for the job's actors to finish
}

bool node_service::announce_stop(const std::string& why, int64_t grace_ms) {
  // Shared: the bridge may run it after we gave up waiting, or never (it ended meanwhile).
  auto told = std::make_shared<std::promise<bool>>();
  auto answer = told->get_future();
  const bool posted = d_->br.post([d = d_.get(), told, why, grace_ms] {
    if (d->job) d->tell_stopping(why, grace_ms);
    told->set_value(d->job != nullptr);
  });
  return posted && answer.wait_for(std::chrono::seconds(2)) == std::future_status::ready && answer.get();
}

void node_service::log(const std::string& line) { d_->log(line); }
std::string node_service::endpoint() const { return d_->br.endpoint(); }
int node_service::jobs_done() const { return d_->jobs_done; }
bool node_service::busy() const { return d_->busy; }

}  // namespace ringmaster
