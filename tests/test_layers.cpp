// The built-in layers one at a time: every layer's forward output and gradients against the float64
// reference (tests/layer_reference.hpp; Keras/TensorFlow semantics, channels-last), batch invariance of
// layers and whole models on the CPU and on a simulated device, and dropout masks keyed by
// (seed, layer, epoch, sample). Whole models' gradients, the registry and the layout: test_models.cpp.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <tuple>
#include <vector>

#include "actors/training.hpp"
#include "kernels/layers.hpp"
#include "kernels/model.hpp"
#include "kernels/registry.hpp"
#include "tests/layer_reference.hpp"
#include "tests/sim_backend.hpp"

using namespace ringmaster;
using namespace ringmaster::test;

namespace {

// Random values at least `gap` away from zero (no ReLU kink within a finite-difference step).
std::vector<float> away_from_zero(size_t n, std::mt19937& rng, float gap = 0.05f) {
  auto v = randv(n, rng);
  for (auto& x : v) x = x < 0 ? std::min(x, -gap) : std::max(x, gap);
  return v;
}

// Distinct values, any two at least 1e-3 apart (no max ties, no switch within a finite-difference step).
std::vector<float> distinct(size_t n, std::mt19937& rng) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = -1.0f + 2.0f * float(i) / float(n) + 1e-3f * float(i % 7) / float(n);
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

// Relative error with a floor, so values near zero are compared absolutely.
double rel_err(double a, double b) { return std::abs(a - b) / std::max(1e-2, std::max(std::abs(a), std::abs(b))); }

// ---- one layer on a backend, with buffers of its own --------------------------------------------------

struct rig_out {
  std::vector<float> y, dx;
  std::vector<std::vector<float>> dp;  // one per parameter
};

class rig {
 public:
  rig(backend& be, const json& settings, const shape& in) : be_(be), in_(in) {
    std::string err;
    impl_ = builtins().create(settings, &err);
    INFO(settings.dump() << ": " << err);
    REQUIRE(impl_);
    REQUIRE(impl_->build(in_, &out_, &ps_, &err));
  }
  const shape& out() const { return out_; }
  const std::vector<param_info>& params() const { return ps_; }
  std::vector<std::vector<float>> random_params(std::mt19937& rng) const {
    std::vector<std::vector<float>> p;
    for (const param_info& i : ps_) p.push_back(randv(i.count(), rng));
    return p;
  }
  // Forward on x (B, in) channels-last; with dy, backward too.
  rig_out run(const std::vector<float>& x, int B, const std::vector<std::vector<float>>& p,
              const std::vector<float>* dy = nullptr, bool training = false, sample_key key = {},
              uint64_t layer_index = 0) {
    REQUIRE(x.size() == size_t(B) * in_.size());
    REQUIRE(p.size() == ps_.size());
    device_buffer<float> xd(be_, x.size()), yd(be_, size_t(B) * out_.size()),
        work(be_, impl_->workspace(in_, out_, B));
    std::vector<device_buffer<float>> pd, gd;
    std::vector<const float*> pv;
    std::vector<float*> gv;
    for (size_t i = 0; i < ps_.size(); ++i) {
      REQUIRE(p[i].size() == ps_[i].count());
      pd.emplace_back(be_, p[i].size());
      gd.emplace_back(be_, p[i].size());
      be_.copy_in(pd.back().data(), p[i].data(), p[i].size() * sizeof(float));
      pv.push_back(pd.back().data());
      gv.push_back(gd.back().data());
    }
    be_.copy_in(xd.data(), x.data(), x.size() * sizeof(float));
    layer_io io(be_);
    io.batch = B;
    io.in = in_;
    io.out = out_;
    io.x = xd.data();
    io.y = yd.data();
    io.params = pv.data();
    io.grads = gv.data();
    io.work = work.data();
    io.training = training;
    io.key = key;
    io.layer_index = layer_index;
    impl_->forward(io);
    rig_out r;
    r.y.resize(yd.size());
    be_.copy_out(r.y.data(), yd.data(), r.y.size() * sizeof(float));
    if (dy) {
      REQUIRE(dy->size() == r.y.size());
      device_buffer<float> dyd(be_, dy->size()), dxd(be_, x.size());
      be_.copy_in(dyd.data(), dy->data(), dy->size() * sizeof(float));
      impl_->backward(io, dyd.data(), dxd.data());
      r.dx.resize(x.size());
      be_.copy_out(r.dx.data(), dxd.data(), r.dx.size() * sizeof(float));
      for (size_t i = 0; i < ps_.size(); ++i) {
        r.dp.emplace_back(p[i].size());
        be_.copy_out(r.dp.back().data(), gd[i].data(), p[i].size() * sizeof(float));
      }
    }
    be_.synchronize();
    return r;
  }

