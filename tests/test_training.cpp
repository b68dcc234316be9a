// Whole local jobs: N replicas train like one replica with the same global batch, runs are reproducible,
// failures end the job with a clear error instead of a hang.
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <thread>

#include "actors/checkpoint.hpp"
#include "actors/replica.hpp"
#include "actors/training.hpp"
#include "kernels/layers.hpp"
#include "tests/checkpoint_util.hpp"
#include "tests/test_data.hpp"
#include "tests/test_util.hpp"

using namespace ringmaster;

namespace {

using test::load;

// max |a - b| / max |b|: the largest difference relative to the weights' scale.
double linf_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::abs(double(a[i]) - b[i]));
    m = std::max(m, std::abs(double(b[i])));
  }
  return d / m;
}

// Max over elements of |a - b| / max(|a|, |b|, 1e-2): relative, with a floor for weights near zero.
double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::abs(double(a[i]) - b[i]) / std::max({std::abs(double(a[i])), std::abs(double(b[i])), 1e-2}));
  return m;
}

// The config of the "N replicas train like one replica" tests: a global batch of 24 (24, 12, 8, 6 per
// replica for n = 1..4), one epoch, no evaluation.
train_config like_one_config(const std::string& model, optimizer_config::kind_t kind, int n,
                             std::shared_ptr<const dataset> train_set) {
  train_config c;
  c.model = model;
  c.opt.kind = kind;
  c.opt.lr = kind == optimizer_config::adam ? 1e-3f : 1e-2f;
  c.replicas = n;
  c.global_batch = 24;
  c.epochs = 1;
  c.train = std::move(train_set);
  c.evaluate = false;
  return c;
}

// The training moved the weights: they differ from c's initial ones by more than 1e-2 (max_rel_diff).
void check_weights_moved(const train_config& c, const std::vector<float>& weights) {
  std::string err;
  auto m = build_model(c, &err);
  REQUIRE(m);
  CHECK(max_rel_diff(weights, init_params(*m, c.seed)) > 1e-2);
}

// n replicas' weights against one replica's: within 1e-5 of the weights' scale, and within 1e-4
// elementwise (relative, see max_rel_diff). `what` starts the WARN line that reports both.
void check_like_one_replica(const std::vector<float>& weights, const std::vector<float>& reference,
                            const std::string& what) {
  const double linf = linf_rel_diff(weights, reference), elem = max_rel_diff(weights, reference);
  WARN(what << ": max |a-b| / max |b| = " << linf << ", max elementwise relative = " << elem);
  CHECK(linf <= 1e-5);
  CHECK(elem <= 1e-4);
}

}  // namespace

TEST_CASE("N replicas at the same global batch train like one replica", "[training]") {
  // N replicas sum a gradient in another order than one replica does, so their weights differ in the last
  // bits, and so do pre-activations: once one lands within rounding of zero, a ReLU passes a sample's
  // gradient in one run and not in the other, and the runs part for good (Adam makes that a full step at
  // once). That is chance, and rare: with 1,200 samples it happened at step 22 of 50 with Adam, and not at
  // all with SGD. So Adam is compared over the first 20 steps, SGD over 50 (a shard left out or counted
  // twice shows in the first step).
  auto sgd_set = load("train", 1200), adam_set = load("train", 480);  // 50 and 20 steps of 24
  for (auto kind : {optimizer_config::adam, optimizer_config::sgd}) {
    auto train_set = kind == optimizer_config::adam ? adam_set : sgd_set;
    std::vector<float> reference;
    uint64_t ref_sum = 0;
    for (int n : {1, 2, 3, 4}) {
      INFO("replicas " << n << (kind == optimizer_config::adam ? " adam" : " sgd"));
      const train_config c = like_one_config("784-64-32-10", kind, n, train_set);
      train_result r = train(c);
      REQUIRE(r.ok);
      REQUIRE(r.history.size() == 1);
      CHECK(r.history[0].samples == int64_t(train_set->count));
      CHECK(r.identical);
      REQUIRE(r.checksums.size() == size_t(n));
      if (n == 1) {
        reference = r.weights;
        ref_sum = r.checksums[0];
        check_weights_moved(c, reference);  // the steps did something
      } else {
        // Summation order differs (one GEMM over the batch vs a ring sum of shard GEMMs), so weights
        // agree to float rounding, not bit for bit. Adam divides by sqrt(v), which turns the rounding of
        // a gradient that nearly cancels into a visible step: single elements drift to ~3e-5 of their
        // own (tiny) size, while the largest difference relative to the weights' scale stays ~1e-6.
        check_like_one_replica(r.weights, reference, "vs 1 replica");
      }
      // The same run again gives bit-identical weights.
      train_result again = train(c);
      REQUIRE(again.ok);
      CHECK(again.checksums[0] == r.checksums[0]);
      (void)ref_sum;
    }
  }
}

