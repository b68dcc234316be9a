#include "actors/topology.hpp"

#include <algorithm>
#include <charconv>

#include "actors/node_service.hpp"
#include "kernels/dataset.hpp"
#include "net/keys.hpp"

namespace ringmaster {

topology::topology() = default;

topology::~topology() = default;

topology& topology::connect(const std::string& endpoint, const std::string& key) {
  auto at = std::find(nodes_.begin(), nodes_.end(), endpoint);
  if (at == nodes_.end()) {
    nodes_.push_back(endpoint);
    node_keys_.push_back(key);
  } else if (!key.empty()) {
    node_keys_[size_t(at - nodes_.begin())] = key;
  }
  return *this;
}

topology& topology::key_dir(const std::string& dir) {
  key_dir_ = dir;
  return *this;
}

topology& topology::insecure(bool on) {
  insecure_ = on;
  return *this;
}

int topology::place(const placement& where) {
  places_.push_back(where);
  return int(places_.size()) - 1;
}

topology& topology::place(int count, const placement& where) {
  for (int i = 0; i < count; ++i) place(where);
  return *this;
}

topology& topology::data_dir(const std::string& dir) {
  data_dir_ = dir;
  return *this;
}

topology& topology::limit(int64_t train_samples, int64_t test_samples) {
  limit_train_ = train_samples;
  limit_test_ = test_samples;
  return *this;
}

topology& topology::listen(const std::string& endpoint, int ring_port) {
  listen_ = endpoint;
  ring_port_ = ring_port;
  return *this;
}

namespace {

// Where this process's ranks are served for the nodes: listen (checked), or this machine's address toward
// the first node; "" with *failed set when there is none to give them.
std::string here_endpoint(const std::string& listen, int ring_port, const std::vector<placement>& places, train_result* failed) {
  auto refuse = [failed](bool invalid, const std::string& why) {
    failed->invalid = invalid;
    failed->error = why;
    return std::string();
  };
  if (ring_port < 0 || ring_port > 65535)
    return refuse(true, "listen(): the ring port must be 0-65535, not " + std::to_string(ring_port));
  if (listen.empty()) {  // a node on another machine cannot reach us at 127.0.0.1
    const auto node = std::find_if(places.begin(), places.end(), [](const placement& p) { return !p.node.empty(); });
    // (A node on ipc:// is on this machine: loopback reaches it.)
    const std::string me = node->node.rfind("ipc://", 0) == 0 ? "127.0.0.1" : net::address_toward(node->node);
    if (me.empty())
      return refuse(false, "cannot tell this machine's address toward node " + node->node +
                               " (no route to it, or a name that does not resolve here): name it with listen(\"tcp://ADDRESS:0\")");
    return "tcp://" + me + ":0";
  }
  std::string error;  // without the daemon's advice of 0.0.0.0 or *, which the nodes cannot be told
  if (!net::check_endpoint(listen, true, &error) || !net::check_listen_host(listen, &error))
    return refuse(true, "listen(): " + error.substr(0, error.find(" (listen on")) + ": name an address of this machine that the nodes reach");
  const std::string host = listen.substr(0, listen.rfind(':'));
  if (host == "tcp://*" || host == "tcp://0.0.0.0" || host == "tcp://[::]")  // the nodes would be told to reach themselves
    return refuse(true, "listen(): name the address of this machine that the nodes reach (" + listen + " names every one)");
  const std::string port_text = listen.substr(listen.rfind(':') + 1);
  int port = -1;
  std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);  // checked above: a number
  if (ring_port != 0 && port == ring_port)  // as the daemon's --ring-port
    return refuse(true, "listen(): the ring port " + std::to_string(ring_port) + " is the port of " + listen + ": ring chunks need a port of their own");
  return listen;
}

}  // namespace

