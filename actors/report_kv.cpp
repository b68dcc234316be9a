#include "actors/report_kv.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "kernels/registry.hpp"

namespace ringmaster {
namespace {

std::string hexf(double v) {
  char b[40];
  std::snprintf(b, sizeof b, "%a", v);
  return b;
}

// Reads kv[key] into *out; false (with *error) if missing or not a number in range. The text is a node's:
// the whole of it must be the number (no spaces, no NUL, no sign or base the writer does not use).
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
  void bad(const char* key, const std::string& v) {
    if (ok) *error = "bad value " + quoted(v, 24) + " for '" + key + "'";
    ok = false;
  }
  void num(const char* key, int64_t* out, int64_t lo, int64_t hi) {
    const std::string* v = get(key);
    if (!v) return;
    int64_t x = 0;
    const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), x);
    if (v->empty() || ec != std::errc() || end != v->data() + v->size() || x < lo || x > hi) return bad(key, *v);
    *out = x;
  }
  // time: seconds, 0 to a year; else a loss, which may be NaN or infinite (the coordinator stops such a
  // job and says why).
  void real(const char* key, double* out, bool time) {
    const std::string* v = get(key);
    if (!v) return;
    char* end = nullptr;
    // strtod, not from_chars: the writer uses %a (hex with 0x), which from_chars does not read.
    const double x = v->empty() || v->find('\0') != std::string::npos || std::isspace(static_cast<unsigned char>((*v)[0]))
                         ? NAN
                         : std::strtod(v->c_str(), &end);
    if (!end || end != v->c_str() + v->size() || (time && !(x >= 0 && x <= 3.2e7))) return bad(key, *v);
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

wire::kv_map to_kv(const stall_report& r) {
  return {{"kind", "stall"}, {"gen", std::to_string(r.gen)}, {"waiting_for", std::to_string(r.waiting_for)}, {"why", r.why.substr(0, 1000)}};
}

std::string report_kind(const wire::kv_map& kv) {
  auto it = kv.find("kind");
  if (it == kv.end()) return "";
  for (const char* k : {"step", "eval", "paused", "stall"})
    if (it->second == k) return it->second;
  return "";
}

bool from_kv(const wire::kv_map& kv, step_report* r, std::string* error) {
  reader rd{kv, error};
  gen(rd, &r->gen);
  rd.num("epoch", &r->epoch, 0, INT64_MAX);
  rd.num("step", &r->step, 0, INT64_MAX);
  rd.real("loss", &r->loss_sum, false);
  rd.num("correct", &r->correct, 0, INT64_MAX);
  rd.num("count", &r->count, 0, INT64_MAX);
  rd.real("wait_batch", &r->wait_batch, true);
  rd.real("compute", &r->compute, true);
  rd.real("wait_ring", &r->wait_ring, true);
  rd.real("update", &r->update, true);
  return rd.ok;
}

bool from_kv(const wire::kv_map& kv, eval_report* r, std::string* error) {
  reader rd{kv, error};
  gen(rd, &r->gen);
  rd.num("epoch", &r->epoch, 0, INT64_MAX);
  rd.real("loss", &r->loss_sum, false);
  rd.num("correct", &r->correct, 0, INT64_MAX);
  rd.num("count", &r->count, 0, INT64_MAX);
  rd.real("seconds", &r->seconds, true);
  return rd.ok;
}

bool from_kv(const wire::kv_map& kv, pause_report* r, std::string* error) {
  reader rd{kv, error};
  gen(rd, &r->gen);
  rd.num("applied", &r->applied, 0, INT64_MAX);
  return rd.ok;
}

bool from_kv(const wire::kv_map& kv, stall_report* r, int replicas, std::string* error) {
  reader rd{kv, error};
  gen(rd, &r->gen);
  int64_t w = 0;
  rd.num("waiting_for", &w, 0, std::max(0, replicas - 1));
  r->waiting_for = int(w);
  if (const std::string* why = rd.get("why")) {
    if (why->size() > 1000) rd.bad("why", *why);
    else r->why = *why;
  }
  return rd.ok;
}

}  // namespace ringmaster