TEST_CASE("gradient buckets overlapped with backward give the weights of one all-reduce, bit for bit", "[training]") {
  auto train_set = load("train", 1200);
  // Bucket boundaries fall between layers: 784-64-32-10 has 50,240 + 2,080 + 330 parameters.
  CHECK(gradient_buckets(*build_model("784-64-32-10", shape{784, 1, 1}, nullptr), 0) == std::vector<size_t>{0});
  CHECK(gradient_buckets(*build_model("784-64-32-10", shape{784, 1, 1}, nullptr), 1) == std::vector<size_t>{52320, 50240, 0});
  CHECK(gradient_buckets(*build_model("784-64-32-10", shape{784, 1, 1}, nullptr), 2000) == std::vector<size_t>{50240, 0});
  for (int n : {3, 4}) {  // three or more addends: the summation order shows in the bits
    INFO("replicas " << n);
    train_config c = like_one_config("784-64-32-10", optimizer_config::adam, n, train_set);
    c.bucket_bytes = 0;
    train_result whole = train(c);
    REQUIRE(whole.ok);
    for (size_t bytes : {size_t(4), size_t(8000), size_t(1) << 20}) {
      c.bucket_bytes = bytes;
      train_result bucketed = train(c);
      REQUIRE(bucketed.ok);
      CHECK(bucketed.identical);
      CHECK(bucketed.weights == whole.weights);
    }
  }
}

TEST_CASE("replicas that spin for their ring's end (train_config::ring_poll) train the same weights, bit for bit", "[training]") {
  // Off by default in one process; on, a replica whose next batch is in takes the ring's chunks on its own
  // thread (actors/reducer.hpp, poll_briefly). Two replicas: a worker each on any machine of 2+ cores, the
  // condition for the spin. Buckets, so chunks come while the replica still computes.
  auto train_set = load("train", 1200);
  train_config c = like_one_config("784-64-32-10", optimizer_config::adam, 2, train_set);
  c.bucket_bytes = 8000;
  train_result still = train(c);
  REQUIRE(still.ok);
  c.ring_poll = std::chrono::microseconds(300);
  train_result spun = train(c);
  REQUIRE(spun.ok);
  CHECK(spun.identical);
  CHECK(spun.history[0].samples == int64_t(train_set->count));
  CHECK(spun.weights == still.weights);
  check_weights_moved(c, spun.weights);
}

TEST_CASE("metrics are exact sums and training learns", "[training]") {
  train_config c;
  c.model = "784-128-10";
  c.replicas = 2;
  c.global_batch = 64;
  c.epochs = 2;
  c.train = load("train", 6400);
  c.test = load("t10k", 1001);  // odd: the two test shards differ in size
  int64_t lines = 0, finals = 0;
  c.on_progress = [&](const progress& p) {
    ++lines;
    finals += p.epoch_end;
    CHECK(p.steps == 100);
    CHECK(format_progress(p).find("/100 [") != std::string::npos);
  };
  train_result r = train(c);
  REQUIRE(r.ok);
  REQUIRE(r.history.size() == 2);
  CHECK(finals == 2);
  CHECK(lines >= 2);
  CHECK(r.history[1].samples == 6400);
  CHECK(r.history[1].loss < r.history[0].loss);
  CHECK(r.history[1].val_accuracy > 0.70);
  // val_accuracy is a count over exactly 1001 samples.
  const double hits = r.history[1].val_accuracy * 1001;
  CHECK(std::abs(hits - std::round(hits)) < 1e-6);
}

