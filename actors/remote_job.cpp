#include "actors/remote_job.hpp"

#include <atomic>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <optional>
#include <random>
#include <thread>

#include "actors/checkpoint.hpp"
#include "actors/job_plan.hpp"
#include "actors/launcher.hpp"
#include "actors/messages.hpp"
#include "actors/node_service.hpp"
#include "net/seal.hpp"

namespace ringmaster {

using clock_type = std::chrono::steady_clock;

namespace {

train_result run_remote(train_config cfg, const remote_options& ro) {
  train_result failed;
  if (ro.nodes.empty()) {
    failed.error = "no nodes given";
    return failed;
  }
  for (const std::string& node : ro.nodes)
    if (!net::check_endpoint(node, false, &failed.error)) {
      failed.error = "node " + failed.error;
      failed.invalid = true;
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
  std::shared_ptr<const void> dir_lock;  // the checkpoint folder is this job's until it returns
  if (!cfg.checkpoint_dir.empty() && !(failed.error = check_checkpoint_dir(cfg.checkpoint_dir, cfg.resume != nullptr, &dir_lock)).empty()) {
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
  bo.connection_ids = true;  // a node of the job cannot take over our link to another
  bo.watch_connects = true;  // a port nothing listens on, or a node with keys when we have none: said as such
  std::vector<bool> record(ro.nodes.size(), false);
  const std::string key_dir = ro.key_dir.empty() ? net::default_key_dir() : ro.key_dir;
  if (!ro.insecure) {
    // Our key folder and known_nodes are the settings', checked before any node is asked (exit 2).
    failed.invalid = true;
    if (!net::load_or_create_keys(key_dir, &bo.keys, &failed.error)) return failed;
    for (size_t i = 0; i < ro.nodes.size(); ++i) {
      const std::string given = i < ro.node_keys.size() ? ro.node_keys[i] : "";
      bool rec = false;
      if (!net::expected_node_key(key_dir + "/known_nodes", ro.nodes[i], given, bo.keys.public_key,
                                  &where.nodes[i].key, &rec, &failed.error))
        return failed;
      record[i] = rec;
    }
    failed.invalid = false;
  }
  launcher L{ro, bo};
  L.interrupt = cfg.interrupt;
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
  L.changed.assign(ro.nodes.size(), {});  // before the bridge thread, which alone touches them
  L.said_changed.assign(ro.nodes.size(), {});
  L.reconnected.assign(ro.nodes.size(), {});
  L.peer = std::vector<std::atomic<int>>(ro.nodes.size());
  for (auto& p : L.peer) p = -1;
  L.unreachable.assign(ro.nodes.size(), 0);
  L.last_heard.reset(new std::atomic<int64_t>[ro.nodes.size()]);
  L.gone.reset(new std::atomic<bool>[ro.nodes.size()]);
  for (size_t i = 0; i < ro.nodes.size(); ++i) {
    L.last_heard[i] = clock_type::now().time_since_epoch().count();
    L.gone[i] = false;
  }
  L.br.set_handler([&L](const net::peer_info& from, const wire::header& h, net::payload p) {
    L.on_message(from, h, std::move(p));
  });
  // A node that refuses our key, or holds another than we expect, says so only through the handshake,
  // and one of another release answers our hello in its own protocol version, which our bridge drops:
  // either reason ends the wait for its answer at once.
  L.br.set_error_handler([&L](const net::bridge_error& e) {
    std::string why;
    if (e.kind == net::fault::handshake_failed) why = "node " + e.message;  // the message names the endpoint
    const int node = L.node_of(e.from);
    if (e.kind == net::fault::unreachable && node >= 0) {  // it may yet come: said if it never answers
      std::lock_guard<std::mutex> lock(L.mu);
      L.unreachable[size_t(node)] = e.retrying;  // false: it accepts connections now
      return;
    }
    // A node started again with another key, or none: while the job runs, it cannot rejoin, and its
    // user hears why once it is lost (tick); while the job is set up, it failed us.
    if (e.kind == net::fault::peer_changed && node >= 0) {
      if (L.started.load(std::memory_order_acquire)) return L.on_changed(node, e.message);
      why = "node " + e.message;
    }
    if (e.kind == net::fault::version_mismatch && node >= 0 && !L.started.load(std::memory_order_acquire))
      why = "node " + L.ro.nodes[size_t(node)] + " runs another release of ringmaster (" + e.message +
            "): run the same one on the launcher and every node";
    if (why.empty()) return;
    launcher::control_msg m{0, {}, {{"error", why}}};
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
    L.peer[i] = p;
  }
  std::vector<wire::kv_map> replies;
  L.broadcast(wire::msg_type::hello, {{"role", "launcher"}});
  failed.error = L.await_all(wire::msg_type::hello_ack, &replies, ro.connect_timeout, ro.connect_timeout);
  if (failed.error.empty()) failed.error = L.await_free(&replies);
  // A node that did not answer because its name does not resolve: a typo, said as such (exit 2). Asked only
  // now: a lookup may wait for DNS, which ZeroMQ has done meanwhile.
  for (size_t i = 0; i < ro.nodes.size(); ++i)
    if (std::string why; failed.error.rfind("node " + ro.nodes[i] + " did not answer", 0) == 0 && !net::check_host_resolves(ro.nodes[i], &why)) {
      failed.error = "node " + why;
      failed.invalid = true;
      return failed;
    }
  // A silent node we know no key for was expected to share ours: the likeliest cause, said plainly.
  for (size_t i = 0; i < ro.nodes.size() && !ro.insecure; ++i)
    if (((failed.error.rfind("node " + ro.nodes[i] + " did not answer", 0) == 0 && failed.error.find(": nothing accepted a connection there") == std::string::npos) ||
         failed.error.rfind("node " + ro.nodes[i] + " hangs up during the handshake", 0) == 0) &&
        L.plan.nodes[i].key == bo.keys.public_key &&
        !(i < ro.node_keys.size() && !ro.node_keys[i].empty()))
      failed.error += ". No key is known for it (no @KEY given, none in " + key_dir +
                      "/known_nodes), so it was expected to share ours: give its key, --nodes " + ro.nodes[i] +
                      "@KEY (in code: topology::connect(\"" + ro.nodes[i] + "\", KEY)), KEY its key.pub (printed at its start)";
  // One whose key comes from known_nodes (none given, not ours): a node given a new key, as ssh warns of a
  // changed host key, said with where that key is recorded.
  for (size_t i = 0; i < ro.nodes.size() && !ro.insecure; ++i)
    if (failed.error.rfind("node " + ro.nodes[i] + " hangs up during the handshake", 0) == 0 && !record[i] &&
        L.plan.nodes[i].key != bo.keys.public_key && !(i < ro.node_keys.size() && !ro.node_keys[i].empty()))
      failed.error += ". The key we expect of it is the one recorded in " + key_dir + "/known_nodes: if it was given a new "
                      "key on purpose, remove its line there and give its key, --nodes " + ro.nodes[i] +
                      "@KEY (in code: topology::connect(\"" + ro.nodes[i] + "\", KEY))";
  if (!failed.error.empty()) return failed;
  // A key given for a node is now proven: remember it, as ssh remembers a host key.
  for (size_t i = 0; i < ro.nodes.size(); ++i)
    if (record[i] && !net::record_known_node(key_dir + "/known_nodes", ro.nodes[i], L.plan.nodes[i].key, &error))
      std::fprintf(stderr, "ringmaster: could not record the key of %s: %s\n", ro.nodes[i].c_str(), error.c_str());

  // How long the nodes keep a job whose launcher has fallen silent (a node's word, checked; one that does
  // not say, an older node, waits the default): the least of them, for the watchdog below.
  std::optional<std::chrono::milliseconds> patience;
  for (wire::kv_map& r : replies) {
    const std::string& said = r["launcher_timeout_ms"];
    int64_t ms = 0;
    const auto [end, ec] = std::from_chars(said.data(), said.data() + said.size(), ms);
    const bool valid = ec == std::errc() && end == said.data() + said.size() && ms >= 1000 && ms <= 600000;
    const auto waits = valid ? std::chrono::milliseconds(ms) : node_options{}.launcher_timeout;
    patience = std::min(patience.value_or(waits), waits);
  }
  // A node takes ring chunks for a rank only from the node that runs its left neighbour, known by the
  // routing id it sends with.
  for (size_t i = 0; i < ro.nodes.size(); ++i) L.plan.nodes[i].id = replies[i]["id"];
  // Two endpoints of one daemon (127.0.0.1 and its host name, say): one node named twice.
  for (size_t i = 0; i < ro.nodes.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (!L.plan.nodes[i].id.empty() && L.plan.nodes[i].id == L.plan.nodes[j].id) {
        failed.error = "--nodes " + ro.nodes[j] + " and " + ro.nodes[i] + " answered with the same id " + ringmaster::quoted(L.plan.nodes[i].id) +
                       ": one daemon named twice (name each node once), or two started with the same --name (give each its own)";
        failed.invalid = true;
        L.abort_all("bad hello");
        return failed;
      }
  // Nodes on one host as one user pass ring chunks through shared memory (net/shm_link.hpp). A host id
  // that would not make a valid plan is no host id: that node uses the network.
  for (size_t i = 0; i < ro.nodes.size(); ++i) L.plan.nodes[i].host = host_of(replies[i]["host"]);
  // Ring chunks between hosts go to each node's ring port, sealed with keys (net/seal.hpp), plain without.
  if (ro.ring_ports) {
    if (!ro.insecure) L.plan.seal_salt = net::make_seal_salt();
    for (size_t i = 0; i < ro.nodes.size(); ++i) L.plan.nodes[i].ring_port = ring_port_of(replies[i]["ring_port"]);
  }
  if (!validate(L.plan, &failed.error)) {
    failed.error = "node answers do not make a job: " + failed.error;
    L.abort_all("bad hello");
    return failed;
  }
  // Every node gets the same plan, saying which of its nodes it is.
  const auto sent = launcher::clock_type::now();  // a heartbeat may come back before the wait begins
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
  failed.sent = true;
  // A node heartbeats once it has the job; until then (a loaded machine) it gets the hello's allowance,
  // after that a running job's: its setup runs off its bridge thread (what is left there, spawning its
  // ranks, took 0.2 ms of a 175M-parameter model's setup).
  failed.error = L.await_all(wire::msg_type::job_ack, &replies, ro.setup_timeout, ro.node_timeout, ro.connect_timeout, sent);
  if (!failed.error.empty()) {
    failed.invalid = L.refused_invalid;
    const int sig = cfg.interrupted();
    // What went wrong, as the launcher says it (a node that refused, was stopped or never answered).
    L.abort_all(sig ? interrupted_by(sig) + " on the launcher" : "the job could not start: " + node_text(failed.error, 500));
    return failed;
  }
  // Each node's data fingerprint (data_fingerprint()): a node's word, so checked, never std::stoul.
  std::vector<uint32_t> prints(replies.size(), 0);
  for (size_t i = 0; i < replies.size(); ++i) {
    const std::string& t = replies[i]["train_data"];
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), prints[i]);
    if (t.empty() || ec != std::errc() || end != t.data() + t.size() || prints[i] == 0) {
      failed.error = "node " + ro.nodes[i] + " sent a bad data fingerprint '" + node_text(t.substr(0, 20)) + "'";
      L.abort_all("bad reply");
      return failed;
    }
  }
  const uint32_t train_data = prints[0];
  const std::string train_count = replies[0]["train"];
  for (size_t i = 1; i < replies.size(); ++i) {
    if (replies[i]["train"] != train_count) {
      failed.error = "nodes disagree on the data: " + ro.nodes[0] + " has " + node_text(train_count.substr(0, 20)) +
                     " training samples, " + ro.nodes[i] + " has " + node_text(replies[i]["train"].substr(0, 20));
      failed.invalid = true;
      L.abort_all("nodes disagree on the data");
      return failed;
    }
    // Each node reads its own copy: one that differs would train the job on a mix (and no longer equal
    // the job in one process).
    if (prints[i] != train_data) {
      failed.error = "nodes disagree on the data: " + ro.nodes[0] + " and " + ro.nodes[i] + " have " +
                     node_text(train_count.substr(0, 20)) + " training samples each, but not the same ones (data fingerprints " +
                     std::to_string(train_data) + " and " + std::to_string(prints[i]) + "): give every node the same copy";
      failed.invalid = true;
      L.abort_all("nodes disagree on the data");
      return failed;
    }
    // Every node built the description into the same layout (same layer code, same data shape).
    if (replies[i]["model"] != replies[0]["model"] || replies[i]["params"] != replies[0]["params"]) {
      auto built = [&](size_t k) { return node_text(replies[k]["model"], 24) + " (" + node_text(replies[k]["params"], 20) + " parameters)"; };
      failed.error = "nodes disagree on the model: " + ro.nodes[0] + " built layout " + built(0) + ", " + ro.nodes[i] +
                     " built " + built(i) + " (different ringmaster or layer versions?)";
      L.abort_all("nodes disagree on the model");
      return failed;
    }
  }
  // The test set's size, for the coordinator's patience while the ranks evaluate: a node's word, so
  // checked, and read as 0 (no allowance) when it makes no sense. Alike on every node (as the training
  // set): one node's 10^12 made the patience years.
  int64_t test_samples = 0;
  {
    const std::string& t = replies[0]["test"];
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), test_samples);
    if (ec != std::errc() || end != t.data() + t.size() || test_samples < 0 || test_samples > int64_t(1e12)) test_samples = 0;
  }
  for (size_t i = 1; i < replies.size(); ++i)
    if (replies[i]["test"] != replies[0]["test"]) {
      failed.error = "nodes disagree on the data: " + ro.nodes[0] + " has " + node_text(replies[0]["test"].substr(0, 20)) + " test samples, " +
                     ro.nodes[i] + " has " + node_text(replies[i]["test"].substr(0, 20));
      failed.invalid = true;
      L.abort_all("nodes disagree on the data");
      return failed;
    }
  uint64_t samples = 0;  // a node's word, not ours: checked, never std::stoull (nor strtoull, which takes "-1")
  const auto [samples_end, samples_ec] = std::from_chars(train_count.data(), train_count.data() + train_count.size(), samples);
  if (train_count.empty() || samples_ec != std::errc() || samples_end != train_count.data() + train_count.size() ||
      samples > uint64_t(1e12)) {
    failed.error = "node " + ro.nodes[0] + " sent a bad sample count '" + node_text(train_count.substr(0, 20)) + "'";
    L.abort_all("bad reply");
    return failed;
  }
  // The parameter count: the size of every state that travels (checkpoints, a rejoin, survivors a step
  // apart). A node's word, so checked, never std::stoull.
  const std::string& params = replies[0]["params"];
  const auto [params_end, params_ec] = std::from_chars(params.data(), params.data() + params.size(), L.param_count);
  if (params.empty() || params_ec != std::errc() || params_end != params.data() + params.size() || L.param_count == 0 ||
      L.param_count > wire::kMaxPayloadBytes / sizeof(float)) {  // a ring chunk of all of them fits one message
    failed.error = "node " + ro.nodes[0] + " sent a bad parameter count '" + node_text(params.substr(0, 20)) + "'";
    L.abort_all("bad reply");
    return failed;
  }
  const int64_t steps = int64_t(steps_per_epoch(samples, cfg.global_batch));
  if (steps == 0) {
    failed.error = "global batch is larger than the nodes' " + train_count + " training samples";
    L.abort_all("batch too large");
    return failed;
  }
  // The model the nodes built, as they describe it: this job's, for their samples, when this launcher has
  // its layers (a node's word: it is what --save writes). Checkpoints are written here, named by this
  // program's layers (they need them), and a resume is checked against it.
  std::shared_ptr<const model> m;
  {
    const layer_registry builtins = layer_registry::with_builtins();
    const layer_registry& reg = cfg.layers ? *cfg.layers : builtins;
    std::string why;
    m = model::build(replies[0]["description"], reg, &why);
    if (!m && (cfg.resume || !cfg.checkpoint_dir.empty())) failed.error = "checkpoints need the model's layers in this launcher too: " + why;
    // The same model from the text as given, for its name ("784-64-10", "cnn") in files and messages.
    if (m) {
      auto named = model::build(cfg.model, reg, m->input(), &why);
      if (!named || named->description() != m->description())
        failed.error = "node " + ro.nodes[0] + " built another model than this job's: " + node_text(replies[0]["description"], 200) +
                       (named ? ", this job's is " + named->description().substr(0, 200) : "; this job's does not build for its samples: " + why);
      else
        m = named;
    }
    if (m && failed.error.empty() && cfg.resume) failed.error = resume_mismatch(*cfg.resume, cfg, m.get(), int64_t(samples), train_data);
    if (m && failed.error.empty() && m->param_count() != L.param_count)
      failed.error = "the nodes built " + params + " parameters, this launcher " + std::to_string(m->param_count());
    if (m && failed.error.empty() && !cfg.checkpoint_dir.empty() && !(cfg.resume && trained_to_end(*cfg.resume, cfg)) &&
        !(failed.error = check_checkpoint_room(cfg.checkpoint_dir, m->param_count(), cfg.opt.kind, cfg.epochs)).empty())
      failed.error = "checkpoints: " + failed.error;  // (not for a run trained to its end: it writes none)
    if (m && failed.error.empty()) failed.error = run_check_model(cfg, *m);
    if (!failed.error.empty()) {
      failed.invalid = true;
      L.abort_all(failed.error);
      return failed;
    }
  }
  // Trained to its end already: its results are the checkpoint's. Only now, once the nodes have shown
  // that it is this job's (the model they built, their data), not before any node is asked.
  if (cfg.resume && trained_to_end(*cfg.resume, cfg)) {
    L.abort_all("the job had trained to its end");
    return finished_run(*cfg.resume);
  }
  // What a node that comes back must say too, and what its plan starts from (actors/launcher.hpp).
  L.state_buffers = cfg.opt.kind == optimizer_config::adam ? 3 : 2;
  L.train_count = train_count;
  L.train_data = std::to_string(train_data);
  L.model_layout = replies[0]["model"];
  L.test_count = replies[0]["test"];
  L.steps_per_epoch = steps;
  L.total_steps = steps * cfg.epochs;
  L.join_failures.assign(ro.nodes.size(), 0);
  L.join_setup.assign(ro.nodes.size(), 0.0);
  L.join_late.assign(ro.nodes.size(), 0);
  L.unfit.assign(ro.nodes.size(), {});
  for (size_t i = 0; i < ro.nodes.size(); ++i) L.original_ranks.push_back(int(L.plan.ranks_on(int(i)).size()));

  caf::actor_system_config sys_cfg;
  configure(sys_cfg, 2);
  caf::actor_system sys{sys_cfg};
  L.sys = &sys;
  rank_actors all;
  for (int r = 0; r < n; ++r) {
    const int node = L.plan.ranks[size_t(r)].node;
    L.proxies.push_back(sys.spawn(rank_proxy, &L.br, L.peer[size_t(node)].load(), L.job_id, r));
    L.proxy_node.push_back(node);
  }
  all.replicas = all.loaders = all.reducers = L.proxies;
  auto last = std::make_shared<std::string>();
  coordinator_config cc = job_coordinator_config(cfg, m, n, cfg.evaluate, int64_t(samples), train_data, steps, last);
  cc.on_event = [&L](const std::string& line) { L.event(line); };
  if (L.plan.elastic)
    cc.on_faulty_node = [&L](const std::string& where, const std::string& why) { L.br.post([&L, where, why] { L.drop_faulty(where, why); }); };
  cc.where = L.plan.rank_nodes();
  // Longer than the ring may wait for a hung rank, and than its node's loss takes to be named: those are
  // handled as lost nodes; this catches a node that answers and trains but holds back its reports.
  cc.report_timeout = std::max<std::chrono::milliseconds>(std::chrono::seconds(30), cfg.ring_timeout + std::chrono::seconds(10));
  cc.eval_batches = (test_samples + cfg.global_batch - 1) / cfg.global_batch;
  // Rank 0's states: a node that withholds them is named after the report limit plus the time its state
  // takes at 10 MB/s (a 2.8 GB Adam state: 280 s more), so that a slow link is not taken for a liar.
  const double state_bytes = double(L.param_count) * double(L.state_buffers) * sizeof(float);
  cc.state_timeout = cc.report_timeout + std::chrono::milliseconds(int64_t(state_bytes / 10e6 * 1000));
  auto coord = sys.spawn(coordinator, cc);
  L.coordinator = coord;
  L.rate_since = L.ring_since = clock_type::now();
  L.ring_from = L.seen_step = L.rate_mark = L.plan.first_step;  // a resumed job's steps are not this run's pace
  // A signal: a job with checkpoints stops with one where its ranks stop (the launcher's
  // stop_with_checkpoint), within this long; others fail at once, and every node is told.
  const bool stop_with_checkpoint = !cfg.checkpoint_dir.empty();
  L.started.store(true, std::memory_order_release);
  L.br.post([&L] { L.take_early_aborts(); });
  // A resumed job's state to every node, before any start (the same connection keeps the order); a node
  // that cannot take it answers with an error, which fails the job.
  if (cfg.resume)
    for (size_t i = 0; i < ro.nodes.size(); ++i) L.send_state(int(i), state_ptr(cfg.resume, &cfg.resume->state));

  // Heartbeats out, silence detection in; what a lost node means is worked out on the bridge thread.
  std::atomic<bool> running{true};
  const auto stop_limit = 2 * launcher::kStopLimit;  // the launcher's own, and the checkpoint's writing
  std::thread watchdog([&] {
    std::vector<bool> dead(ro.nodes.size(), false);
    auto woke = clock_type::now();
    std::optional<clock_type::time_point> stop_since;
    while (running) {
      std::this_thread::sleep_for(ro.heartbeat);
      if (const int sig = cfg.interrupted(); sig && stop_with_checkpoint && !stop_since) {
        stop_since = clock_type::now();
        L.br.post([&L, sig] { L.stop_with_checkpoint(sig); });
      } else if (sig && (!stop_since || clock_type::now() - *stop_since > stop_limit)) {
        L.br.post([&L, why = interrupted_by(sig) + (stop_since ? "; no checkpoint was written at the stop: it took too long" : "")] {
          L.kill_node(-1, why);
        });
        break;
      }
      // This process itself was stopped (SIGSTOP, a debugger) or starved: the silence was ours, not the
      // nodes'. Under their patience they are heard afresh; past it they have dropped the job, and we say why.
      const auto slept = clock_type::now() - woke;
      woke = clock_type::now();
      const auto waits = patience.value_or(node_options{}.launcher_timeout);  // what a node waits for its launcher
      if (slept > waits) {  // past it: the nodes dropped the job
        char why[160];
        std::snprintf(why, sizeof why, "this launcher was stopped or starved for %.1f s, longer than its nodes wait for it (%.0f s): they dropped the job",
                      std::chrono::duration<double>(slept).count(), std::chrono::duration<double>(waits).count());
        L.br.post([&L, why = std::string(why)] { L.kill_node(-1, why); });
        break;
      }
      if (slept > ro.node_timeout) {
        for (size_t i = 0; i < ro.nodes.size(); ++i) L.last_heard[i] = woke.time_since_epoch().count();
        char line[120];
        std::snprintf(line, sizeof line, "this launcher was stopped or starved for %.1f s; the nodes are heard afresh",
                      std::chrono::duration<double>(slept).count());
        L.br.post([&L, line = std::string(line)] { L.event(line); });
        continue;
      }
      L.broadcast(wire::msg_type::heartbeat, {}, true);
      // The time taken before the broadcast: a stop during it shows as our oversleep next time round,
      // not as every node's silence now.
      const int64_t now = woke.time_since_epoch().count();
      for (size_t i = 0; i < ro.nodes.size(); ++i) {
        const auto silent = clock_type::duration(now - L.last_heard[i]);
        if (silent <= ro.node_timeout) dead[i] = false;  // heard again: a node that rejoins
        else if (!dead[i]) {
          dead[i] = true;
          char why[64];
          std::snprintf(why, sizeof why, "no heartbeat for %.1f s", std::chrono::duration<double>(silent).count());
          L.br.post([&L, i, why = std::string(why)] { L.node_lost(int(i), why); });
        }
      }
      L.br.post([&L] { L.tick(); });
    }
  });

  std::shared_ptr<train_result> result = run_coordinator(sys, coord, all);
  result->model = replies[0]["description"];
  result->checkpoint = *last;
  result->sent = true;
  running = false;
  watchdog.join();
  // Every node goes back to idle, whether the job succeeded or not.
  const int sig = cfg.interrupted();
  L.abort_all(result->ok ? "finished" : sig ? interrupted_by(sig) + " on the launcher" : "the job failed: " + result->error);
  L.br.stop(launcher::kAbortDrain);
  result->failed_joins = std::move(L.failed_joins);  // the bridge thread has stopped
  result->faults = std::move(L.faults);
  result->relinks = std::move(L.relinks);
  if (!result->ok && !result->interrupted) result->interrupted = L.stopping;  // a stop its nodes began, which failed
  // Nodes lost on the way to a ring that never formed (the job failed meanwhile): the summary names them too.
  if (!result->ok) result->losses.insert(result->losses.end(), L.losses.begin(), L.losses.end());
  for (auto* group : {&L.proxies, &L.retired})
    for (auto& p : *group) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
  return std::move(*result);
}

}  // namespace

train_result train_remote(train_config cfg, const remote_options& ro) {
  if (cfg.init_params) {  // not in the job plan: the nodes would start from the seed's weights, in silence
    train_result refused;
    refused.invalid = true;
    refused.error = "init_params do not travel to nodes: a job with ranks on nodes starts from the seed's weights "
                    "(leave init_params unset, or place every rank in this process)";
    return refused;
  }
  const std::atomic<int>* interrupt = cfg.interrupt;
  const auto start = std::chrono::steady_clock::now();
  train_result r = run_remote(std::move(cfg), ro);
  r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();  // a failed setup took its time too
  // Stopped by our signal, it was interrupted, whatever else went wrong meanwhile, said in one way: a
  // rank's proxy failed with "interrupted (SIGTERM)", or the nodes were stopped with us (a whole batch
  // allocation preempted) and the job failed first.
  if (const int sig = !r.ok && interrupt ? interrupt->load() : 0) {
    r.interrupted = sig;
    const std::string head = interrupted_by(sig);
    const size_t at = r.error.find(head);
    r.error = at != std::string::npos ? r.error.substr(at) : head + "; " + r.error;
  }
  return r;
}

}  // namespace ringmaster
