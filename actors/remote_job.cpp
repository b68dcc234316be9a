#include "actors/remote_job.hpp"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "actors/checkpoint.hpp"
#include "actors/job_plan.hpp"
#include "actors/messages.hpp"
#include "actors/reform.hpp"
#include "actors/report_kv.hpp"
#include "net/bridge.hpp"

namespace ringmaster {
namespace {

using clock_type = std::chrono::steady_clock;

struct control_msg {
  int node;
  wire::header h;
  wire::kv_map kv;
};

// A remote rank as the coordinator sees it: run starts the rank on its node, weights are fetched from
// it, reports arrive from the bridge. It quits with an error when its node fails or falls silent. The
// nodes wire the ring themselves, from the job plan.
struct rank_proxy_state {
  caf::response_promise weights;
  bool waiting = false;
};

caf::behavior rank_proxy(caf::event_based_actor* self, net::bridge* br, int peer, uint64_t job, int rank) {
  auto st = std::make_shared<rank_proxy_state>();
  return {
      [br, peer, job, rank](run_atom, caf::actor, caf::actor, caf::actor) {
        wire::header h;
        h.type = wire::msg_type::start;
        h.job_id = job;
        h.sender_rank = rank;  // the rank addressed
        br->send(peer, h);
      },
      [self, st, br, peer, job, rank](weights_atom) {
        st->weights = self->make_response_promise();
        wire::header h;
        h.type = wire::msg_type::weights;
        h.job_id = job;
        h.sender_rank = rank;  // the rank addressed; no payload: a request
        br->send(peer, h);
        return st->weights;
      },
      [st](weights_atom, chunk_ptr w) { st->weights.deliver(std::move(w)); },
      [self](fail_atom, const std::string& why) { self->quit(caf::make_error(caf::sec::runtime_error, why)); },
  };
}

struct launcher {
  launcher(remote_options o, net::bridge_options bo) : ro(std::move(o)), br(std::move(bo)) {}
  remote_options ro;
  net::bridge br;
  std::vector<int> peer;  // node index -> connection
  uint64_t job_id = 0;
  job_plan plan;  // the plan the nodes hold: set before any job message goes out; then on the bridge thread
  // Control replies during setup, for the main thread.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<control_msg> inbox;
  // After setup: where reports go (set before the nodes start, then read and changed on the bridge thread).
  caf::actor_system* sys = nullptr;
  std::vector<caf::actor> proxies;  // the coordinator's ranks, index = rank
  std::vector<int> proxy_node;      // the node each of them runs on
  std::vector<caf::actor> retired;  // proxies of rings given up on, stopped when the job ends
  caf::actor coordinator;
  std::atomic<bool> started{false};  // proxies and coordinator are set (the bridge thread reads them)
  std::unique_ptr<std::atomic<int64_t>[]> last_heard;  // per node, steady-clock ticks
  bool refused_invalid = false;  // a node refused the job's description or settings as invalid
  // Checkpoints: rank 0's state arrives one buffer at a time (set before start: sizes; then the bridge
  // thread's alone).
  size_t param_count = 0;
  int32_t state_buffers = 0;  // 3 for Adam, 2 for SGD
  std::shared_ptr<network_state> incoming;
  // Elastic continuation (actors/reform.hpp), on the bridge thread but `gone` (the watchdog reads it).
  std::unique_ptr<std::atomic<bool>[]> gone;  // per node: lost, no part of the job any more
  enum class phase { running, pausing, reforming } now = phase::running;
  int gen = 0;                                 // the ring generation being formed or running
  std::map<std::pair<int, int>, int64_t> applied;  // pause answers: (node, rank) -> steps applied
  std::vector<bool> acked;                     // per node: took the re-formed plan
  int taken_back = 0;                          // ranks that were one step ahead
  clock_type::time_point forming_since;
  std::vector<node_loss> losses;               // since the last re-forming, for the coordinator
  clock_type::time_point last_word = clock_type::time_point::max();  // the earliest last message of those
  std::mutex event_mu;

