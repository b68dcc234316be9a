#include "actors/job_plan.hpp"

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>

#include "actors/checkpoint.hpp"
#include "kernels/registry.hpp"
#include "net/keys.hpp"
#include "net/seal.hpp"
#include "net/wire.hpp"

namespace ringmaster {
namespace {

constexpr int kMaxBatch = 1 << 24;
constexpr int64_t kMaxEpochs = 1 << 20;
constexpr int kMaxPrefetch = 64;
constexpr int64_t kMaxSteps = int64_t(1) << 50;  // steps of a job (first_step, checkpoint_every)
constexpr int kMaxGenerations = 1 << 20;
constexpr int64_t kMinRingTimeoutMs = 100, kMaxRingTimeoutMs = int64_t(7) * 24 * 3600 * 1000;  // 0.1 s to a week

bool fail(std::string* error, const std::string& what) {
  *error = "job plan: " + what;
  return false;
}

// "'ranks[3].right' is 5, expected 0"
std::string is(const std::string& path, const std::string& value, const std::string& expected) {
  return "'" + path + "' is " + value + ", expected " + expected;
}
std::string is(const std::string& path, int64_t value, const std::string& expected) {
  return is(path, std::to_string(value), expected);
}
std::string range(int64_t lo, int64_t hi) { return std::to_string(lo) + ".." + std::to_string(hi); }

// Endpoints and routing ids: printable ASCII (ids may hold spaces), so that they read in logs and errors
// as they are and travel through JSON unchanged.
bool printable(const std::string& s, size_t max, bool spaces) {
  if (s.size() > max) return false;
  for (unsigned char c : s)
    if (c > 0x7e || c < (spaces ? 0x20 : 0x21)) return false;
  return true;
}

// "cpu", "cuda", and with an index (with_index) also "cuda:12" (or "sim:x": backends of one's own may
// name their devices as they like, within reason).
bool sane_device(const std::string& d, bool with_index) {
  const size_t colon = d.find(':');
  const std::string kind = d.substr(0, colon);
  if (kind.empty() || kind.size() > 16 || kind[0] < 'a' || kind[0] > 'z' ||
      kind.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos)
    return false;
  if (colon == std::string::npos) return true;
  const std::string index = d.substr(colon + 1);
  return with_index && !index.empty() && index.size() <= 16 &&
         index.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-") == std::string::npos;
}

bool check_optimizer(const optimizer_config& o, std::string* error) {
  if (!(o.lr > 0) || !std::isfinite(o.lr)) return fail(error, is("optimizer.lr", std::to_string(o.lr), "a positive number"));
  if (!(o.beta1 >= 0 && o.beta1 < 1)) return fail(error, is("optimizer.beta1", std::to_string(o.beta1), "[0, 1)"));
  if (!(o.beta2 >= 0 && o.beta2 < 1)) return fail(error, is("optimizer.beta2", std::to_string(o.beta2), "[0, 1)"));
  if (!(o.eps > 0) || !std::isfinite(o.eps)) return fail(error, is("optimizer.eps", std::to_string(o.eps), "a positive number"));
  if (!(o.momentum >= 0 && o.momentum <= 1))
    return fail(error, is("optimizer.momentum", std::to_string(o.momentum), "[0, 1]"));
  return true;
}

bool check_nodes(const job_plan& p, std::string* error) {
  const size_t k = p.nodes.size();
  if (k < 1 || k > size_t(kMaxPlanRanks)) return fail(error, "'nodes' lists " + std::to_string(k) + " nodes, expected " + range(1, kMaxPlanRanks));
  for (size_t i = 0; i < k; ++i) {
    const plan_node& nd = p.nodes[i];
    const std::string at = "nodes[" + std::to_string(i) + "]";
    if (!printable(nd.endpoint, kMaxEndpointBytes, false))
      return fail(error, "'" + at + ".endpoint' must be at most 256 printable ASCII characters without spaces");
    if (!printable(nd.id, kMaxNodeIdBytes, true))
      return fail(error, "'" + at + ".id' must be at most 255 printable ASCII characters");
    if (!printable(nd.host, kMaxHostIdBytes, false))
      return fail(error, "'" + at + ".host' must be at most 64 printable ASCII characters without spaces");
    if (nd.endpoint.empty() && k > 1)
      return fail(error, "'" + at + ".endpoint' is empty (this process) in a plan of " + std::to_string(k) + " nodes");
    if (nd.endpoint.empty() && !nd.id.empty()) return fail(error, "'" + at + ".id' is set for this process");
    if (!nd.key.empty() && !net::is_key(nd.key)) return fail(error, "'" + at + ".key' is not a Z85 public key (40 characters)");
    if (!p.nodes[0].key.empty() != !nd.key.empty())
      return fail(error, "'" + at + ".key' is " + (nd.key.empty() ? "missing" : "set") + ", unlike 'nodes[0].key' (all nodes use keys or none)");
    if (nd.ring_port < 0 || nd.ring_port > 65535) return fail(error, is("" + at + ".ring_port", nd.ring_port, range(0, 65535)));
    if (nd.ring_port > 0 && !nd.key.empty() && p.seal_salt.empty())  // plain chunks only between nodes without keys
      return fail(error, "'" + at + ".ring_port' is set for a node with a key in a plan without 'seal_salt' (nodes with keys take only sealed chunks there)");
    if (nd.life < 0 || nd.life > kMaxGenerations) return fail(error, is("" + at + ".life", nd.life, range(0, kMaxGenerations)));
    if (p.generation == 0 && nd.life != 0)
      return fail(error, is("" + at + ".life", nd.life, "0 in generation 0 (a job starts with first lives)"));
    for (size_t j = 0; j < i; ++j) {
      if (p.nodes[j].endpoint == nd.endpoint)
        return fail(error, "'nodes[" + std::to_string(j) + "]' and '" + at + "' are both " + ringmaster::quoted(nd.endpoint));
      if (!nd.id.empty() && p.nodes[j].id == nd.id)
        return fail(error, "'nodes[" + std::to_string(j) + "]' and '" + at + "' have the same id " + ringmaster::quoted(nd.id));
    }
  }
  if (!p.seal_salt.empty() && !net::is_seal_salt(p.seal_salt))
    return fail(error, "'seal_salt' must be 64 lowercase hex digits or empty");
  if (!p.seal_salt.empty() && p.nodes[0].key.empty()) return fail(error, "'seal_salt' is set for nodes without keys");
  if (p.recipient < -1 || p.recipient >= int(k)) return fail(error, is("recipient", p.recipient, range(-1, int64_t(k) - 1)));
  return true;
}

bool check_ranks(const job_plan& p, std::string* error) {
  const int n = p.replicas();
  const bool reformed = p.generation > 0;
  if (n < 1 || n > kMaxPlanRanks) return fail(error, "'ranks' lists " + std::to_string(n) + " ranks, expected " + range(1, kMaxPlanRanks));
  if (p.global_batch % n != 0 && !reformed)
    return fail(error, "'global_batch' is " + std::to_string(p.global_batch) + ", not divisible by " + std::to_string(n) + " ranks");
  if (p.global_batch < n) return fail(error, "'global_batch' is " + std::to_string(p.global_batch) + ", less than " + std::to_string(n) + " ranks");
  const int b = p.global_batch / n;
  std::vector<int> per_node(p.nodes.size(), 0);
  int last_was = -1;
  for (int r = 0; r < n; ++r) {
    const rank_plan& rp = p.ranks[size_t(r)];
    const std::string at = "ranks[" + std::to_string(r) + "]";
    if (rp.rank >= 0 && rp.rank < r)
      return fail(error, "rank " + std::to_string(rp.rank) + " listed twice ('ranks[" + std::to_string(rp.rank) + "]' and '" + at + "')");
    if (rp.rank != r) return fail(error, is(at + ".rank", rp.rank, std::to_string(r)));
    if (rp.node < 0 || rp.node >= int(p.nodes.size()))
      return fail(error, is(at + ".node", rp.node, range(0, int64_t(p.nodes.size()) - 1)));
    ++per_node[size_t(rp.node)];
    if (rp.endpoint != p.nodes[size_t(rp.node)].endpoint)
      return fail(error, "'" + at + "' runs on node " + std::to_string(rp.node) + " but names endpoint " + ringmaster::quoted(rp.endpoint));
    if (!sane_device(rp.device, true) || device_kind(rp.device) != p.device)
      return fail(error, is(at + ".device", ringmaster::quoted(rp.device), "a " + p.device + " device"));
    if (rp.left != (r + n - 1) % n) return fail(error, is(at + ".left", rp.left, std::to_string((r + n - 1) % n)));
    if (rp.right != (r + 1) % n) return fail(error, is(at + ".right", rp.right, std::to_string((r + 1) % n)));
    // Even shards; after a re-forming, any contiguous split into shards of b or b + 1 samples.
    const int begin = r == 0 ? 0 : p.ranks[size_t(r) - 1].batch_end;
    if (rp.batch_begin != (reformed ? begin : r * b))
      return fail(error, is(at + ".batch_begin", rp.batch_begin, std::to_string(reformed ? begin : r * b)));
    const int size = rp.batch_end - rp.batch_begin;
    if (reformed ? size < b || size > b + 1 : size != b)
      return fail(error, is(at + ".batch_end", rp.batch_end, reformed ? range(rp.batch_begin + b, rp.batch_begin + b + 1) : std::to_string((r + 1) * b)));
    // Generation 0: each rank is itself; later ones list the previous generation's survivors in ring
    // order, and ranks that join (-1) anywhere.
    if (reformed ? rp.was != -1 && (rp.was <= last_was || rp.was >= kMaxPlanRanks) : rp.was != r)
      return fail(error, is(at + ".was", rp.was, reformed ? "-1 or more than the last rank before's" : std::to_string(r)));
    if (rp.was >= 0) last_was = rp.was;
  }
  if (p.ranks.back().batch_end != p.global_batch)
    return fail(error, is("ranks[" + std::to_string(n - 1) + "].batch_end", p.ranks.back().batch_end, std::to_string(p.global_batch)));
  for (size_t i = 0; i < per_node.size() && !reformed; ++i)
    if (per_node[i] == 0) return fail(error, "'nodes[" + std::to_string(i) + "]' runs no rank");
  return true;
}

}  // namespace

std::string job_plan::node_name(int node) const {
  const bool remote = node >= 0 && size_t(node) < nodes.size() && !nodes[size_t(node)].endpoint.empty();
  return remote ? "node " + nodes[size_t(node)].endpoint : "";
}

std::vector<std::string> job_plan::rank_nodes() const {
  std::vector<std::string> out;
  for (const rank_plan& r : ranks) out.push_back(node_name(r.node));
  return out;
}

std::vector<int> job_plan::ranks_on(int node) const {
  std::vector<int> out;
  for (const rank_plan& r : ranks)
    if (r.node == node) out.push_back(r.rank);
  return out;
}

int job_plan::shard_size() const {
  int most = 0;
  for (const rank_plan& r : ranks) most = std::max(most, r.batch_end - r.batch_begin);
  return most;
}

std::pair<size_t, size_t> job_plan::test_shard(int r, size_t count) const {
  const size_t n = size_t(replicas());
  return {count * size_t(r) / n, count * size_t(r + 1) / n};
}

bool validate(const job_plan& p, std::string* error) {
  if (p.model.empty() || p.model.size() > kMaxPlanModelBytes)
    return fail(error, "'model' is " + std::to_string(p.model.size()) + " bytes, expected 1.." + std::to_string(kMaxPlanModelBytes));
  if (!check_optimizer(p.opt, error)) return false;
  if (p.global_batch < 1 || p.global_batch > kMaxBatch) return fail(error, is("global_batch", p.global_batch, range(1, kMaxBatch)));
  if (p.epochs < 1 || p.epochs > kMaxEpochs) return fail(error, is("epochs", p.epochs, range(1, kMaxEpochs)));
  if (p.prefetch < 1 || p.prefetch > kMaxPrefetch) return fail(error, is("prefetch", p.prefetch, range(1, kMaxPrefetch)));
  if (p.bucket_bytes < 0 || p.bucket_bytes > (int64_t(1) << 32))
    return fail(error, is("bucket_bytes", p.bucket_bytes, range(0, int64_t(1) << 32)));
  if (p.ring_timeout_ms < kMinRingTimeoutMs || p.ring_timeout_ms > kMaxRingTimeoutMs)
    return fail(error, is("ring_timeout_ms", p.ring_timeout_ms, range(kMinRingTimeoutMs, kMaxRingTimeoutMs)));
  if (p.limit_train < 0) return fail(error, is("limit_train", p.limit_train, "0 or more"));
  if (p.limit_test < 0) return fail(error, is("limit_test", p.limit_test, "0 or more"));
  if (p.first_step < 0 || p.first_step > kMaxSteps) return fail(error, is("first_step", p.first_step, range(0, kMaxSteps)));
  if (p.checkpoint_every < 0 || p.checkpoint_every > kMaxSteps)
    return fail(error, is("checkpoint_every", p.checkpoint_every, range(0, kMaxSteps)));
  if (!sane_device(p.device, false)) return fail(error, is("device", ringmaster::quoted(p.device), "a kind of device (cpu, cuda)"));
  if (p.generation < 0 || p.generation > kMaxGenerations) return fail(error, is("generation", p.generation, range(0, kMaxGenerations)));
  if (p.generation > 0 && (p.ring == 0 || p.ring == p.job_id))
    return fail(error, "'ring' is " + std::to_string(p.ring) + ": a re-formed ring needs an id of its own");
  if (p.generation == 0 && p.ring != 0) return fail(error, is("ring", std::to_string(p.ring), "0 (the job's id) in generation 0"));
  if (p.start_step < 0) return fail(error, is("start_step", p.start_step, "0 or more"));
  return check_nodes(p, error) && check_ranks(p, error);
}

bool make_job_plan(const train_config& cfg, const job_placement& where, job_plan* out, std::string* error) {
  const int n = int(where.rank_node.size());
  if (where.nodes.empty()) return *error = "no nodes given", false;
  if (n < 1 || n > kMaxPlanRanks) return *error = "a job runs 1.." + std::to_string(kMaxPlanRanks) + " ranks, not " + std::to_string(n), false;
  if (where.devices.size() != size_t(n))
    return *error = std::to_string(where.devices.size()) + " devices given for " + std::to_string(n) + " ranks", false;
  std::vector<int> per_node(where.nodes.size(), 0);
  for (int node : where.rank_node) {
    if (node < 0 || node >= int(where.nodes.size()))
      return *error = "placement names node " + std::to_string(node) + " of " + std::to_string(where.nodes.size()), false;
    ++per_node[size_t(node)];
  }
  for (size_t i = 0; i < per_node.size(); ++i)
    if (per_node[i] == 0) return *error = "node " + where.nodes[i].endpoint + " has no ranks placed on it", false;
  if (cfg.global_batch < 1 || cfg.global_batch % n != 0)
    return *error = "global batch " + std::to_string(cfg.global_batch) + " is not divisible by " + std::to_string(n) + " replicas", false;
  job_plan p;
  p.model = cfg.model;
  p.opt = cfg.opt;
  p.global_batch = cfg.global_batch;
  p.epochs = cfg.epochs;
  p.seed = cfg.seed;
  p.prefetch = cfg.prefetch;
  p.bucket_bytes = int64_t(std::min<size_t>(cfg.bucket_bytes, size_t(INT64_MAX)));  // not wrapped to a negative
  p.ring_timeout_ms = int64_t(cfg.ring_timeout.count());
  p.evaluate = cfg.evaluate;
  p.limit_train = where.limit_train;
  p.limit_test = where.limit_test;
  p.first_step = cfg.resume ? cfg.resume->state.steps : 0;
  p.checkpoints = !cfg.checkpoint_dir.empty();
  p.checkpoint_every = cfg.checkpoint_every;
  p.device = device_kind(where.devices[0]);
  p.nodes = where.nodes;
  const int b = cfg.global_batch / n;
  for (int r = 0; r < n; ++r) {
    rank_plan rp;
    rp.rank = r;
    rp.node = where.rank_node[size_t(r)];
    rp.endpoint = where.nodes[size_t(rp.node)].endpoint;
    rp.device = where.devices[size_t(r)];
    rp.left = (r + n - 1) % n;
    rp.right = (r + 1) % n;
    rp.batch_begin = r * b;
    rp.batch_end = (r + 1) * b;
    rp.was = r;
    p.ranks.push_back(std::move(rp));
  }
  if (!validate(p, error)) return false;
  *out = std::move(p);
  return true;
}

bool make_local_plan(const train_config& cfg, job_plan* out, std::string* error) {
  job_placement here;
  here.nodes = {plan_node{}};
  here.rank_node.assign(size_t(std::max(cfg.replicas, 0)), 0);
  here.devices = cfg.devices.empty() ? std::vector<std::string>(here.rank_node.size(), "cpu") : cfg.devices;
  return make_job_plan(cfg, here, out, error);
}

train_config plan_train_config(const job_plan& p) {
  train_config c;
  c.model = p.model;
  c.opt = p.opt;
  c.replicas = p.replicas();
  c.global_batch = p.global_batch;
  c.epochs = p.epochs;
  c.seed = p.seed;
  c.prefetch = p.prefetch;
  c.bucket_bytes = size_t(p.bucket_bytes);
  c.ring_timeout = std::chrono::milliseconds(p.ring_timeout_ms);
  c.evaluate = p.evaluate;
  c.checkpoint_every = p.checkpoint_every;
  c.devices.clear();
  for (const rank_plan& r : p.ranks) c.devices.push_back(r.device);
  return c;
}

std::string to_json(const job_plan& p) {
  json nodes = json::array(), ranks = json::array();
  for (const plan_node& nd : p.nodes)
    nodes.push_back({{"endpoint", nd.endpoint}, {"id", nd.id}, {"key", nd.key}, {"host", nd.host}, {"ring_port", nd.ring_port},
                     {"life", nd.life}});
  for (const rank_plan& r : p.ranks)
    ranks.push_back({{"rank", r.rank}, {"node", r.node}, {"device", r.device}, {"left", r.left}, {"right", r.right},
                     {"batch_begin", r.batch_begin}, {"batch_end", r.batch_end}, {"was", r.was}});
  // Floats widen to doubles exactly, and a double prints with enough digits to read back the same.
  const json opt = {{"kind", p.opt.kind == optimizer_config::adam ? "adam" : "sgd"},
                    {"lr", double(p.opt.lr)},
                    {"beta1", double(p.opt.beta1)},
                    {"beta2", double(p.opt.beta2)},
                    {"eps", double(p.opt.eps)},
                    {"momentum", double(p.opt.momentum)}};
  const json j = {{"job", p.job_id},           {"model", p.model},
                  {"optimizer", opt},          {"global_batch", p.global_batch},
                  {"epochs", p.epochs},        {"seed", p.seed},
                  {"prefetch", p.prefetch},    {"evaluate", p.evaluate},
                  {"bucket_bytes", p.bucket_bytes}, {"ring_timeout_ms", p.ring_timeout_ms},
                  {"limit_train", p.limit_train}, {"limit_test", p.limit_test},
                  {"first_step", p.first_step}, {"checkpoints", p.checkpoints},
                  {"checkpoint_every", p.checkpoint_every},
                  {"device", p.device},        {"recipient", p.recipient},
                  {"elastic", p.elastic},      {"generation", p.generation},
                  {"ring", p.ring},            {"start_step", p.start_step},
                  {"seal_salt", p.seal_salt}, {"shared_memory", p.shared_memory},
                  {"nodes", nodes},            {"ranks", ranks}};
  // replace: text that is not UTF-8 (endpoints and ids are ASCII; a model description that is not UTF-8
  // is no model) is changed rather than thrown on.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {

// A value for an error message: its JSON text, cut short.
std::string shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > 40 ? s.substr(0, 40) + "..." : s;
}

// Reads the fields of one JSON object of a plan without exceptions. The first problem is kept in *error,
// naming the field by its path ("ranks[3].right"); later reads then do nothing.
class reader {
 public:
  reader(const json& obj, std::string prefix, std::string* error) : obj_(obj), prefix_(std::move(prefix)), error_(error) {}
  bool ok() const { return ok_; }

