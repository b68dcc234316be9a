#include "actors/node_service.hpp"

#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "actors/job_spec.hpp"
#include "actors/messages.hpp"
#include "actors/node_links.hpp"
#include "actors/ring_links.hpp"
#include "actors/training.hpp"
#include "net/bridge.hpp"
#include "net/ring.hpp"

namespace ringmaster {

using clock_type = std::chrono::steady_clock;

bool parse_devices(const std::string& text, std::vector<std::string>* slots, std::string* error) {
  auto number = [](const std::string& n) {
    return !n.empty() && n.size() <= 4 && n.find_first_not_of("0123456789") == std::string::npos;
  };
  slots->clear();
  const size_t colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  if (text == "cuda") {  // every GPU of this machine, one replica each
    for (int g = 0, n = cuda_device_count(); g < n; ++g) slots->push_back("cuda:" + std::to_string(g));
    if (slots->empty()) *error = "--devices cuda: this machine has no usable CUDA device";
    return !slots->empty();
  }
  if (kind == "cpu" && colon != std::string::npos && number(text.substr(4)) && std::stoi(text.substr(4)) > 0) {
    slots->assign(size_t(std::stoi(text.substr(4))), "cpu");
    return true;
  }
  if (kind != "cpu" && !kind.empty() && colon != std::string::npos) {  // KIND:I[,J...]: one replica each
    std::string list = text.substr(colon + 1);
    for (size_t at = 0; at <= list.size();) {
      const size_t comma = std::min(list.find(',', at), list.size());
      const std::string id = list.substr(at, comma - at);
      if (!number(id)) {
        slots->clear();
        break;
      }
      slots->push_back(kind + ":" + id);
      at = comma + 1;
    }
    if (!slots->empty()) return true;
  }
  *error = "bad --devices '" + text + "': expected cpu:N (N CPU replicas), cuda (every GPU) or cuda:I[,J...] (GPUs by number)";
  return false;
}

struct node_service::impl {
  node_options opt;
  std::vector<std::string> slots;  // one device per replica this node offers
  caf::actor_system_config sys_cfg;
  std::unique_ptr<caf::actor_system> sys;
  net::bridge br;
  std::thread ticker;
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopping = false;
  std::atomic<int> jobs_done{0};
  std::atomic<bool> busy{false};

  // The job, touched only on the bridge thread.
  struct job_state {
    uint64_t id = 0;
    net::peer_info launcher;
    job_spec spec;
    std::map<int, caf::actor> reducers, replicas, loaders;
    std::vector<caf::actor> links;  // launcher_link
    clock_type::time_point last_heard;
    bool started = false;  // the launcher sent start: from then on it heartbeats
  };
  std::unique_ptr<job_state> job;
  std::map<std::string, int> peers;  // node endpoint -> our connection
  // Node endpoint -> the routing id its chunks come with (from its node hello, which may come before our
  // own setup of the job is done). Bounded: a stranger's hellos cannot grow it without limit.
  std::map<std::string, std::string> peer_names;
  std::mutex data_mu;  // data_cache is filled on the data thread
  std::map<std::string, std::shared_ptr<const dataset>> data_cache;  // whole files, by prefix and classes
  // Threads that load a job's data, so the bridge thread keeps answering meanwhile. Joined once done
  // (never on the bridge thread while still loading), and all at stop().
  struct loader_thread {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<loader_thread> data_threads;

  explicit impl(node_options o) : opt(std::move(o)), br(net::bridge_options{opt.name}) {}