  void event(const std::string& line) {
    std::lock_guard<std::mutex> lock(event_mu);
    if (ro.on_event) ro.on_event(line);
  }
  clock_type::time_point heard(int node) const { return clock_type::time_point(clock_type::duration(last_heard[node].load())); }

  int node_of(const net::peer_info& from) const {
    for (size_t i = 0; i < peer.size(); ++i)
      if (peer[i] == from.peer) return int(i);
    return -1;
  }

  // Fails the job: the coordinator's ranks on `node` (all of them if none) stop with `why`.
  void kill_node(int node, const std::string& why) {
    bool any = false;
    for (size_t r = 0; r < proxies.size(); ++r)
      if (proxy_node[r] == node) any = true, caf::anon_send(proxies[r], fail_atom::value, why);
    for (size_t r = 0; r < proxies.size() && !any; ++r) caf::anon_send(proxies[r], fail_atom::value, why);
  }

  // Whether node `node` runs the coordinator's rank r: what a node says about a rank is heard only from
  // the node running it. (While the ring is re-formed the nodes' plan is ahead of the coordinator's.)
  bool reports_to_us(int node, int r) const { return r >= 0 && size_t(r) < proxies.size() && proxy_node[size_t(r)] == node; }

  // A buffer of rank 0's state after a step; once whole it goes to the coordinator. One out of order or
  // of the wrong size is dropped (and the coordinator then ends the job saying the checkpoint never came).
  void take_checkpoint(const wire::header& h, const net::payload& p) {
    const bool next = h.segment == 0 || (incoming && h.step == incoming->steps && h.segment == int32_t(incoming_filled()));
    if (!next || h.elements != param_count || h.segment >= state_buffers) {
      incoming.reset();
      return;
    }
    if (h.segment == 0) incoming = std::make_shared<network_state>();
    incoming->steps = h.step;
    std::vector<float>* into[] = {&incoming->params, &incoming->m1, &incoming->m2};
    into[h.segment]->assign(p.floats(), p.floats() + h.elements);
    if (h.segment + 1 == state_buffers) caf::anon_send(coordinator, checkpt_atom::value, state_ptr(std::move(incoming)));
  }
  size_t incoming_filled() const {
    return size_t(!incoming->params.empty()) + size_t(!incoming->m1.empty()) + size_t(!incoming->m2.empty());
  }

  // "2-3" or "1,4" : the ranks a node runs, for messages.
  std::string ranks_of(int node) const { return rank_list(plan.ranks_on(node)); }

  void send(int node, wire::msg_type type, const std::string& text, int rank = -1) {
    wire::header h;
    h.type = type;
    h.job_id = job_id;
    h.sender_rank = rank;
    br.send(peer[size_t(node)], h, text.empty() ? net::payload{} : net::payload::copy_of(text));
  }
  void send_kv(int node, wire::msg_type type, const wire::kv_map& kv) {
    std::string text, err;
    if (wire::encode_kv(kv, &text, &err)) send(node, type, text);
  }
  // Surviving nodes that run ranks of the plan.
  std::vector<int> survivors() const {
    std::vector<int> out;
    for (size_t i = 0; i < ro.nodes.size(); ++i)
      if (!gone[i] && !plan.ranks_on(int(i)).empty()) out.push_back(int(i));
    return out;
  }

  // Node `node` is lost: dead or silent (why: "no heartbeat for 1.6 s"), or stopped by a signal ("was
  // stopped (SIGTERM)"). Elastic: the survivors pause, and the ring is re-formed once they have said how
  // far they got (on_paused). On the bridge thread.
  void node_lost(int node, const std::string& why) {
    if (gone[node]) return;
    const std::string said = (why.rfind("no heartbeat", 0) == 0 ? "stopped answering: " : "") + why;
    if (!plan.elastic) return kill_node(node, "node " + ro.nodes[node] + " (ranks " + ranks_of(node) + ") " + said);
    gone[node] = true;
    node_loss l;
    l.node = ro.nodes[node];
    l.ranks = ranks_of(node);
    l.why = why;
    l.detected = std::chrono::duration<double>(clock_type::now() - heard(node)).count();
    losses.push_back(l);
    last_word = std::min(last_word, heard(node));
    send_kv(node, wire::msg_type::abort, {{"reason", "dropped from the job: " + l.why}});  // if it lives
    const std::vector<int> left = survivors();
    if (left.empty()) return kill_node(node, "node " + l.node + " (ranks " + l.ranks + ") " + said + ", and no node is left");
    event("lost node " + l.node + " (ranks " + l.ranks + "): " + why + "; re-forming the ring from " +
          std::to_string(left.size()) + " node" + (left.size() > 1 ? "s" : ""));
    ++gen;
    applied.clear();
    if (now == phase::running) forming_since = clock_type::now();
    now = phase::pausing;
    for (int i : left) send_kv(i, wire::msg_type::pause, {{"gen", std::to_string(gen)}});
  }