train_result topology::train(train_config cfg) {
  train_result failed;
  if (places_.empty()) {
    failed.invalid = true;
    failed.error = "no ranks placed";
    return failed;
  }
  if (limit_train_ < 0 || limit_test_ < 0) {  // it took them for "all"
    failed.invalid = true;
    failed.error = "limit(): sample counts must be 0 (all) or more, not " + std::to_string(limit_train_) + " and " + std::to_string(limit_test_);
    return failed;
  }
  const bool all_here =
      std::all_of(places_.begin(), places_.end(), [](const placement& p) { return p.node.empty(); });
  if (all_here) {
    // Data in memory, or else data_dir()'s files with limit() applied, as a job on nodes reads them.
    const auto load = [&](const char* prefix, int64_t limit, std::shared_ptr<const dataset>* to) {
      auto d = std::make_shared<dataset>();
      if (!load_mnist(data_dir_, prefix, 256, d.get(), &failed.error)) return failed.invalid = !load_error_is_resource(failed.error), false;
      if (limit > 0) truncate(*d, size_t(limit));
      *to = std::move(d);
      return true;
    };
    const bool from_files = !cfg.train;  // a test set of data_dir()'s goes only with its training set
    if (from_files && !load("train", limit_train_, &cfg.train)) return failed;
    if (from_files && !cfg.test && cfg.evaluate && !load("t10k", limit_test_, &cfg.test)) return failed;
    cfg.replicas = ranks();
    cfg.devices.clear();
    for (const placement& p : places_) cfg.devices.push_back(p.device);
    return ringmaster::train(cfg);
  }
  // One kind of device per job. A rank on a node names only the kind ("cpu", "cuda"): the node runs it on
  // the devices it offers. A rank here names its device ("cpu", "cuda:1").
  std::string local_devices;  // the --devices of this process's own node service
  int local_cpus = 0;
  for (const placement& p : places_) {
    if (!p.node.empty() && std::find(nodes_.begin(), nodes_.end(), p.node) == nodes_.end()) {
      failed.error = "rank placed on " + p.node + ", which was not connect()ed";
      return failed;
    }
    if (device_kind(p.device) != device_kind(places_[0].device)) {
      failed.error = "ranks on " + places_[0].device + " and on " + p.device +
                     ": a job runs on CPUs or on GPUs, not both";
      return failed;
    }
    if (!p.node.empty() && p.device != device_kind(p.device)) {
      failed.error = "a rank on node " + p.node + " names the kind of device only (" + device_kind(p.device) +
                     "), not '" + p.device + "': the node runs it on the devices it offers";
      return failed;
    }
    if (p.node.empty() && p.device != "cpu" && p.device.find(':') == std::string::npos) {
      failed.error = "a rank in this process names its device (cpu, cuda:0, ...), not only a kind ('" + p.device + "')";
      return failed;
    }
    if (p.node.empty() && p.device == "cpu") ++local_cpus;
    else if (p.node.empty()) local_devices += local_devices.empty() ? p.device : "," + p.device.substr(p.device.find(':') + 1);
  }
  if (local_cpus) local_devices = "cpu:" + std::to_string(local_cpus);
  // Each node reads its own copy of the data, this process's ranks too: data in memory would be passed over
  // in silence (a job given 32 samples trained on the 60,000 of data_dir()).
  if (cfg.train || cfg.test) {
    failed.invalid = true;
    failed.error = "a job with ranks on nodes reads its data on each node, from data_dir() (" + data_dir_ +
                   "): leave cfg.train and cfg.test unset, or place every rank in this process to train on data in memory";
    return failed;
  }
  cfg.devices = {places_[0].device};  // the job's kind
  // Ranks of this process: served by a node service of our own on a loopback port.
  std::unique_ptr<node_service> here;
  remote_options ro;
  ro.nodes = nodes_;
  ro.limit_train = limit_train_;
  ro.limit_test = limit_test_;
  ro.key_dir = key_dir_;
  ro.insecure = insecure_;
  ro.node_keys = node_keys_;
  const int local = int(std::count_if(places_.begin(), places_.end(), [](auto& p) { return p.node.empty(); }));
  if (local > 0) {
    node_options no;
    no.listen = here_endpoint(listen_, ring_port_, places_, &failed);
    if (no.listen.empty()) return failed;
    no.ring_port = ring_port_;
    no.name = "this process";
    no.devices = local_devices;
    no.make_backend = cfg.make_backend;
    no.layers = cfg.layers;  // the ranks here build the program's own layers, as a local job does
    no.data_dir = data_dir_;
    no.log = [](const std::string&) {};
    no.key_dir = key_dir_;  // our own keys: the node accepts us, we know its key
    no.insecure = insecure_;
    here = std::make_unique<node_service>(no);
    if (!here->start(&failed.error)) return failed;
    ro.nodes.push_back(here->endpoint());
    ro.node_keys.push_back("");
  }
  for (const placement& p : places_) {
    const std::string& ep = p.node.empty() ? here->endpoint() : p.node;
    ro.rank_node.push_back(int(std::find(ro.nodes.begin(), ro.nodes.end(), ep) - ro.nodes.begin()));
  }
  // Nodes with no ranks take no part.
  std::vector<std::string> used, used_keys;
  std::vector<int> index(ro.nodes.size(), -1);
  for (int& n : ro.rank_node) {
    if (index[size_t(n)] < 0) {
      index[size_t(n)] = int(used.size());
      used.push_back(ro.nodes[size_t(n)]);
      used_keys.push_back(ro.node_keys[size_t(n)]);
    }
    n = index[size_t(n)];
  }
  ro.nodes = used;
  ro.node_keys = used_keys;
  return train_remote(cfg, ro);
}

struct topology::ring_system {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;  // after cfg, which it reads until it is gone
};

std::unique_ptr<local_ring> topology::ring(int size) {
  if (!rings_) {
    rings_ = std::make_shared<ring_system>();
    configure(rings_->cfg, 0);
    rings_->sys = std::make_unique<caf::actor_system>(rings_->cfg);
  }
  return std::make_unique<local_ring>(*rings_->sys, size, rings_);
}

}  // namespace ringmaster
