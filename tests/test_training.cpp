// Whole local jobs: N replicas train like one replica with the same global batch, runs are reproducible,
// failures end the job with a clear error instead of a hang.
#include <catch2/catch.hpp>
#include <cmath>

#include "actors/training.hpp"
#include "tests/test_data.hpp"

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

}  // namespace

TEST_CASE("N replicas at the same global batch train like one replica", "[training]") {
  auto train_set = load("train", 1200);  // 1200 / 24 = 50 steps
  for (auto kind : {optimizer_config::adam, optimizer_config::sgd}) {
    std::vector<float> reference;
    uint64_t ref_sum = 0;
    for (int n : {1, 2, 3, 4}) {
      INFO("replicas " << n << (kind == optimizer_config::adam ? " adam" : " sgd"));
      train_config c;
      c.model = "784-64-32-10";
      c.opt.kind = kind;
      c.opt.lr = kind == optimizer_config::adam ? 1e-3f : 1e-2f;
      c.replicas = n;
      c.global_batch = 24;  // 24, 12, 8, 6 per replica
      c.epochs = 1;
      c.train = train_set;
      c.evaluate = false;
      train_result r = train(c);
      REQUIRE(r.ok);
      REQUIRE(r.history.size() == 1);
      CHECK(r.history[0].samples == 1200);
      CHECK(r.identical);
      REQUIRE(r.checksums.size() == size_t(n));
      if (n == 1) {
        reference = r.weights;
        ref_sum = r.checksums[0];
        // The weights moved: 50 steps did something.
        CHECK(max_rel_diff(reference, init_params(model_spec{{784, 64, 32, 10}}, c.seed)) > 1e-2);
      } else {
        // Summation order differs (one GEMM over the batch vs a ring sum of shard GEMMs), so weights
        // agree to float rounding, not bit for bit. Adam divides by sqrt(v), which turns the rounding of
        // a gradient that nearly cancels into a visible step: single elements drift to ~3e-5 of their
        // own (tiny) size, while the largest difference relative to the weights' scale stays ~1e-6.
        const double linf = linf_rel_diff(r.weights, reference), elem = max_rel_diff(r.weights, reference);
        WARN("vs 1 replica: max |a-b| / max |b| = " << linf << ", max elementwise relative = " << elem);
        CHECK(linf <= 1e-5);
        CHECK(elem <= 1e-4);
      }
      // The same run again gives bit-identical weights.
      train_result again = train(c);
      REQUIRE(again.ok);
      CHECK(again.checksums[0] == r.checksums[0]);
      (void)ref_sum;
    }
  }
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

TEST_CASE("a replica that cannot start ends the job with an error, not a hang", "[training]") {
  train_config c;
  c.model = "784-16-10";
  c.replicas = 2;
  c.global_batch = 8;
  c.epochs = 1;
  c.train = load("train", 64);
  c.devices = {"cuda:98", "cuda:99"};  // no such GPUs (or none at all): both replicas fail to start
  train_result r = train(c);
  CHECK_FALSE(r.ok);
  CHECK(r.error.find("replica ") != std::string::npos);
  INFO(r.error);
  CHECK(r.error.find("cuda:9") != std::string::npos);
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
  CHECK(train(c).error.find("the limit is 2^28") != std::string::npos);
}
