#include "actors/checkpoint.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cfloat>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <tuple>

#include "kernels/safetensors.hpp"

namespace ringmaster {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFormat = "ringmaster-checkpoint";
constexpr int kVersion = 1;
constexpr uint64_t kMaxHeaderBytes = uint64_t(1) << 26;  // 64 MiB: three entries per tensor, a long history
// Keys and values of the header outside its strings: ~10 per tensor, and a model description of at most
// 64 KiB has no more than ~40,000 tensors with their optimizer state. Parsed, 2^20 of them take ~100 MB.
constexpr size_t kMaxHeaderItems = size_t(1) << 20;

// Floats as text that reads back to the same float.
std::string exact(float v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.9g", double(v));
  return b;
}

// The optimizer-state tensors' prefixes, in the order their buffers follow the weights.
std::vector<std::string> state_prefixes(optimizer_config::kind_t k) {
  if (k == optimizer_config::adam) return {"optimizer/m/", "optimizer/v/"};
  return {"optimizer/velocity/"};
}

uint32_t crc_of(uint32_t crc, const void* p, size_t n) {
  if (n == 0) return crc;  // zlib answers 0, not crc, for a null pointer: an empty buffer's data() may be one
  return uint32_t(crc32_z(crc, static_cast<const Bytef*>(p), n));
}

// The header a checkpoint of model m with these metadata has, its data `buffers` float buffers of the
// model's size one after the other (weights first).
json make_header(const model& m, const std::vector<std::string>& prefixes, const std::map<std::string, std::string>& meta) {
  json h = json::object();
  h["__metadata__"] = meta;
  const size_t n = m.param_count();
  for (size_t b = 0; b <= prefixes.size(); ++b) {
    const std::string prefix = b == 0 ? "" : prefixes[b - 1];
    for (const param_entry& p : m.params())
      h[prefix + p.name] = {{"dtype", "F32"},
                            {"shape", p.dims},
                            {"data_offsets", {(b * n + p.offset) * 4, (b * n + p.offset + p.count) * 4}}};
  }
  return h;
}

json progress_json(const job_progress& p) {
  json hist = json::array();
  for (const epoch_stats& e : p.history)  // NaN (no evaluation) becomes null
    hist.push_back({{"epoch", e.epoch}, {"loss", e.loss}, {"accuracy", e.accuracy}, {"val_loss", e.val_loss},
                    {"val_accuracy", e.val_accuracy}, {"samples", e.samples}, {"seconds", e.seconds},
                    {"eval_seconds", e.eval_seconds}});
  return {{"history", hist}, {"loss", p.loss}, {"correct", p.correct}, {"count", p.count}};
}

bool read_all(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, std::min<size_t>(n, size_t(1) << 30));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= size_t(r);
  }
  return true;
}

// "ckpt-E-S.safetensors" -> (E, S); false for any other name.
bool parse_name(const std::string& name, int64_t* e, int64_t* s) {
  const std::string pre = "ckpt-", post = ".safetensors";
  if (name.size() <= pre.size() + post.size() || name.compare(0, pre.size(), pre) != 0 ||
      name.compare(name.size() - post.size(), post.size(), post) != 0)
    return false;
  const char* p = name.data() + pre.size();
  const char* end = name.data() + name.size() - post.size();
  auto r = std::from_chars(p, end, *e);
  if (r.ec != std::errc() || r.ptr == end || *r.ptr != '-' || *e < 0) return false;
  r = std::from_chars(r.ptr + 1, end, *s);
  // Only the name we write (not "ckpt-01-0" or "ckpt-+1-0"): what else is there is not ours to read or prune.
  return r.ec == std::errc() && r.ptr == end && *s >= 0 && name == checkpoint_name(*e, *s);
}