 private:
  backend& be_;
  std::unique_ptr<layer> impl_;
  shape in_, out_;
  std::vector<param_info> ps_;
};

// ---- gradient checks of one layer ---------------------------------------------------------------------

using ref_fn = std::function<dvec(const dvec& x, const std::vector<dvec>& p)>;

// Forward against ref (relative 1e-5), then dx and every parameter's gradient against central
// differences of L = sum(ref(x, p) .* R), R being the dy handed to backward.
void check_layer(rig& r, int B, const std::vector<float>& x, const ref_fn& ref, uint32_t seed,
                 bool training = false, sample_key key = {}, uint64_t layer_index = 0) {
  std::mt19937 rng(seed);
  const auto p = r.random_params(rng);
  const auto R = randv(size_t(B) * r.out().size(), rng);
  const rig_out got = r.run(x, B, p, &R, training, key, layer_index);
  dvec xd = to_d(x);
  std::vector<dvec> pd;
  for (const auto& v : p) pd.push_back(to_d(v));
  const dvec yref = ref(xd, pd);
  REQUIRE(yref.size() == got.y.size());
  double fwd = 0;
  for (size_t i = 0; i < yref.size(); ++i) fwd = std::max(fwd, std::abs(got.y[i] - yref[i]) / std::max(1.0, std::abs(yref[i])));
  CHECK(fwd < 1e-5);
  auto L = [&] {
    const dvec y = ref(xd, pd);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * R[i];
    return s;
  };
  const double h = 1e-6;
  auto worst = [&](dvec& v, const std::vector<float>& grad) {
    REQUIRE(grad.size() == v.size());
    double w = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      const double keep = v[i];
      v[i] = keep + h;
      const double up = L();
      v[i] = keep - h;
      const double down = L();
      v[i] = keep;
      w = std::max(w, rel_err(grad[i], (up - down) / (2 * h)));
    }
    return w;
  };
  CHECK(worst(xd, got.dx) < 1e-4);
  for (size_t i = 0; i < pd.size(); ++i) {
    INFO("parameter " << r.params()[i].name);
    CHECK(worst(pd[i], got.dp[i]) < 1e-4);
  }
}

// ---- batch invariance of one layer --------------------------------------------------------------------

// Samples alone, in batches of 3 and in one batch of 64 give the same bits; with dropout the global
// sample index (first_sample + position) is kept. Returns the batch of 64's output.
std::vector<float> check_invariance(backend& be, const json& settings, const shape& in, bool training) {
  INFO(settings.dump() << " on " << be.name());
  rig r(be, settings, in);
  std::mt19937 rng(11);
  const auto p = r.random_params(rng);
  const int N = 64;
  const size_t fi = in.size(), fo = r.out().size();
  const auto x = away_from_zero(size_t(N) * fi, rng);
  const int64_t base = 1000;
  sample_key key{7, 2, base};
  const auto all = r.run(x, N, p, nullptr, training, key, 3).y;
  // Batches of 1, 3 and 6 (what each of 4 replicas gets of a global batch of 24) cut from the 64.
  for (int B : {1, 3, 6}) {
    std::vector<int> wrong;  // samples whose output differs
    for (int s = 0; s + B <= N; s += B) {
      std::vector<float> part(x.begin() + ptrdiff_t(s * fi), x.begin() + ptrdiff_t((s + B) * fi));
      const auto y = r.run(part, B, p, nullptr, training, sample_key{7, 2, base + s}, 3).y;
      for (int i = 0; i < B; ++i)
        if (!std::equal(y.begin() + ptrdiff_t(i * fo), y.begin() + ptrdiff_t((i + 1) * fo), all.begin() + ptrdiff_t((s + i) * fo)))
          wrong.push_back(s + i);
    }
    INFO("batches of " << B << ": " << wrong.size() << " samples differ from the batch of 64, the first "
                       << (wrong.empty() ? -1 : wrong[0]));
    CHECK(wrong.empty());
  }
  return all;
}

}  // namespace