namespace {

// A job of a few steps, for tests of how a job ends.
train_config tiny_job() {
  train_config c;
  c.model = "784-16-10";
  c.replicas = 2;
  c.global_batch = 8;
  c.epochs = 1;
  c.train = load("train", 64);
  return c;
}

}  // namespace

TEST_CASE("a replica that cannot start ends the job with an error, not a hang", "[training]") {
  train_config c = tiny_job();
  c.devices = {"cuda:98", "cuda:99"};  // no such GPUs (or none at all): both replicas fail to start
  train_result r = train(c);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("replica ") != std::string::npos);
  INFO(r.error);
  CHECK(r.error.find("cuda:9") != std::string::npos);
  // A program's own backend factory that throws, or gives none and says nothing: named as such (the
  // error was "system_error(runtime_error)", or ended in ": ").
  c = tiny_job();
  c.make_backend = [](const std::string&, std::string*) -> std::unique_ptr<backend> { throw std::runtime_error("no such card"); };
  r = train(c);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("on cpu: its backend factory threw: no such card") != std::string::npos);
  c.make_backend = [](const std::string&, std::string*) -> std::unique_ptr<backend> { return nullptr; };
  r = train(c);
  CHECK(r.error.find("on cpu: its backend factory gave none, and said nothing") != std::string::npos);
}

TEST_CASE("an exception in the coordinator (a throwing on_progress) ends the job with its message, not a hang", "[training]") {
  train_config c = tiny_job();
  c.on_progress = [](const progress&) { throw std::runtime_error("the progress bar broke"); };
  train_result r = train(c);
  INFO(r.error);
  CHECK_FALSE(r.ok);
  CHECK(r.error == "coordinator: the progress bar broke");
}

TEST_CASE("bad configurations are refused before anything runs", "[training]") {
  train_config c;
  c.train = load("train", 100);
  c.replicas = 3;
  c.global_batch = 128;
  CHECK(train(c).error.find("not divisible by 3 replicas") != std::string::npos);
  c.replicas = 2;
  CHECK(train(c).error.find("larger than the 100 training samples") != std::string::npos);
  c.global_batch = 10;
  c.model = "100-10";
  CHECK(train(c).error.find("does not match") != std::string::npos);
  c.model = "784-abc";
  CHECK(train(c).error.find("bad model spec") != std::string::npos);
  c.model = "784-9999999-9999999-10";  // 10^14 parameters: refused, not attempted
  CHECK(train(c).error.find("over 2^30 values") != std::string::npos);
  c.model = "784-400000-10";  // 3.1e8 parameters: a model, but over what a replica may hold
  CHECK(train(c).error.find("the limit is 2^28") != std::string::npos);
}

TEST_CASE("a data set filled by hand whose count is more than its arrays hold is refused, not read past its end", "[training]") {
  // Its fields are public: a program may set count and forget an array (before: SIGSEGV in the loader,
  // or a label check that read past the labels and named garbage).
  train_config c;
  c.model = "784-10";
  c.global_batch = 32;
  auto bad = [&](const std::function<void(dataset&)>& spoil) {
    auto d = std::make_shared<dataset>(*load("train", 64));
    spoil(*d);
    c.train = d;
    const train_result r = train(c);
    CHECK(!r.ok);
    CHECK(r.invalid);
    return r.error;
  };
  CHECK(bad([](dataset& d) { d.count = 200000, d.labels.resize(200000); }) ==
        "200000 training samples of 784 values each with 50176 pixel values");
  CHECK(bad([](dataset& d) { d.count = 200000; }) == "200000 training samples with 64 labels");
  CHECK(bad([](dataset& d) { d.bytes.resize(10); }) == "64 training samples with 50176 pixel values and 10 bytes");
  c.train = load("train", 64);
  auto test = std::make_shared<dataset>(*load("train", 64));
  test->labels.pop_back();
  c.test = test;
  CHECK(train(c).error == "64 test samples with 63 labels");
  c.test = load("train", 64);
  CHECK(train(c).ok);  // and whole, it trains
}