// Whether `name` is what a checkpoint's write cut short leaves: "ckpt-E-S.safetensors.<pid>-<hex>.tmp"
// (write_whole's temporary name), not any file of that prefix.
bool left_by_write(const std::string& name) {
  const size_t cut = name.find(".safetensors.");
  int64_t e = 0, s = 0;
  unsigned pid = 0, tag = 0;
  char rest[8] = "";
  return cut != std::string::npos && parse_name(name.substr(0, cut + 12), &e, &s) &&
         std::sscanf(name.c_str() + cut + 12, ".%u-%8x%7s", &pid, &tag, rest) == 3 && std::string(rest) == ".tmp";
}

// The checkpoints in dir with their (epoch, step), newest first; *error (if given) when the folder could
// not be read to its end (then what was read).
std::vector<std::pair<std::pair<int64_t, int64_t>, std::string>> checkpoints_in(const std::string& dir, std::string* error = nullptr) {
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::string>> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    int64_t e = 0, s = 0;
    if (parse_name(it->path().filename().string(), &e, &s)) out.push_back({{e, s}, it->path().string()});
  }
  if (ec && error) *error = "cannot read folder " + dir + ": " + ec.message();
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

// After writing the checkpoint of epoch e, step s: removes every other checkpoint but one before it, and
// temporary files a crash left. The one kept is `keep` (a file name) when given and there: one known to
// read back whole (the job's last, or the one it resumed from); else the newest before it, which may be a
// damaged file a resume passed over.
void prune(const std::string& dir, int64_t e, int64_t s, const std::string* keep) {
  bool older_kept = false;
  std::error_code ec;
  const auto all = checkpoints_in(dir);
  // Not there (a resume from another folder, or from a checkpoint made in memory): the newest before.
  if (keep && std::none_of(all.begin(), all.end(), [&](const auto& f) { return fs::path(f.second).filename() == *keep; }))
    keep = nullptr;
  for (const auto& [at, path] : all) {
    if (at == std::make_pair(e, s)) continue;
    const bool kept = keep ? fs::path(path).filename() == *keep : at < std::make_pair(e, s);
    if (kept && !older_kept) {
      older_kept = true;
      continue;
    }
    fs::remove(path, ec);
  }
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (left_by_write(name)) fs::remove(it->path(), ec);
  }
}

// Metadata fields, read without trusting them: false with *error naming the field.
class meta_reader {
 public:
  meta_reader(const json& meta, std::string path, std::string* error) : meta_(meta), path_(std::move(path)), error_(error) {}
  bool ok() const { return ok_; }
  const std::string* text(const char* key) {
    if (!ok_) return nullptr;
    auto it = meta_.find(key);
    if (it == meta_.end() || !it->is_string()) {
      bad(std::string("no metadata field '") + key + "'");
      return nullptr;
    }
    return &it->get_ref<const std::string&>();
  }
  template <class T>
  meta_reader& number(const char* key, T* out, T lo, T hi, bool optional = false) {
    if (optional && ok_ && !meta_.contains(key)) return *this;
    const std::string* t = text(key);
    if (!t) return *this;
    T v{};
    const auto r = std::from_chars(t->data(), t->data() + t->size(), v);
    if (r.ec != std::errc() || r.ptr != t->data() + t->size() || !(v >= lo && v <= hi))
      return bad(std::string("metadata field '") + key + "' is '" + t->substr(0, 40) + "', not a number in range");
    *out = v;
    return *this;
  }
  meta_reader& bad(const std::string& what) {
    if (ok_) *error_ = path_ + ": " + what;
    ok_ = false;
    return *this;
  }

 private:
  const json& meta_;
  std::string path_;
  std::string* error_;
  bool ok_ = true;
};