// ---- a. every built-in layer against float64 -----------------------------------------------------------

TEST_CASE("dense: output and gradients match float64, flat or image input", "[layers]") {
  auto be = make_cpu_backend();
  std::mt19937 rng(1);
  for (shape in : {shape{7, 1, 1}, shape{2, 3, 3}}) {
    for (int B : {3, 5}) {  // under and over the 4 rows the CPU pads small batches to
      for (bool relu : {false, true}) {
        INFO("input " << in.str() << ", batch " << B << (relu ? ", fused relu" : ""));
        rig r(*be, layers::dense(4, relu ? "relu" : "linear"), in);
        CHECK(r.out() == shape{4, 1, 1});
        REQUIRE(r.params().size() == 2);
        CHECK(r.params()[0].dims == std::vector<size_t>{in.size(), 4});
        CHECK(r.params()[1].dims == std::vector<size_t>{4});
        const int IN = int(in.size());
        check_layer(r, B, randv(size_t(B) * IN, rng),
                    [&](const dvec& x, const std::vector<dvec>& p) {
                      const dvec y = ref_dense(x, p[0], p[1], B, IN, 4);
                      return relu ? ref_relu(y) : y;
                    },
                    2);
      }
    }
  }
}

TEST_CASE("conv2d: output and gradients match float64 (valid/same, strides, 1x1, 2x3, 1 and 3 channels)", "[layers]") {
  struct conv_case {
    shape in;
    int F;
    window g;
    shape expect;
  };
  const std::vector<conv_case> cases = {
      {{1, 6, 5}, 2, {3, 3, 1, 1, false}, {2, 4, 3}},
      {{3, 7, 6}, 2, {3, 3, 2, 2, false}, {2, 3, 2}},
      {{3, 5, 5}, 4, {3, 3, 1, 1, true}, {4, 5, 5}},
      {{1, 6, 7}, 3, {3, 3, 2, 2, true}, {3, 3, 4}},  // padding 0 top / 1 bottom, 1 left / 1 right
      {{3, 4, 4}, 2, {1, 1, 1, 1, false}, {2, 4, 4}},  // pointwise: no unfolding
      {{3, 4, 4}, 2, {1, 1, 1, 1, true}, {2, 4, 4}},
      {{3, 5, 5}, 2, {1, 1, 2, 2, false}, {2, 3, 3}},
      {{3, 5, 7}, 2, {2, 3, 1, 2, false}, {2, 4, 3}},
      {{1, 5, 6}, 2, {2, 3, 2, 2, true}, {2, 3, 3}},
      {{3, 4, 5}, 2, {2, 3, 1, 1, true}, {2, 4, 5}},  // even kernel: the extra padding row goes below
      {{2, 3, 3}, 3, {3, 3, 1, 1, false}, {3, 1, 1}},  // kernel as large as the input
  };
  auto be = make_cpu_backend();
  std::mt19937 rng(3);
  uint32_t seed = 100;
  for (const conv_case& c : cases) {
    for (bool relu : {false, true}) {
      json s = {{"type", "conv2d"}, {"filters", c.F}, {"kernel", {c.g.KH, c.g.KW}},
                {"stride", {c.g.SH, c.g.SW}}, {"padding", c.g.same ? "same" : "valid"}};
      if (relu) s["activation"] = "relu";
      INFO(s.dump() << " on input " << c.in.str());
      rig r(*be, s, c.in);
      CHECK(r.out() == c.expect);
      REQUIRE(r.params().size() == 2);
      CHECK(r.params()[0].dims == std::vector<size_t>{size_t(c.g.KH), size_t(c.g.KW), size_t(c.in.c), size_t(c.F)});
      CHECK(r.params()[1].dims == std::vector<size_t>{size_t(c.F)});
      const int B = 2;
      check_layer(r, B, randv(size_t(B) * c.in.size(), rng),
                  [&](const dvec& x, const std::vector<dvec>& p) {
                    shape out;
                    const dvec y = ref_conv(x, p[0], p[1], B, c.in, c.F, c.g, &out);
                    return relu ? ref_relu(y) : y;
                  },
                  seed++);
    }
  }
}

