#include "actors/report_kv.hpp"

#include <cstdio>
#include <cstdlib>

namespace ringmaster {
namespace {

std::string hexf(double v) {
  char b[40];
  std::snprintf(b, sizeof b, "%a", v);
  return b;
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
};

// A generation: 0..2^20 (job_plan.cpp's limit).
void gen(reader& rd, int* out) {
  int64_t g = 0;
  rd.num("gen", &g, 0, 1 << 20);
  *out = int(g);
}

}  // namespace

wire::kv_map to_kv(const step_report& r) {
  return {{"kind", "step"},                   {"gen", std::to_string(r.gen)}, {"epoch", std::to_string(r.epoch)},
          {"step", std::to_string(r.step)},   {"loss", hexf(r.loss_sum)},
          {"correct", std::to_string(r.correct)},
          {"count", std::to_string(r.count)}, {"wait_batch", hexf(r.wait_batch)},
          {"compute", hexf(r.compute)},       {"wait_ring", hexf(r.wait_ring)},
          {"update", hexf(r.update)}};
}

wire::kv_map to_kv(const eval_report& r) {
  return {{"kind", "eval"},                   {"gen", std::to_string(r.gen)}, {"epoch", std::to_string(r.epoch)},
          {"loss", hexf(r.loss_sum)},         {"correct", std::to_string(r.correct)},
          {"count", std::to_string(r.count)}, {"seconds", hexf(r.seconds)}};
}

wire::kv_map to_kv(const pause_report& r) {
  return {{"kind", "paused"}, {"gen", std::to_string(r.gen)}, {"applied", std::to_string(r.applied)}};
}

std::string report_kind(const wire::kv_map& kv) {
  auto it = kv.find("kind");
  return it != kv.end() && (it->second == "step" || it->second == "eval" || it->second == "paused") ? it->second : "";
}

bool from_kv(const wire::kv_map& kv, step_report* r, std::string* error) {
  reader rd{kv, error};
  gen(rd, &r->gen);
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
  gen(rd, &r->gen);
  rd.num("epoch", &r->epoch, 0, INT64_MAX);
  rd.real("loss", &r->loss_sum);
  rd.num("correct", &r->correct, 0, INT64_MAX);
  rd.num("count", &r->count, 0, INT64_MAX);
  rd.real("seconds", &r->seconds);
  return rd.ok;
}

bool from_kv(const wire::kv_map& kv, pause_report* r, std::string* error) {
  reader rd{kv, error};
  gen(rd, &r->gen);
  rd.num("applied", &r->applied, 0, INT64_MAX);
  return rd.ok;
}

}  // namespace ringmaster