// "" when a checkpoint's metrics could be a job's: epochs in order, rates in [0, 1], losses and times not
// negative (training losses finite), no more samples than the steps hold. (The checksum catches
// accidents, not a careful forger.)
std::string progress_fault(const checkpoint& c) {
  const auto rate = [](double v) { return std::isnan(v) || (v >= 0 && v <= 1); };
  const auto positive = [](double v) { return std::isnan(v) || v >= 0; };  // a validation loss (none: NaN)
  const auto loss = [](double v) { return std::isfinite(v) && v >= 0; };    // training's: a job stops at NaN
  const int64_t per_epoch = c.steps_per_epoch * int64_t(c.global_batch);
  for (size_t i = 0; i < c.progress.history.size(); ++i) {
    const epoch_stats& e = c.progress.history[i];
    if (e.epoch != int64_t(i) || !rate(e.accuracy) || !rate(e.val_accuracy) || !loss(e.loss) || !positive(e.val_loss) ||
        e.samples > per_epoch || !(e.seconds >= 0) || !(e.eval_seconds >= 0))
      return "epoch " + std::to_string(i + 1) + " of its history cannot be";
  }
  if (c.progress.count > c.epoch_step() * int64_t(c.global_batch) || c.progress.correct > c.progress.count || !loss(c.progress.loss))
    return "the open epoch's sums cannot be";
  return "";
}

// The progress JSON back, of a job of at most `epochs` epochs; false when any field is missing or of the
// wrong type. Each history entry is read as it is parsed and then dropped, and nothing else nests: a count
// of items bounded by `epochs` bounds nothing, as the epochs field comes from the same (perhaps crafted)
// file, and 4M "{}," under epochs 2^20 took ~450 MB parsed (64 MiB of them, 1.3 GB).
bool read_progress(const std::string& text, int64_t epochs, job_progress* p) {
  if (json_depth(text) > 4) return false;
  auto num = [](const json& o, const char* k, double* out) {
    auto it = o.find(k);
    if (it == o.end()) return false;
    if (it->is_null()) *out = NAN;  // a value JSON cannot hold (no evaluation)
    else if (it->is_number()) *out = it->get<double>();
    else return false;
    return true;
  };
  auto count = [](const json& o, const char* k, int64_t* out) {
    auto it = o.find(k);
    if (it == o.end() || !it->is_number_integer() || it->get<int64_t>() < 0) return false;
    *out = it->get<int64_t>();
    return true;
  };
  auto entry = [&](const json& e, epoch_stats* s) {
    return e.is_object() && e.size() == 8 && count(e, "epoch", &s->epoch) && num(e, "loss", &s->loss) &&
           num(e, "accuracy", &s->accuracy) && num(e, "val_loss", &s->val_loss) && num(e, "val_accuracy", &s->val_accuracy) &&
           count(e, "samples", &s->samples) && num(e, "seconds", &s->seconds) && num(e, "eval_seconds", &s->eval_seconds);
  };
  // depth: the value's (the whole text 0, its members 1, history entries 2, their numbers 3).
  std::string key;  // the member of the whole text being read
  int histories = 0;
  size_t entry_keys = 0;
  bool bad = false;
  const json::parser_callback_t keep = [&](int depth, json::parse_event_t ev, json& v) {
    using event = json::parse_event_t;
    if (bad) return depth == 0;  // the rest is dropped as it is parsed
    if (depth == 1 && ev == event::key) {
      key = v.get<std::string>();
      if (key == "history") ++histories;
      else if (key != "loss" && key != "correct" && key != "count") bad = true;
      return !bad;
    }
    if (depth <= 1) return true;
    if (depth == 2 && key == "history" && ev == event::object_start) {
      entry_keys = 0;
      return true;
    }
    if (depth == 2 && key == "history" && ev == event::object_end) {
      epoch_stats s;
      if (entry(v, &s) && int64_t(p->history.size()) < epochs) p->history.push_back(s);
      else bad = true;
      return false;  // read: dropped from the parsed text
    }
    if (depth == 3 && ev == event::key) {
      bad = ++entry_keys > 8;
      return !bad;
    }
    if (depth == 3 && ev == event::value) return true;
    bad = true;  // anything else nests where a checkpoint's progress has nothing
    return false;
  };
  const json j = json::parse(text, keep, false);
  if (bad || histories != 1 || !j.is_object() || !j.contains("history") || !j["history"].is_array()) return false;
  return num(j, "loss", &p->loss) && count(j, "correct", &p->correct) && count(j, "count", &p->count);
}