TEST_CASE("a fused ReLU gives exactly the bits of the layer followed by a relu layer", "[layers]") {
  auto be = make_cpu_backend();
  std::mt19937 rng(9);
  const int B = 5;
  for (const auto& [plain, fused, in] :
       {std::tuple{layers::dense(6), layers::dense(6, "relu"), shape{2, 3, 3}},
        std::tuple{layers::conv2d(4, 3, 1, "same"), layers::conv2d(4, 3, 1, "same", "relu"), shape{3, 5, 6}},
        std::tuple{layers::conv2d(4, 1), layers::conv2d(4, 1, 1, "valid", "relu"), shape{3, 4, 4}}}) {
    INFO(fused.dump());
    rig a(*be, plain, in), f(*be, fused, in), r(*be, layers::relu(), a.out());
    REQUIRE(f.out() == a.out());
    const auto p = a.random_params(rng);
    const auto x = randv(size_t(B) * in.size(), rng);
    const auto dy = randv(size_t(B) * a.out().size(), rng);
    const auto z = a.run(x, B, p).y;
    const rig_out after = r.run(z, B, {}, &dy);  // relu's output and its dx (= dy masked)
    const rig_out fo = f.run(x, B, p, &dy);
    CHECK(fo.y == after.y);
    const rig_out ao = a.run(x, B, p, &after.dx);
    CHECK(fo.dx == ao.dx);
    CHECK(fo.dp == ao.dp);
    size_t zeros = 0;
    for (float v : fo.y) zeros += v == 0.0f;
    CHECK(zeros > 0);  // the ReLU did something
  }
}

TEST_CASE("max_pool2d: output and gradients match float64 (2/2, overlapping 3/2, 2x3, remainders)", "[layers]") {
  struct pool_case {
    shape in;
    json size, stride;
    window g;
    shape expect;
  };
  const std::vector<pool_case> cases = {
      {{2, 6, 6}, 2, 2, {2, 2, 2, 2}, {2, 3, 3}},
      {{3, 7, 7}, 3, 2, {3, 3, 2, 2}, {3, 3, 3}},        // overlapping windows: gradients add up
      {{2, 6, 7}, {2, 3}, nullptr, {2, 3, 2, 3}, {2, 3, 2}},  // stride defaults to the size
      {{1, 5, 5}, 2, nullptr, {2, 2, 2, 2}, {1, 2, 2}},   // the last row and column fall off
      {{2, 4, 5}, 3, 1, {3, 3, 1, 1}, {2, 2, 3}},
  };
  auto be = make_cpu_backend();
  std::mt19937 rng(4);
  uint32_t seed = 200;
  for (const pool_case& c : cases) {
    json s = {{"type", "max_pool2d"}, {"size", c.size}};
    if (!c.stride.is_null()) s["stride"] = c.stride;
    INFO(s.dump() << " on input " << c.in.str());
    rig r(*be, s, c.in);
    CHECK(r.out() == c.expect);
    CHECK(r.params().empty());
    const int B = 3;
    check_layer(r, B, distinct(size_t(B) * c.in.size(), rng),
                [&](const dvec& x, const std::vector<dvec>&) {
                  shape out;
                  return ref_pool(x, B, c.in, c.g, &out);
                },
                seed++);
  }
}

TEST_CASE("flatten and relu: output and gradients match float64", "[layers]") {
  auto be = make_cpu_backend();
  std::mt19937 rng(5);
  const int B = 3;
  {
    rig r(*be, layers::flatten(), shape{3, 2, 4});
    CHECK(r.out() == shape{24, 1, 1});
    const auto x = randv(size_t(B) * 24, rng);
    check_layer(r, B, x, [](const dvec& x, const std::vector<dvec>&) { return x; }, 6);
    CHECK(r.run(x, B, {}).y == x);  // channels-last memory is already (h, w, c) in order
  }
  {
    rig r(*be, layers::relu(), shape{2, 3, 3});
    CHECK(r.out() == shape{2, 3, 3});
    const auto x = away_from_zero(size_t(B) * 18, rng);
    check_layer(r, B, x, [](const dvec& x, const std::vector<dvec>&) { return ref_relu(x); }, 7);
  }
}