  // Re-forming waits for every survivor's answer; a replica busy with a long step answers late, but one
  // that never does must not hold the job forever.
  void check_forming() {
    if (now == phase::running || clock_type::now() - forming_since < ro.setup_timeout) return;
    now = phase::running;  // once
    kill_node(-1, "the ring could not be re-formed within " + std::to_string(ro.setup_timeout.count() / 1000) + " s of a node's loss");
  }

  // A replica stopped for generation `gen` after applying some steps. Once every surviving rank has
  // answered, the ring is re-formed from the smallest count (reform.hpp says why that is the one).
  void on_paused(int node, int rank, const pause_report& r) {
    if (now != phase::pausing || r.gen != gen || rank < 0 || rank >= kMaxPlanRanks) return;
    applied[{node, rank}] = r.applied;
    const std::vector<int> left = survivors();
    for (int i : left) {
      size_t answers = 0;
      for (auto& [who, n] : applied) answers += who.first == i;
      if (answers < plan.ranks_on(i).size()) return;
    }
    int64_t lo = INT64_MAX, hi = 0;
    for (auto& [who, n] : applied) lo = std::min(lo, n), hi = std::max(hi, n);
    if (hi - lo > 1) return kill_node(-1, "the survivors applied " + std::to_string(lo) + " to " + std::to_string(hi) + " steps: cannot go on together");
    std::random_device rd;
    uint64_t ring = 0;
    while (ring == 0 || ring == job_id) ring = uint64_t(rd()) | uint64_t(rd()) << 32;
    std::vector<bool> lost(ro.nodes.size());
    for (size_t i = 0; i < lost.size(); ++i) lost[i] = gone[i];
    job_plan next;
    std::string error;
    if (!make_reform(plan, lost, gen, ring, lo, &next, &error)) return kill_node(-1, "cannot re-form the ring: " + error);
    for (int i : left) {
      next.recipient = i;
      send(i, wire::msg_type::reform, to_json(next));
    }
    next.recipient = -1;
    plan = std::move(next);
    taken_back = 0;
    for (auto& [who, n] : applied) taken_back += n > lo;
    acked.assign(ro.nodes.size(), false);
    now = phase::reforming;
  }

  // A node took the re-formed plan. Once all have, its ranks start: every node has its new reducers
  // by then, so no chunk of the new ring finds nobody to take it.
  void on_reformed(int node, const wire::kv_map& kv) {
    auto g = kv.find("generation");
    if (now != phase::reforming || g == kv.end() || g->second != std::to_string(gen)) return;
    acked[size_t(node)] = true;
    for (int i : survivors())
      if (!acked[size_t(i)]) return;
    reform_note note;
    note.gen = gen;
    note.start_step = plan.start_step;
    retired.insert(retired.end(), proxies.begin(), proxies.end());
    proxies.clear();
    proxy_node.clear();
    for (const rank_plan& r : plan.ranks) {
      proxies.push_back(sys->spawn(rank_proxy, &br, peer[size_t(r.node)], job_id, r.rank));
      proxy_node.push_back(r.node);
    }
    note.ranks = proxies;
    note.losses = std::move(losses);
    note.last_word = last_word;
    losses.clear();
    last_word = clock_type::time_point::max();
    event("ring generation " + std::to_string(gen) + ": " + std::to_string(plan.replicas()) + " ranks go on from step " +
          std::to_string(plan.start_step + 1) + " of the job" + (taken_back ? " (" + std::to_string(taken_back) + " took their last step back)" : ""));
    caf::anon_send(coordinator, reform_atom::value, note);  // before any report of the new ranks
    for (const rank_plan& r : plan.ranks) send(r.node, wire::msg_type::start, "", r.rank);
    now = phase::running;
  }