// write_checkpoint with c's progress and state given apart (the coordinator's, not copied into c).
bool write_file(const std::string& dir, const model& m, const checkpoint& head, const job_progress& progress,
                const network_state& state, std::string* path, std::string* error, const std::string* keep) {
  checkpoint c;  // the settings and the step, without the buffers
  c.opt = head.opt;
  c.steps_per_epoch = head.steps_per_epoch;
  c.progress.step = progress.step;
  const size_t n = m.param_count();
  const std::vector<std::string> prefixes = state_prefixes(c.opt.kind);
  const std::vector<const std::vector<float>*> buffers = {&state.params, &state.m1, &state.m2};
  for (size_t b = 0; b <= prefixes.size(); ++b)
    if (buffers[b]->size() != n) return *error = "the state does not fit model " + m.label(), false;
  if (progress.step != state.steps || c.steps_per_epoch <= 0) return *error = "inconsistent checkpoint", false;
  const std::map<std::string, std::string> meta = {
      {"format", kFormat}, {"format_version", std::to_string(kVersion)}, {"layout", "keras"},
      {"model", m.description()}, {"model_label", m.label()}, {"model_fingerprint", hex64(m.fingerprint())},
      {"optimizer", c.opt.kind == optimizer_config::adam ? "adam" : "sgd"}, {"lr", exact(c.opt.lr)},
      {"beta1", exact(c.opt.beta1)}, {"beta2", exact(c.opt.beta2)}, {"eps", exact(c.opt.eps)},
      {"momentum", exact(c.opt.momentum)}, {"seed", std::to_string(head.seed)},
      {"global_batch", std::to_string(head.global_batch)}, {"replicas", std::to_string(head.replicas)},
      {"ranks_changed", std::to_string(progress.ranks_changed)}, {"unmeasured", std::to_string(progress.unmeasured)},
      {"train_samples", std::to_string(head.train_samples)}, {"train_data", std::to_string(head.train_data)},
      {"steps_per_epoch", std::to_string(c.steps_per_epoch)},
      {"epochs", std::to_string(head.epochs)}, {"step", std::to_string(c.progress.step)},
      {"epoch", std::to_string(c.epoch())}, {"epoch_step", std::to_string(c.epoch_step())},
      {"progress", progress_json(progress).dump()}};
  json h = make_header(m, prefixes, meta);
  // The checksum covers the header as it reads without it, then the data.
  uint32_t crc = 0;
  const std::string unsummed = h.dump();
  crc = crc_of(crc, unsummed.data(), unsummed.size());
  for (size_t b = 0; b <= prefixes.size(); ++b) crc = crc_of(crc, buffers[b]->data(), n * sizeof(float));
  char sum[24];
  std::snprintf(sum, sizeof sum, "crc32:%08x", crc);
  h["__metadata__"]["checksum"] = sum;
  std::string text = h.dump();
  while (text.size() % 8) text += ' ';  // the data starts 8-byte aligned
  if (text.size() > kMaxHeaderBytes)  // a history of some 300,000 epochs: a file no reader would take back
    return *error = "a checkpoint header of " + std::to_string(text.size()) + " bytes, over the " +
                    std::to_string(kMaxHeaderBytes >> 20) + " MiB a checkpoint is read back with", false;
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = (unsigned char)(uint64_t(text.size()) >> (8 * i));

  const std::string final_path = (fs::path(dir) / checkpoint_name(c.epoch(), c.epoch_step())).string();
  std::vector<std::pair<const void*, size_t>> pieces = {{len, 8}, {text.data(), text.size()}};
  for (size_t b = 0; b <= prefixes.size(); ++b) pieces.push_back({buffers[b]->data(), n * sizeof(float)});
  if (!write_whole(final_path, pieces, error)) return false;
  prune(dir, c.epoch(), c.epoch_step(), keep);
  *path = final_path;
  return true;
}

}  // namespace

std::string checkpoint_name(int64_t epoch, int64_t step) {
  return "ckpt-" + std::to_string(epoch) + "-" + std::to_string(step) + ".safetensors";
}