TEST_CASE("a model at the edge of a setting's range reads back from its own description, and a negative input is named", "[layers]") {
  // 0.999 is kept as the float 0.99900001...: its description (a checkpoint's, --save's) must build
  // again. It failed "expected a number in [0, 0.999]", after training (a tester's run).
  std::string err;
  const std::string text = sequential{layers::flatten(), layers::dropout(0.999), layers::dense(10)}.text();
  auto m = model::build(text, builtins(), shape{1, 4, 4}, &err);
  REQUIRE(m);
  auto again = model::build(m->description(), builtins(), &err);
  INFO(err);
  REQUIRE(again);
  CHECK(again->description() == m->description());
  CHECK_FALSE(model::build("784-10", builtins(), shape{-1, 28, 28}, &err));  // it spoke of 18446744073709550832 features
  CHECK(err == "input (-1, 28, 28) is empty or too large");
}

TEST_CASE("dropout in training: output is the masked, scaled input, its gradient the same mask and scale", "[layers]") {
  auto be = make_cpu_backend();
  std::mt19937 rng(6);
  const int B = 4;
  const shape in{5, 2, 3};
  for (double rate : {0.25, 0.5}) {
    INFO("rate " << rate);
    rig r(*be, layers::dropout(rate), in);
    CHECK(r.out() == in);
    const sample_key key{99, 3, 40};
    const auto x = away_from_zero(size_t(B) * in.size(), rng);
    check_layer(r, B, x,
                [&](const dvec& x, const std::vector<dvec>&) { return ref_dropout(x, B, in.size(), rate, key, 2); }, 8,
                /*training=*/true, key, /*layer_index=*/2);
    // Exactly: kept elements are x * float(1 / (1 - rate)), the rest 0, and backward does the same to dy.
    const auto dy = randv(x.size(), rng);
    const rig_out o = r.run(x, B, {}, &dy, true, key, 2);
    const float scale = 1.0f / (1.0f - float(rate));
    size_t wrong = 0, dropped = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const bool k = kept(key, 2, key.first_sample + int64_t(i / in.size()), i % in.size(), rate);
      dropped += !k;
      wrong += o.y[i] != (k ? x[i] * scale : 0.0f);
      wrong += o.dx[i] != (k ? dy[i] * scale : 0.0f);
    }
    CHECK(wrong == 0);
    CHECK(dropped > 0);
    CHECK(dropped < x.size());
  }
}

// ---- b. batch invariance --------------------------------------------------------------------------------

TEST_CASE("every layer gives a sample the same bits alone, in a batch of 3 and in a batch of 64", "[layers]") {
  auto cpu = make_cpu_backend();
  auto reg = std::make_shared<test::sim_devices>();
  test::sim_backend sim(0, reg);
  struct inv_case {
    json settings;
    shape in;
    bool training;
  };
  const std::vector<inv_case> cases = {
      {layers::dense(16), {3, 4, 4}, false},
      {layers::dense(10), {40, 1, 1}, false},
      {layers::dense(12, "relu"), {5, 3, 3}, false},
      {layers::dense(2), {3, 1, 1}, false},  // a small product
      {layers::conv2d(1, 3), {1, 6, 6}, false},  // a single output column
      {layers::conv2d(8, 3), {3, 6, 6}, false},
      {layers::conv2d(8, 3, 1, "valid", "relu"), {1, 8, 8}, false},
      {layers::conv2d(8, 3, 2, "same"), {3, 7, 6}, false},
      {layers::conv2d(5, 1), {3, 5, 5}, false},
      {{{"type", "conv2d"}, {"filters", 4}, {"kernel", {2, 3}}, {"padding", "same"}}, {2, 5, 6}, false},
      {layers::max_pool2d(2), {4, 6, 6}, false},
      {layers::max_pool2d(3, 2), {3, 7, 7}, false},
      {layers::flatten(), {3, 4, 4}, false},
      {layers::relu(), {3, 4, 4}, false},
      {layers::dropout(0.5), {3, 4, 4}, true},
      {layers::dropout(0.5), {3, 4, 4}, false},
  };
  for (const inv_case& c : cases) {
    const auto on_cpu = check_invariance(*cpu, c.settings, c.in, c.training);
    const auto on_sim = check_invariance(sim, c.settings, c.in, c.training);
    CHECK(on_cpu == on_sim);
  }
}