  void on_message(const net::peer_info& from, const wire::header& h, net::payload p) {
    const int node = node_of(from);
    if (node < 0 || (h.job_id != job_id && h.type != wire::msg_type::hello_ack)) return;
    if (gone && gone[node]) return;  // lost: whatever it says now is of no use
    last_heard[node] = clock_type::now().time_since_epoch().count();
    using wire::msg_type;
    // Reports, weights and aborts concern the proxies and the coordinator, which exist once started.
    const bool setup_reply = h.type == msg_type::hello_ack || h.type == msg_type::job_ack || h.type == msg_type::error;
    if (!setup_reply && !started.load(std::memory_order_acquire)) return;
    wire::kv_map kv;
    std::string error;
    switch (h.type) {
      case msg_type::hello_ack:
      case msg_type::job_ack:
      case msg_type::error: {
        wire::decode_kv(p.text(), &kv, &error);
        if (h.type == msg_type::job_ack && started.load(std::memory_order_acquire)) return on_reformed(node, kv);
        const std::string why = kv.count("error") ? kv["error"] : "node " + ro.nodes[node] + " reported an error";
        {
          std::lock_guard<std::mutex> lock(mu);
          inbox.push_back({node, h, std::move(kv)});
          cv.notify_all();
        }
        if (h.type == msg_type::error && started.load(std::memory_order_acquire)) kill_node(node, why);
        return;
      }
      case msg_type::report: {
        if (!wire::decode_kv(p.text(), &kv, &error)) return;
        const std::string kind = report_kind(kv);
        if (kind == "paused") {  // numbered as the replica knew itself: counted per node
          pause_report r;
          if (from_kv(kv, &r, &error)) on_paused(node, h.sender_rank, r);
          return;
        }
        if (!reports_to_us(node, h.sender_rank)) return;
        if (kind == "step") {
          step_report r;
          r.rank = h.sender_rank;
          if (from_kv(kv, &r, &error)) caf::anon_send(coordinator, r);
        } else if (kind == "eval") {
          eval_report r;
          r.rank = h.sender_rank;
          if (from_kv(kv, &r, &error)) caf::anon_send(coordinator, r);
        }
        return;
      }
      case msg_type::done:
        if (reports_to_us(node, h.sender_rank)) caf::anon_send(coordinator, done_atom::value, int(h.sender_rank));
        return;
      case msg_type::weights:
        if (reports_to_us(node, h.sender_rank)) {
          auto w = std::make_shared<std::vector<float>>(p.floats(), p.floats() + h.elements);
          caf::anon_send(proxies[size_t(h.sender_rank)], weights_atom::value, chunk_ptr(std::move(w)));
        }
        return;
      case msg_type::checkpoint:
        if (h.sender_rank == 0 && reports_to_us(node, 0)) take_checkpoint(h, p);
        return;
      case msg_type::abort:
        wire::decode_kv(p.text(), &kv, &error);
        // A node stopped by a signal is a lost node (elastic jobs go on without it); other aborts end the job.
        if (kv["stopped"] == "SIGTERM" || kv["stopped"] == "SIGINT") return node_lost(node, "was stopped (" + kv["stopped"] + ")");
        kill_node(node, kv.count("reason") ? kv["reason"] : "node " + ro.nodes[node] + " aborted the job");
        return;
      default:
        return;
    }
  }