bool write_checkpoint(const std::string& dir, const model& m, const checkpoint& c, std::string* path, std::string* error,
                      const std::string* keep) {
  return write_file(dir, m, c, c.progress, c.state, path, error, keep);
}

std::string made_by(const checkpoint& c) { return "the checkpoint " + (c.file.empty() ? "" : c.file + " ") + "was made "; }

std::string model_mismatch(const checkpoint& c, const model& m) {
  if (c.model != m.description()) {
    if (c.label != m.label()) return made_by(c) + "for model " + c.label + ", this job's is " + m.label();
    return made_by(c) + "for another model: " + c.model.substr(0, 200) + "; this job's is " + m.description().substr(0, 200);
  }
  if (c.fingerprint != m.fingerprint()) return made_by(c) + "for model " + m.label() + " laid out differently (another layer version?)";
  return "";
}

namespace {
// read_checkpoint's work (which may run out of memory on a large file).
bool read_whole(const std::string& path, const layer_registry& reg, checkpoint* out, std::string* error,
                const std::string* want, bool* other_model);
}  // namespace

bool read_checkpoint(const std::string& path, const layer_registry& reg, checkpoint* out, std::string* error,
                     const std::string* want, bool* other_model) {
  bool other = false;
  bool ok = false;
  try {
    ok = read_whole(path, reg, out, error, want, &other);
  } catch (const std::bad_alloc&) {
    *error = path + ": not enough memory to read it";
  }
  if (other_model) *other_model = other;
  if (ok) out->file = path;
  return ok;
}