// ---- models made of layers ------------------------------------------------------------------------------

TEST_CASE("N replicas train the cnn (with dropout) like one replica, reruns are bit-identical", "[training]") {
  auto train_set = load("train", 240);  // 240 / 24 = 10 steps
  for (auto kind : {optimizer_config::adam, optimizer_config::sgd}) {
    std::vector<float> reference;
    for (int n : {1, 2, 3, 4}) {
      INFO("replicas " << n << (kind == optimizer_config::adam ? " adam" : " sgd"));
      const train_config c = like_one_config("cnn", kind, n, train_set);
      train_result r = train(c);
      INFO(r.error);
      REQUIRE(r.ok);
      CHECK(r.history[0].samples == 240);
      CHECK(r.identical);
      REQUIRE(r.checksums.size() == size_t(n));
      if (n == 1) {
        reference = r.weights;
        check_weights_moved(c, reference);
      } else {
        // Dropout masks follow the sample, not the replica, so every replica count drops the same
        // activations; what differs is the summation order of the gradients (shard GEMMs, then a ring
        // sum, against one GEMM over 24 rows), and while the CPU dense kernel is not batch-invariant for
        // 6 rows, the forward of 4 replicas' last two samples too (see "every layer gives a sample the
        // same bits ..." in test_layers.cpp). Measured after these 10 steps (AVX-512 host): max |a-b| /
        // max |b| at most 6.3e-7 (Adam) and 1.1e-7 (SGD); the largest elementwise relative difference at
        // most 4.4e-6 (Adam) and 1.6e-6 (SGD). The bounds are the MLP test's, 15x and more above that.
        // Not more steps: at 20, Adam turned one rounding difference into a visible step (1.7e-5 and
        // 1.4e-4 with 3 and 4 replicas), the drift DESIGN.md describes.
        check_like_one_replica(r.weights, reference, "cnn, " + std::to_string(n) + " replicas vs 1");
      }
      train_result again = train(c);
      REQUIRE(again.ok);
      CHECK(again.checksums == r.checksums);
    }
  }
}

namespace {

// 3-channel 8x8 images of four classes: stripes (period 2, random phase) run horizontally or vertically,
// in the red or in the blue channel; every pixel of every channel gets noise.
std::shared_ptr<const dataset> stripes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.0f, 0.3f);
  const shape s{3, 8, 8};
  std::vector<float> f(n * s.size());
  std::vector<int32_t> labels(n);
  for (size_t i = 0; i < n; ++i) {
    const int label = int(rng() % 4), channel = label / 2 ? 2 : 0, phase = int(rng() % 2);
    const bool horizontal = label % 2;
    labels[i] = label;
    for (int c = 0; c < 3; ++c)
      for (int y = 0; y < 8; ++y)
        for (int x = 0; x < 8; ++x) {
          const bool on = c == channel && ((horizontal ? y : x) + phase) % 2 == 0;
          f[((i * 3 + c) * 8 + y) * 8 + x] = (on ? 1.0f : 0.0f) + noise(rng);
        }
  }
  auto d = std::make_shared<dataset>();
  std::string err;
  REQUIRE(make_dataset(s, std::move(f), std::move(labels), 4, d.get(), &err));
  return d;
}

}  // namespace

TEST_CASE("the replicas' wait for a batch leaves out their evaluations", "[training]") {
  using namespace layers;
  train_config c;
  c.model = sequential{flatten(), dense(512), relu(), dense(4)}.text();
  c.replicas = 2;
  c.global_batch = 32;
  c.epochs = 3;
  c.train = stripes(256, 1);  // 8 steps an epoch, prefetched
  c.test = stripes(30000, 2);  // each epoch's evaluation is the larger part of its time
  train_result r = train(c);
  INFO(r.error);
  REQUIRE(r.ok);
  REQUIRE(r.history.size() == 3);
  const double evals = r.history[0].eval_seconds + r.history[1].eval_seconds;  // those a next step came after
  INFO("wait for batches " << r.wait_batch << " s, evaluations " << evals << " s");
  CHECK(evals > 0.02);
  CHECK(r.wait_batch < 0.5 * evals);  // it counted them (2 ranks: twice)
}