  // Refuses keys other than these: a misspelt or unknown field is an error, not silently ignored.
  reader& only(std::initializer_list<const char*> keys) {
    if (!ok_) return *this;
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      bool known = false;
      for (const char* k : keys) known = known || it.key() == k;
      if (!known) return bad("unknown key " + ringmaster::quoted(path(it.key()), 60));
    }
    return *this;
  }
  const json* get(const char* key) {
    if (!ok_) return nullptr;
    auto it = obj_.find(key);
    if (it == obj_.end()) {
      bad("'" + path(key) + "' is missing");
      return nullptr;
    }
    return &*it;
  }
  reader& u64(const char* key, uint64_t* out) {
    if (const json* v = get(key)) {
      if (v->is_number_unsigned()) *out = v->get<uint64_t>();
      else if (v->is_number_integer()) bad(is(path(key), shown(*v), "0..18446744073709551615"));
      else bad("'" + path(key) + "' must be an integer in 0..18446744073709551615, got " + shown(*v));
    }
    return *this;
  }
  reader& integer(const char* key, int64_t* out, int64_t lo, int64_t hi) {
    const json* v = get(key);
    if (!v) return *this;
    if (!v->is_number_integer()) return bad("'" + path(key) + "' must be an integer in " + range(lo, hi) + ", got " + shown(*v));
    // An unsigned value above INT64_MAX would wrap in get<int64_t>: compare it as unsigned first.
    const bool above = v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(hi);
    if (above || v->get<int64_t>() < lo || v->get<int64_t>() > hi) return bad(is(path(key), shown(*v), range(lo, hi)));
    *out = v->get<int64_t>();
    return *this;
  }
  reader& integer(const char* key, int* out, int lo, int hi) {
    int64_t x = 0;
    integer(key, &x, lo, hi);
    if (ok_) *out = int(x);
    return *this;
  }
  // A finite number that fits a float (settings are floats): read as a double, so the float it came from
  // comes back exactly.
  reader& real(const char* key, float* out) {
    if (const json* v = get(key)) {
      const double d = v->is_number() ? v->get<double>() : NAN;
      if (!std::isfinite(d) || std::fabs(d) > FLT_MAX) return bad("'" + path(key) + "' must be a finite number, got " + shown(*v));
      *out = float(d);
    }
    return *this;
  }
  reader& boolean(const char* key, bool* out) {
    if (const json* v = get(key)) {
      if (!v->is_boolean()) return bad("'" + path(key) + "' must be true or false, got " + shown(*v));
      *out = v->get<bool>();
    }
    return *this;
  }
  reader& text(const char* key, std::string* out, size_t max) {
    if (const json* v = get(key)) {
      if (!v->is_string()) return bad("'" + path(key) + "' must be a string, got " + shown(*v));
      const std::string& s = v->get_ref<const std::string&>();
      if (s.size() > max) return bad("'" + path(key) + "' is " + std::to_string(s.size()) + " bytes, the limit is " + std::to_string(max));
      *out = s;
    }
    return *this;
  }
  // An array of at most `max` elements.
  const json* array(const char* key, size_t max) {
    const json* v = get(key);
    if (!v) return nullptr;
    if (!v->is_array()) {
      bad("'" + path(key) + "' must be an array, got " + shown(*v));
      return nullptr;
    }
    if (v->size() > max) {
      bad("'" + path(key) + "' has " + std::to_string(v->size()) + " entries, the limit is " + std::to_string(max));
      return nullptr;
    }
    return v;
  }
  const json* object(const char* key) {
    const json* v = get(key);
    if (v && !v->is_object()) {
      bad("'" + path(key) + "' must be an object, got " + shown(*v));
      return nullptr;
    }
    return v;
  }
  std::string path(const std::string& key) const { return prefix_.empty() ? key : prefix_ + "." + key; }