namespace {
bool read_whole(const std::string& path, const layer_registry& reg, checkpoint* out, std::string* error,
                const std::string* want, bool* other_model) {
  // O_NONBLOCK: a FIFO under a checkpoint's name must not hang us in open() (a file reads as ever).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return *error = path + ": cannot open: " + std::strerror(errno), false;
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } close_fd{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return *error = path + ": not a regular file", false;
  // Its checksum guards against damage, not against whoever may write it: only trusted owners' files (ours).
  if (!checkpoint_owner_trusted(st.st_uid, path))
    return *error = path + ": belongs to another user (uid " + std::to_string(st.st_uid) + "): not trusted as a checkpoint", false;
  if (st.st_mode & 022) return *error = path + ": writable by its group or by others: not trusted as a checkpoint (chmod go-w " + path + ")", false;
  const uint64_t file_size = uint64_t(st.st_size);
  unsigned char len[8];
  if (file_size < 8 || !read_all(fd, len, 8)) return *error = path + ": truncated: no safetensors header", false;
  uint64_t hn = 0;
  for (int i = 7; i >= 0; --i) hn = hn << 8 | len[i];
  if (hn > file_size - 8)
    return *error = path + ": header length " + std::to_string(hn) + " does not fit a file of " + std::to_string(file_size) + " bytes", false;
  if (hn > kMaxHeaderBytes)
    return *error = path + ": a header of " + std::to_string(hn) + " bytes, over the " + std::to_string(kMaxHeaderBytes) + " a checkpoint's takes", false;
  std::string text(hn, '\0');
  if (!read_all(fd, text.data(), hn)) return *error = path + ": truncated header", false;
  if (json_depth(text) > 8) return *error = path + ": the header nests deeper than a checkpoint's", false;
  if (json_items(text) > kMaxHeaderItems)
    return *error = path + ": the header holds more than " + std::to_string(kMaxHeaderItems) + " keys and values, more than any checkpoint's", false;
  std::string twice;
  json h = parse_json(text, &twice);
  if (h.is_discarded() || !h.is_object() || !h.contains("__metadata__") || !h["__metadata__"].is_object())
    return *error = path + ": the header is not a safetensors header with metadata (damaged?)", false;
  if (!twice.empty()) return *error = path + ": the header names " + ringmaster::quoted(twice) + " twice (damaged?)", false;
  json& meta = h["__metadata__"];
  meta_reader rd(meta, path, error);
  const std::string* format = rd.text("format");
  if (!rd.ok()) return false;
  if (*format != kFormat) return *error = path + ": not a ringmaster checkpoint (format '" + format->substr(0, 40) + "')", false;
  int version = 0;
  rd.number("format_version", &version, 0, 1 << 20);
  if (rd.ok() && version != kVersion)
    return *error = path + ": checkpoint format version " + std::to_string(version) + ", this build reads " + std::to_string(kVersion), false;
  const std::string* sum = rd.text("checksum");
  if (!rd.ok()) return false;
  const std::string stored = *sum;
  meta.erase("checksum");
  uint32_t crc = 0;
  const std::string unsummed = h.dump();
  crc = crc_of(crc, unsummed.data(), unsummed.size());

  checkpoint c;
  const std::string *model_text = rd.text("model"), *kind = rd.text("optimizer"), *fingerprint = rd.text("model_fingerprint");
  rd.number("seed", &c.seed, uint64_t(0), UINT64_MAX).number("global_batch", &c.global_batch, 1, 1 << 24);
  rd.number("replicas", &c.replicas, 1, 1 << 20).number("train_samples", &c.train_samples, int64_t(1), int64_t(1) << 40);
  rd.number("train_data", &c.train_data, uint32_t(0), UINT32_MAX, /*optional=*/true);  // files before 2026-12-04 lack it
  // Bounded so that steps_per_epoch * epochs cannot overflow (2^40 samples, 2^20 epochs: a job plan's limit).
  rd.number("steps_per_epoch", &c.steps_per_epoch, int64_t(1), int64_t(1) << 40).number("epochs", &c.epochs, int64_t(1), int64_t(1) << 20);
  rd.number("step", &c.progress.step, int64_t(1), INT64_MAX);
  for (auto [key, v] : {std::pair<const char*, float*>{"lr", &c.opt.lr}, {"beta1", &c.opt.beta1}, {"beta2", &c.opt.beta2},
                        {"eps", &c.opt.eps}, {"momentum", &c.opt.momentum}})
    rd.number(key, v, -FLT_MAX, FLT_MAX);
  const std::string* progress = rd.text("progress");
  const std::string* label = rd.text("model_label");  // as the writer named it: "784-64-10", "cnn"
  if (!rd.ok()) return false;
  if (*kind != "adam" && *kind != "sgd") return rd.bad("optimizer '" + kind->substr(0, 20) + "' is neither adam nor sgd").ok();
  c.opt.kind = *kind == "adam" ? optimizer_config::adam : optimizer_config::sgd;
  if (!read_progress(*progress, c.epochs, &c.progress)) return rd.bad("the progress field is not what a checkpoint writes").ok();
  if (!rd.number("ranks_changed", &c.progress.ranks_changed, 0, 1 << 30, /*optional=*/true).ok()) return false;  // not before 2026-12-07
  if (!rd.number("unmeasured", &c.progress.unmeasured, int64_t(0), c.progress.count, /*optional=*/true).ok()) return false;  // older files lack it
  std::string why;
  auto m = model::build(*model_text, reg, &why);
  if (!m) return *error = path + ": its model does not build here: " + why, false;
  // As its maker named it ("784-64-10"), not as its description reads back ("JSON, 2 layers"); a label
  // no writer of ours makes (escapes, a newline: a forged file's) is quoted, so that no terminal runs it.
  const bool plain = std::all_of(label->begin(), label->end(), [](char ch) { return ch >= 0x20 && ch < 0x7f; });
  c.label = plain ? label->substr(0, 80) : ringmaster::quoted(*label, 80);
  if (hex64(m->fingerprint()) != *fingerprint)
    return *error = path + ": model " + c.label + " lays out its parameters differently here (another ringmaster or layer version?)", false;
  c.model = m->description();
  c.fingerprint = m->fingerprint();
  if (want) {  // before the data: a stranger's file is not read whole here (latest_checkpoint reads it for its own model)
    // The job's model as it would train on this checkpoint's samples: a description that names its input
    // builds as it is; one that does not ("784-64-10", "cnn") takes the input of the checkpoint's model.
    auto job = model::build(*want, reg, &why);
    if (!job) job = model::build(*want, reg, m->input(), &why);
    checkpoint model_only;
    model_only.model = c.model, model_only.label = c.label, model_only.fingerprint = c.fingerprint, model_only.file = path;
    if (!job) return *other_model = true, *error = made_by(model_only) + "for model " + c.label + ", for whose samples this job's does not build: " + why, false;
    if (std::string why = model_mismatch(model_only, *job); !why.empty()) return *other_model = true, *error = why, false;
  }

  // The tensors must be exactly where a checkpoint of this model puts them.
  const std::vector<std::string> prefixes = state_prefixes(c.opt.kind);
  json expected = make_header(*m, prefixes, {});
  expected.erase("__metadata__");
  for (auto it = h.begin(); it != h.end(); ++it)
    if (it.key() != "__metadata__" && !expected.contains(it.key()))
      return *error = path + ": unexpected tensor '" + it.key().substr(0, 60) + "'", false;
  for (auto it = expected.begin(); it != expected.end(); ++it)
    if (!h.contains(it.key()) || h[it.key()] != it.value())
      return *error = path + ": tensor '" + it.key() + "' is missing or not where model " + c.label + " puts it", false;
  const size_t n = m->param_count();
  const uint64_t data_bytes = uint64_t(n) * 4 * (prefixes.size() + 1);
  if (file_size != 8 + hn + data_bytes)
    return *error = path + ": " + std::to_string(file_size) + " bytes, a checkpoint of this model has " +
                    std::to_string(8 + hn + data_bytes) + " (truncated?)", false;
  // The checksum first, read through a small buffer: a damaged or forged file (a sparse one of any size
  // costs nothing to make) is refused before we hold its data. Then the data, read again.
  const off_t data_at = off_t(8 + hn);
  std::vector<unsigned char> chunk(size_t(1) << 20);
  for (uint64_t left = data_bytes; left > 0;) {
    const size_t k = size_t(std::min<uint64_t>(left, chunk.size()));
    if (!read_all(fd, chunk.data(), k)) return *error = path + ": truncated data", false;
    crc = crc_of(crc, chunk.data(), k);
    left -= k;
  }
  char sum_now[24];
  std::snprintf(sum_now, sizeof sum_now, "crc32:%08x", crc);
  if (stored != sum_now)
    return *error = path + ": checksum " + std::string(sum_now) + " but the file says " + stored.substr(0, 20) + ": the file is damaged", false;
  if (::lseek(fd, data_at, SEEK_SET) != data_at) return *error = path + ": cannot read it again: " + std::strerror(errno), false;
  // (Nobody else may write the file, checked above: it changing between the two reads is its owner's doing.)
  std::vector<float>* buffers[] = {&c.state.params, &c.state.m1, &c.state.m2};
  for (size_t b = 0; b <= prefixes.size(); ++b) {
    buffers[b]->resize(n);
    if (!read_all(fd, buffers[b]->data(), n * sizeof(float))) return *error = path + ": truncated data", false;
  }
  c.state.steps = c.progress.step;
  if (c.progress.step > c.steps_per_epoch * c.epochs || c.progress.count < 0 || int64_t(c.progress.history.size()) != c.epoch())
    return *error = path + ": its step and history do not agree", false;
  if (c.steps_per_epoch != c.train_samples / c.global_batch)
    return *error = path + ": " + std::to_string(c.steps_per_epoch) + " steps per epoch do not follow from its " +
                    std::to_string(c.train_samples) + " samples in batches of " + std::to_string(c.global_batch) + " (damaged?)", false;
  if (std::string bad = progress_fault(c); !bad.empty()) return *error = path + ": " + bad + " (damaged?)", false;
  // No training writes these, and resumed they would read as a learning rate too high.
  if (std::string bad = state_fault(c.state); !bad.empty()) return *error = path + ": " + bad + " (not written by training)", false;
  *out = std::move(c);
  return true;
}
}  // namespace