namespace {

// The whole model on a backend: every one of 64 samples' loss (a function of its logits) is the same
// alone, in batches of 3 and in one batch of 64, in evaluation and in training (dropout keyed by the
// sample's global index). Losses are summed in double in batch order, so equal logits give equal sums.
void check_model_invariance(backend& be, const std::string& text, const shape& in) {
  INFO(text << " on " << be.name());
  std::string err;
  auto m = build_model(text, in, &err);
  REQUIRE(m);
  const int N = 64;
  network net(be, m, N, {});
  net.set_params(init_params(*m, 9).data());
  std::mt19937 rng(31);
  const auto xh = randv(size_t(N) * in.size(), rng, 0, 1);
  std::vector<int32_t> yh(N);
  for (int i = 0; i < N; ++i) yh[i] = int32_t(rng() % m->classes());
  device_buffer<float> x(be, xh.size());
  device_buffer<int32_t> y(be, yh.size());
  be.copy_in(x.data(), xh.data(), xh.size() * sizeof(float));
  be.copy_in(y.data(), yh.data(), yh.size() * sizeof(int32_t));
  const int64_t base = 240;
  for (bool training : {false, true}) {
    INFO((training ? "training" : "evaluation"));
    auto run = [&](int first, int B) {
      const size_t f = in.size();
      return training ? net.forward_backward(x.data() + first * f, y.data() + first, B, 1.0f, {5, 1, base + first})
                      : net.evaluate(x.data() + first * f, y.data() + first, B);
    };
    const batch_metrics all = run(0, N);
    std::vector<double> alone(N);
    int64_t hits = 0;
    for (int s = 0; s < N; ++s) {
      const batch_metrics b = run(s, 1);
      alone[s] = b.loss_sum;
      hits += b.correct;
    }
    double sum = 0;
    for (double l : alone) sum += l;
    CHECK(all.loss_sum == sum);
    CHECK(all.correct == hits);
    for (int B : {3, 6}) {  // 6: what each of 4 replicas gets of a global batch of 24
      size_t wrong = 0;
      for (int s = 0; s + B <= N; s += B) {
        double sum_alone = 0;
        for (int i = s; i < s + B; ++i) sum_alone += alone[i];
        wrong += run(s, B).loss_sum != sum_alone;
      }
      INFO("batches of " << B);
      CHECK(wrong == 0);
    }
  }
}

}  // namespace

TEST_CASE("whole models are batch-invariant on the CPU and on a simulated device", "[layers]") {
  auto cpu = make_cpu_backend();
  auto reg = std::make_shared<test::sim_devices>();
  test::sim_backend sim(0, reg);
  using namespace layers;
  const std::string small3 = sequential{conv2d(6, 3, 1, "same"), relu(), max_pool2d(2), conv2d(8, 3, 2), relu(),
                                        flatten(), dropout(0.3), dense(4)}
                                 .text();
  for (backend* be : {cpu.get(), static_cast<backend*>(&sim)}) {
    check_model_invariance(*be, "cnn", shape{1, 28, 28});
    check_model_invariance(*be, small3, shape{3, 10, 10});
  }
}

// ---- c. dropout masks -----------------------------------------------------------------------------------