  // Waits for one reply of `type` from every node; "" or what went wrong. A node that says nothing at all
  // (not even a heartbeat) for `silence` is given up on before the deadline.
  std::string await_all(wire::msg_type type, std::vector<wire::kv_map>* replies, std::chrono::milliseconds limit,
                        std::chrono::milliseconds silence) {
    replies->assign(ro.nodes.size(), {});
    std::vector<bool> got(ro.nodes.size(), false);
    size_t n = 0;
    const auto start = clock_type::now(), deadline = start + limit;
    auto beat = start;
    std::unique_lock<std::mutex> lock(mu);
    while (n < ro.nodes.size()) {
      if (!cv.wait_for(lock, std::chrono::milliseconds(50), [this] { return !inbox.empty(); })) {
        const auto now = clock_type::now();
        // Heartbeats while the nodes set up, too: a node whose launcher died frees itself within seconds.
        if (job_id != 0 && now - beat >= ro.heartbeat) {
          beat = now;
          broadcast(wire::msg_type::heartbeat, {});
        }
        for (size_t i = 0; i < got.size(); ++i) {
          if (got[i]) continue;
          const auto heard = clock_type::time_point(clock_type::duration(last_heard[i].load()));
          const auto quiet = now - std::max(heard, start);
          if (now > deadline || quiet > silence)
            return "node " + ro.nodes[i] + " did not answer within " +
                   std::to_string(std::chrono::duration<double>(now > deadline ? limit : silence).count()).substr(0, 4) +
                   " s (is ringmaster-node running there? A node that does not hold the key we expect, or runs "
                   "--insecure while we do not, stays silent)";
        }
        continue;
      }
      control_msg m = std::move(inbox.front());
      inbox.pop_front();
      if (m.h.type == wire::msg_type::error) {
        refused_invalid = m.kv.count("invalid") && m.kv["invalid"] == "1";  // a bad model or settings
        return m.kv.count("error") ? m.kv["error"] : "node " + ro.nodes[m.node] + " refused the job";
      }
      if (m.h.type != type || got[m.node]) continue;
      got[m.node] = true;
      (*replies)[m.node] = std::move(m.kv);
      ++n;
    }
    return "";
  }

  // Tells every node to drop the job, and gives the bridge a moment to send that before it stops.
  void abort_all(const std::string& reason) {
    broadcast(wire::msg_type::abort, {{"reason", reason}});
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }

