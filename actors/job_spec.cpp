#include "actors/job_spec.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace ringmaster {
namespace {

std::string hexf(double v) {
  char b[40];
  std::snprintf(b, sizeof b, "%a", v);
  return b;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += v[i];
  }
  return s;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size() && !s.empty()) {
    size_t c = s.find(',', at);
    out.push_back(s.substr(at, c == std::string::npos ? std::string::npos : c - at));
    if (c == std::string::npos) break;
    at = c + 1;
  }
  return out;
}

// Reads kv[key] into *out; false (with *error) if missing or not a number in range.
struct reader {
  const wire::kv_map& kv;
  std::string* error;
  bool ok = true;
  const std::string* get(const char* key) {
    auto it = kv.find(key);
    if (it == kv.end()) {
      if (ok) *error = std::string("missing key '") + key + "'";
      ok = false;
      return nullptr;
    }
    return &it->second;
  }
  void num(const char* key, int64_t* out, int64_t lo, int64_t hi) {
    const std::string* v = get(key);
    if (!v) return;
    char* end = nullptr;
    long long x = std::strtoll(v->c_str(), &end, 10);
    if (v->empty() || *end || x < lo || x > hi) {
      if (ok) *error = std::string("bad value '") + *v + "' for '" + key + "'";
      ok = false;
      return;
    }
    *out = x;
  }
  void real(const char* key, double* out) {
    const std::string* v = get(key);
    if (!v) return;
    char* end = nullptr;
    double x = std::strtod(v->c_str(), &end);
    if (v->empty() || *end) {
      if (ok) *error = std::string("bad value '") + *v + "' for '" + key + "'";
      ok = false;
      return;
    }
    *out = x;
  }
  void str(const char* key, std::string* out) {
    if (const std::string* v = get(key)) *out = *v;
  }
};

}  // namespace

job_spec make_job_spec(const train_config& c) {
  job_spec j;
  j.model = c.model;
  j.opt = c.opt;
  j.replicas = c.replicas;
  j.global_batch = c.global_batch;
  j.epochs = c.epochs;
  j.seed = c.seed;
  j.prefetch = c.prefetch;
  j.evaluate = c.evaluate;
  j.device = c.devices.empty() ? "cpu" : device_kind(c.devices[0]);
  return j;
}

train_config make_train_config(const job_spec& j) {
  train_config c;
  c.model = j.model;
  c.opt = j.opt;
  c.replicas = j.replicas;
  c.global_batch = j.global_batch;
  c.epochs = j.epochs;
  c.seed = j.seed;
  c.prefetch = j.prefetch;
  c.evaluate = j.evaluate;
  return c;
}

wire::kv_map to_kv(const job_spec& j) {
  std::vector<std::string> ranks;
  for (int r : j.ranks) ranks.push_back(std::to_string(r));
  return {{"job", std::to_string(j.job_id)},
          {"model", j.model},
          {"optimizer", j.opt.kind == optimizer_config::adam ? "adam" : "sgd"},
          {"lr", hexf(j.opt.lr)},
          {"beta1", hexf(j.opt.beta1)},
          {"beta2", hexf(j.opt.beta2)},
          {"eps", hexf(j.opt.eps)},
          {"momentum", hexf(j.opt.momentum)},
          {"replicas", std::to_string(j.replicas)},
          {"global_batch", std::to_string(j.global_batch)},
          {"epochs", std::to_string(j.epochs)},
          {"seed", std::to_string(j.seed)},
          {"prefetch", std::to_string(j.prefetch)},
          {"evaluate", j.evaluate ? "1" : "0"},
          {"limit_train", std::to_string(j.limit_train)},
          {"limit_test", std::to_string(j.limit_test)},
          {"ranks", join(ranks)},
          {"rank_nodes", join(j.rank_nodes)},
          {"device", j.device}};
}