std::vector<std::string> list_checkpoints(const std::string& dir, std::string* error) {
  std::vector<std::string> out;
  for (auto& [at, path] : checkpoints_in(dir, error)) out.push_back(path);
  return out;
}

bool latest_checkpoint(const std::string& dir, const layer_registry& reg, checkpoint* out, std::string* path,
                       std::vector<std::string>* skipped, std::string* error, const std::string* want) {
  const auto all = checkpoints_in(dir);
  if (all.empty()) return *error = "no checkpoint (ckpt-E-S.safetensors) in " + dir, false;
  std::string other;  // why the first whole one made for another model (another run's) is not this job's
  bool found = false;
  for (const auto& [at, file] : all) {
    checkpoint c;
    std::string why;
    bool other_model = false;
    if (!read_checkpoint(file, reg, &c, &why, want, &other_model)) {
      // Another model's: read whole for its own model, it is another run's; else its description was
      // damaged and still builds, and its checksum says so. (Too large to read here, it is kept: the
      // checksum, read first, passed.)
      std::string damage;
      if (other_model && !read_checkpoint(file, reg, &c, &damage) && damage != file + ": not enough memory to read it") why = damage;
      else if (other_model && other.empty()) other = why;
      if (!found) skipped->push_back(why);  // (which names the file)
      continue;
    }
    if (found) continue;  // an older one of this job's: read to see that it is not another run's
    if (at != std::make_pair(c.epoch(), c.epoch_step())) {
      skipped->push_back(file + ": holds epoch " + std::to_string(c.epoch()) + ", step " + std::to_string(c.epoch_step()) +
                         ", not what its name says (renamed?)");
      continue;
    }
    *out = std::move(c);
    *path = file;
    found = true;
  }
  if (!other.empty())  // said once, as the refusal
    if (auto it = std::find(skipped->begin(), skipped->end(), other); it != skipped->end()) skipped->erase(it);
  // Beside this job's: as a plain start refuses a folder of checkpoints, they are not this job's to delete.
  if (found && !other.empty())
    return *error = other + "; it reads back whole, so it is another run's, which this job's next checkpoint would delete: "
                    "move it out of " + dir, false;
  if (found) return true;
  *error = !other.empty() ? other : "no checkpoint in " + dir + " reads back whole (" + std::to_string(all.size()) + " tried)";
  return false;
}