  // To every node (but lost ones when skip_gone).
  void broadcast(wire::msg_type type, const wire::kv_map& kv, bool skip_gone = false) {
    std::string text, err;
    wire::encode_kv(kv, &text, &err);
    for (size_t i = 0; i < peer.size(); ++i) {
      if (skip_gone && gone && gone[i]) continue;
      wire::header h;
      h.type = type;
      h.job_id = job_id;
      br.send(peer[i], h, kv.empty() ? net::payload{} : net::payload::copy_of(text));
    }
  }
};

}  // namespace

train_result train_remote(train_config cfg, const remote_options& ro) {
  train_result failed;
  if (ro.nodes.empty()) {
    failed.error = "no nodes given";
    return failed;
  }
  if (ro.replicas_per_node < 1) {
    failed.error = "replicas per node must be at least 1";
    return failed;
  }
  model_desc desc;  // checked here; the nodes build it with their own layers and data
  if (!parse_model_desc(cfg.model, &desc, &failed.error)) {
    failed.invalid = true;
    return failed;
  }
  // What a resume or checkpoints need that can be checked before any node is asked.
  if (cfg.resume && !(failed.error = resume_mismatch(*cfg.resume, cfg, nullptr, -1)).empty()) {
    failed.invalid = true;
    return failed;
  }
  if (!cfg.checkpoint_dir.empty() && !(failed.error = check_checkpoint_dir(cfg.checkpoint_dir)).empty()) {
    failed.error = "checkpoints: " + failed.error;
    failed.invalid = true;
    return failed;
  }
  // The plan, computed once: every rank's node, device, neighbours and shard. The nodes' routing ids are
  // added once they have said them (hello_ack).
  job_placement where;
  for (const std::string& node : ro.nodes) where.nodes.push_back({node, "", "", ""});
  where.rank_node = ro.rank_node;
  if (where.rank_node.empty())
    for (int r = 0; r < int(ro.nodes.size()) * ro.replicas_per_node; ++r) where.rank_node.push_back(r / ro.replicas_per_node);
  // Of the devices only the kind: each node runs its ranks on the devices it offers.
  where.devices.assign(where.rank_node.size(), cfg.devices.empty() ? "cpu" : device_kind(cfg.devices[0]));
  where.limit_train = ro.limit_train;
  where.limit_test = ro.limit_test;
  // Keys: ours, and the one each node must prove it holds.
  net::bridge_options bo;
  std::vector<bool> record(ro.nodes.size(), false);
  const std::string key_dir = ro.key_dir.empty() ? net::default_key_dir() : ro.key_dir;
  if (!ro.insecure) {
    if (!net::load_or_create_keys(key_dir, &bo.keys, &failed.error)) return failed;
    for (size_t i = 0; i < ro.nodes.size(); ++i) {
      const std::string given = i < ro.node_keys.size() ? ro.node_keys[i] : "";
      bool rec = false;
      if (!net::expected_node_key(key_dir + "/known_nodes", ro.nodes[i], given, bo.keys.public_key,
                                  &where.nodes[i].key, &rec, &failed.error))
        return failed;
      record[i] = rec;
    }
  }
  launcher L{ro, bo};
  if (!make_job_plan(cfg, where, &L.plan, &failed.error)) {
    failed.invalid = true;  // the settings or the placement, not a node
    return failed;
  }
  const int n = L.plan.replicas();
  cfg.replicas = n;
  // Random, so a late message of an earlier job is never taken for this one; 0 means "no job".
  std::random_device rd;
  while (L.job_id == 0) L.job_id = uint64_t(rd()) | uint64_t(rd()) << 32;
  L.plan.job_id = L.job_id;
  L.plan.elastic = !ro.abort_on_node_loss;
  L.plan.shared_memory = ro.shared_memory;
  L.last_heard.reset(new std::atomic<int64_t>[ro.nodes.size()]);
  L.gone.reset(new std::atomic<bool>[ro.nodes.size()]);
  for (size_t i = 0; i < ro.nodes.size(); ++i) {
    L.last_heard[i] = clock_type::now().time_since_epoch().count();
    L.gone[i] = false;
  }
  L.br.set_handler([&L](const net::peer_info& from, const wire::header& h, net::payload p) {
    L.on_message(from, h, std::move(p));
  });
  // A node that refuses our key, or holds another than we expect, says so only through the handshake:
  // that reason ends the wait for its answer at once.
  L.br.set_error_handler([&L](const net::bridge_error& e) {
    if (e.kind != net::fault::handshake_failed) return;
    control_msg m{0, {}, {{"error", "node " + e.message}}};  // the message names the endpoint
    m.h.type = wire::msg_type::error;
    std::lock_guard<std::mutex> lock(L.mu);
    L.inbox.push_back(std::move(m));
    L.cv.notify_all();
  });
  std::string error;
  if (!L.br.start("", &error)) {
    failed.error = error;
    return failed;
  }
  for (size_t i = 0; i < ro.nodes.size(); ++i) {
    const std::string& node = ro.nodes[i];
    int p = L.br.connect(node, L.plan.nodes[i].key, &error);
    if (p < 0) {
      failed.error = "cannot connect to node " + node + ": " + error;
      return failed;
    }
    L.peer.push_back(p);
  }
  std::vector<wire::kv_map> replies;
  L.broadcast(wire::msg_type::hello, {{"role", "launcher"}});
  failed.error = L.await_all(wire::msg_type::hello_ack, &replies, ro.connect_timeout, ro.connect_timeout);
  if (!failed.error.empty()) return failed;
  // A key given for a node is now proven: remember it, as ssh remembers a host key.
  for (size_t i = 0; i < ro.nodes.size(); ++i)
    if (record[i] && !net::record_known_node(key_dir + "/known_nodes", ro.nodes[i], L.plan.nodes[i].key, &error))
      std::fprintf(stderr, "ringmaster: could not record the key of %s: %s\n", ro.nodes[i].c_str(), error.c_str());

  // A node takes ring chunks for a rank only from the node that runs its left neighbour, known by the
  // routing id it sends with.
  for (size_t i = 0; i < ro.nodes.size(); ++i) L.plan.nodes[i].id = replies[i]["id"];
  // Nodes on one host as one user pass ring chunks through shared memory (net/shm_link.hpp). A host id
  // that would not make a valid plan is no host id: that node uses the network.
  for (size_t i = 0; i < ro.nodes.size(); ++i) {
    const std::string& host = replies[i]["host"];
    const bool fits = host.size() <= kMaxHostIdBytes &&
                      std::all_of(host.begin(), host.end(), [](char c) { return c > ' ' && c < 127; });
    L.plan.nodes[i].host = fits ? host : "";
  }
  // With keys, ring chunks between nodes are sealed (net/seal.hpp) and go to each node's sealed port.
  if (!ro.insecure && ro.seal_chunks) {
    L.plan.seal_salt = net::make_seal_salt();
    for (size_t i = 0; i < ro.nodes.size(); ++i) {
      const std::string& port = replies[i]["sealed_port"];  // a node's word: checked, never std::stoi
      int v = 0;
      const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), v);
      L.plan.nodes[i].sealed_port = ec == std::errc() && end == port.data() + port.size() && v > 0 && v <= 65535 ? v : 0;
    }
  }
  if (!validate(L.plan, &failed.error)) {
    failed.error = "node answers do not make a job: " + failed.error;
    L.abort_all("bad hello");
    return failed;
  }
  // Every node gets the same plan, saying which of its nodes it is.
  for (size_t i = 0; i < ro.nodes.size(); ++i) {
    L.plan.recipient = int(i);
    const std::string text = to_json(L.plan);
    if (text.size() > wire::kMaxJobBytes) {
      failed.error = "the job plan is " + std::to_string(text.size()) + " bytes, over the limit of " +
                     std::to_string(wire::kMaxJobBytes) + " (a shorter model description or fewer nodes)";
      failed.invalid = true;
      L.abort_all("bad job");
      return failed;
    }
    wire::header h;
    h.type = wire::msg_type::job;
    h.job_id = L.job_id;
    L.br.send(L.peer[i], h, net::payload::copy_of(text));
  }
  L.plan.recipient = -1;
  // A node heartbeats once it has the job; until then (a loaded machine) it gets the hello's allowance.
  failed.error = L.await_all(wire::msg_type::job_ack, &replies, ro.setup_timeout, std::max(ro.node_timeout, ro.connect_timeout));
  if (!failed.error.empty()) {
    failed.invalid = L.refused_invalid;
    L.abort_all("another node refused the job");
    return failed;
  }
  const std::string train_count = replies[0]["train"];
  for (size_t i = 1; i < replies.size(); ++i) {
    if (replies[i]["train"] != train_count) {
      failed.error = "nodes disagree on the data: " + ro.nodes[0] + " has " + train_count + " training samples, " +
                     ro.nodes[i] + " has " + replies[i]["train"];
      L.abort_all("nodes disagree on the data");
      return failed;
    }
    // Every node built the description into the same layout (same layer code, same data shape).
    if (replies[i]["model"] != replies[0]["model"]) {
      failed.error = "nodes disagree on the model: " + ro.nodes[0] + " built layout " + replies[0]["model"] + ", " +
                     ro.nodes[i] + " built " + replies[i]["model"] + " (different ringmaster or layer versions?)";
      L.abort_all("nodes disagree on the model");
      return failed;
    }
  }
  char* end = nullptr;  // a node's word, not ours: checked, never std::stoull
  const unsigned long long samples = std::strtoull(train_count.c_str(), &end, 10);
  if (train_count.empty() || *end || train_count.size() > 12) {
    failed.error = "node " + ro.nodes[0] + " sent a bad sample count '" + train_count.substr(0, 20) + "'";
    L.abort_all("bad reply");
    return failed;
  }
  const int64_t steps = int64_t(steps_per_epoch(samples, cfg.global_batch));
  if (steps == 0) {
    failed.error = "global batch is larger than the nodes' " + train_count + " training samples";
    L.abort_all("batch too large");
    return failed;
  }
  // Checkpoints are written here, named by this program's layers; a resume is checked against the model
  // the nodes built.
  std::shared_ptr<const model> m;
  if (cfg.resume || !cfg.checkpoint_dir.empty()) {
    const layer_registry builtins = layer_registry::with_builtins();
    const layer_registry& reg = cfg.layers ? *cfg.layers : builtins;
    m = model::build(replies[0]["description"], reg, &failed.error);  // as the nodes built it
    if (!m) failed.error = "checkpoints need the model's layers in this launcher too: " + failed.error;
    // The same model from the text as given, for its name ("784-64-10", "cnn") in files and messages.
    std::string ignored;
    if (auto named = m ? model::build(cfg.model, reg, m->input(), &ignored) : nullptr; named && named->description() == m->description())
      m = named;
    if (m && cfg.resume) failed.error = resume_mismatch(*cfg.resume, cfg, m.get(), int64_t(samples));
    if (!failed.error.empty()) {
      failed.invalid = true;
      L.abort_all("the job cannot resume or checkpoint");
      return failed;
    }
    L.param_count = m->param_count();
    L.state_buffers = cfg.opt.kind == optimizer_config::adam ? 3 : 2;
  }

  caf::actor_system_config sys_cfg;
  configure(sys_cfg, 2);
  caf::actor_system sys{sys_cfg};
  L.sys = &sys;
  rank_actors all;
  for (int r = 0; r < n; ++r) {
    const int node = L.plan.ranks[size_t(r)].node;
    L.proxies.push_back(sys.spawn(rank_proxy, &L.br, L.peer[size_t(node)], L.job_id, r));
    L.proxy_node.push_back(node);
  }
  all.replicas = all.loaders = all.reducers = L.proxies;
  auto last = std::make_shared<std::string>();
  coordinator_config cc = job_coordinator_config(cfg, m, n, cfg.evaluate, int64_t(samples), steps, last);
  cc.on_event = [&L](const std::string& line) { L.event(line); };
  auto coord = sys.spawn(coordinator, cc);
  L.coordinator = coord;
  L.started.store(true, std::memory_order_release);
  // A resumed job's state to every node, before any start (the same connection keeps the order); a node
  // that cannot take it answers with an error, which fails the job.
  if (cfg.resume) {
    const auto& c = cfg.resume;
    const std::vector<float>* buffers[] = {&c->state.params, &c->state.m1, &c->state.m2};
    for (size_t i = 0; i < ro.nodes.size(); ++i)
      for (int32_t b = 0; b < L.state_buffers; ++b) {
        wire::header h;
        h.type = wire::msg_type::checkpoint;
        h.job_id = L.job_id;
        h.step = c->state.steps;
        h.segment = b;
        h.elements = buffers[b]->size();
        L.br.send(L.peer[i], h, net::payload::of(chunk_ptr(c, buffers[b])));
      }
  }

  // Heartbeats out, silence detection in; what a lost node means is worked out on the bridge thread.
  std::atomic<bool> running{true};
  std::thread watchdog([&] {
    std::vector<bool> dead(ro.nodes.size(), false);
    while (running) {
      std::this_thread::sleep_for(ro.heartbeat);
      L.broadcast(wire::msg_type::heartbeat, {}, true);
      const int64_t now = clock_type::now().time_since_epoch().count();
      for (size_t i = 0; i < ro.nodes.size(); ++i) {
        const auto silent = clock_type::duration(now - L.last_heard[i]);
        if (!dead[i] && silent > ro.node_timeout) {
          dead[i] = true;
          char why[64];
          std::snprintf(why, sizeof why, "no heartbeat for %.1f s", std::chrono::duration<double>(silent).count());
          L.br.post([&L, i, why = std::string(why)] { L.node_lost(int(i), why); });
        }
      }
      L.br.post([&L] { L.check_forming(); });
    }
  });

  std::shared_ptr<train_result> result = run_coordinator(sys, coord, all);
  result->model = replies[0]["description"];
  result->checkpoint = *last;
  running = false;
  watchdog.join();
  // Every node goes back to idle, whether the job succeeded or not.
  L.abort_all(result->ok ? "finished" : "the job failed: " + result->error);
  L.br.stop();
  for (auto* group : {&L.proxies, &L.retired})
    for (auto& p : *group) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
  return std::move(*result);
}

}  // namespace ringmaster