TEST_CASE("dropout masks depend only on (seed, layer, epoch, sample), evaluation passes through", "[layers]") {
  auto be = make_cpu_backend();
  const shape in{2000, 1, 1};
  rig r(*be, layers::dropout(0.5), in);
  const int B = 8;
  const std::vector<float> x(size_t(B) * in.size(), 1.0f);
  auto row = [&](const std::vector<float>& y, int pos) {
    return std::vector<float>(y.begin() + ptrdiff_t(pos * in.size()), y.begin() + ptrdiff_t((pos + 1) * in.size()));
  };
  const sample_key k{42, 0, 100};
  const auto a = r.run(x, B, {}, nullptr, true, k, 4).y;
  // Sample 100 at position 0, then at position 5 of a batch starting at 95: the same mask.
  const auto b = r.run(x, B, {}, nullptr, true, sample_key{42, 0, 95}, 4).y;
  CHECK(row(a, 0) == row(b, 5));
  CHECK(row(a, 2) == row(b, 7));
  auto differing = [&](const std::vector<float>& u, const std::vector<float>& v) {
    size_t n = 0;
    for (size_t i = 0; i < u.size(); ++i) n += u[i] != v[i];
    return n;
  };
  // Neighbouring samples, another epoch, another layer, another seed: different masks (about half the
  // elements differ between two independent masks at rate 0.5).
  CHECK(differing(row(a, 0), row(a, 1)) > 800);
  const auto e1 = r.run(x, B, {}, nullptr, true, sample_key{42, 1, 100}, 4).y;
  CHECK(differing(row(a, 0), row(e1, 0)) > 800);
  const auto l5 = r.run(x, B, {}, nullptr, true, k, 5).y;
  CHECK(differing(row(a, 0), row(l5, 0)) > 800);
  const auto s43 = r.run(x, B, {}, nullptr, true, sample_key{43, 0, 100}, 4).y;
  CHECK(differing(row(a, 0), row(s43, 0)) > 800);
  // The same key again: the same mask (a pure function of the key).
  CHECK(r.run(x, B, {}, nullptr, true, k, 4).y == a);

  // Keep rates within 5 standard deviations; kept values scaled by 1 / (1 - rate).
  for (double rate : {0.1, 0.5, 0.9}) {
    INFO("rate " << rate);
    rig d(*be, layers::dropout(rate), in);
    const auto y = d.run(x, B, {}, nullptr, true, sample_key{1, 2, 3}, 0).y;
    size_t kept_n = 0, wrong = 0;
    for (float v : y) {
      kept_n += v != 0.0f;
      wrong += v != 0.0f && v != 1.0f / (1.0f - float(rate));
    }
    const double n = double(y.size()), keep = 1.0 - rate;
    CHECK(std::abs(double(kept_n) / n - keep) < 5 * std::sqrt(keep * (1 - keep) / n));
    CHECK(wrong == 0);
    // Evaluation: everything passes through unchanged.
    std::mt19937 rng(3);
    const auto xr = randv(x.size(), rng);
    CHECK(d.run(xr, B, {}, nullptr, false, sample_key{1, 2, 3}, 0).y == xr);
  }
  // Rate 0 in training: a copy.
  rig zero(*be, layers::dropout(0.0), in);
  CHECK(zero.run(x, B, {}, nullptr, true, k, 0).y == x);
}

TEST_CASE("a model with dropout evaluates exactly like the same model without it", "[layers]") {
  using namespace layers;
  std::string err;
  const shape in{1, 28, 28};
  auto with = build_model("cnn", in, &err);
  auto without = build_model(sequential{conv2d(32, 3, 1, "valid", "relu"), max_pool2d(2), conv2d(64, 3, 1, "valid", "relu"),
                                        max_pool2d(2), flatten(), dense(10)}
                                 .text(),
                             in, &err);
  REQUIRE(with);
  REQUIRE(without);
  REQUIRE(with->param_count() == without->param_count());
  auto be = make_cpu_backend();
  const int B = 6;
  network a(*be, with, B, {}), b(*be, without, B, {});
  const auto p = init_params(*with, 3);
  a.set_params(p.data());
  b.set_params(p.data());
  std::mt19937 rng(8);
  const auto x = randv(size_t(B) * in.size(), rng, 0, 1);
  const std::vector<int32_t> y = {1, 2, 3, 4, 5, 6};
  CHECK(a.evaluate(x.data(), y.data(), B).loss_sum == b.evaluate(x.data(), y.data(), B).loss_sum);
  // In training the dropout layer does act.
  CHECK(a.forward_backward(x.data(), y.data(), B, 1.0f, {1, 0, 0}).loss_sum !=
        b.forward_backward(x.data(), y.data(), B, 1.0f, {1, 0, 0}).loss_sum);
}