 private:
  reader& bad(const std::string& what) {
    if (ok_) fail(error_, what);
    ok_ = false;
    return *this;
  }
  const json& obj_;
  std::string prefix_;
  std::string* error_;
  bool ok_ = true;
};

bool read_plan(const json& j, job_plan* p, std::string* error) {
  if (!j.is_object()) return fail(error, "the text is not a JSON object");
  reader rd(j, "", error);
  rd.only({"job", "model", "optimizer", "global_batch", "epochs", "seed", "prefetch", "evaluate", "bucket_bytes", "ring_timeout_ms", "limit_train",
           "limit_test", "first_step", "checkpoints", "checkpoint_every", "device", "recipient", "elastic", "generation",
           "ring", "start_step", "seal_salt", "shared_memory", "nodes", "ranks"});
  std::string kind;
  const json* opt = rd.object("optimizer");
  if (opt) {
    reader ro(*opt, "optimizer", error);
    ro.only({"kind", "lr", "beta1", "beta2", "eps", "momentum"}).text("kind", &kind, 8);
    ro.real("lr", &p->opt.lr).real("beta1", &p->opt.beta1).real("beta2", &p->opt.beta2).real("eps", &p->opt.eps);
    ro.real("momentum", &p->opt.momentum);
    if (!ro.ok()) return false;
    if (kind != "adam" && kind != "sgd") return fail(error, is("optimizer.kind", ringmaster::quoted(kind), "'adam' or 'sgd'"));
    p->opt.kind = kind == "adam" ? optimizer_config::adam : optimizer_config::sgd;
  }
  rd.u64("job", &p->job_id).text("model", &p->model, kMaxPlanModelBytes);
  rd.integer("global_batch", &p->global_batch, 1, kMaxBatch).integer("epochs", &p->epochs, 1, kMaxEpochs);
  rd.u64("seed", &p->seed).integer("prefetch", &p->prefetch, 1, kMaxPrefetch).boolean("evaluate", &p->evaluate);
  rd.integer("bucket_bytes", &p->bucket_bytes, 0, int64_t(1) << 32);
  rd.integer("ring_timeout_ms", &p->ring_timeout_ms, kMinRingTimeoutMs, kMaxRingTimeoutMs);
  rd.integer("limit_train", &p->limit_train, 0, INT64_MAX).integer("limit_test", &p->limit_test, 0, INT64_MAX);
  rd.integer("first_step", &p->first_step, 0, kMaxSteps).boolean("checkpoints", &p->checkpoints);
  rd.integer("checkpoint_every", &p->checkpoint_every, 0, kMaxSteps);
  rd.text("device", &p->device, 16).integer("recipient", &p->recipient, -1, kMaxPlanRanks - 1);
  rd.boolean("elastic", &p->elastic).integer("generation", &p->generation, 0, kMaxGenerations).u64("ring", &p->ring);
  rd.integer("start_step", &p->start_step, 0, INT64_MAX).text("seal_salt", &p->seal_salt, 2 * net::kSealSaltBytes);
  rd.boolean("shared_memory", &p->shared_memory);
  const json* nodes = rd.array("nodes", size_t(kMaxPlanRanks));
  const json* ranks = rd.array("ranks", size_t(kMaxPlanRanks));
  if (!rd.ok()) return false;
  for (size_t i = 0; i < nodes->size(); ++i) {
    const std::string at = "nodes[" + std::to_string(i) + "]";
    if (!(*nodes)[i].is_object()) return fail(error, "'" + at + "' must be an object, got " + shown((*nodes)[i]));
    plan_node nd;
    reader rn((*nodes)[i], at, error);
    rn.only({"endpoint", "id", "key", "host", "ring_port", "life"}).text("endpoint", &nd.endpoint, kMaxEndpointBytes);
    rn.integer("life", &nd.life, 0, kMaxGenerations);
    rn.text("host", &nd.host, kMaxHostIdBytes);
    rn.text("id", &nd.id, kMaxNodeIdBytes).text("key", &nd.key, net::kKeyChars).integer("ring_port", &nd.ring_port, 0, 65535);
    if (!rn.ok()) return false;
    p->nodes.push_back(std::move(nd));
  }
  for (size_t i = 0; i < ranks->size(); ++i) {
    const std::string at = "ranks[" + std::to_string(i) + "]";
    if (!(*ranks)[i].is_object()) return fail(error, "'" + at + "' must be an object, got " + shown((*ranks)[i]));
    rank_plan r;
    reader rr((*ranks)[i], at, error);
    rr.only({"rank", "node", "device", "left", "right", "batch_begin", "batch_end", "was"});
    rr.integer("rank", &r.rank, 0, kMaxPlanRanks - 1).integer("node", &r.node, 0, kMaxPlanRanks - 1);
    rr.text("device", &r.device, 33).integer("left", &r.left, 0, kMaxPlanRanks - 1).integer("right", &r.right, 0, kMaxPlanRanks - 1);
    rr.integer("batch_begin", &r.batch_begin, 0, kMaxBatch).integer("batch_end", &r.batch_end, 0, kMaxBatch);
    rr.integer("was", &r.was, -1, kMaxPlanRanks - 1);
    if (!rr.ok()) return false;
    if (r.node < int(p->nodes.size())) r.endpoint = p->nodes[size_t(r.node)].endpoint;  // else validate names it
    p->ranks.push_back(std::move(r));
  }
  return validate(*p, error);
}

}  // namespace