TEST_CASE("a conv model learns 3-channel images held in memory", "[training]") {
  using namespace layers;
  train_config c;
  c.model = sequential{conv2d(8, 3, 1, "same", "relu"), max_pool2d(2), flatten(), dropout(0.25), dense(4)}.text();
  c.replicas = 2;
  c.global_batch = 32;
  c.epochs = 3;
  c.opt.lr = 3e-3f;
  c.train = stripes(640, 1);
  c.test = stripes(256, 2);
  train_result r = train(c);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.identical);
  REQUIRE(r.history.size() == 3);
  WARN("stripes: validation accuracy " << r.history[2].val_accuracy << " (chance 0.25)");
  CHECK(r.history[2].val_accuracy > 0.8);
  CHECK(r.history[2].loss < r.history[0].loss);
  CHECK(r.model.find("\"input\":[3,8,8]") != std::string::npos);
}

TEST_CASE("bad model descriptions are refused by train() with the reason", "[training]") {
  using namespace layers;
  train_config c;
  c.replicas = 2;
  c.global_batch = 32;
  c.epochs = 1;
  c.train = stripes(64, 3);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {sequential{conv2d(0, 3), flatten(), dense(4)}.text(), "layer 0: conv2d: 'filters': expected an integer in 1..65536, got 0"},
      {sequential{conv2d(4, 9), flatten(), dense(4)}.text(), "layer 0 (conv2d_0): a 9x9 kernel does not fit input (3, 8, 8)"},
      {sequential{flatten(), custom("lstm", {{"units", 4}}), dense(4)}.text(), "layer 1: unknown layer type 'lstm'"},
      {sequential{flatten(), dropout(1.0), dense(4)}.text(), "layer 1: dropout: 'rate'"},
      // Settings given as no object are refused, not dropped.
      {sequential{flatten(), custom("scale", 2.5), dense(4)}.text(), "layer 1: a layer is a JSON object such as {\"type\": \"dense\", \"units\": 10}, not number"},
      {sequential{flatten(), dense(1)}.text(), "at least 2 classes"},
      {R"({"layers": [{"type": "flatten"}, )", "not valid JSON"},
      {R"({"input": [1, 28, 28], "layers": [{"type": "flatten"}, {"type": "dense", "units": 4}]})",
       "model expects input (1, 28, 28) but the data's samples are (3, 8, 8)"},
      {"784-10", "model input width 784 does not match the data's 192 features"},
      {sequential{flatten(), dense(3)}.text(), "label 3 of training sample"},  // 4 classes in the data, 3 outputs
  };
  for (const auto& [model, why] : cases) {
    INFO(model);
    c.model = model;
    train_result r = train(c);
    CHECK_FALSE(r.ok);
    INFO(r.error);
    CHECK(r.error.find(why) != std::string::npos);
  }
}

TEST_CASE("a signal as the job's last step ends lets it finish with its results, checkpoints on or not", "[training][checkpoint]") {
  const auto train_set = test::load("train", 480);  // 20 steps
  for (const int64_t every : {int64_t(0), int64_t(1)}) {
    INFO("checkpoint every " << every);
    const std::string dir = "/tmp/ringmaster-test-signal-at-end-" + std::to_string(::getpid());
    std::filesystem::remove_all(dir);
    train_config c = like_one_config("784-64-32-10", optimizer_config::adam, 2, train_set);
    c.checkpoint_dir = dir;
    c.checkpoint_every = every;
    std::atomic<int> signal{0};
    c.interrupt = &signal;
    // The last epoch closes once every rank has applied the last step: the stop finds them all there.
    c.on_progress = [&signal](const progress& p) {
      if (p.epoch_end) signal = SIGTERM;
    };
    const train_result r = train(c);
    INFO(r.error);
    CHECK(r.ok);
    CHECK(r.interrupted == 0);
    CHECK(r.weights.size() > 0);
    CHECK(r.identical);
    CHECK(r.checkpoint == dir + "/ckpt-1-0.safetensors");
    std::filesystem::remove_all(dir);
  }
}