  void log(const std::string& line) {
    char ts[32];
    std::time_t t = std::time(nullptr);
    std::strftime(ts, sizeof ts, "%H:%M:%S", std::localtime(&t));
    std::string msg = std::string(ts) + " ringmaster-node " + (opt.name.empty() ? br.endpoint() : opt.name) + ": " + line;
    if (opt.log) opt.log(msg);
    else std::fprintf(stderr, "%s\n", msg.c_str());
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

  // Labels are checked against the model's outputs once it is built (check_config), so any byte loads.
  std::shared_ptr<const dataset> load(const std::string& prefix, int64_t limit, std::string* error) {
    std::shared_ptr<const dataset> whole;
    {
      std::lock_guard<std::mutex> lock(data_mu);
      const std::string key = prefix;
      if (auto it = data_cache.find(key); it != data_cache.end()) {
        whole = it->second;
      } else {
        auto d = std::make_shared<dataset>();
        if (!load_mnist(opt.data_dir, prefix, 256, d.get(), error)) return nullptr;
        data_cache[key] = whole = d;
      }
    }
    if (limit <= 0 || size_t(limit) >= whole->count) return whole;
    auto part = std::make_shared<dataset>();
    part->count = size_t(limit);
    part->channels = whole->channels;
    part->rows = whole->rows;
    part->cols = whole->cols;
    part->pixels.assign(whole->pixels.begin(), whole->pixels.begin() + ptrdiff_t(size_t(limit) * whole->features()));
    part->labels.assign(whole->labels.begin(), whole->labels.begin() + limit);
    return part;
  }

  void teardown(const std::string& why) {
    if (!job) return;
    for (auto* group : {&job->replicas, &job->loaders, &job->reducers})
      for (auto& [r, a] : *group) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    for (auto& a : job->links) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    // Chunks still queued for a peer (one that died, say) are dropped with their buffers; the next
    // job connects afresh.
    for (auto& [endpoint, peer] : peers) br.disconnect(peer);
    peers.clear();
    log("job " + std::to_string(job->id) + " ended: " + why);
    job.reset();
    busy = false;
    ++jobs_done;
  }

  int peer_for(const std::string& endpoint, std::string* error) {
    if (auto it = peers.find(endpoint); it != peers.end()) return it->second;
    int p = br.connect(endpoint, error);
    if (p >= 0) peers[endpoint] = p;
    return p;
  }

  // invalid: the job itself is bad (its model or settings), not this node's state; the launcher says so.
  void refuse(const net::peer_info& from, uint64_t job_id, const std::string& why, bool invalid = false) {
    log("refused job " + std::to_string(job_id) + ": " + why);
    send_kv(from, wire::msg_type::error, job_id, {{"error", "node " + name() + ": " + why}, {"invalid", invalid ? "1" : "0"}});
  }

  // First half of a job's setup, on the bridge thread: check the spec, take the job slot, and load the
  // data on the data thread (it can take seconds), which then posts the second half back here.
  void setup(const net::peer_info& from, const wire::kv_map& kv) {
    job_spec spec;
    std::string error;
    if (!from_kv(kv, &spec, &error)) return refuse(from, spec.job_id, "bad job spec: " + error, true);
    if (job) return refuse(from, spec.job_id, "busy with job " + std::to_string(job->id));
    if (int(spec.ranks.size()) > int(slots.size()))
      return refuse(from, spec.job_id,
                    "job asks for " + std::to_string(spec.ranks.size()) + " replicas, this node offers " + opt.devices);
    if (device_kind(spec.device) != device_kind(slots[0]))
      return refuse(from, spec.job_id, "job runs on " + device_kind(spec.device) + " replicas, this node offers " + opt.devices);
    model_desc desc;  // the description's syntax now; its layers and shapes once the data is here
    if (!parse_model_desc(spec.model, &desc, &error)) return refuse(from, spec.job_id, "bad model: " + error, true);
    job = std::make_unique<job_state>();
    job->id = spec.job_id;
    job->launcher = from;
    job->spec = spec;
    job->last_heard = clock_type::now();
    busy = true;
    for (auto it = data_threads.begin(); it != data_threads.end();) {
      if (it->done->load()) {
        it->thread.join();
        it = data_threads.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    data_threads.push_back({std::thread([this, from, spec, done] {
      std::string err;
      std::shared_ptr<const dataset> train, test;
      try {  // out of memory, say: the job is refused below (train stays null), the daemon lives on
        train = load("train", spec.limit_train, &err);
        if (train && spec.evaluate) test = load("t10k", spec.limit_test, &err);
      } catch (const std::exception& e) {
        train = nullptr;
        err = std::string("could not load the data: ") + e.what();
      }
      br.post([this, from, spec, train, test, err] {
        try {
          start_job(from, spec, train, test, err);
        } catch (const std::exception& e) {  // e.g. out of memory: refuse the job, keep the daemon
          if (job && job->id == spec.job_id) teardown(std::string("could not start: ") + e.what());
          if (!job) busy = false;
          refuse(from, spec.job_id, std::string("could not start the job: ") + e.what());
        }
      });
      done->store(true);
    }), done});
  }

  // Second half, on the bridge thread once the data is loaded: spawn the ranks and join the ring.
  void start_job(const net::peer_info& from, const job_spec& spec, std::shared_ptr<const dataset> train,
                 std::shared_ptr<const dataset> test, std::string error) {
    if (!job || job->id != spec.job_id || !job->reducers.empty()) return;  // aborted while loading
    auto refuse = [&](const std::string& why, bool invalid) {
      job.reset();
      busy = false;
      this->refuse(from, spec.job_id, why, invalid);
    };
    if (!train || (spec.evaluate && !test)) return refuse(error, false);
    train_config cfg = make_train_config(spec);
    cfg.train = train;
    cfg.test = test;
    cfg.layers = opt.layers;
    cfg.devices.assign(size_t(spec.replicas), device_kind(slots[0]));  // ranks elsewhere: only their kind counts
    for (size_t i = 0; i < spec.ranks.size(); ++i) cfg.devices[size_t(spec.ranks[i])] = slots[i];
    cfg.make_backend = opt.make_backend;
    auto m = build_model(cfg, &error);
    if (!m) return refuse("bad model: " + error, true);
    if (std::string e = check_config(cfg, *m); !e.empty()) return refuse(e, true);

    std::unique_ptr<job_state> js = std::move(job);
    rank_actors local = spawn_ranks(*sys, cfg, m, spec.ranks, spec.job_id);
    for (size_t i = 0; i < spec.ranks.size(); ++i) {
      js->reducers[spec.ranks[i]] = local.reducers[i];
      js->replicas[spec.ranks[i]] = local.replicas[i];
      js->loaders[spec.ranks[i]] = local.loaders[i];
    }
    // Rank r sends to rank r + 1: a reducer here directly, one on another node through the bridge.
    for (int r : spec.ranks) {
      const int right = ring::right(r, spec.replicas);
      link_ptr link;
      if (js->reducers.count(right)) {
        link = make_actor_link(js->reducers[right]);
      } else {
        int peer = peer_for(spec.rank_nodes[right], &error);
        if (peer < 0) {
          job = std::move(js);
          teardown("cannot reach " + spec.rank_nodes[right]);
          return this->refuse(from, spec.job_id, "cannot reach node " + spec.rank_nodes[right] + ": " + error);
        }
        link = make_bridge_link(&br, peer);
        // Who we are, ahead of our chunks on this connection, so that node accepts them from us only.
        std::string text;
        wire::encode_kv({{"role", "node"}, {"endpoint", spec.rank_nodes[size_t(r)]}}, &text, &error);
        wire::header h;
        h.type = wire::msg_type::hello;
        h.job_id = spec.job_id;
        br.send(peer, h, net::payload::copy_of(text));
      }
      caf::anon_send(js->reducers[r], ring_atom::value, std::move(link));
    }
    // The launcher hears of any of them failing.
    std::vector<caf::actor> watched;
    for (auto* group : {&local.replicas, &local.loaders, &local.reducers})
      watched.insert(watched.end(), group->begin(), group->end());
    js->links.insert(js->links.begin(), sys->spawn(launcher_link, &br, from, spec.job_id, js->replicas, watched, name()));
    job = std::move(js);
    std::string ranks;
    for (int r : spec.ranks) {
      if (!ranks.empty()) ranks += ',';
      ranks += std::to_string(r);
    }
    log("job " + std::to_string(spec.job_id) + " started: model " + m->label() + ", ranks " + ranks + " of " +
        std::to_string(spec.replicas) + ", " + std::to_string(cfg.train->count) + " training samples");
    send_kv(from, wire::msg_type::job_ack, spec.job_id,
            {{"train", std::to_string(cfg.train->count)}, {"test", std::to_string(cfg.test ? cfg.test->count : 0)},
             {"model", std::to_string(m->fingerprint())}, {"description", m->description()}});
  }

  std::string name() const { return opt.name.empty() ? br.endpoint() : opt.name; }

  void on_message(const net::peer_info& from, const wire::header& h, net::payload p) {
    using wire::msg_type;
    const bool ours = job && h.job_id == job->id;
    if (ours && h.type != msg_type::chunk) job->last_heard = clock_type::now();
    wire::kv_map kv;
    std::string error;
    switch (h.type) {
      case msg_type::hello:
        if (wire::decode_kv(p.text(), &kv, &error) && kv["role"] == "node") {  // a peer node of our job
          if (!from.identity.empty() && (peer_names.size() < 4096 || peer_names.count(kv["endpoint"])))
            peer_names[kv["endpoint"]] = from.identity;
          return;
        }
        send_kv(from, msg_type::hello_ack, h.job_id,
                {{"name", name()}, {"devices", opt.devices}, {"version", std::to_string(wire::kProtocolVersion)}});
        return;
      case msg_type::job:
        if (!wire::decode_kv(p.text(), &kv, &error)) {
          log("dropped a job message with a bad payload: " + error);
          return;
        }
        if (kv.count("action") && kv["action"] == "start") {
          if (!ours) return;
          job->started = true;
          job->last_heard = clock_type::now();
          int rank = -1;  // from the network: parsed, never atoi (undefined on overflow)
          const std::string& rs = kv["rank"];
          if (std::from_chars(rs.data(), rs.data() + rs.size(), rank).ptr != rs.data() + rs.size()) rank = -1;
          auto it = job->replicas.find(rank);
          if (it != job->replicas.end() && !job->links.empty())
            caf::anon_send(it->second, run_atom::value, job->loaders[rank], job->reducers[rank], job->links[0]);
          return;
        }
        setup(from, kv);
        return;
      case msg_type::abort:
        if (ours) {
          wire::decode_kv(p.text(), &kv, &error);
          teardown(kv.count("reason") ? kv["reason"] : "aborted by the launcher");
        }
        return;
      case msg_type::weights:
        if (ours && !job->links.empty()) caf::anon_send(job->links[0], weights_atom::value, int(h.round));
        return;
      case msg_type::chunk: {
        if (!ours) return;  // a late chunk of a job that ended
        // Only the node that runs the sender's rank may send its chunks, and only to its right neighbour.
        const int sender = h.sender_rank, dest = sender >= 0 && sender < job->spec.replicas ? ring::right(sender, job->spec.replicas) : -1;
        auto it = job->reducers.find(dest);
        if (it == job->reducers.end() || job->reducers.count(sender) || from.identity.empty() ||
            !peer_names.count(job->spec.rank_nodes[size_t(sender)]) ||
            from.identity != peer_names.at(job->spec.rank_nodes[size_t(sender)])) {
          log("dropped a chunk from rank " + std::to_string(sender) + " that did not come from its node or is not for a rank here");
          return;
        }
        caf::anon_send(it->second, chunk_atom::value, from_wire(h, std::move(p)));
        return;
      }
      case msg_type::heartbeat:
        return;
      default:
        log(std::string("ignored a ") + wire::type_name(h.type) + " message");
    }
  }

  void tick() {
    if (!job) return;
    // Until it sends start, the launcher may be waiting (silently) for slower nodes to load their data:
    // give it the launcher's whole setup allowance before dropping the job.
    const auto allowance = job->started ? opt.launcher_timeout : std::chrono::milliseconds(150000);
    if (clock_type::now() - job->last_heard > allowance) {
      teardown("the launcher stopped answering");
      return;
    }
    wire::header h;
    h.type = wire::msg_type::heartbeat;
    h.job_id = job->id;
    br.reply(job->launcher, h);
  }
};

node_service::node_service(node_options options) : d_(std::make_unique<impl>(std::move(options))) {}

node_service::~node_service() { stop(); }

bool node_service::start(std::string* error) {
  if (!parse_devices(d_->opt.devices, &d_->slots, error)) return false;
  // Every device offered must work now, not fail a job later: make each backend once.
  for (const std::string& dev : d_->slots) {
    if (dev == "cpu") continue;
    std::string why;
    if (!(d_->opt.make_backend ? d_->opt.make_backend(dev, &why) : make_backend(dev, &why))) {
      *error = "--devices " + d_->opt.devices + ": " + dev + ": " + why;
      return false;
    }
  }
  configure(d_->sys_cfg, d_->opt.threads);
  d_->sys = std::make_unique<caf::actor_system>(d_->sys_cfg);
  impl* d = d_.get();
  d->br.set_handler([d](const net::peer_info& from, const wire::header& h, net::payload p) {
    d->on_message(from, h, std::move(p));
  });
  d->br.set_error_handler([d](const net::bridge_error& e) {
    d->log(std::string("dropped a message (") + net::fault_name(e.kind) + "): " + e.message);
  });
  if (!d->br.start(d->opt.listen, error)) {
    d->sys.reset();
    return false;
  }
  d->ticker = std::thread([d] {
    std::unique_lock<std::mutex> lock(d->stop_mu);
    while (!d->stop_cv.wait_for(lock, d->opt.heartbeat, [d] { return d->stopping; }))
      d->br.post([d] { d->tick(); });
  });
  d->log("listening on " + d->br.endpoint() + ", offering " + d->opt.devices + ", data from " + d->opt.data_dir);
  return true;
}

void node_service::stop() {
  if (!d_ || !d_->sys) return;
  {
    std::lock_guard<std::mutex> lock(d_->stop_mu);
    if (d_->stopping) return;
    d_->stopping = true;
  }
  d_->stop_cv.notify_all();
  if (d_->ticker.joinable()) d_->ticker.join();
  impl* d = d_.get();
  std::promise<void> done;
  if (d->br.post([d, &done] {
        d->teardown("the node is shutting down");
        done.set_value();
      }))
    done.get_future().wait();
  d->br.stop();
  for (auto& t : d->data_threads) t.thread.join();
  d->log("stopped");
  d->sys.reset();  // waits for the job's actors to finish
}

std::string node_service::endpoint() const { return d_->br.endpoint(); }
int node_service::jobs_done() const { return d_->jobs_done; }
bool node_service::busy() const { return d_->busy; }

}  // namespace ringmaster
