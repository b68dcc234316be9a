// The built-in layers and models made of them: every layer's forward output and gradients against a
// float64 reference written here (Keras/TensorFlow semantics, channels-last), whole models against
// finite differences, batch invariance on the CPU and on a simulated device, dropout masks keyed by
// (seed, layer, epoch, sample), the registry's refusals, and the Keras parameter layout.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "actors/training.hpp"
#include "kernels/counter_rng.hpp"
#include "kernels/layers.hpp"
#include "kernels/model.hpp"
#include "kernels/registry.hpp"
#include "tests/sim_backend.hpp"

using namespace ringmaster;

namespace {

using dvec = std::vector<double>;

const layer_registry& builtins() {
  static const layer_registry reg = layer_registry::with_builtins();
  return reg;
}

std::vector<float> randv(size_t n, std::mt19937& rng, float lo = -1, float hi = 1) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

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

dvec to_d(const std::vector<float>& v) { return dvec(v.begin(), v.end()); }

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

// ---- float64 references (TensorFlow semantics; samples channels-last (h, w, c)) ------------------------

dvec ref_dense(const dvec& x, const dvec& w, const dvec& b, int B, int IN, int OUT) {
  dvec y(size_t(B) * OUT);
  for (int i = 0; i < B; ++i)
    for (int j = 0; j < OUT; ++j) {
      double acc = b[j];
      for (int k = 0; k < IN; ++k) acc += x[size_t(i) * IN + k] * w[size_t(k) * OUT + j];
      y[size_t(i) * OUT + j] = acc;
    }
  return y;
}

struct window {
  int KH = 1, KW = 1, SH = 1, SW = 1;
  bool same = false;
};

// TensorFlow's output size and leading padding along one axis.
void tf_axis(int in, int k, int s, bool same, int* out, int* pad) {
  if (same) {
    *out = (in + s - 1) / s;
    *pad = std::max((*out - 1) * s + k - in, 0) / 2;
  } else {
    *out = (in - k) / s + 1;
    *pad = 0;
  }
}

// Keras Conv2D: kernel (KH, KW, C, F), bias (F).
dvec ref_conv(const dvec& x, const dvec& k, const dvec& bias, int B, const shape& in, int F, const window& g,
              shape* out) {
  int OH, OW, PT, PL;
  tf_axis(in.h, g.KH, g.SH, g.same, &OH, &PT);
  tf_axis(in.w, g.KW, g.SW, g.same, &OW, &PL);
  *out = shape{F, OH, OW};
  const int H = in.h, W = in.w, C = in.c;
  dvec y(size_t(B) * OH * OW * F);
  for (int b = 0; b < B; ++b)
    for (int oy = 0; oy < OH; ++oy)
      for (int ox = 0; ox < OW; ++ox)
        for (int f = 0; f < F; ++f) {
          double acc = bias[f];
          for (int kh = 0; kh < g.KH; ++kh)
            for (int kw = 0; kw < g.KW; ++kw) {
              const int iy = oy * g.SH + kh - PT, ix = ox * g.SW + kw - PL;
              if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;  // zero padding
              for (int c = 0; c < C; ++c)
                acc += x[((size_t(b) * H + iy) * W + ix) * C + c] * k[((size_t(kh) * g.KW + kw) * C + c) * F + f];
            }
          y[((size_t(b) * OH + oy) * OW + ox) * F + f] = acc;
        }
  return y;
}

// Keras MaxPooling2D, valid padding.
dvec ref_pool(const dvec& x, int B, const shape& in, const window& g, shape* out) {
  const int OH = (in.h - g.KH) / g.SH + 1, OW = (in.w - g.KW) / g.SW + 1, C = in.c;
  *out = shape{C, OH, OW};
  dvec y(size_t(B) * OH * OW * C);
  for (int b = 0; b < B; ++b)
    for (int oy = 0; oy < OH; ++oy)
      for (int ox = 0; ox < OW; ++ox)
        for (int c = 0; c < C; ++c) {
          double m = -1e300;
          for (int kh = 0; kh < g.KH; ++kh)
            for (int kw = 0; kw < g.KW; ++kw)
              m = std::max(m, x[((size_t(b) * in.h + oy * g.SH + kh) * in.w + ox * g.SW + kw) * C + c]);
          y[((size_t(b) * OH + oy) * OW + ox) * C + c] = m;
        }
  return y;
}

dvec ref_relu(dvec x) {
  for (double& v : x) v = std::max(0.0, v);
  return x;
}

// The dropout mask as documented (kernels/counter_rng.hpp, cpu_kernels.hpp): element e of global sample s
// is kept when uniform01(dropout_stream(seed, layer, epoch), s, e) >= rate.
bool kept(const sample_key& key, uint64_t layer, int64_t sample, size_t e, double rate) {
  return double(uniform01(dropout_stream(key.seed, layer, key.epoch), sample, e)) >= rate;
}

dvec ref_dropout(dvec x, int B, size_t n, double rate, const sample_key& key, uint64_t layer) {
  for (int b = 0; b < B; ++b)
    for (size_t e = 0; e < n; ++e) {
      double& v = x[size_t(b) * n + e];
      v = kept(key, layer, key.first_sample + b, e, rate) ? v / (1.0 - rate) : 0.0;
    }
  return x;
}

// Mean-free softmax cross-entropy summed over the batch.
double ref_xent(const dvec& z, const std::vector<int32_t>& y, int B, int C) {
  double loss = 0;
  for (int i = 0; i < B; ++i) {
    double m = -1e300, s = 0;
    for (int c = 0; c < C; ++c) m = std::max(m, z[size_t(i) * C + c]);
    for (int c = 0; c < C; ++c) s += std::exp(z[size_t(i) * C + c] - m);
    loss += std::log(s) + m - z[size_t(i) * C + y[i]];
  }
  return loss;
}

// A whole model in float64 from its layers' settings (config()), the data in NCHW as data sets give it.
// training: dropout masks from key (as forward_backward); else dropout passes everything through.
double ref_model_loss(const model& m, const dvec& p, const std::vector<float>& x_nchw, const std::vector<int32_t>& y,
                      int B, bool training = false, sample_key key = {}) {
  const shape in = m.input();
  dvec a(x_nchw.size());
  for (int b = 0; b < B; ++b)  // NCHW -> NHWC, written out here
    for (int c = 0; c < in.c; ++c)
      for (int h = 0; h < in.h; ++h)
        for (int w = 0; w < in.w; ++w)
          a[((size_t(b) * in.h + h) * in.w + w) * in.c + c] = x_nchw[((size_t(b) * in.c + c) * in.h + h) * in.w + w];
  for (size_t l = 0; l < m.layers().size(); ++l) {
    const model::entry& e = m.layers()[l];
    const std::string t = e.impl->type();
    const json cfg = e.impl->config();
    auto param = [&](size_t i) {
      const param_entry& pe = m.params()[e.first_param + i];
      return dvec(p.begin() + ptrdiff_t(pe.offset), p.begin() + ptrdiff_t(pe.offset + pe.count));
    };
    shape out;
    if (t == "dense") {
      a = ref_dense(a, param(0), param(1), B, int(e.in.size()), cfg["units"].get<int>());
      if (cfg.value("activation", "linear") == "relu") a = ref_relu(a);
    } else if (t == "conv2d") {
      window g{cfg["kernel"][0].get<int>(), cfg["kernel"][1].get<int>(), cfg["stride"][0].get<int>(),
               cfg["stride"][1].get<int>(), cfg["padding"] == "same"};
      a = ref_conv(a, param(0), param(1), B, e.in, cfg["filters"].get<int>(), g, &out);
      REQUIRE(out == e.out);
      if (cfg.value("activation", "linear") == "relu") a = ref_relu(a);
    } else if (t == "max_pool2d") {
      window g{cfg["size"][0].get<int>(), cfg["size"][1].get<int>(), cfg["stride"][0].get<int>(),
               cfg["stride"][1].get<int>(), false};
      a = ref_pool(a, B, e.in, g, &out);
      REQUIRE(out == e.out);
    } else if (t == "relu") {
      a = ref_relu(a);
    } else if (t == "dropout") {
      if (training) a = ref_dropout(a, B, e.in.size(), cfg["rate"].get<double>(), key, l);
    } else if (t != "flatten") {
      FAIL("no reference for layer type " << t);
    }
  }
  return ref_xent(a, y, B, m.classes());
}

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

TEST_CASE("dropout in training: output is the masked, scaled input; its gradient the same mask and scale", "[layers]") {
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

// ---- b. whole models: double reference and finite differences of the network's own loss ------------------

namespace {

// Checks a network's loss against ref_model_loss and its gradients against (1) central differences of
// the float64 reference and (2) central differences of the network's own loss, on a handful of
// parameters per tensor (the largest gradients, where float noise matters least, and a random one).
void check_model_gradients(const std::string& text, const shape& in, int B, bool dropout_key) {
  INFO("model " << text);
  std::string err;
  auto m = build_model(text, in, &err);
  INFO(err);
  REQUIRE(m);
  auto be = make_cpu_backend();
  network net(*be, m, B, {});
  std::mt19937 rng(21);
  std::vector<float> p = init_params(*m, 5);
  for (float& v : p) v += std::uniform_real_distribution<float>(-0.05f, 0.05f)(rng);  // nonzero biases
  net.set_params(p.data());
  const auto x = randv(size_t(B) * in.size(), rng, 0, 1);
  std::vector<int32_t> y(B);
  for (int i = 0; i < B; ++i) y[i] = int32_t(rng() % m->classes());
  const sample_key key{123, 1, 48};
  // The network's own loss: forward_backward with a fixed dropout key, or evaluate (no dropout).
  auto own_loss = [&] {
    net.set_params(p.data());
    return dropout_key ? net.forward_backward(x.data(), y.data(), B, 1.0f, key).loss_sum
                       : net.evaluate(x.data(), y.data(), B).loss_sum;
  };
  const batch_metrics bm = net.forward_backward(x.data(), y.data(), B, 1.0f, key);
  const std::vector<float> g(net.grads(), net.grads() + net.size());
  dvec pd = to_d(p);
  CHECK(bm.loss_sum == Approx(ref_model_loss(*m, pd, x, y, B, true, key)).epsilon(1e-5));
  if (!dropout_key) CHECK(net.evaluate(x.data(), y.data(), B).loss_sum == Approx(bm.loss_sum).epsilon(1e-6));
  auto ref_loss = [&] { return ref_model_loss(*m, pd, x, y, B, dropout_key, key); };
  double worst_ref = 0, worst_own = 0;
  size_t checked = 0;
  for (const param_entry& e : m->params()) {
    std::vector<size_t> idx(e.count);
    std::iota(idx.begin(), idx.end(), e.offset);
    const size_t top = std::min<size_t>(3, idx.size());
    std::partial_sort(idx.begin(), idx.begin() + ptrdiff_t(top), idx.end(),
                      [&](size_t a, size_t b) { return std::abs(g[a]) > std::abs(g[b]); });
    idx.resize(top);
    idx.push_back(e.offset + rng() % e.count);
    for (size_t i : idx) {
      INFO(e.name << " [" << i - e.offset << "]: gradient " << g[i]);
      const double keep = pd[i];
      const double h = 1e-6;
      pd[i] = keep + h;
      const double up = ref_loss();
      pd[i] = keep - h;
      const double down = ref_loss();
      pd[i] = keep;
      const double fd_ref = (up - down) / (2 * h);
      // The network computes in float: its loss carries rounding noise (~1e-7 relative) that a small
      // step magnifies, while a large step crosses ReLU and max kinks. Measured worst errors: 7e-2 / 2.5e-2
      // / 7e-3 / 2e-2 at steps 3e-3 / 1e-3 / 1e-4 / 3e-5; 1e-4 it is, with a bound of 4x what it gave.
      const float hf = 1e-4f, kf = p[i];
      p[i] = kf + hf;
      const double up_own = own_loss();
      p[i] = kf - hf;
      const double down_own = own_loss();
      p[i] = kf;
      const double fd_own = (up_own - down_own) / (double(kf + hf) - double(kf - hf));
      const double scale = std::max(1e-2, std::abs(double(g[i])));
      worst_ref = std::max(worst_ref, std::abs(g[i] - fd_ref) / scale);
      worst_own = std::max(worst_own, std::abs(g[i] - fd_own) / scale);
      CHECK(std::abs(g[i] - fd_ref) / scale < 1e-5);  // measured: under 1e-6
      CHECK(std::abs(g[i] - fd_own) / scale < 3e-2);
      ++checked;
    }
  }
  net.set_params(p.data());
  WARN(text.substr(0, 40) << ": worst relative gradient error vs float64 differences " << worst_ref
                          << ", vs the network's own float differences " << worst_own << " (" << checked << " parameters)");
}

}  // namespace

TEST_CASE("the cnn's gradient matches finite differences (with a fixed dropout key)", "[layers]") {
  check_model_gradients("cnn", shape{1, 28, 28}, 3, /*dropout_key=*/true);
}

TEST_CASE("a 3-channel conv model with 'same' padding: NCHW data, loss and gradient match", "[layers]") {
  using namespace layers;
  const std::string text = sequential{conv2d(4, 3, 1, "same"), relu(), conv2d(5, 3, 2, "same"), relu(),
                                      max_pool2d(2), flatten(), dense(6), relu(), dense(3)}
                               .text();
  check_model_gradients(text, shape{3, 9, 8}, 4, /*dropout_key=*/false);
}

// ---- c. batch invariance --------------------------------------------------------------------------------

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

// ---- d. dropout masks -----------------------------------------------------------------------------------

TEST_CASE("dropout masks depend only on (seed, layer, epoch, sample); evaluation passes through", "[layers]") {
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

// ---- e. registry and descriptions -------------------------------------------------------------------------

namespace {

std::string build_error(const std::string& text, const shape& in = shape{1, 28, 28},
                        const layer_registry& reg = builtins()) {
  std::string err;
  auto m = model::build(text, reg, in, &err);
  CHECK_FALSE(m);
  CHECK_FALSE(err.empty());
  return err;
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A user layer: y = x * scale, one learnable scale per value, starting at ones. CPU only.
class scale_layer final : public layer {
 public:
  std::string type() const override { return "scale"; }
  bool build(const shape& in, shape* out, std::vector<param_info>* params, std::string*) override {
    *out = in;
    params->push_back({"scale", {in.size()}, param_init::ones, 0, 0});
    return true;
  }
  void forward(const layer_io& io) const override {
    if (!io.be.is_host()) throw std::runtime_error("scale: this layer runs on the CPU only");
    const size_t n = io.in.size();
    for (int b = 0; b < io.batch; ++b)
      for (size_t i = 0; i < n; ++i) io.y[b * n + i] = io.x[b * n + i] * io.params[0][i];
  }
  void backward(const layer_io& io, const float* dy, float* dx) const override {
    if (!io.be.is_host()) throw std::runtime_error("scale: this layer runs on the CPU only");
    const size_t n = io.in.size();
    for (size_t i = 0; i < n; ++i) {
      float s = 0;
      for (int b = 0; b < io.batch; ++b) s += dy[b * n + i] * io.x[b * n + i];
      io.grads[0][i] = s;
    }
    if (dx)
      for (int b = 0; b < io.batch; ++b)
        for (size_t i = 0; i < n; ++i) dx[b * n + i] = dy[b * n + i] * io.params[0][i];
  }
};

layer_registry with_scale() {
  layer_registry reg = layer_registry::with_builtins();
  std::string err;
  const bool added = reg.add("scale", [](const json& s, std::string* error) -> std::unique_ptr<layer> {
    settings_reader r(s);
    if (!r.only({}).ok()) return *error = r.error(), nullptr;
    return std::make_unique<scale_layer>();
  }, &err);
  REQUIRE(added);
  return reg;
}

// n samples of 8 features, two classes: the sign of (features 0..3 summed) - (features 4..7 summed).
std::shared_ptr<const dataset> two_class_set(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> f = randv(n * 8, rng);
  std::vector<int32_t> l(n);
  for (size_t i = 0; i < n; ++i) {
    float s = 0;
    for (int k = 0; k < 8; ++k) s += k < 4 ? f[i * 8 + k] : -f[i * 8 + k];
    l[i] = s > 0;
  }
  auto d = std::make_shared<dataset>();
  std::string err;
  REQUIRE(make_dataset(shape{8, 1, 1}, std::move(f), std::move(l), 2, d.get(), &err));
  return d;
}

}  // namespace

TEST_CASE("the registry refuses unknown types, duplicates and bad names", "[layers]") {
  const std::string e = build_error(R"({"layers": [{"type": "conv3d", "filters": 2}]})");
  CHECK(has(e, "layer 0"));
  CHECK(has(e, "unknown layer type 'conv3d'"));
  CHECK(has(e, "known: conv2d, dense, dropout, flatten, max_pool2d, relu"));
  CHECK(has(build_error(R"({"layers": [{"type": "dense", "units": 4}, {"units": 2}]})"), "layer 1: a layer has no \"type\""));
  CHECK(has(build_error(R"({"layers": [{"type": 5}]})"), "has no \"type\""));
  CHECK(has(build_error(R"({"layers": [7]})"), "layer 0: a layer is a JSON object"));

  layer_registry reg = layer_registry::with_builtins();
  std::string err;
  auto dummy = [](const json&, std::string*) -> std::unique_ptr<layer> { return std::make_unique<scale_layer>(); };
  CHECK_FALSE(reg.add("dense", dummy, &err));
  CHECK(has(err, "'dense' is registered already"));
  for (const char* bad : {"", "Scale", "my-layer", "a b", "0123456789012345678901234567890123"}) {
    INFO(bad);
    CHECK_FALSE(reg.add(bad, dummy, &err));
    CHECK(has(err, "a-z, 0-9 and _"));
  }
  CHECK_FALSE(reg.add("nothing", layer_factory{}, &err));
  CHECK(has(err, "no factory"));
  REQUIRE(reg.add("my_layer_2", dummy, &err));
  CHECK(reg.types().size() == 7);
  // A factory that throws or gives nothing: refused with its reason, nothing escapes.
  REQUIRE(reg.add("thrower", [](const json&, std::string*) -> std::unique_ptr<layer> { throw std::runtime_error("boom"); }, &err));
  REQUIRE(reg.add("silent", [](const json&, std::string*) -> std::unique_ptr<layer> { return nullptr; }, &err));
  CHECK(has(build_error(R"({"layers": [{"type": "thrower"}]})", {8, 1, 1}, reg), "layer 0: thrower: boom"));
  CHECK(has(build_error(R"({"layers": [{"type": "silent"}]})", {8, 1, 1}, reg), "layer 0: silent: could not be created"));
}

TEST_CASE("bad layer settings are refused naming the layer and the problem", "[layers]") {
  struct bad_case {
    const char* layer;
    std::vector<const char*> parts;
  };
  const std::vector<bad_case> cases = {
      {R"({"type": "conv2d", "filters": 0, "kernel": 3})", {"conv2d", "'filters': expected an integer in 1..65536, got 0"}},
      {R"({"type": "conv2d", "filters": -3, "kernel": 3})", {"'filters'", "got -3"}},
      {R"({"type": "conv2d", "filters": 100000, "kernel": 3})", {"'filters'", "got 100000"}},
      {R"({"type": "conv2d", "filters": 1e30, "kernel": 3})", {"'filters'", "expected an integer"}},
      {R"({"type": "conv2d", "filters": 9223372036854775808, "kernel": 3})", {"'filters'", "got 9223372036854775808"}},
      {R"({"type": "conv2d", "filters": -9223372036854775808, "kernel": 3})", {"'filters'"}},
      {R"({"type": "conv2d", "filters": 18446744073709551615, "kernel": 3})", {"'filters'"}},
      {R"({"type": "conv2d", "filters": 4294967297, "kernel": 3})", {"'filters'"}},  // 2^32 + 1: no wrap to 1
      {R"({"type": "conv2d", "filters": "32", "kernel": 3})", {"'filters'", "got \"32\""}},
      {R"({"type": "conv2d", "filters": 32.5, "kernel": 3})", {"'filters'"}},
      {R"({"type": "conv2d", "filters": true, "kernel": 3})", {"'filters'"}},
      {R"({"type": "conv2d", "filters": 4})", {"'kernel' is required"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": [3]})", {"'kernel'", "or a pair of them"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": [3, 3, 3]})", {"'kernel'"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": [3, "3"]})", {"'kernel'"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 0})", {"'kernel'"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 65})", {"'kernel'", "1..64"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 3, "stride": 0})", {"'stride'"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 3, "padding": "full"})", {"'padding': expected \"valid\" or \"same\""}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 3, "padding": 1})", {"'padding'"}},
      {R"({"type": "conv2d", "filter": 4, "kernel": 3})", {"unknown setting 'filter'", "known: filters, kernel, stride, padding"}},
      {R"({"type": "conv2d", "filters": 4, "kernel": 3, "activation": "tanh"})", {"'activation': expected \"linear\" or \"relu\""}},
      {R"({"type": "dense"})", {"dense", "'units' is required"}},
      {R"({"type": "dense", "units": 0})", {"'units'"}},
      {R"({"type": "dense", "units": 1e30})", {"'units'"}},
      {R"({"type": "dense", "units": 9223372036854775807})", {"'units'"}},
      {R"({"type": "dense", "units": [10]})", {"'units'"}},
      {R"({"type": "dense", "units": null})", {"'units'"}},
      {R"({"type": "dense", "units": 10, "use_bias": false})", {"unknown setting 'use_bias'"}},
      {R"({"type": "dense", "units": 10, "activation": "softmax"})", {"'activation'"}},
      {R"({"type": "dense", "units": 10, "activation": null})", {"'activation'"}},
      {R"({"type": "max_pool2d"})", {"max_pool2d", "'size' is required"}},
      {R"({"type": "max_pool2d", "size": -2})", {"'size'"}},
      {R"({"type": "max_pool2d", "size": 2, "stride": 1e30})", {"'stride'"}},
      {R"({"type": "dropout", "rate": 1.0})", {"dropout", "'rate': expected a number in"}},
      {R"({"type": "dropout", "rate": -0.1})", {"'rate'"}},
      {R"({"type": "dropout", "rate": 1e30})", {"'rate'"}},
      {R"({"type": "dropout", "rate": "0.5"})", {"'rate'"}},
      {R"({"type": "dropout"})", {"'rate' is required"}},
      {R"({"type": "relu", "alpha": 0.1})", {"relu", "unknown setting 'alpha' (it takes none)"}},
      {R"({"type": "flatten", "x": 1})", {"flatten", "unknown setting 'x'"}},
  };
  for (const bad_case& c : cases) {
    // The bad layer is the second one: the message names index 1.
    const std::string text = std::string(R"({"layers": [{"type": "relu"}, )") + c.layer + R"(, {"type": "dense", "units": 10}]})";
    INFO(text);
    const std::string e = build_error(text);
    INFO(e);
    CHECK(has(e, "layer 1: "));
    for (const char* part : c.parts) CHECK(has(e, part));
  }
}

TEST_CASE("shapes that do not fit are refused naming the layer", "[layers]") {
  using namespace layers;
  const std::string big_kernel = build_error(sequential{conv2d(4, 5), flatten(), dense(10)}.text(), shape{1, 4, 4});
  CHECK(has(big_kernel, "layer 0 (conv2d_0)"));
  CHECK(has(big_kernel, "a 5x5 kernel does not fit input (1, 4, 4) with 'valid' padding"));
  // 'same' padding fits any input.
  std::string err;
  CHECK(build_model(sequential{conv2d(4, 5, 1, "same"), flatten(), dense(10)}.text(), shape{1, 4, 4}, &err));
  // The cnn on too small an image: its second conv no longer fits.
  const std::string small = build_error("cnn", shape{1, 7, 7});
  CHECK(has(small, "layer 2 (conv2d_1)"));
  CHECK(has(small, "a 3x3 kernel does not fit input (32, 2, 2)"));
  const std::string pool = build_error(sequential{max_pool2d(4), flatten(), dense(10)}.text(), shape{2, 3, 8});
  CHECK(has(pool, "layer 0 (max_pool2d_0)"));
  CHECK(has(pool, "a 4x4 window does not fit input (2, 3, 8)"));
  // Absurd sizes: refused from the description, nothing allocated.
  CHECK(has(build_error(sequential{dense(1 << 24), dense(1 << 24)}.text(), shape{8, 1, 1}), "over 2^30 values"));
  CHECK(has(build_error(sequential{conv2d(65536, 64, 1, "same"), flatten(), dense(10)}.text(), shape{1, 512, 512}),
            "layer 0 (conv2d_0)"));
  // A model input the data does not have.
  CHECK(has(build_error(R"({"input": [3, 8, 8], "layers": [{"type": "dense", "units": 2}]})", shape{1, 28, 28}),
            "model expects input (3, 8, 8) but the data's samples are (1, 28, 28)"));
  CHECK(has(build_error("100-10", shape{1, 28, 28}), "model input width 100 does not match the data's 784 features"));
}

TEST_CASE("malformed descriptions are refused before any layer is built", "[layers]") {
  CHECK(has(build_error(R"({"layers": [{"type": "relu"})"), "not valid JSON"));
  CHECK(has(build_error(R"({"layers": [{"type": "relu"},]})"), "not valid JSON"));
  CHECK(has(build_error("[" + std::string(40, '{')), "nested deeper than 16 levels"));
  CHECK(has(build_error(std::string(17, '[') + std::string(17, ']')), "nested deeper than 16 levels"));
  CHECK(has(build_error(std::string(100000, '[')), "over 64 KiB"));
  CHECK(has(build_error(R"({"layers": []})"), "\"layers\" must be a non-empty array"));
  CHECK(has(build_error("[]"), "non-empty array"));
  CHECK(has(build_error(R"({"layers": {"type": "relu"}})"), "non-empty array"));
  CHECK(has(build_error(R"({"input": [1, 28, 28]})"), "has no \"layers\""));
  CHECK(has(build_error(R"({"layer": [{"type": "relu"}]})"), "unknown key 'layer'"));
  CHECK(has(build_error(R"({"input": [0, 28, 28], "layers": [{"type": "relu"}]})"), "\"input\" must be [C, H, W]"));
  CHECK(has(build_error(R"({"input": "1x28x28", "layers": [{"type": "relu"}]})"), "\"input\" must be"));
  // Nesting inside strings does not count.
  std::string err;
  CHECK(build_model(R"({"layers": [{"type": "dense", "units": 10}], "format": "[[[[[[[[[[[[[[[[[[[[[["})", shape{4, 1, 1}, &err));
  // The loss needs at least two classes.
  const std::string one = build_error(sequential{layers::flatten(), layers::dense(1)}.text());
  CHECK(has(one, "dense_0), the last, gives 1 output(s)"));
  CHECK(has(one, "at least 2 classes"));
  CHECK(has(build_error("784-16-1"), "at least 2 classes"));
  // A layer count beyond reason.
  json many = {{"layers", json::array()}};
  for (int i = 0; i < 1025; ++i) many["layers"].push_back(layers::relu());
  CHECK(has(build_error(many.dump()), "more than 1024 layers"));
  // A description that names no input cannot be built without data.
  CHECK_FALSE(model::build("cnn", builtins(), &err));
  CHECK(has(err, "does not name its input shape"));
}

TEST_CASE("a user layer from a registry builds and trains through train(); without the registry it is unknown", "[layers]") {
  auto reg = std::make_shared<const layer_registry>(with_scale());
  using namespace layers;
  train_config c;
  c.model = sequential{custom("scale"), dense(16), relu(), dense(2)}.text();
  c.layers = reg;
  c.replicas = 2;
  c.global_batch = 16;
  c.epochs = 3;
  c.threads = 2;
  c.opt.lr = 1e-2f;
  c.train = two_class_set(512, 1);
  c.test = two_class_set(200, 2);
  train_result r = train(c);
  INFO(r.error);
  REQUIRE(r.ok);
  CHECK(r.identical);
  std::string err;
  auto m = model::build(c.model, *reg, shape{8, 1, 1}, &err);
  REQUIRE(m);
  REQUIRE(m->params()[0].name == "scale_0/scale");
  REQUIRE(r.weights.size() == m->param_count());
  CHECK(init_params(*m, 1)[0] == 1.0f);  // param_init::ones
  size_t moved = 0;
  for (size_t i = 0; i < 8; ++i) moved += r.weights[i] != 1.0f;
  CHECK(moved == 8);  // the scales learned
  CHECK(r.history.back().val_accuracy > 0.8);
  CHECK(has(r.model, "\"type\":\"scale\""));

  // The built-in registry does not know it.
  c.layers = nullptr;
  train_result unknown = train(c);
  CHECK_FALSE(unknown.ok);
  CHECK(has(unknown.error, "layer 0: unknown layer type 'scale'"));

  // On a device that is not the host, the layer's own refusal ends the job with its reason.
  c.layers = reg;
  c.make_backend = test::sim_factory(std::make_shared<test::sim_devices>());
  c.devices = {"sim:0", "sim:1"};
  train_result on_sim = train(c);
  INFO(on_sim.error);
  CHECK_FALSE(on_sim.ok);
  CHECK(has(on_sim.error, "CPU only"));
}

// ---- f. summary and layout --------------------------------------------------------------------------------

TEST_CASE("the cnn's parameters, shapes and names are Keras's; fingerprints follow the description", "[layers]") {
  std::string err;
  auto m = build_model("cnn", shape{1, 28, 28}, &err);
  REQUIRE(m);
  CHECK(m->param_count() == 34826);  // Keras: 320 + 18,496 + 16,010
  CHECK(m->classes() == 10);
  CHECK(m->label() == "cnn");
  struct want_param {
    const char* name;
    std::vector<size_t> dims;
  };
  const std::vector<want_param> want = {{"conv2d_0/kernel", {3, 3, 1, 32}}, {"conv2d_0/bias", {32}},
                                        {"conv2d_1/kernel", {3, 3, 32, 64}}, {"conv2d_1/bias", {64}},
                                        {"dense_0/kernel", {1600, 10}},       {"dense_0/bias", {10}}};
  REQUIRE(m->params().size() == want.size());
  size_t offset = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const param_entry& p = m->params()[i];
    CHECK(p.name == want[i].name);
    CHECK(p.dims == want[i].dims);
    CHECK(p.offset == offset);
    offset += p.count;
  }
  CHECK(offset == 34826);
  // As Keras writes it: Conv2D(32, 3, activation="relu"), MaxPooling2D(2), Conv2D(64, 3, activation="relu"),
  // MaxPooling2D(2), Flatten(), Dropout(0.5), Dense(10).
  const std::vector<std::pair<std::string, shape>> layers_want = {
      {"conv2d_0", {32, 26, 26}}, {"max_pool2d_0", {32, 13, 13}}, {"conv2d_1", {64, 11, 11}}, {"max_pool2d_1", {64, 5, 5}},
      {"flatten_0", {1600, 1, 1}}, {"dropout_0", {1600, 1, 1}},    {"dense_0", {10, 1, 1}}};
  REQUIRE(m->layers().size() == layers_want.size());
  for (size_t i = 0; i < layers_want.size(); ++i) {
    CHECK(m->layers()[i].name == layers_want[i].first);
    CHECK(m->layers()[i].out == layers_want[i].second);
  }
  const std::string s = m->summary();
  INFO(s);
  CHECK(has(s, "Total params: 34826"));
  for (const char* line : {"conv2d_0", "(32, 26, 26)", "320", "18496", "16010", "(1600)"}) CHECK(has(s, line));

  // The canonical description rebuilds the same model; equal descriptions, equal fingerprints.
  auto again = build_model("cnn", shape{1, 28, 28}, &err);
  auto canonical = model::build(m->description(), builtins(), &err);
  REQUIRE(canonical);
  CHECK(canonical->input() == shape{1, 28, 28});
  CHECK(m->fingerprint() == again->fingerprint());
  CHECK(m->fingerprint() == canonical->fingerprint());
  CHECK(canonical->description() == m->description());
  using namespace layers;
  auto cnn_with = [](int filters, const std::string& padding, double rate, bool fused) {
    sequential s{conv2d(filters, 3, 1, padding, fused ? "relu" : "linear")};
    if (!fused) s.add(relu());
    s.add(max_pool2d(2)).add(conv2d(64, 3, 1, "valid", fused ? "relu" : "linear"));
    if (!fused) s.add(relu());
    return s.add(max_pool2d(2)).add(flatten()).add(dropout(rate)).add(dense(10)).text();
  };
  CHECK(build_model(cnn_with(32, "valid", 0.5, true), shape{1, 28, 28}, &err)->fingerprint() == m->fingerprint());
  // Any change: a dropout rate (same parameters), a filter count, a padding, separate ReLU layers, the input.
  for (const std::string& other : {cnn_with(32, "valid", 0.4, true), cnn_with(16, "valid", 0.5, true),
                                   cnn_with(32, "same", 0.5, true), cnn_with(32, "valid", 0.5, false)}) {
    auto o = build_model(other, shape{1, 28, 28}, &err);
    REQUIRE(o);
    CHECK(o->fingerprint() != m->fingerprint());
  }
  CHECK(build_model("cnn", shape{1, 30, 30}, &err)->fingerprint() != m->fingerprint());

  // The MLP form keeps its old layout: dense_0/kernel (784, 512), dense_0/bias, ...
  auto mlp = build_model("784-512-512-10", shape{1, 28, 28}, &err);
  REQUIRE(mlp);
  CHECK(mlp->label() == "784-512-512-10");
  REQUIRE(mlp->params().size() == 6);
  CHECK(mlp->params()[0].name == "dense_0/kernel");
  CHECK(mlp->params()[0].dims == std::vector<size_t>{784, 512});
  CHECK(mlp->params()[5].name == "dense_2/bias");
}
