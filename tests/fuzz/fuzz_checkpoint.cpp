// libFuzzer harness: checkpoint files (actors/checkpoint.hpp's read_checkpoint), as --resume reads them
// from a folder others may have written, for the harnesses' small MLP (4-3-2) with Adam or SGD.
//
// Input: byte 0's bit 0 passes the job's model as `want` (a stranger's file is refused before its data);
// bit 1 mends the checksum first, so that changes to the header's fields and the data reach the checks
// behind it rather than all ending at the checksum. The rest is the file.
//
// Properties: a refusal says why; a checkpoint read is one training could have written (its state the
// model's size, its step, history and sums in agreement, finite values) and writes and reads back as it was.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/checkpoint.hpp"
#include "tests/fuzz/fuzz_util.hpp"

using namespace ringmaster;
using fuzz::require;

namespace {

// The input with its checksum made right, or empty when its header does not parse as one with metadata
// (then it goes in as it came).
std::string mended(const uint8_t* data, size_t size) {
  if (size < 8) return {};
  uint64_t hn = 0;
  for (int i = 7; i >= 0; --i) hn = hn << 8 | data[i];
  if (hn > size - 8) return {};
  // Deeper than the reader takes (8) is refused there anyway; dump() below would recurse that deep.
  int depth = 0, deepest = 0;
  for (uint64_t i = 0; i < hn; ++i) {
    const char c = char(data[8 + i]);
    depth += c == '[' || c == '{' ? 1 : c == ']' || c == '}' ? -1 : 0;
    deepest = std::max(deepest, depth);
  }
  if (deepest > 16) return {};
  auto h = nlohmann::json::parse(data + 8, data + 8 + hn, nullptr, /*allow_exceptions=*/false);
  if (h.is_discarded() || !h.is_object() || !h.contains("__metadata__") || !h["__metadata__"].is_object()) return {};
  h["__metadata__"].erase("checksum");
  const std::string unsummed = h.dump();
  uLong crc = crc32_z(0, reinterpret_cast<const Bytef*>(unsummed.data()), unsummed.size());
  if (size > 8 + hn) crc = crc32_z(crc, data + 8 + hn, size - 8 - hn);
  char sum[24];
  std::snprintf(sum, sizeof sum, "crc32:%08x", unsigned(crc));
  h["__metadata__"]["checksum"] = sum;
  const std::string text = h.dump();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[size_t(i)] = char(uint64_t(text.size()) >> (8 * i));
  out += text;
  out.append(reinterpret_cast<const char*>(data + 8 + hn), size - 8 - hn);
  return out;
}

// One file in memory (tmpfs), rewritten for every input: no disk, and fsync costs nothing.
struct scratch {
  int fd = -1;
  std::string path, dir;
  scratch() {
    fd = ::memfd_create("fuzz-checkpoint", MFD_CLOEXEC);
    require(fd >= 0, "memfd_create", std::strerror(errno));
    path = "/proc/self/fd/" + std::to_string(fd);
    dir = "/dev/shm/ringmaster-fuzz-checkpoint-" + std::to_string(::getpid());
    std::filesystem::create_directories(dir);
  }
  ~scratch() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  void put(const void* p, size_t n) {
    require(::ftruncate(fd, 0) == 0 && ::pwrite(fd, p, n, 0) == ssize_t(n), "writing the scratch file", std::strerror(errno));
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// A checkpoint that was read must be one training could have written, and survive a write and a read.
void check_read(const checkpoint& c, const layer_registry& reg, const scratch& s) {
  std::string err;
  auto m = model::build(c.model, reg, &err);
  require(m != nullptr, "a read checkpoint's model builds", err);
  const size_t n = m->param_count();
  require(c.state.params.size() == n && c.state.m1.size() == n, "weights and first moments are the model's size");
  require(c.state.m2.size() == (c.opt.kind == optimizer_config::adam ? n : 0), "second moments only for Adam");
  require(c.state.steps == c.progress.step && c.progress.step >= 1, "the state's steps are the progress's");
  require(c.steps_per_epoch >= 1 && c.progress.step <= c.steps_per_epoch * c.epochs, "the step lies within the job");
  require(int64_t(c.progress.history.size()) == c.epoch(), "one history entry per epoch done");
  require(c.progress.correct >= 0 && c.progress.correct <= c.progress.count, "no more right than seen");
  require(state_fault(c.state).empty(), "the state is finite", state_fault(c.state));

  std::string path;
  require(write_checkpoint(s.dir, *m, c, &path, &err), "a read checkpoint writes", err);
  checkpoint again;
  require(read_checkpoint(path, reg, &again, &err), "and reads back", err);
  require(again.model == c.model && again.fingerprint == c.fingerprint && again.seed == c.seed &&
              again.global_batch == c.global_batch && again.replicas == c.replicas && again.epochs == c.epochs &&
              again.steps_per_epoch == c.steps_per_epoch && again.train_samples == c.train_samples &&
              again.train_data == c.train_data && again.opt.kind == c.opt.kind,
          "as it was: its settings");
  for (auto [a, b] : {std::pair{again.opt.lr, c.opt.lr}, {again.opt.beta1, c.opt.beta1}, {again.opt.beta2, c.opt.beta2},
                      {again.opt.eps, c.opt.eps}, {again.opt.momentum, c.opt.momentum}})
    require(std::memcmp(&a, &b, sizeof a) == 0, "as it was: the optimizer's settings, bit for bit");
  require(again.progress.step == c.progress.step && again.progress.count == c.progress.count &&
              again.progress.correct == c.progress.correct && again.progress.history.size() == c.progress.history.size() &&
              std::memcmp(&again.progress.loss, &c.progress.loss, sizeof(double)) == 0,
          "as it was: its progress");
  for (size_t e = 0; e < c.progress.history.size(); ++e) {  // NaN (no evaluation) reads back as NaN: compared as bits
    const epoch_stats &x = again.progress.history[e], &y = c.progress.history[e];
    require(x.epoch == y.epoch && x.samples == y.samples, "as it was: an epoch's number and samples");
    for (auto [p, q] : {std::pair{x.loss, y.loss}, {x.accuracy, y.accuracy}, {x.val_loss, y.val_loss}, {x.val_accuracy, y.val_accuracy},
                        {x.seconds, y.seconds}, {x.eval_seconds, y.eval_seconds}})
      require(std::memcmp(&p, &q, sizeof p) == 0 || (std::isnan(p) && std::isnan(q)), "as it was: an epoch's figures");
  }
  require(same_bits(again.state.params, c.state.params) && same_bits(again.state.m1, c.state.m1) &&
              same_bits(again.state.m2, c.state.m2),
          "as it was: its state, bit for bit");
  for (const auto& f : std::filesystem::directory_iterator(s.dir)) std::filesystem::remove(f.path());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const layer_registry reg = layer_registry::with_builtins();
  static scratch s;
  static const std::string want = fuzz::kMlpModel;
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  const std::string fixed = (mode & 2) ? mended(data + 1, size - 1) : std::string();
  if (!fixed.empty()) s.put(fixed.data(), fixed.size());
  else s.put(data + 1, size - 1);
  checkpoint c;
  std::string err;
  bool other = false;
  const bool ok = read_checkpoint(s.path, reg, &c, &err, (mode & 1) ? &want : nullptr, &other);
  require(ok == err.empty(), "a refusal says why, a read file has no error", err);
  require(!other || !ok, "a file for another model is not read");
  if (ok) check_read(c, reg, s);
  return 0;
}
