// Helpers of the checkpoint tests (test_checkpoint.cpp: the file on its own; test_resume.cpp: --resume
// through the real launcher): folders of their own, sample checkpoints, the launcher run and read.
#pragma once
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "actors/checkpoint.hpp"
#include "tests/test_util.hpp"

namespace ringmaster::checkpoint_test {


namespace fs = std::filesystem;
using test::run_result;
using test::slurp;

inline run_result mnist(const std::string& args) { return test::run(std::string(RINGMASTER_MNIST_BIN) + " " + args); }

// An empty folder of its own for one test.
inline std::string fresh_dir(const std::string& name) {
  const std::string dir = "/tmp/ringmaster-ckpt-test-" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// The file names in a folder, sorted, but for the lock a job takes on it (.ringmaster-lock).
inline std::set<std::string> names(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename() != ".ringmaster-lock") out.insert(e.path().filename().string());
  return out;
}

// The checksum of the final weights from the launcher's summary ("" when there is none).
inline std::string fnv(const std::string& out) {
  const size_t at = out.find("(fnv1a64 ");
  return at == std::string::npos ? "" : out.substr(at + 9, 16);
}

// A data folder of other samples in the same numbers (its training files are the test set's, so the first
// 1024 are not Fashion-MNIST's first 1024 training samples).
inline std::string other_data() {
  const std::string dir = fresh_dir("other-data"), from = RINGMASTER_DATA_DIR;
  for (const std::string set : {"images-idx3-ubyte.gz", "labels-idx1-ubyte.gz"}) {
    fs::create_symlink(from + "/t10k-" + set, dir + "/train-" + set);
    fs::create_symlink(from + "/t10k-" + set, dir + "/t10k-" + set);
  }
  return dir;
}

inline bool killed(const run_result& r) { return r.status == -1 || r.status == 128 + 9; }  // SIGKILL, seen directly or by sh

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

// Every epoch's training and test metrics of two --report-json files agree exactly (the times may not).
inline void same_history(const std::string& a, const std::string& b) {
  const auto ja = nlohmann::json::parse(slurp(a)), jb = nlohmann::json::parse(slurp(b));
  REQUIRE(ja["history"].size() == jb["history"].size());
  for (size_t i = 0; i < ja["history"].size(); ++i)
    for (const char* k : {"epoch", "loss", "accuracy", "val_loss", "val_accuracy"}) {
      INFO("epoch " << i + 1 << " " << k);
      CHECK(ja["history"][i][k] == jb["history"][i][k]);
    }
}

// A checkpoint of a small MLP with distinct values everywhere, after `step` steps of 10 per epoch.
inline checkpoint sample(const model& m, optimizer_config::kind_t kind, int64_t step) {
  std::mt19937 rng{uint32_t(step)};
  checkpoint c;
  c.model = m.description();
  c.label = m.label();
  c.fingerprint = m.fingerprint();
  c.opt.kind = kind;
  c.opt.lr = 0.0123f;
  c.seed = (uint64_t(1) << 63) + 7;
  c.global_batch = 64;
  c.replicas = 2;
  c.train_samples = 640;
  c.steps_per_epoch = 10;
  c.epochs = 3;
  c.progress.step = step;
  for (int64_t e = 0; e < step / 10; ++e) {
    epoch_stats s;
    s.epoch = e;
    s.loss = 1.0 / 3.0 + double(e);
    s.accuracy = 0.1 * double(e);
    s.val_loss = e == 0 ? NAN : 0.7;  // no evaluation that epoch
    s.val_accuracy = e == 0 ? NAN : 0.6;
    s.samples = 640;
    s.seconds = 1e-3;
    c.progress.history.push_back(s);
  }
  c.progress.loss = 12.345678901234567;
  c.progress.count = 64 * (step % 10);
  c.progress.correct = std::min<int64_t>(17, c.progress.count);  // a file with more right than seen is refused
  c.state.steps = step;
  c.state.params = test::randv(m.param_count(), rng);
  c.state.m1 = test::randv(m.param_count(), rng);
  if (kind == optimizer_config::adam) c.state.m2 = test::randv(m.param_count(), rng, 0, 1);
  return c;
}

inline std::shared_ptr<const model> mlp(const std::string& widths) {
  std::string error;
  auto m = build_model(widths, shape{784, 1, 1}, &error);
  INFO(error);
  REQUIRE(m);
  return m;
}


}  // namespace ringmaster::checkpoint_test
