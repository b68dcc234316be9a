#include "actors/report_kv.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "actors/coordinator.hpp"  // hex64
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
  // 16 lowercase hex digits, as hex64 writes them.
  void hex64(const char* key, uint64_t* out) {
    const std::string* v = get(key);
    if (!v) return;
    uint64_t x = 0;
    const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), x, 16);
    if (v->size() != 16 || v->find_first_not_of("0123456789abcdef") != std::string::npos || ec != std::errc() ||
        end != v->data() + v->size())
      return bad(key, *v);
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
constexpr int64_t kMaxGen = 1 << 20;
void gen(reader& rd, int* out) {
  int64_t g = 0;
  rd.num("gen", &g, 0, kMaxGen);
  *out = int(g);
}

void put_f64(unsigned char* p, double v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  wire::put_le<uint64_t>(p, u);
}
double get_f64(const unsigned char* p) {
  const uint64_t u = wire::get_le<uint64_t>(p);
  double v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
// Seconds: 0 to a year, as the kv reader's times.
bool is_time(double s) { return s >= 0 && s <= 3.2e7; }

}  // namespace

wire::kv_map to_kv(const eval_report& r) {
  return {{"kind", "eval"},                   {"gen", std::to_string(r.gen)}, {"epoch", std::to_string(r.epoch)},
          {"loss", hexf(r.loss_sum)},         {"correct", std::to_string(r.correct)},
          {"count", std::to_string(r.count)}, {"seconds", hexf(r.seconds)}};
}

wire::kv_map to_kv(const pause_report& r) {
  return {{"kind", "paused"}, {"gen", std::to_string(r.gen)}, {"applied", std::to_string(r.applied)}, {"state_sum", hex64(r.state_sum)}};
}

wire::kv_map to_kv(const held_report& r) {
  return {{"kind", "held"}, {"gen", std::to_string(r.gen)}, {"started", std::to_string(r.started)}};
}

wire::kv_map to_kv(const stall_report& r) {
  return {{"kind", "stall"}, {"gen", std::to_string(r.gen)}, {"waiting_for", std::to_string(r.waiting_for)}, {"why", r.why.substr(0, 1000)},
          {"link", r.link ? "1" : "0"}};
}

std::string encode_steps(const step_report* r, size_t n) {
  std::string out(n * wire::kStepRecordBytes, '\0');
  auto* p = reinterpret_cast<unsigned char*>(out.data());
  for (size_t i = 0; i < n; ++i, p += wire::kStepRecordBytes) {
    wire::put_le<int32_t>(p + 0, r[i].rank);
    wire::put_le<int32_t>(p + 4, r[i].gen);
    wire::put_le<int64_t>(p + 8, r[i].epoch);
    wire::put_le<int64_t>(p + 16, r[i].step);
    put_f64(p + 24, r[i].loss_sum);
    wire::put_le<int64_t>(p + 32, r[i].correct);
    wire::put_le<int64_t>(p + 40, r[i].count);
    put_f64(p + 48, r[i].wait_batch);
    put_f64(p + 56, r[i].compute);
    put_f64(p + 64, r[i].wait_ring);
    put_f64(p + 72, r[i].update);
    wire::put_le<uint64_t>(p + 80, r[i].state_sum);
  }
  return out;
}

bool decode_steps(const void* data, size_t bytes, std::vector<step_report>* out, std::string* error) {
  if (bytes == 0 || bytes % wire::kStepRecordBytes != 0 || bytes / wire::kStepRecordBytes > wire::kMaxStepRecords) {
    *error = "step records of " + std::to_string(bytes) + " bytes";
    return false;
  }
  const auto* p = static_cast<const unsigned char*>(data);
  out->resize(bytes / wire::kStepRecordBytes);
  for (size_t i = 0; i < out->size(); ++i, p += wire::kStepRecordBytes) {
    step_report& r = (*out)[i];
    r.rank = wire::get_le<int32_t>(p + 0);
    r.gen = wire::get_le<int32_t>(p + 4);
    r.epoch = wire::get_le<int64_t>(p + 8);
    r.step = wire::get_le<int64_t>(p + 16);
    r.loss_sum = get_f64(p + 24);  // may be NaN or infinite: the coordinator stops that job and says why
    r.correct = wire::get_le<int64_t>(p + 32);
    r.count = wire::get_le<int64_t>(p + 40);
    r.wait_batch = get_f64(p + 48);
    r.compute = get_f64(p + 56);
    r.wait_ring = get_f64(p + 64);
    r.update = get_f64(p + 72);
    r.state_sum = wire::get_le<uint64_t>(p + 80);  // any value: the coordinator compares it
    const char* bad = r.rank < 0 ? "rank" : r.gen < 0 || r.gen > kMaxGen ? "gen" : r.epoch < 0 ? "epoch" : r.step < 0 ? "step"
                    : r.correct < 0 ? "correct" : r.count < 0 ? "count" : !is_time(r.wait_batch) ? "wait_batch"
                    : !is_time(r.compute) ? "compute" : !is_time(r.wait_ring) ? "wait_ring" : !is_time(r.update) ? "update" : nullptr;
    if (bad) {
      *error = "step record " + std::to_string(i) + " has a bad " + bad;
      return false;
    }
  }
  return true;
}

std::string report_kind(const wire::kv_map& kv) {
  auto it = kv.find("kind");
  if (it == kv.end()) return "";
  for (const char* k : {"eval", "paused", "held", "stall"})
    if (it->second == k) return it->second;
  return "";
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
  rd.hex64("state_sum", &r->state_sum);
  return rd.ok;
}

bool from_kv(const wire::kv_map& kv, held_report* r, std::string* error) {
  reader rd{kv, error};
  gen(rd, &r->gen);
  rd.num("started", &r->started, 0, INT64_MAX);
  return rd.ok;
}

bool from_kv(const wire::kv_map& kv, stall_report* r, int replicas, std::string* error) {
  reader rd{kv, error};
  gen(rd, &r->gen);
  int64_t w = 0;
  rd.num("waiting_for", &w, 0, std::max(0, replicas - 1));
  r->waiting_for = int(w);
  int64_t link = 0;
  rd.num("link", &link, 0, 1);
  r->link = link == 1;
  if (const std::string* why = rd.get("why")) {
    if (why->size() > 1000) rd.bad("why", *why);
    else r->why = *why;
  }
  return rd.ok;
}

}  // namespace ringmaster
