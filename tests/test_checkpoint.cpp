// Checkpoints on their own: a file reads back exactly, damage and numbers no job makes are noticed,
// older files are pruned, and a job of other settings may not resume from one (one on another count of
// replicas may, and is remembered by the checkpoints after it).
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <zlib.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "actors/checkpoint.hpp"
#include "kernels/safetensors.hpp"
#include "tests/checkpoint_util.hpp"
#include "tests/test_data.hpp"

using namespace ringmaster;
using namespace ringmaster::checkpoint_test;

namespace {

// Rewrites a checkpoint's metadata with `edit`, its checksum made anew: a file as another release (or a
// forger who knows the format) wrote it.
void rewrite_metadata(const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
  const std::string bytes = slurp(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(static_cast<unsigned char>(bytes[size_t(i)])) << (8 * i);
  auto h = nlohmann::json::parse(bytes.substr(8, n));
  const std::string data = bytes.substr(8 + n);
  edit(h["__metadata__"]);
  h["__metadata__"].erase("checksum");
  const std::string unsummed = h.dump();
  uLong crc = crc32(0L, reinterpret_cast<const Bytef*>(unsummed.data()), uInt(unsummed.size()));
  crc = crc32(crc, reinterpret_cast<const Bytef*>(data.data()), uInt(data.size()));
  char sum[24];
  std::snprintf(sum, sizeof sum, "crc32:%08lx", crc);
  h["__metadata__"]["checksum"] = sum;
  std::string text = h.dump();
  while (text.size() % 8) text += ' ';
  std::string len(8, '\0');
  for (int i = 0; i < 8; ++i) len[size_t(i)] = char(uint64_t(text.size()) >> (8 * i));
  write_bytes(path, len + text + data);
}

}  // namespace

TEST_CASE("checkpoint: one whose checksum holds but whose state holds NaN is refused, not resumed", "[checkpoint]") {
  const auto m = mlp("784-16-10");
  const std::string dir = fresh_dir("nan");
  checkpoint c = sample(*m, optimizer_config::adam, 23);
  c.state.params[5] = NAN;  // written with a checksum over it, as a forger would
  std::string path, error;
  REQUIRE(write_checkpoint(dir, *m, c, &path, &error));
  checkpoint back;
  CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
  CHECK(error == path + ": its parameters hold NaN or infinite values (not written by training)");
  // A training loss that is NaN: a job stops there, so it never wrote one (resumed, it would stop at
  // once, blaming the learning rate).
  c = sample(*m, optimizer_config::adam, 23);
  c.progress.loss = NAN;
  REQUIRE(write_checkpoint(dir, *m, c, &path, &error));
  CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
  CHECK(error == path + ": the open epoch's sums cannot be (damaged?)");
  c = sample(*m, optimizer_config::adam, 23);
  c.progress.history[1].loss = INFINITY;
  REQUIRE(write_checkpoint(dir, *m, c, &path, &error));
  CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
  CHECK(error == path + ": epoch 2 of its history cannot be (damaged?)");
}

TEST_CASE("checkpoint: a file of a release before data fingerprints (no train_data) reads back and resumes on any data",
          "[checkpoint]") {
  const auto m = mlp("784-16-10");
  const std::string dir = fresh_dir("no-print");
  checkpoint c = sample(*m, optimizer_config::adam, 23);
  c.train_data = 99;
  std::string path, error;
  REQUIRE(write_checkpoint(dir, *m, c, &path, &error));
  checkpoint back;
  REQUIRE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
  CHECK(back.train_data == 99);
  // Written again as that release wrote it: no train_data, the checksum over the rest made anew.
  rewrite_metadata(path, [](nlohmann::json& meta) { meta.erase("train_data"); });
  REQUIRE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
  CHECK(back.train_data == 0);
  CHECK(back.state.params == c.state.params);
  train_config cfg;
  cfg.opt = c.opt;
  cfg.seed = c.seed;
  cfg.global_batch = 64;
  cfg.epochs = 3;
  CHECK(resume_mismatch(back, cfg, m.get(), 640, 12345) == "");  // its data is not known: the count is checked
}

TEST_CASE("checkpoint: a file reads back exactly, opens as weights, and any damaged byte is noticed", "[checkpoint]") {
  const auto m = mlp("784-16-10");
  const std::string dir = fresh_dir("file");
  for (auto kind : {optimizer_config::adam, optimizer_config::sgd}) {
    checkpoint c = sample(*m, kind, 23);
    c.progress.unmeasured = 5;  // samples of the open epoch a lost node's reports took with them
    std::string path, error;
    REQUIRE(write_checkpoint(dir, *m, c, &path, &error));
    CHECK(path == dir + "/ckpt-2-3.safetensors");
    checkpoint back;
    REQUIRE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
    CHECK(back.model == m->description());
    CHECK(back.label == "784-16-10");
    CHECK(back.fingerprint == m->fingerprint());
    CHECK(back.opt.kind == kind);
    CHECK(back.opt.lr == c.opt.lr);
    CHECK(back.seed == c.seed);
    CHECK(back.global_batch == 64);
    CHECK(back.replicas == 2);
    CHECK(back.train_samples == 640);
    CHECK(back.steps_per_epoch == 10);
    CHECK(back.epoch() == 2);
    CHECK(back.epoch_step() == 3);
    CHECK(back.state.steps == 23);
    CHECK(back.state.params == c.state.params);  // bit for bit
    CHECK(back.state.m1 == c.state.m1);
    CHECK(back.state.m2 == c.state.m2);
    CHECK(back.progress.loss == c.progress.loss);
    CHECK(back.progress.correct == 17);
    CHECK(back.progress.count == 192);
    CHECK(back.progress.unmeasured == 5);
    REQUIRE(back.progress.history.size() == 2);
    CHECK(std::isnan(back.progress.history[0].val_loss));
    CHECK(back.progress.history[1].val_loss == 0.7);
    CHECK(back.progress.history[1].loss == c.progress.history[1].loss);
    // The weights part is a weights file like --save's.
    std::vector<float> weights;
    REQUIRE(read_safetensors(path, *m, &weights, &error));
    CHECK(weights == c.state.params);

    // Damage anywhere: the length, the header, the data, a cut, bytes added.
    const std::string good = slurp(path);
    std::mt19937 rng(kind);
    std::vector<size_t> at;
    uint64_t header = 0;
    for (int i = 7; i >= 0; --i) header = header << 8 | (unsigned char)good[size_t(i)];
    for (size_t i = 0; i < 8 + header; i += 5) at.push_back(i);
    for (int i = 0; i < 100; ++i) at.push_back(8 + header + rng() % (good.size() - 8 - header));
    for (size_t i : at) {
      std::string bad = good;
      bad[i] = char(bad[i] ^ (1 << (rng() % 8)));
      write_bytes(path, bad);
      INFO("byte " << i << " of " << good.size());
      CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
    }
    for (size_t cut : {size_t(0), size_t(5), size_t(8 + header / 2), size_t(8 + header), good.size() - 1}) {
      write_bytes(path, good.substr(0, cut));
      CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
    }
    write_bytes(path, good + "x");
    CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
    write_bytes(path, good);
    CHECK(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
    fs::remove(path);
  }
}

TEST_CASE("checkpoint: a write keeps the newest older one, and the newest good one is found", "[checkpoint]") {
  const auto m = mlp("784-8-10");
  const std::string dir = fresh_dir("prune");
  std::string path, error;
  for (int64_t step : {10, 20, 30}) REQUIRE(write_checkpoint(dir, *m, sample(*m, optimizer_config::adam, step), &path, &error));
  CHECK(names(dir) == std::set<std::string>{"ckpt-2-0.safetensors", "ckpt-3-0.safetensors"});
  // A crash mid-write leaves a .tmp; a job resumed from step 20 writes step 25: later files (another
  // course of the job) and the .tmp go, the newest one before 25 stays.
  write_bytes(dir + "/ckpt-3-5.safetensors.4242-0badf00d.tmp", "half a file");  // write_whole's temporary name
  // Names like ours that we never write are not ours to read or remove (once resumed from, then pruned).
  for (const char* name : {"ckpt-3-5.safetensors.tmp", "ckpt-03-5.safetensors", "ckpt-3-+5.safetensors"})
    write_bytes(dir + "/" + name, "a file of the user's");
  REQUIRE(write_checkpoint(dir, *m, sample(*m, optimizer_config::adam, 25), &path, &error));
  CHECK(names(dir) == std::set<std::string>{"ckpt-2-0.safetensors", "ckpt-2-5.safetensors", "ckpt-3-5.safetensors.tmp", "ckpt-03-5.safetensors",
                                            "ckpt-3-+5.safetensors"});
  CHECK(list_checkpoints(dir) == std::vector<std::string>{dir + "/ckpt-2-5.safetensors", dir + "/ckpt-2-0.safetensors"});
  for (const char* name : {"ckpt-3-5.safetensors.tmp", "ckpt-03-5.safetensors", "ckpt-3-+5.safetensors"}) {
    CHECK(slurp(dir + "/" + name) == "a file of the user's");
    fs::remove(dir + "/" + name);
  }

  checkpoint c;
  std::vector<std::string> skipped;
  REQUIRE(latest_checkpoint(dir, layer_registry::with_builtins(), &c, &path, &skipped, &error));
  CHECK(path == dir + "/ckpt-2-5.safetensors");
  CHECK(skipped.empty());
  std::string bytes = slurp(path);
  bytes[bytes.size() / 2] ^= 1;
  write_bytes(path, bytes);
  REQUIRE(latest_checkpoint(dir, layer_registry::with_builtins(), &c, &path, &skipped, &error));
  CHECK(path == dir + "/ckpt-2-0.safetensors");
  CHECK(c.progress.step == 20);
  REQUIRE(skipped.size() == 1);
  CHECK(skipped[0].find("ckpt-2-5.safetensors: checksum") != std::string::npos);
  CHECK(skipped[0].find("the file is damaged") != std::string::npos);
  // A file that holds another step than its name says is not taken either.
  fs::rename(dir + "/ckpt-2-0.safetensors", dir + "/ckpt-9-9.safetensors");
  skipped.clear();
  CHECK_FALSE(latest_checkpoint(dir, layer_registry::with_builtins(), &c, &path, &skipped, &error));
  CHECK(error == "no checkpoint in " + dir + " reads back whole (2 tried)");
  REQUIRE(skipped.size() == 2);
  CHECK(skipped[0].find("ckpt-9-9.safetensors: holds epoch 2, step 0, not what its name says") != std::string::npos);
  fs::remove_all(dir);
  fs::create_directories(dir);
  CHECK_FALSE(latest_checkpoint(dir, layer_registry::with_builtins(), &c, &path, &skipped, &error));
  CHECK(error == "no checkpoint (ckpt-E-S.safetensors) in " + dir);
  // A folder that cannot be listed is not one without checkpoints (a --resume would train over them).
  std::string unreadable;
  CHECK(list_checkpoints(dir, &unreadable).empty());
  CHECK(unreadable.empty());
  CHECK(list_checkpoints(dir + "/not-there", &unreadable).empty());
  CHECK(unreadable == "cannot read folder " + dir + "/not-there: No such file or directory");
}

TEST_CASE("checkpoint: a file whose numbers no job makes is refused, and a FIFO in its place does not hang", "[checkpoint]") {
  const auto m = mlp("784-8-10");
  const std::string dir = fresh_dir("lies");
  std::string path, error;
  checkpoint back;
  const std::vector<std::pair<std::function<void(checkpoint&)>, std::string>> lies = {
      {[](checkpoint& c) { c.steps_per_epoch = 11; }, "11 steps per epoch do not follow from its 640 samples in batches of 64"},
      {[](checkpoint& c) { c.progress.history[1].accuracy = 7.5; }, "epoch 2 of its history cannot be"},
      {[](checkpoint& c) { c.progress.history[0].epoch = 100; }, "epoch 1 of its history cannot be"},
      {[](checkpoint& c) { c.progress.history[1].samples = 641; }, "epoch 2 of its history cannot be"},
      {[](checkpoint& c) { c.progress.correct = c.progress.count + 1; }, "the open epoch's sums cannot be"},
      {[](checkpoint& c) { c.progress.loss = -3.2; }, "the open epoch's sums cannot be"},
  };
  for (const auto& [lie, says] : lies) {
    checkpoint c = sample(*m, optimizer_config::adam, 23);
    lie(c);
    REQUIRE(write_checkpoint(dir, *m, c, &path, &error));  // written as the job's own files are: with a good checksum
    CHECK_FALSE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
    INFO(error);
    CHECK(error.find(says) != std::string::npos);
    fs::remove(path);
  }
  // A FIFO under a checkpoint's name: open() must not wait for a writer.
  REQUIRE(::mkfifo((dir + "/ckpt-2-3.safetensors").c_str(), 0600) == 0);
  CHECK_FALSE(read_checkpoint(dir + "/ckpt-2-3.safetensors", layer_registry::with_builtins(), &back, &error));
  CHECK(error.find("not a regular file") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: a header of millions of tiny values is refused before it is parsed", "[checkpoint]") {
  // "0," is two bytes of text and a parsed value of 16 or more: without a count, 64 MiB of it took 2.3 GB.
  std::string header = "{\"__metadata__\":{\"format\":\"ringmaster-checkpoint\"},\"x\":[0";
  for (int i = 0; i < (1 << 20) + 8; ++i) header += ",0";
  header += "]}";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char(uint64_t(header.size()) >> (8 * i) & 0xff);
  file += header;
  const std::string dir = fresh_dir("items");
  write_bytes(dir + "/ckpt-1-10.safetensors", file);
  checkpoint back;
  std::string error;
  CHECK_FALSE(read_checkpoint(dir + "/ckpt-1-10.safetensors", layer_registry::with_builtins(), &back, &error));
  CHECK(error.find("more than 1048576 keys and values") != std::string::npos);
  // The weights reader (--load, and weights a node returns) counts as well.
  const auto m = mlp("784-8-10");
  std::vector<float> params;
  CHECK_FALSE(read_safetensors_bytes("crafted", file.data(), file.size(), *m, &params, &error));
  CHECK(error.find("more keys and values") != std::string::npos);
  // A key twice: the parser would keep the second, whatever the first said.
  const std::string twice = R"({"__metadata__":{"format":"ringmaster-checkpoint","format":"x"}})";
  std::string dup(8, '\0');
  for (int i = 0; i < 8; ++i) dup[size_t(i)] = char(uint64_t(twice.size()) >> (8 * i) & 0xff);
  write_bytes(dir + "/ckpt-1-10.safetensors", dup + twice);
  CHECK_FALSE(read_checkpoint(dir + "/ckpt-1-10.safetensors", layer_registry::with_builtins(), &back, &error));
  CHECK(error.find("the header names 'format' twice") != std::string::npos);
  // A real checkpoint's header is far under the bound.
  std::string path;
  REQUIRE(write_checkpoint(dir, *m, sample(*m, optimizer_config::adam, 23), &path, &error));
  CHECK(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
  fs::remove_all(dir);
}

namespace {

// Peak and current resident memory of this process, in MiB (Linux).
long peak_mib() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss / 1024;
}
long resident_mib() {
  long pages = 0, resident = 0;
  std::ifstream("/proc/self/statm") >> pages >> resident;
  return resident * (sysconf(_SC_PAGESIZE) / 1024) / 1024;
}

}  // namespace

TEST_CASE("checkpoint: a progress text of millions of empty epochs is refused without standing parsed, whatever its epochs field says",
          "[checkpoint]") {
  // The epochs field bounds nothing: it comes from the same file. 4M "{}," (12 MB) under epochs 2^20
  // took ~450 MB parsed at once; read entry by entry, the first one is refused and dropped.
  std::string progress = "{\"history\":[{}";
  for (int i = 1; i < 4 << 20; ++i) progress += ",{}";
  progress += "],\"loss\":0,\"correct\":0,\"count\":0}";
  const nlohmann::json meta = {
      {"format", "ringmaster-checkpoint"}, {"format_version", "1"}, {"checksum", "crc32:00000000"}, {"model", "784-8-10"},
      {"optimizer", "adam"}, {"model_fingerprint", "0"}, {"seed", "1"}, {"global_batch", "10"}, {"replicas", "1"},
      {"train_samples", "100"}, {"steps_per_epoch", "10"}, {"epochs", std::to_string(1 << 20)}, {"step", "10"},
      {"lr", "0.001"}, {"beta1", "0.9"}, {"beta2", "0.999"}, {"eps", "1e-8"}, {"momentum", "0"},
      {"progress", progress}, {"model_label", "x"}};
  progress.clear();
  progress.shrink_to_fit();
  const std::string header = nlohmann::json{{"__metadata__", meta}}.dump();
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[size_t(i)] = char(uint64_t(header.size()) >> (8 * i) & 0xff);
  file += header;
  const std::string dir = fresh_dir("progress-items");
  write_bytes(dir + "/ckpt-1-0.safetensors", file);
  file.clear();
  file.shrink_to_fit();
  const long before = resident_mib(), peak_before = peak_mib();
  checkpoint back;
  std::string error;
  CHECK_FALSE(read_checkpoint(dir + "/ckpt-1-0.safetensors", layer_registry::with_builtins(), &back, &error));
  CHECK(error.find("the progress field is not what a checkpoint writes") != std::string::npos);
  INFO("resident before " << before << " MiB, peak after " << peak_mib() << " MiB");
  CHECK(peak_mib() <= std::max(peak_before, before + 200));  // the header's text and copies, not 4M entries parsed
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: a history too long to read back is not written", "[checkpoint]") {
  const auto m = mlp("784-8-10");
  checkpoint c = sample(*m, optimizer_config::sgd, 0);
  c.epochs = 500000;
  c.progress.step = c.state.steps = c.steps_per_epoch * c.epochs;
  c.progress.count = c.progress.correct = 0;
  epoch_stats e;
  e.loss = 1.0 / 3.0;
  e.accuracy = e.val_accuracy = 2.0 / 3.0;
  e.val_loss = 0.1;
  e.samples = 640;
  e.seconds = e.eval_seconds = 1.0 / 7.0;
  for (int64_t i = 0; i < c.epochs; ++i) {
    e.epoch = i;
    c.progress.history.push_back(e);
  }
  const std::string dir = fresh_dir("long-history");
  std::string path, error;
  CHECK_FALSE(write_checkpoint(dir, *m, c, &path, &error));
  CHECK(error.find("over the 64 MiB a checkpoint is read back with") != std::string::npos);
  CHECK(names(dir).empty());  // no file, not even a temporary one
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: a job of other settings may not resume from it", "[checkpoint]") {
  const auto m = mlp("784-8-10");
  const checkpoint c = sample(*m, optimizer_config::adam, 23);
  train_config cfg;
  cfg.opt = c.opt;
  cfg.seed = c.seed;
  cfg.global_batch = 64;
  cfg.epochs = 3;
  cfg.replicas = 4;  // another replica count may resume
  CHECK(resume_mismatch(c, cfg, m.get(), 640) == "");
  CHECK(resume_mismatch(c, cfg, mlp("784-9-10").get(), 640) == "the checkpoint was made for model 784-8-10, this job's is 784-9-10");
  CHECK(resume_mismatch(c, cfg, m.get(), 700) ==
        "the checkpoint was made on 640 training samples, this job has 700 (another --limit-train or data set?)");
  // The samples themselves, by their fingerprint, when both sides know it (0: a file of before, or a
  // job whose data is not known yet).
  checkpoint printed = c;
  printed.train_data = 1234;
  CHECK(resume_mismatch(printed, cfg, m.get(), 640, 1234) == "");
  CHECK(resume_mismatch(printed, cfg, m.get(), 640, 0) == "");
  CHECK(resume_mismatch(c, cfg, m.get(), 640, 4321) == "");
  CHECK(resume_mismatch(printed, cfg, m.get(), 640, 4321) ==
        "the checkpoint was made on other training data: 640 samples as this job's, but not the same (another data set, or a copy "
        "that differs)");
  train_config other = cfg;
  other.opt.kind = optimizer_config::sgd;
  CHECK(resume_mismatch(c, other, nullptr, -1) == "the checkpoint was made with optimizer adam, this job uses sgd");
  other = cfg;
  other.opt.beta2 = 0.99f;
  CHECK(resume_mismatch(c, other, nullptr, -1) == "the checkpoint was made with adam beta2 0.999, this job's is 0.99");
  other = cfg;
  other.global_batch = 32;
  CHECK(resume_mismatch(c, other, nullptr, -1) == "the checkpoint was made with global batch 64, this job's is 32");
  other = cfg;
  other.seed = 1;
  CHECK(resume_mismatch(c, other, nullptr, -1) == "the checkpoint was made with seed 9223372036854775815, this job's is 1");
  other = cfg;
  other.epochs = 2;
  CHECK(resume_mismatch(c, other, nullptr, -1) ==
        "the checkpoint was made after epoch 2, step 3: 2 epochs leave nothing to train (raise --epochs to go on)");
}

TEST_CASE("checkpoint: a folder whose disk cannot take three of the model's checkpoints is refused before training",
          "[checkpoint]") {
  const std::string dir = fresh_dir("room");
  // 2^47 parameters with Adam's two moments: 1.7 PB a checkpoint, 5 PB for three. No disk here has that.
  const size_t huge = size_t(1) << 47;
  const std::string why = check_checkpoint_room(dir, huge, optimizer_config::adam, 1);
  INFO(why);
  CHECK(why.rfind(dir + " has ", 0) == 0);
  CHECK(why.find(" MB free, but this model's checkpoints take 1688849860.3 MB each and up to 3 are there at once (the newest two "
                 "kept and one being written): 5066549581.0 MB are needed") != std::string::npos);
  // SGD keeps one moment: two thirds of it.
  CHECK(check_checkpoint_room(dir, huge, optimizer_config::sgd, 1).find("take 1125899906.9 MB each") != std::string::npos);
  CHECK(check_checkpoint_room(dir, 1000, optimizer_config::adam, 100).empty());  // a few KB fit anywhere tests run
  // A header's history grows with the epochs: a model of a few KB trained for 2^40 of them would not fit.
  CHECK(check_checkpoint_room(dir, 1000, optimizer_config::adam, int64_t(1) << 40).find("take 281474976.8 MB each") != std::string::npos);
  // Needed just over what is free (a few KB, well under the 0.1 MB the figures used to be rounded to):
  // the two read apart, with as many decimals as it takes. (What is free may change between our look and
  // the check's: tried again then.)
  std::string close;
  for (int attempt = 0; attempt < 5 && close.empty(); ++attempt) {
    struct statvfs st {};
    REQUIRE(::statvfs(dir.c_str(), &st) == 0);
    const double free = double(st.f_bavail) * double(st.f_frsize), each = (free + 4096) / 3;
    close = check_checkpoint_room(dir, 1000, optimizer_config::sgd, int64_t((each - 1000 * 8 - 64 * 1024) / 256) + 1);
  }
  REQUIRE(close != "");
  INFO(close);
  const auto figure = [&](const std::string& before) {
    const size_t at = close.find(before) + before.size();
    return close.substr(at, close.find(' ', at) - at);
  };
  CHECK(figure(" has ") != figure("written): "));
  // Through the launcher: exit 2 before training (it used to fail at the first checkpoint, exit 1).
  const run_result r = mnist("--replicas 1 --batch 32 --epochs 1 --limit-train 64 --limit-test 32 -q --model 784-64-10 --checkpoint-dir " +
                             dir + " --data " + std::string(RINGMASTER_DATA_DIR));
  CHECK(r.status == 0);  // this model's fit
  fs::remove_all(dir);
  // A program's own checks of that kind (its outputs' room: ringmaster-mnist) see the built model first.
  train_config cfg;
  cfg.model = "784-16-10";
  cfg.global_batch = 32;
  cfg.train = test::load("train", 64);
  size_t seen = 0;
  cfg.check_model = [&seen](const model& m) { return seen = m.param_count(), std::string("no room for its weights"); };
  const train_result refused = train(cfg);
  CHECK(seen == 784 * 16 + 16 + 16 * 10 + 10);
  CHECK(!refused.ok);
  CHECK(refused.invalid);
  CHECK(refused.error == "no room for its weights");
  CHECK(refused.history.empty());
  cfg.check_model = [](const model&) -> std::string { throw std::runtime_error("boom"); };  // it used to abort
  CHECK(train(cfg).error == "check_model threw: boom");
}

TEST_CASE("checkpoint: a forged model label reaches no terminal as it is", "[checkpoint]") {
  // Escapes and a newline in a file's model_label (its checksum made anew) were printed raw in refusals.
  const auto m = mlp("784-16-10");
  const std::string dir = fresh_dir("label");
  std::string path, error;
  REQUIRE(write_checkpoint(dir, *m, sample(*m, optimizer_config::adam, 23), &path, &error));
  rewrite_metadata(path, [](nlohmann::json& meta) { meta["model_label"] = "784-16-10\x1b[2J\nfake line"; });
  checkpoint back;
  REQUIRE(read_checkpoint(path, layer_registry::with_builtins(), &back, &error));
  CHECK(back.label == "'784-16-10\\u001b[2J\\nfake line'");
  fs::remove_all(dir);
}

TEST_CASE("checkpoint: a resume on another count of replicas is remembered by the checkpoints written after it",
          "[checkpoint][launcher]") {
  // Before, the next resume (on as many replicas as the one before) said nothing: its weights equal no
  // uninterrupted run's but up to rounding.
  const std::string dir = fresh_dir("recount");
  const std::string job = " --model 784-32-10 --batch 64 --limit-train 512 --limit-test 128 -q --checkpoint-dir " + dir;
  REQUIRE(mnist("--replicas 2 --epochs 1" + job).status == 0);
  run_result r = mnist("--replicas 1 --epochs 2 --resume" + job);
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK(r.out.find("Note: the checkpoint was written by 2 replicas, this run has 1") != std::string::npos);
  const std::string note = "Note: the run this checkpoint continues changed its ranks on the way (1 time: ";
  for (const char* epochs : {"2", "3"}) {  // the run that trained to its end; and on with a third epoch
    r = mnist(std::string("--replicas 1 --epochs ") + epochs + " --resume --report-json " + dir + "/r.json" + job);
    INFO(r.out);
    REQUIRE(r.status == 0);
    CHECK((r.out.find("The run had trained to its end") != std::string::npos) == (epochs[0] == '2'));
    CHECK(r.out.find(note) != std::string::npos);
    CHECK(slurp(dir + "/r.json").find("\"ranks_changed_before_resume\": 1") != std::string::npos);
  }
}

TEST_CASE("checkpoint: another run's checkpoint beside this job's is refused, a damaged one passed over", "[checkpoint]") {
  // A whole checkpoint of another model is another run's: resuming beside it would prune it, as a plain
  // start would (which refuses the folder). One whose description was damaged and still builds reads as
  // another model's too, but its checksum fails: latest_checkpoint goes on to older files, saying why.
  const auto mine = mlp("784-16-10"), theirs = mlp("784-8-10");
  const std::string mine_text = "784-16-10";
  const std::string dir = fresh_dir("mixed");
  checkpoint a = sample(*mine, optimizer_config::adam, 23), b = sample(*theirs, optimizer_config::adam, 23);
  b.progress.step = a.progress.step + 1, b.state.steps = b.progress.step;  // one step later: the newest
  std::string path, error;
  REQUIRE(write_checkpoint(dir, *mine, a, &path, &error));
  const std::string ours = path;
  REQUIRE(write_checkpoint(dir, *theirs, b, &path, &error));
  const std::string other_file = path;
  REQUIRE(other_file != ours);
  const std::string mismatch = "the checkpoint " + other_file + " was made for model 784-8-10, this job's is 784-16-10";
  checkpoint c;
  std::vector<std::string> skipped;
  CHECK_FALSE(latest_checkpoint(dir, layer_registry::with_builtins(), &c, &path, &skipped, &error, &mine_text));
  CHECK(error == mismatch + "; it reads back whole, so it is another run's, which this job's next checkpoint would delete: "
                 "move it out of " + dir);
  CHECK(skipped.empty());  // said once, as the refusal
  // Older than this job's: the next checkpoint would delete it all the same.
  const std::string older = (fs::path(dir) / checkpoint_name(0, 1)).string();
  fs::remove(other_file);
  fs::remove(ours);
  REQUIRE(write_checkpoint(dir, *theirs, sample(*theirs, optimizer_config::adam, 1), &path, &error));
  REQUIRE(path == older);
  REQUIRE(write_checkpoint(dir, *mine, a, &path, &error));  // (which keeps the one before it)
  REQUIRE(path == ours);
  CHECK_FALSE(latest_checkpoint(dir, layer_registry::with_builtins(), &c, &path, &skipped, &error, &mine_text));
  CHECK(error.find("the checkpoint " + older + " was made for model 784-8-10") == 0);
  CHECK(fs::exists(older));
  // Damaged (a byte of its data flipped): not another run's, passed over.
  {
    const int fd = ::open(older.c_str(), O_RDWR);
    REQUIRE(fd >= 0);
    const off_t at = ::lseek(fd, -3, SEEK_END);
    unsigned char byte = 0;
    REQUIRE(::pread(fd, &byte, 1, at) == 1);
    byte ^= 0x5a;
    REQUIRE(::pwrite(fd, &byte, 1, at) == 1);
    ::close(fd);
  }
  skipped.clear();
  REQUIRE(latest_checkpoint(dir, layer_registry::with_builtins(), &c, &path, &skipped, &error, &mine_text));
  CHECK(path == ours);
  CHECK(skipped.empty());  // older than the one resumed from: not said
  fs::rename(older, other_file);  // newer than ours: said, with its damage
  REQUIRE(latest_checkpoint(dir, layer_registry::with_builtins(), &c, &path, &skipped, &error, &mine_text));
  CHECK(path == ours);
  REQUIRE(skipped.size() == 1);
  CHECK(skipped[0].find(other_file + ": checksum ") == 0);
  CHECK(skipped[0].find("the file is damaged") != std::string::npos);
  // Only the other model's, whole: the error says why it is not this job's.
  fs::remove(ours);
  fs::remove(other_file);
  REQUIRE(write_checkpoint(dir, *theirs, b, &path, &error));
  skipped.clear();
  CHECK_FALSE(latest_checkpoint(dir, layer_registry::with_builtins(), &c, &path, &skipped, &error, &mine_text));
  CHECK(error == mismatch);  // which, where
  CHECK(skipped.empty());
}