bool from_json(std::string_view text, job_plan* out, std::string* error) {
  if (text.size() > wire::kMaxJobBytes)
    return fail(error, "the text is " + std::to_string(text.size()) + " bytes, the limit is " + std::to_string(wire::kMaxJobBytes));
  const std::string whole(text);
  // Before parsing: copying or printing a deeply nested value recurses, and a few bytes a level suffice.
  if (json_depth(whole) > kMaxPlanDepth)
    return fail(error, "the text nests deeper than " + std::to_string(kMaxPlanDepth) + " levels");
  // The parser would stop at a NUL byte and ignore what follows: a plan is all of its text.
  if (whole.find('\0') != std::string::npos) return fail(error, "the text holds a NUL byte");
  try {
    std::string twice;  // a plan that says two things is refused
    const json j = parse_json(whole, &twice);
    if (j.is_discarded()) return fail(error, "the text is not valid JSON");
    if (!twice.empty()) return fail(error, "key " + ringmaster::quoted(twice) + " appears twice in one object");
    job_plan p;
    if (!read_plan(j, &p, error)) return false;
    *out = std::move(p);
    return true;
  } catch (const std::exception& e) {  // out of memory, say: an error like any other, never an escape
    return fail(error, std::string("cannot be read: ") + e.what());
  }
}

}  // namespace ringmaster
