#include "actors/node_job.hpp"

#include <algorithm>
#include <atomic>
#include <tuple>

#include "actors/checkpoint.hpp"
#include "actors/messages.hpp"
#include "actors/node_links.hpp"
#include "actors/reform.hpp"
#include "actors/ring_links.hpp"
#include "actors/training.hpp"

namespace ringmaster {

using clock_type = std::chrono::steady_clock;

std::string check_plan(const job_plan& plan, const node_context& ctx, bool* invalid) {
  *invalid = false;
  if (plan.recipient < 0) {
    *invalid = true;
    return "the job plan does not say which of its nodes this is ('recipient' is -1)";
  }
  for (size_t i = 0; i < plan.nodes.size() && plan.nodes.size() > 1; ++i)
    if (plan.nodes[i].id.empty()) {
      *invalid = true;
      return "the job plan does not name the id of node " + plan.nodes[i].endpoint;
    }
  // A plan past generation 0 as a job is a node joining a running ring: if it seals, it does so in a life
  // after its first, whatever the launcher says: under its first life's keys its counters, which start
  // again at 0, would reuse nonces. (The daemon refuses a (job, life) it has run before.)
  const plan_node& me = plan.nodes[size_t(plan.recipient)];
  if (plan.generation > 0 && !plan.seal_salt.empty() && me.ring_port != 0 && me.life == 0) {
    *invalid = true;
    return "the job plan has this node join ring generation " + std::to_string(plan.generation) +
           " with the sealing keys of its first life";
  }
  // What the node offers is how it was started, not a passing state: a job that asks for more or for other
  // devices is a mistake in its command line (the launcher exits 2), as a bad model is.
  const size_t mine = plan.ranks_on(plan.recipient).size();
  *invalid = mine > ctx.slots.size() || plan.device != device_kind(ctx.slots[0]);
  if (mine > ctx.slots.size())
    return "job asks for " + std::to_string(mine) + " replica" + (mine == 1 ? "" : "s") + ", this node offers " + ctx.offers;
  if (plan.device != device_kind(ctx.slots[0]))
    return "job runs on " + plan.device + " replicas, this node offers " + ctx.offers;
  model_desc desc;  // the description's syntax now; its layers and shapes once the data is here
  std::string error;
  if (!parse_model_desc(plan.model, &desc, &error)) {
    *invalid = true;
    return "bad model: " + error;
  }
  return "";
}

node_job::node_job(const node_context& ctx, net::peer_info launcher, job_plan plan)
    : ctx_(ctx), launcher_(std::move(launcher)), plan_(std::move(plan)), last_heard_(clock_type::now()) {
  mine_ = plan_.ranks_on(plan_.recipient);
  // The plan names only the kind of device for ranks on nodes: ours run on our devices, in order.
  for (size_t i = 0; i < mine_.size(); ++i) plan_.ranks[size_t(mine_[i])].device = ctx_.slots[i];
  make_pair_keys();
}

// With a seal salt in the plan: the key we share with every other node of the job (X25519 of our secret
// and its public key, net/seal.hpp), a sealer for what we send it and an opener for what it sends us. A
// node whose key does not work gets neither: chunks to and from it go over CurveZMQ.
void node_job::make_pair_keys() {
  // A node without a ring port in the plan seals nothing either (its chunks go over CurveZMQ, still
  // encrypted).
  if (plan_.seal_salt.empty() || ctx_.keys.empty() || plan_.nodes[size_t(plan_.recipient)].ring_port == 0) return;
  for (size_t j = 0; j < plan_.nodes.size(); ++j)
    if (j != size_t(plan_.recipient)) make_pair_key(j);
}

// The pair key with node j for the lives both are in (plan_node::life): made again, with its sealer and
// opener replacing the old ones, when j comes back (reform).
void node_job::make_pair_key(size_t j) {
  const uint32_t me = uint32_t(plan_.recipient);
  net::seal_key key;
  std::string error;
  sealers_.erase(int(j));
  openers_.erase(int(j));
  if (!net::pair_key(ctx_.keys, plan_.nodes[j].key, plan_.seal_salt, plan_.job_id, me, uint32_t(j),
                     uint32_t(plan_.nodes[me].life), uint32_t(plan_.nodes[j].life), &key, &error)) {
    ctx_.log("job " + std::to_string(plan_.job_id) + ": no sealing key for node " + plan_.nodes[j].endpoint + ": " + error);
    return;
  }
  sealers_[int(j)] = std::make_shared<net::sealer>(key, plan_.job_id, me);
  openers_[int(j)] = std::make_shared<net::opener>(key, plan_.job_id, uint32_t(j));
  net::wipe(key);
}

node_job::~node_job() {
  cancelled_->store(true);
  say_lending();
  shm_in_.clear();  // their threads hand chunks to our ports: they stop first (one a replica polls, once
  tcp_in_.clear();  // its poll ends: its chunks go to the port it polls for, which the replica holds)
  for (auto& [node, out] : tcp_out_) out->abort();
  tcp_out_.clear();
  for (auto* group : {&replicas_, &loaders_, &reducers_})
    for (auto& [r, a] : *group) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  if (launcher_link_) caf::anon_send_exit(launcher_link_, caf::exit_reason::user_shutdown);
  // Chunks still queued for a peer (one that died, say) are dropped with their buffers; the next job
  // connects afresh.
  for (auto& [endpoint, peer] : peers_) ctx_.br->disconnect(peer);
}

bool node_job::from_launcher(const net::peer_info& p) const {
  return p.peer == launcher_.peer && p.identity == launcher_.identity && p.key == launcher_.key;
}

// The job's settings as the node runs them: its data, and what the node brings.
static train_config job_config(const job_plan& plan, const node_context& ctx, std::shared_ptr<const dataset> train,
                               std::shared_ptr<const dataset> test) {
  train_config cfg = plan_train_config(plan);
  cfg.train = std::move(train);
  cfg.test = std::move(test);
  cfg.layers = ctx.layers;
  cfg.make_backend = ctx.make_backend;
  cfg.stall_after_steps = ctx.stall_after_steps;
  cfg.stall_at_join_pause = ctx.stall_at_join_pause;
  return cfg;
}

std::shared_ptr<const job_model> prepare_model(const job_plan& plan, const node_context& ctx, std::shared_ptr<const dataset> train,
                                               std::shared_ptr<const dataset> test, const std::atomic<bool>& cancelled,
                                               std::string* error, bool* invalid) {
  *invalid = false;
  error->clear();
  try {  // out of memory, say: the job is refused, the daemon lives on
    const train_config cfg = job_config(plan, ctx, train, test);
    auto out = std::make_shared<job_model>();
    if (out->m = build_model(cfg, error); !out->m) {
      *error = "bad model: " + *error;
      *invalid = true;
      return nullptr;
    }
    if (*error = check_config(cfg, *out->m, int(plan.ranks_on(plan.recipient).size())); !error->empty()) {
      *invalid = true;
      return nullptr;
    }
    const int64_t steps = int64_t(steps_per_epoch(train->count, size_t(plan.global_batch))) * plan.epochs;
    // Equal: a job resumed from its last step's checkpoint, which its launcher checks against our model and
    // data (our job_ack) and then ends, writing its results from that checkpoint. No rank runs before it says.
    if (plan.first_step > steps) {
      *error = "the job resumes after step " + std::to_string(plan.first_step) + ", but this node's " + std::to_string(train->count) +
               " training samples make " + std::to_string(steps) + " steps in all (a checkpoint made with another --limit-train or data set?)";
      *invalid = true;
      return nullptr;
    }
    if (cancelled.load()) return nullptr;
    // A resumed job's ranks start from these too, until its state comes in a restore message.
    out->init = std::make_shared<const std::vector<float>>(init_params(*out->m, plan.seed));
    return out;
  } catch (const std::exception& e) {
    *error = std::string("could not start the job: ") + e.what();
    return nullptr;
  }
}

void node_job::start(const job_model& prepared, std::shared_ptr<const dataset> train, std::shared_ptr<const dataset> test,
                     uint32_t train_data, wire::kv_map* ack) {
  train_config cfg = job_config(plan_, ctx_, std::move(train), std::move(test));
  cfg.init_params = prepared.init;
  const std::shared_ptr<const model>& m = prepared.m;
  param_count_ = m->param_count();
  test_count_ = cfg.test ? cfg.test->count : 0;
  rank_actors local = spawn_ranks(*ctx_.sys, plan_, cfg, m, mine_, [this](int rank, size_t floats) { return lend_memory(rank, floats); });
  for (size_t i = 0; i < mine_.size(); ++i) {
    reducers_[mine_[i]] = local.reducers[i];
    ports_[mine_[i]] = local.ports[i];
    replicas_[mine_[i]] = local.replicas[i];
    loaders_[mine_[i]] = local.loaders[i];
  }
  started_ = replicas_;
  open_shm_receivers();  // before the job_ack: the launcher starts no rank (so no sender wires) before it
  open_tcp_receivers();
  // The ring is wired at the first start, not now: a node with a key of its own lets our connection in
  // only once it has the plan naming our key, and the launcher starts ranks only when every node has it.
  // The launcher hears of any of them failing.
  std::vector<caf::actor> watched;
  for (auto* group : {&local.replicas, &local.loaders, &local.reducers})
    watched.insert(watched.end(), group->begin(), group->end());
  link_faults faults = ctx_.faults;
  if (faults.lie_in_steps) {
    const int64_t spe = int64_t(steps_per_epoch(cfg.train->count, size_t(plan_.global_batch)));
    faults.last_epoch = plan_.epochs - 1;
    faults.last_step = spe - 1;
  }
  launcher_link_ = ctx_.sys->spawn(launcher_link, ctx_.br, launcher_, plan_.job_id, replicas_, watched, ctx_.name, faults);

  std::string ranks;
  for (int r : mine_) {
    if (!ranks.empty()) ranks += ',';
    ranks += std::to_string(r);
  }
  ctx_.log("job " + std::to_string(plan_.job_id) + " started: model " + m->label() + ", ranks " + ranks + " of " +
           std::to_string(plan_.replicas()) + ", " + std::to_string(cfg.train->count) + " training samples");
  *ack = {{"train", std::to_string(cfg.train->count)},
          {"train_data", std::to_string(train_data)},  // the same samples on every node?
          {"test", std::to_string(cfg.test ? cfg.test->count : 0)},
          {"model", std::to_string(m->fingerprint())},
          {"params", std::to_string(m->param_count())},
          {"description", m->description()}};
}

// The ring as the plan orders it. False with *error when a node cannot be reached.
bool node_job::wire_ring(std::string* error) {
  // Rank r sends to its right neighbour: a reducer here directly; one on another node through shared
  // memory (same host), over our TCP connection to that node's ring port (net/tcp_link.hpp, one per
  // node, sealed or plain), or else through the bridge, where that node takes our chunks as the plan
  // names our routing id.
  for (int r : mine_) {
    const int right = plan_.right(r);
    if (auto p = ports_.find(r); p == ports_.end() || !p->second) return *error = "rank " + std::to_string(r) + " has no reducer", false;
    link_ptr link;
    if (reducers_.count(right)) {
      link = make_port_link(ports_[right]);
    } else if (auto shm = open_shm_sender(r, right)) {
      if (auto w = windows_.find(r); w != windows_.end()) {
        shm->lend(w->second);
        // The replica waiting for its all-reduce lets go of what the neighbour has read, as it polls.
        if (auto in = shm_in_.find(r); in != shm_in_.end()) set_shm_poller(r, in->second, shm);
        lending_[r] = shm;
      }
      link = make_shm_link(std::move(shm));
    } else if (const int node = plan_.ranks[size_t(right)].node; on_ring_ports(node)) {
      if (!(link = tcp_ring_link(node, error))) return false;
    } else {
      const std::string& endpoint = plan_.ranks[size_t(right)].endpoint;
      auto known = peers_.find(endpoint);
      const int peer = known != peers_.end() ? known->second : ctx_.br->connect(endpoint, plan_.nodes[size_t(node)].key, error);
      if (peer < 0) {
        *error = "cannot reach node " + endpoint + ": " + *error;
        return false;
      }
      peers_[endpoint] = peer;
      link = make_bridge_link(ctx_.br, peer);
    }
    join(*ports_[r], std::move(link));
  }
  return true;
}

bool node_job::sends_through_bridge(const std::string& key) const {
  for (int r = 0; r < plan_.replicas(); ++r) {
    const int node = plan_.ranks[size_t(r)].node;
    if (node != plan_.recipient && plan_.nodes[size_t(node)].key == key && !on_ring_ports(node) &&
        plan_.ranks[size_t(plan_.right(r))].node == plan_.recipient)
      return true;  // as route_chunk takes chunks
  }
  return false;
}

bool node_job::on_ring_ports(int node) const {
  if (plan_.nodes[size_t(plan_.recipient)].ring_port == 0 || plan_.nodes[size_t(node)].ring_port == 0) return false;
  return sealers_.count(node) || (ctx_.keys.empty() && plan_.seal_salt.empty() && plan_.nodes[size_t(node)].key.empty());
}

link_ptr node_job::tcp_ring_link(int node, std::string* error) {
  if (auto known = tcp_out_.find(node); known != tcp_out_.end()) return make_tcp_link(known->second);
  const plan_node& nd = plan_.nodes[size_t(node)];
  // The node's ring port on the host we reach it at.
  const std::string endpoint = nd.endpoint.substr(0, nd.endpoint.rfind(':') + 1) + std::to_string(nd.ring_port);
  // A port that never lets us in fails the ranks that send there (on the sender's thread: the ports are
  // safe from any thread, the log goes to the bridge thread).
  std::vector<std::shared_ptr<reducer_port>> senders;
  for (int r : mine_)
    if (plan_.ranks[size_t(plan_.right(r))].node == node) senders.push_back(ports_[r]);
  net::bridge* br = ctx_.br;
  const std::string job = "job " + std::to_string(plan_.job_id);
  auto failed = [br, say = ctx_.log, job, senders, node = nd.endpoint](const std::string& why) {
    br->post([say, line = job + ": the ring's link to node " + node + " failed: " + why] { say(line); });
    for (auto& port : senders) fail(*port, "ring link to the next node: " + why);
  };
  auto seal = sealers_.count(node) ? sealers_[node] : nullptr;  // none: plain (on_ring_ports)
  auto out = net::tcp_sender::connect(endpoint, plan_.job_id, uint32_t(plan_.recipient), seal, failed, error);
  if (!out) return *error = "cannot reach node " + nd.endpoint + ": " + *error, nullptr;
  ctx_.log(job + ": ring chunks to node " + nd.endpoint + (seal ? std::string(" sealed (") + net::kSealCipher + ")" : " plain (--insecure)") +
           " at " + endpoint);
  tcp_out_[node] = out;
  return make_tcp_link(std::move(out));
}

void node_job::open_tcp_receivers() {
  if (!ctx_.ring_port) return;
  const uint64_t ring_id = plan_.ring_id();
  const std::string job = "job " + std::to_string(plan_.job_id);
  // Which of our ports each sending rank feeds, by the node it runs on.
  std::map<int, std::map<int, std::shared_ptr<reducer_port>>> feeds;
  for (int r : mine_) {
    const int left = plan_.left(r);
    const int node = plan_.ranks[size_t(left)].node;
    if (node != plan_.recipient && on_ring_ports(node)) feeds[node][left] = ports_[r];
  }
  net::bridge* br = ctx_.br;
  auto log = [br, say = ctx_.log, job](std::string line) { br->post([say, line = job + ": " + line] { say(line); }); };
  for (auto& [node, ports] : feeds) {
    auto strays = std::make_shared<int>(0);
    tcp_in_[node] = ctx_.ring_port->expect(
        plan_.job_id, uint32_t(node), openers_.count(node) ? openers_[node] : nullptr,
        [ports = ports, ring_id, log, strays](const wire::header& h, net::payload p) {
          // The pair key proved the node (or, plain, the login named it); the chunk must also be of this
          // ring and from a rank it runs whose right neighbour is here.
          if (auto it = ports.find(h.sender_rank); it != ports.end() && h.job_id == ring_id)
            return deliver(*it->second, from_wire(h, std::move(p)));
          if ((*strays)++ == 0)
            log("dropped a chunk of ring " + std::to_string(h.job_id) + " from rank " + std::to_string(h.sender_rank) +
                ": not a rank of this ring whose right neighbour runs here");
        },
        [ports = ports, log, br, fault = ctx_.fault, errors = std::make_shared<std::atomic<int>>(0)](const std::string& why) {
          // The first fails the ring; the rest (a plain port's strangers, who may log in again and again)
          // go to the node's rate-limited log.
          if (errors->fetch_add(1) == 0) log(why);
          else br->post([fault, why] { fault({net::fault::malformed, {}, why}); });
          for (auto& [r, port] : ports) fail(*port, why);
        },
        // Closed under our ring: the ranks it fed wait for chunks that will not come. Their launcher
        // judges it (the node gone, or the connection broken between live nodes) from their stalls.
        // (Said by the replicas whose all-reduce it fails: at a job's end a link closes with nothing to say.)
        [ports = ports, from = plan_.nodes[size_t(node)].endpoint](const std::string& why) {
          for (auto& [left, port] : ports) fail_link(*port, left, "the ring's link from node " + from + " closed: " + why);  // why last
        });
    // The replicas whose chunks come this way may take them themselves, as from shared memory. (One whose
    // left neighbour may send through shared memory polls that.)
    const auto budget = ctx_.workers >= int(mine_.size()) ? ctx_.ring_poll : std::chrono::microseconds(0);
    for (auto& [left, port] : ports) {
      if (shm_in_.count(plan_.right(left))) continue;
      set_poller(*port, [weak = std::weak_ptr<net::tcp_receiver>(tcp_in_[node])](std::chrono::steady_clock::time_point until,
                                                                                 const std::function<bool()>& done) {
        auto in = weak.lock();
        return in ? in->poll(until, done) : done();
      }, budget);
    }
  }
}

// A chunk arrives on our listening socket from the node that runs its sender's rank, for the sender's
// right neighbour, which runs here. Anything else is dropped: a stranger who knows the job id must not
// feed gradients into the ring.
void node_job::route_chunk(const net::peer_info& from, const wire::header& h, net::payload p) {
  const int sender = h.sender_rank;
  if (sender < 0 || sender >= plan_.replicas()) {
    ctx_.fault({net::fault::malformed, from,
                "a chunk from rank " + std::to_string(sender) + " of a job of " + std::to_string(plan_.replicas())});
    return;
  }
  const int dest = plan_.right(sender);
  auto it = reducers_.find(dest);
  if (it == reducers_.end()) {
    ctx_.fault({net::fault::malformed, from, "a chunk for rank " + std::to_string(dest) + ", which does not run here"});
    return;
  }
  const int node = plan_.ranks[size_t(sender)].node;
  // A node whose chunks come to our ring port (open_tcp_receivers) sends none this way: without keys,
  // whoever took over its routing id on the bridge would get them in.
  if (node != plan_.recipient && on_ring_ports(node)) {
    ctx_.fault({net::fault::unauthorized, from,
                "dropped a chunk said to be from rank " + std::to_string(sender) + " through the bridge: node " +
                    plan_.nodes[size_t(node)].endpoint + " sends its chunks to our ring port"});
    return;
  }
  // The CurveZMQ connection it came on proves the sender, and the routing id the plan names.
  const plan_node& nd = plan_.nodes[size_t(node)];
  const bool proven = from.key == nd.key && from.peer < 0 && from.identity == nd.id;
  if (node == plan_.recipient || !proven) {
    ctx_.fault({net::fault::unauthorized, from,
                "dropped a chunk said to be from rank " + std::to_string(sender) + ": it did not come from node " +
                    plan_.nodes[size_t(node)].endpoint + ", which runs that rank"});
    return;
  }
  // Added (and passed on) right here on the bridge thread: no hop to the reducer's thread per chunk.
  deliver(*ports_[dest], from_wire(h, std::move(p)));
}

bool node_job::take_state(const wire::header& h, const net::payload& p, std::string* error, bool* complete) {
  *complete = false;
  const int32_t buffers = plan_.opt.kind == optimizer_config::adam ? 3 : 2;
  // Paused: the state after the step the others finished (reform.hpp). Else a resumed job's, before start.
  const bool paused = paused_gen_ > plan_.generation;
  if (!paused && (!running() || plan_.first_step == 0 || resumed_)) {
    *error = "a state to resume from came for a job that does not resume, or has its state";
    return false;
  }
  std::shared_ptr<network_state>& into = paused ? forward_ : resume_state_;
  const bool whole = add_state_buffer(into, h, p, param_count_, buffers);
  if (!into || (!paused && h.step != plan_.first_step) || (paused && h.step < 1)) {
    *error = "state buffer " + std::to_string(h.segment) + " after step " + std::to_string(h.step) + " with " +
             std::to_string(h.elements) + " floats does not fit: expected " + std::to_string(param_count_) + " floats" +
             (paused ? std::string(", buffers in order") : " after step " + std::to_string(plan_.first_step) + ", buffers in order");
    into.reset();
    return false;
  }
  if (!whole) return true;
  // Every replica here gets it from this thread, so before anything sent after it (a start, a re-formed
  // ring): resumed, each starts from it; paused, each a step behind takes it and the others are there.
  const state_ptr state = std::move(into);
  for (auto& [rank, replica] : replicas_) caf::anon_send(replica, restore_atom::value, state);
  if (!paused) resumed_ = *complete = true;
  return true;
}

void node_job::pause(int gen, int64_t at, const std::string& purpose) {
  if (gen <= paused_gen_ || gen <= plan_.generation) return;  // old news: a later pause came first
  const bool stop = purpose == "stop";
  if (purpose == "hold") {  // the report link asks each replica and tells the launcher what it said
    if (ring_open_ && launcher_link_)
      for (auto& [rank, replica] : started_) caf::anon_send(launcher_link_, hold_atom::value, gen, rank, replica);
    return;
  }
  paused_gen_ = gen;
  resume_.clear();  // a re-formed ring that never started
  const std::string job = "job " + std::to_string(plan_.job_id);
  planned_ = at >= 0 && ring_open_;
  if (planned_) {  // every rank stops after the same step, so the ring is idle when the new plan comes
    for (auto& [r, a] : replicas_) caf::anon_send(a, pause_atom::value, gen, at);
    ctx_.log(job + (stop ? ": its launcher stops it; pausing after step " + std::to_string(at) + " for a checkpoint there"
                         : ": a node rejoins; pausing after step " + std::to_string(at) + " for ring generation " + std::to_string(gen)));
    return;
  }
  // The replicas hear first, so that the ends of their all-reduces (failed as the reducers leave) find
  // them paused: they apply nothing more and answer with what they applied.
  for (auto& [r, a] : replicas_) caf::anon_send(a, pause_atom::value, gen);
  close_ring();
  ctx_.log(job + (stop ? ": its launcher stops it; paused for a checkpoint where the ranks stopped"
                      : ": the ring is re-formed (a node lost, or a link broken); paused for ring generation " + std::to_string(gen)));
}

void node_job::close_ring() {
  ring_open_ = false;
  say_lending();
  shm_in_.clear();  // no more chunks from this ring's shared memory or ring-port connections (a poll under
  tcp_in_.clear();  // way keeps its receiver until it ends: leave() below fails its port, which drops what
                    // still comes, and the poll stops once the port has no all-reduce left)
  for (auto& [r, port] : ports_) leave(*port);  // waits for ring work under way: the buffers are free
  for (auto& [r, a] : reducers_) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  reducers_.clear();
  ports_.clear();
  // Chunks still queued for a node (a lost one, say) go with their buffers; the new ring connects afresh.
  for (auto& [endpoint, peer] : peers_) ctx_.br->disconnect(peer);
  peers_.clear();
  for (auto& [node, out] : tcp_out_) out->abort();  // what is still queued belonged to this ring
  tcp_out_.clear();
}

bool node_job::reform(job_plan next, std::string* error, bool* dropped) {
  *dropped = false;
  if (next.generation != paused_gen_ || (ring_open_ && !planned_))
    return *error = "ring generation " + std::to_string(next.generation) + " without a pause for it", false;
  if (*error = check_reform(plan_, next); !error->empty()) return false;
  std::vector<int> mine = next.ranks_on(plan_.recipient);
  if (mine.empty()) return *dropped = true, false;
  if (ring_open_) close_ring();  // after a planned pause: every rank has stopped after its step
  planned_ = false;
  const bool grows = std::any_of(next.ranks.begin(), next.ranks.end(), [](const rank_plan& r) { return r.was < 0; });
  // Our ranks keep their actors and devices under their new numbers.
  std::map<int, caf::actor> replicas, loaders;
  for (int r : mine) {
    rank_plan& rp = next.ranks[size_t(r)];
    rp.device = plan_.ranks[size_t(rp.was)].device;
    replicas[r] = replicas_[rp.was];
    loaders[r] = loaders_[rp.was];
  }
  std::map<int, std::shared_ptr<net::shm_window>> windows;
  for (int r : mine)
    if (auto w = windows_.find(next.ranks[size_t(r)].was); w != windows_.end()) windows[r] = w->second;
  replicas_ = std::move(replicas);
  loaders_ = std::move(loaders);
  windows_ = std::move(windows);
  mine_ = std::move(mine);
  std::vector<size_t> joined;  // nodes that come back: their pair keys are new (check_reform saw to it)
  for (size_t j = 0; j < next.nodes.size(); ++j)
    if (next.nodes[j].life != plan_.nodes[j].life) joined.push_back(j);
  next.first_step = plan_.first_step;  // where this node started, whatever another node's plan says
  plan_ = std::move(next);
  if (!sealers_.empty())
    for (size_t j : joined) make_pair_key(j);
  std::vector<caf::actor> watch;
  for (int r : mine_) {
    caf::actor a;
    ports_[r] = spawn_reducer(*ctx_.sys, plan_reducer_config(plan_, r, param_count_), &a);
    reducers_[r] = a;
    watch.push_back(a);
  }
  // Wired at the first start of a rank, as at the job's start: the launcher starts none before every node
  // has re-formed, so every segment of the new ring is there by then.
  open_shm_receivers();
  open_tcp_receivers();
  wired_ = false;
  ring_open_ = true;
  caf::anon_send(launcher_link_, reform_atom::value, replicas_, watch);
  for (int r : mine_) {
    const rank_plan& rp = plan_.ranks[size_t(r)];
    rank_reform& go = resume_[r];
    go.gen = plan_.generation;
    go.rank = r;
    go.replicas = plan_.replicas();
    go.start_step = plan_.start_step;
    go.batch_begin = rp.batch_begin;
    go.batch_end = rp.batch_end;
    std::tie(go.test_begin, go.test_end) = plan_.test_shard(r, test_count_);
    go.port = ports_[r];
    go.evaluate_again = !grows;
  }
  ctx_.log("job " + std::to_string(plan_.job_id) + ": ring generation " + std::to_string(plan_.generation) + " of " +
           std::to_string(plan_.replicas()) + " ranks, ranks " + rank_list(mine_) + " here, from step " +
           std::to_string(plan_.start_step + 1) + " of the job");  // counted from 1, as the launcher says it
  return true;
}

void node_job::link_failed(int peer, const std::string& why) {
  for (auto& [endpoint, p] : peers_)
    if (p == peer) {
      ctx_.log("job " + std::to_string(plan_.job_id) + ": the ring's link to " + endpoint + " failed: " + why);
      for (auto& [r, port] : ports_) fail(*port, "ring link to the next node: " + why);
      return;
    }
}

void node_job::heard() { last_heard_ = clock_type::now(); }

void node_job::flush_reports(std::chrono::milliseconds wait) {
  if (!launcher_link_) return;
  caf::scoped_actor self{*ctx_.sys};
  self->request(launcher_link_, wait, flush_atom::value, true).receive([](bool) {}, [](caf::error&) {});
}

void node_job::run_rank(int rank) {
  auto it = replicas_.find(rank);
  if (it == replicas_.end() || !launcher_link_) {
    ctx_.fault({net::fault::malformed, {}, "a start for rank " + std::to_string(rank) + ", which does not run here"});
    return;
  }
  if (!ring_open_) {  // paused: a start for the ring given up on
    ctx_.log("ignored a start for rank " + std::to_string(rank) + ": the job is paused for a re-formed ring");  // a race
    return;
  }
  if (!wired_) {
    wired_ = true;
    std::string error;
    if (!wire_ring(&error)) {  // the replicas' all-reduces fail with it, and so the job
      ctx_.log("job " + std::to_string(plan_.job_id) + ": " + error);
      for (auto& [r, port] : ports_) fail(*port, error);
    }
  }
  if (auto go = resume_.find(rank); go != resume_.end()) {  // on in the re-formed ring, by its new number
    caf::anon_send(it->second, reform_atom::value, go->second);
    resume_.erase(go);
    for (auto s = started_.begin(); s != started_.end();) s = s->second == it->second ? started_.erase(s) : std::next(s);
    started_[rank] = it->second;
    return;
  }
  caf::anon_send(it->second, run_atom::value, loaders_[rank], reducers_[rank], launcher_link_);
}

void node_job::send_state(int rank) {
  auto it = started_.find(rank);
  if (launcher_link_ && it != started_.end()) caf::anon_send(launcher_link_, checkpt_atom::value, rank, it->second);
}

void node_job::send_weights(int rank) {
  if (launcher_link_ && replicas_.count(rank)) caf::anon_send(launcher_link_, weights_atom::value, rank);
}

void node_job::send_weights_sum(int rank) {
  if (launcher_link_ && replicas_.count(rank)) caf::anon_send(launcher_link_, sum_atom::value, rank);
}

std::chrono::milliseconds node_job::launcher_silence() const {
  return std::chrono::duration_cast<std::chrono::milliseconds>(clock_type::now() - last_heard_);
}

}  // namespace ringmaster