namespace {
// A user layer that passes its input on and owns one parameter the forward pass never uses, whose
// gradient turns NaN after `good` backward passes: the weights go NaN while the loss stays finite
// (and each such step takes a millisecond more).
class nan_later final : public layer {
 public:
  nan_later(std::shared_ptr<std::atomic<int>> calls, int good) : calls_(std::move(calls)), good_(good) {}
  std::string type() const override { return "nan_later"; }
  bool build(const shape& in, shape* out, std::vector<param_info>* params, std::string*) override {
    *out = in;
    params->push_back({"unused", {1}, param_init::ones, 0, 0});
    return true;
  }
  void forward(const layer_io& io) const override { std::copy(io.x, io.x + size_t(io.batch) * io.in.size(), io.y); }
  void backward(const layer_io& io, const float* dy, float* dx) const override {
    const bool gone = ++*calls_ > good_;
    io.grads[0][0] = gone ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
    if (gone) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // time for a signal to be seen
    if (dx) std::copy(dy, dy + size_t(io.batch) * io.in.size(), dx);
  }

 private:
  std::shared_ptr<std::atomic<int>> calls_;
  int good_;
};
}  // namespace

TEST_CASE("checkpoint: weights gone NaN under a finite loss are never written, and the last good checkpoint is kept",
          "[training][checkpoint]") {
  // It used to write them, and prune the good ones: a resume then found none it could read.
  auto calls = std::make_shared<std::atomic<int>>(0);
  layer_registry reg = layer_registry::with_builtins();
  std::string err;
  REQUIRE(reg.add("nan_later", [calls](const json&, std::string*) -> std::unique_ptr<layer> { return std::make_unique<nan_later>(calls, 25); }, &err));
  const std::string dir = test::temp_dir("nan-state");
  using namespace layers;
  train_config c = like_one_config(sequential{custom("nan_later"), flatten(), dense(16), relu(), dense(10)}.text(), optimizer_config::adam, 1,
                                   load("train", 480));  // 20 steps of 24 an epoch
  c.epochs = 2;  c.layers = std::make_shared<const layer_registry>(std::move(reg));
  c.checkpoint_dir = dir;
  c.checkpoint_every = 5;
  const train_result r = train(c);
  INFO(r.error);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("the state after step 30: its parameters hold NaN or infinite values") != std::string::npos);
  CHECK(r.error.find("no checkpoint was written from it; the last one, after step 25, is kept") != std::string::npos);
  checkpoint ck;
  std::string path;
  std::vector<std::string> skipped;
  REQUIRE(latest_checkpoint(dir, *c.layers, &ck, &path, &skipped, &err));
  CHECK(ck.progress.step == 25);
  CHECK(skipped.empty());
  // Nor at a stop, none due before it (the job says it was stopped): a signal after step 50 of 400
  // (the job looks every 50 ms).
  std::filesystem::remove_all(dir);
  *calls = 0;
  c.train = load("train", 4800);
  c.checkpoint_every = 1000;
  std::atomic<int> signal{0};
  c.interrupt = &signal;
  c.on_progress = [&signal](const progress& p) {
    if (p.step >= 50) signal = SIGTERM;
  };
  const train_result stopped = train(c);
  INFO("stopped: " << stopped.error);
  CHECK(stopped.interrupted == SIGTERM);
  CHECK(stopped.error.find("no checkpoint was written at the stop: the state after step ") != std::string::npos);
  CHECK(stopped.error.find(": its parameters hold NaN or infinite values (training diverged") != std::string::npos);
  CHECK(checkpoint_test::names(dir).empty());
  std::filesystem::remove_all(dir);
}