bool from_kv(const wire::kv_map& kv, job_spec* j, std::string* error) {
  reader rd{kv, error};
  int64_t job = 0, replicas = 0, batch = 0, epochs = 0, seed = 0, prefetch = 0, eval = 0;
  std::string opt, ranks, nodes;
  double lr = 0, b1 = 0, b2 = 0, eps = 0, mom = 0;
  rd.num("job", &job, 0, INT64_MAX);
  rd.str("model", &j->model);
  rd.str("optimizer", &opt);
  rd.real("lr", &lr);
  rd.real("beta1", &b1);
  rd.real("beta2", &b2);
  rd.real("eps", &eps);
  rd.real("momentum", &mom);
  rd.num("replicas", &replicas, 1, 1024);
  rd.num("global_batch", &batch, 1, 1 << 24);
  rd.num("epochs", &epochs, 1, 1 << 20);
  rd.num("seed", &seed, 0, INT64_MAX);
  rd.num("prefetch", &prefetch, 1, 64);
  rd.num("evaluate", &eval, 0, 1);
  rd.num("limit_train", &j->limit_train, 0, INT64_MAX);
  rd.num("limit_test", &j->limit_test, 0, INT64_MAX);
  rd.str("ranks", &ranks);
  rd.str("rank_nodes", &nodes);
  rd.str("device", &j->device);
  if (!rd.ok) return false;
  if (opt != "adam" && opt != "sgd") {
    *error = "bad optimizer '" + opt + "'";
    return false;
  }
  j->job_id = uint64_t(job);
  j->opt.kind = opt == "adam" ? optimizer_config::adam : optimizer_config::sgd;
  j->opt.lr = float(lr);
  j->opt.beta1 = float(b1);
  j->opt.beta2 = float(b2);
  j->opt.eps = float(eps);
  j->opt.momentum = float(mom);
  j->replicas = int(replicas);
  j->global_batch = int(batch);
  j->epochs = epochs;
  j->seed = uint64_t(seed);
  j->prefetch = int(prefetch);
  j->evaluate = eval != 0;
  j->ranks.clear();
  for (const std::string& r : split(ranks)) {
    char* end = nullptr;
    long v = std::strtol(r.c_str(), &end, 10);
    if (r.empty() || *end || v < 0 || v >= replicas) {
      *error = "bad rank '" + r + "' for " + std::to_string(replicas) + " replicas";
      return false;
    }
    if (std::find(j->ranks.begin(), j->ranks.end(), int(v)) != j->ranks.end()) {
      *error = "rank " + r + " listed twice";
      return false;
    }
    j->ranks.push_back(int(v));
  }
  j->rank_nodes = split(nodes);
  if (int(j->rank_nodes.size()) != j->replicas) {
    *error = "rank_nodes lists " + std::to_string(j->rank_nodes.size()) + " nodes for " +
             std::to_string(j->replicas) + " ranks";
    return false;
  }
  return true;
}

wire::kv_map to_kv(const step_report& r) {
  return {{"epoch", std::to_string(r.epoch)}, {"step", std::to_string(r.step)},
          {"loss", hexf(r.loss_sum)},         {"correct", std::to_string(r.correct)},
          {"count", std::to_string(r.count)}, {"wait_batch", hexf(r.wait_batch)},
          {"compute", hexf(r.compute)},       {"wait_ring", hexf(r.wait_ring)},
          {"update", hexf(r.update)}};
}

wire::kv_map to_kv(const eval_report& r) {
  return {{"epoch", std::to_string(r.epoch)}, {"loss", hexf(r.loss_sum)}, {"correct", std::to_string(r.correct)},
          {"count", std::to_string(r.count)}, {"seconds", hexf(r.seconds)}};
}

bool from_kv(const wire::kv_map& kv, step_report* r, std::string* error) {
  reader rd{kv, error};
  rd.num("epoch", &r->epoch, 0, INT64_MAX);
  rd.num("step", &r->step, 0, INT64_MAX);
  rd.real("loss", &r->loss_sum);
  rd.num("correct", &r->correct, 0, INT64_MAX);
  rd.num("count", &r->count, 0, INT64_MAX);
  rd.real("wait_batch", &r->wait_batch);
  rd.real("compute", &r->compute);
  rd.real("wait_ring", &r->wait_ring);
  rd.real("update", &r->update);
  return rd.ok;
}

bool from_kv(const wire::kv_map& kv, eval_report* r, std::string* error) {
  reader rd{kv, error};
  rd.num("epoch", &r->epoch, 0, INT64_MAX);
  rd.real("loss", &r->loss_sum);
  rd.num("correct", &r->correct, 0, INT64_MAX);
  rd.num("count", &r->count, 0, INT64_MAX);
  rd.real("seconds", &r->seconds);
  return rd.ok;
}

}  // namespace ringmaster