std::function<std::string(const job_progress&, const network_state&)> checkpoint_writer(
    const train_config& cfg, std::shared_ptr<const model> m, int64_t train_samples, uint32_t train_data,
    int64_t steps_per_epoch, std::shared_ptr<std::string> last) {
  checkpoint head;  // everything but progress and state
  head.model = m->description();
  head.fingerprint = m->fingerprint();
  head.opt = cfg.opt;
  head.seed = cfg.seed;
  head.global_batch = cfg.global_batch;
  head.replicas = cfg.replicas;
  head.train_samples = train_samples;
  head.train_data = train_data;
  head.steps_per_epoch = steps_per_epoch;
  head.epochs = cfg.epochs;
  // The older checkpoint kept beside each new one: the one written before, or the one resumed from (a
  // newer file that resume passed over as damaged must not outlive it).
  std::string good = cfg.resume ? fs::path(cfg.resume->file).filename().string() : std::string();
  return [head, m, last, good, dir = cfg.checkpoint_dir, told = cfg.on_checkpoint, job_replicas = cfg.replicas](
             const job_progress& p, const network_state& s) mutable {
    std::string path, error;
    head.replicas = p.replicas > 0 ? p.replicas : job_replicas;  // who made it: a resume on as many is exact
    if (!write_file(dir, *m, head, p, s, &path, &error, &good)) return error;
    good = fs::path(path).filename().string();
    *last = path;
    if (told) told(path);
    return std::string();
  };
}

}  // namespace ringmaster
