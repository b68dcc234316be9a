// Kernels against double-precision finite differences and reference formulas.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <memory>
#include <string>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/backend.hpp"
#include "kernels/counter_rng.hpp"
#include "kernels/cpu_kernels.hpp"
#include "kernels/model.hpp"

using namespace ringmaster;

namespace {

std::vector<float> randv(size_t n, std::mt19937& rng, float lo = -1, float hi = 1) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Relative error with a floor, so values near zero are compared absolutely.
double rel_err(double a, double b) { return std::abs(a - b) / std::max(1e-2, std::max(std::abs(a), std::abs(b))); }

// Reference loss of the whole MLP in double precision: mean over the batch of softmax cross-entropy.
// The model's parameters are (kernel (IN, OUT), bias (OUT)) per dense layer, ReLU after all but the last.
double ref_loss(const model& s, const std::vector<double>& p, const std::vector<float>& x,
                const std::vector<int32_t>& y, int B) {
  std::vector<double> a(x.begin(), x.end());
  const size_t layers = s.params().size() / 2;
  for (size_t l = 0; l < layers; ++l) {
    const param_entry &w = s.params()[2 * l], &b = s.params()[2 * l + 1];
    const int IN = int(w.dims[0]), OUT = int(w.dims[1]);
    std::vector<double> o(size_t(B) * OUT);
    for (int i = 0; i < B; ++i)
      for (int j = 0; j < OUT; ++j) {
        double acc = p[b.offset + j];
        for (int k = 0; k < IN; ++k) acc += a[size_t(i) * IN + k] * p[w.offset + size_t(k) * OUT + j];
        o[size_t(i) * OUT + j] = (l + 1 < layers) ? std::max(0.0, acc) : acc;
      }
    a = o;
  }
  const int C = s.classes();
  double loss = 0;
  for (int i = 0; i < B; ++i) {
    double m = -1e300, sum = 0;
    for (int c = 0; c < C; ++c) m = std::max(m, a[size_t(i) * C + c]);
    for (int c = 0; c < C; ++c) sum += std::exp(a[size_t(i) * C + c] - m);
    loss += std::log(sum) + m - a[size_t(i) * C + y[i]];
  }
  return loss / B;
}

}  // namespace

TEST_CASE("dense forward and backward match finite differences", "[kernels]") {
  std::mt19937 rng(1);
  const int B = 3, IN = 5, OUT = 4;
  auto in = randv(size_t(B) * IN, rng), w = randv(size_t(IN) * OUT, rng), b = randv(OUT, rng);
  auto R = randv(size_t(B) * OUT, rng);  // L = sum(out .* R), so dL/dout = R
  auto L = [&](const std::vector<double>& in_d, const std::vector<double>& w_d, const std::vector<double>& b_d) {
    double s = 0;
    for (int i = 0; i < B; ++i)
      for (int j = 0; j < OUT; ++j) {
        double o = b_d[j];
        for (int k = 0; k < IN; ++k) o += in_d[i * IN + k] * w_d[k * OUT + j];
        s += o * R[i * OUT + j];
      }
    return s;
  };
  std::vector<float> out(size_t(B) * OUT), din(size_t(B) * IN), dw(size_t(IN) * OUT, 99.f), db(OUT, 99.f);
  cpu::dense_forward(out.data(), in.data(), w.data(), b.data(), B, IN, OUT);
  for (int i = 0; i < B; ++i)
    for (int j = 0; j < OUT; ++j) {
      double o = b[j];
      for (int k = 0; k < IN; ++k) o += double(in[i * IN + k]) * w[k * OUT + j];
      CHECK(out[i * OUT + j] == Approx(o).epsilon(1e-5));
    }
  cpu::dense_backward(din.data(), dw.data(), db.data(), R.data(), in.data(), w.data(), B, IN, OUT);
  std::vector<double> ind(in.begin(), in.end()), wd(w.begin(), w.end()), bd(b.begin(), b.end());
  const double h = 1e-6;
  auto check = [&](std::vector<double>& v, const std::vector<float>& grad) {
    for (size_t i = 0; i < v.size(); ++i) {
      const double keep = v[i];
      v[i] = keep + h;
      const double up = L(ind, wd, bd);
      v[i] = keep - h;
      const double down = L(ind, wd, bd);
      v[i] = keep;
      CHECK(rel_err(grad[i], (up - down) / (2 * h)) < 1e-4);
    }
  };
  check(wd, dw);
  check(bd, db);
  check(ind, din);
}

TEST_CASE("fused dense + relu equals dense then relu", "[kernels]") {
  std::mt19937 rng(2);
  const int B = 7, IN = 9, OUT = 13;
  auto in = randv(size_t(B) * IN, rng), w = randv(size_t(IN) * OUT, rng), b = randv(OUT, rng);
  std::vector<float> a(size_t(B) * OUT), c(size_t(B) * OUT);
  cpu::dense_forward(a.data(), in.data(), w.data(), b.data(), B, IN, OUT);
  cpu::relu_forward(a.data(), a.data(), a.size());
  cpu::dense_relu_forward(c.data(), in.data(), w.data(), b.data(), B, IN, OUT);
  REQUIRE(a == c);
  size_t zeros = 0;
  for (float v : c) zeros += v == 0.0f;
  CHECK(zeros > 0);  // the relu did something
  std::vector<float> dout = randv(a.size(), rng), din(a.size());
  cpu::relu_backward(din.data(), dout.data(), c.data(), c.size());
  for (size_t i = 0; i < c.size(); ++i) CHECK(din[i] == (c[i] > 0 ? dout[i] : 0.0f));
}

TEST_CASE("relu and max pooling pass a NaN on, fused or not, so that it reaches the loss", "[kernels]") {
  // A NaN turned into 0 (or passed over by a maximum) trains on to the end on garbage: the loss stays
  // finite, and the NaN weights are found only as the job ends (a tester's run).
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x = {nan, -1.0f, -0.0f, 2.0f}, y(4);
  cpu::relu_forward(y.data(), x.data(), x.size());
  CHECK(std::isnan(y[0]));
  CHECK((y[1] == 0.0f && y[3] == 2.0f));
  CHECK_FALSE(std::signbit(y[2]));  // -0 becomes +0
  const int IN = 2, OUT = 3;
  std::vector<float> in = {nan, 1.0f}, w = {1, -1, 0, 1, 1, 1}, b = {0, 0, -5}, out(OUT);
  cpu::dense_relu_forward(out.data(), in.data(), w.data(), b.data(), 1, IN, OUT);
  for (float v : out) CHECK(std::isnan(v));
  // Max pooling a 1x3 row (C = 1) in one window: NaN wherever it is.
  for (int at = 0; at < 3; ++at) {
    std::vector<float> row = {1.0f, 2.0f, 3.0f};
    row[size_t(at)] = nan;
    conv_geometry g;
    g.H = 1, g.W = 3, g.C = 1, g.KH = 1, g.KW = 3, g.SH = 1, g.SW = 3, g.OH = 1, g.OW = 1;
    float o = 0;
    int32_t arg = -1;
    cpu::maxpool_forward(&o, &arg, row.data(), g, 1);
    INFO("NaN at " << at);
    CHECK(std::isnan(o));
    CHECK(arg == at);
  }
}

TEST_CASE("softmax cross-entropy: loss, gradient, accuracy, stability", "[kernels]") {
  std::mt19937 rng(3);
  const int B = 4, C = 5;
  auto z = randv(size_t(B) * C, rng, -3, 3);
  std::vector<int32_t> y = {0, 3, 4, 1};
  const float scale = 1.0f / 8;
  std::vector<float> dz(z.size());
  double loss = 0;
  int64_t correct = 0;
  cpu::softmax_xent(dz.data(), &loss, &correct, z.data(), y.data(), B, C, scale);
  auto L = [&](const std::vector<double>& zd) {
    double s = 0;
    for (int i = 0; i < B; ++i) {
      double sum = 0;
      for (int c = 0; c < C; ++c) sum += std::exp(zd[i * C + c]);
      s += std::log(sum) - zd[i * C + y[i]];
    }
    return s;
  };
  std::vector<double> zd(z.begin(), z.end());
  CHECK(loss == Approx(L(zd)).epsilon(1e-6));
  int64_t want_correct = 0;
  for (int i = 0; i < B; ++i)
    want_correct += std::max_element(z.begin() + i * C, z.begin() + (i + 1) * C) - (z.begin() + i * C) == y[i];
  CHECK(correct == want_correct);
  const double h = 1e-6;
  for (size_t i = 0; i < zd.size(); ++i) {
    const double keep = zd[i];
    zd[i] = keep + h;
    const double up = L(zd);
    zd[i] = keep - h;
    const double down = L(zd);
    zd[i] = keep;
    CHECK(rel_err(dz[i], scale * (up - down) / (2 * h)) < 1e-4);
  }
  // Huge logits: no overflow, finite loss.
  std::vector<float> big = {1000.f, -1000.f, 999.f, 0.f, 0.f};
  int32_t label = 2;
  double l2 = 0;
  int64_t c2 = 0;
  std::vector<float> d2(5);
  cpu::softmax_xent(d2.data(), &l2, &c2, big.data(), &label, 1, 5, 1.0f);
  CHECK(std::isfinite(l2));
  CHECK(l2 == Approx(std::log(1 + std::exp(1.0))).epsilon(1e-5));
  for (float v : d2) CHECK(std::isfinite(v));
}

TEST_CASE("whole MLP gradient matches finite differences of a double reference", "[kernels]") {
  std::string err;
  auto sp = build_model("6-5-4-3", shape{6, 1, 1}, &err);
  REQUIRE(sp);
  const model& s = *sp;
  REQUIRE(s.params().size() == 6);
  std::mt19937 rng(4);
  const int B = 4;
  auto x = randv(size_t(B) * 6, rng);
  std::vector<int32_t> y = {0, 2, 1, 2};
  auto be = make_cpu_backend();
  network m(*be, sp, B, {});
  std::vector<float> p = init_params(s, 7);
  for (auto& v : p) v += 0.05f;  // nonzero biases
  m.set_params(p.data());
  batch_metrics bm = m.forward_backward(x.data(), y.data(), B, 1.0f / B, sample_key{});
  std::vector<double> pd(p.begin(), p.end());
  CHECK(bm.loss_sum / B == Approx(ref_loss(s, pd, x, y, B)).epsilon(1e-5));
  const double h = 1e-6;
  size_t checked = 0;
  for (size_t i = 0; i < pd.size(); ++i) {
    const double keep = pd[i];
    pd[i] = keep + h;
    const double up = ref_loss(s, pd, x, y, B);
    pd[i] = keep - h;
    const double down = ref_loss(s, pd, x, y, B);
    pd[i] = keep;
    CHECK(rel_err(m.grads()[i], (up - down) / (2 * h)) < 1e-3);
    ++checked;
  }
  CHECK(checked == s.param_count());
}

TEST_CASE("Adam and SGD follow the Keras update rules", "[kernels]") {
  std::mt19937 rng(5);
  const size_t n = 37;
  auto w = randv(n, rng), g1 = randv(n, rng), g2 = randv(n, rng);
  std::vector<double> wd(w.begin(), w.end()), md(n, 0), vd(n, 0);
  std::vector<float> m(n, 0), v(n, 0);
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-7;
  int t = 0;
  for (auto* g : {&g1, &g2, &g1}) {
    ++t;
    cpu::adam_update(w.data(), m.data(), v.data(), g->data(), n, float(lr), float(b1), float(b2), float(eps), t);
    const double alpha = lr * std::sqrt(1 - std::pow(b2, t)) / (1 - std::pow(b1, t));
    for (size_t i = 0; i < n; ++i) {
      md[i] += ((*g)[i] - md[i]) * (1 - b1);
      vd[i] += (double((*g)[i]) * (*g)[i] - vd[i]) * (1 - b2);
      wd[i] -= alpha * md[i] / (std::sqrt(vd[i]) + eps);
    }
  }
  for (size_t i = 0; i < n; ++i) CHECK(w[i] == Approx(wd[i]).epsilon(1e-5));
  // First Adam step moves every weight by about lr against its gradient's sign.
  auto w0 = randv(n, rng), w1 = w0;
  std::vector<float> m1(n, 0), v1(n, 0);
  cpu::adam_update(w1.data(), m1.data(), v1.data(), g1.data(), n, 1e-3f, 0.9f, 0.999f, 1e-7f, 1);
  for (size_t i = 0; i < n; ++i) CHECK(w0[i] - w1[i] == Approx(g1[i] > 0 ? 1e-3 : -1e-3).epsilon(1e-3));

  auto ws = randv(n, rng);
  std::vector<double> wsd(ws.begin(), ws.end()), veld(n, 0);
  std::vector<float> vel(n, 0);
  for (auto* g : {&g1, &g2}) {
    cpu::sgd_update(ws.data(), vel.data(), g->data(), n, 0.01f, 0.9f);
    for (size_t i = 0; i < n; ++i) {
      veld[i] = 0.9 * veld[i] - 0.01 * (*g)[i];
      wsd[i] += veld[i];
    }
  }
  for (size_t i = 0; i < n; ++i) CHECK(ws[i] == Approx(wsd[i]).epsilon(1e-5));
}

TEST_CASE("a network's update applied in pieces, as gradient buckets come in, is the whole update bit for bit", "[kernels]") {
  auto m = build_model("784-33-10", shape{784, 1, 1}, nullptr);  // odd sizes: pieces start unaligned
  REQUIRE(m);
  std::mt19937 rng(9);
  const size_t n = m->param_count();
  for (auto kind : {optimizer_config::adam, optimizer_config::sgd}) {
    INFO((kind == optimizer_config::adam ? "adam" : "sgd"));
    optimizer_config opt;
    opt.kind = kind;
    auto be = make_cpu_backend();
    network whole(*be, m, 4, opt), parts(*be, m, 4, opt);
    const auto p0 = init_params(*m, 3);
    whole.set_params(p0.data());
    parts.set_params(p0.data());
    for (int step = 0; step < 3; ++step) {
      const auto g = randv(n, rng);
      whole.apply(g.data());
      // Last bucket first, as the ring ends them; an empty and an out-of-range piece change nothing.
      const size_t cuts[] = {n, n - 7, 26177, 1001, 0};
      for (size_t i = 0; i + 1 < std::size(cuts); ++i) parts.apply_part(g.data(), cuts[i + 1], cuts[i]);
      parts.apply_part(g.data(), 5, 5);
      parts.apply_part(g.data(), n - 1, n + 1);
      CHECK(parts.steps() == step);  // not counted until end_step()
      parts.end_step();
      CHECK(parts.steps() == whole.steps());
    }
    network_state a, b;
    whole.save_state(&a);
    parts.save_state(&b);
    CHECK(a.params != p0);
    CHECK(a.params == b.params);
    CHECK(a.m1 == b.m1);
    CHECK(a.m2 == b.m2);
  }
}

TEST_CASE("model specs parse and Glorot init is bounded and deterministic", "[kernels]") {
  std::string err;
  auto big = build_model("784-512-512-10", shape{784, 1, 1}, &err);
  REQUIRE(big);
  CHECK(big->param_count() == size_t(784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10));
  CHECK(big->label() == "784-512-512-10");
  for (const char* bad : {"", "784", "784--10", "784-x-10", "784-0-10", "784-10-1", "-784-10"}) {
    INFO(bad);
    CHECK_FALSE(build_model(bad, shape{784, 1, 1}, &err));
    CHECK(err.find("model spec") != std::string::npos);
  }
  CHECK_FALSE(build_model("cnnn", shape{784, 1, 1}, &err));  // a word, not widths: what a model may be
  CHECK(err == "bad model spec 'cnnn': a model is widths (784-512-512-10), cnn, or a JSON list of layers");
  auto sp = build_model("100-50-10", shape{100, 1, 1}, &err);
  REQUIRE(sp);
  const model& s = *sp;
  auto a = init_params(s, 1), b = init_params(s, 1), c = init_params(s, 2);
  CHECK(a == b);
  CHECK(a != c);
  const double limit0 = std::sqrt(6.0 / 150);
  double sum = 0, sq = 0;
  for (size_t i = 0; i < 100 * 50; ++i) {
    CHECK(std::abs(a[i]) <= limit0);
    sum += a[i];
    sq += a[i] * a[i];
  }
  CHECK(std::abs(sum / 5000) < 0.01);
  CHECK(sq / 5000 == Approx(limit0 * limit0 / 3).epsilon(0.05));  // variance of U(-l, l)
  REQUIRE(s.params()[1].name == "dense_0/bias");
  for (int j = 0; j < 50; ++j) CHECK(a[s.params()[1].offset + j] == 0.0f);
}

namespace {

// The MLP's weights as the MLP-only code drew them: one mt19937_64 stream, each layer's kernel (IN, OUT)
// row-major from 24 random bits scaled to the Glorot limit, then the layer's zero bias (no draws).
std::vector<float> old_mlp_init(const std::vector<int>& dims, uint64_t seed) {
  std::vector<float> p;
  std::mt19937_64 rng(seed);
  for (size_t l = 0; l + 1 < dims.size(); ++l) {
    const double limit = std::sqrt(6.0 / double(dims[l] + dims[l + 1]));
    for (size_t i = 0; i < size_t(dims[l]) * dims[l + 1]; ++i) {
      const double u = double(rng() >> 40) * (1.0 / 16777216.0);
      p.push_back(float((2.0 * u - 1.0) * limit));
    }
    p.insert(p.end(), size_t(dims[l + 1]), 0.0f);
  }
  return p;
}

}  // namespace

TEST_CASE("MLP descriptions keep the old layout and initial weights bit for bit", "[kernels]") {
  std::string err;
  for (const auto& dims : {std::vector<int>{784, 512, 512, 10}, std::vector<int>{784, 64, 32, 10}, std::vector<int>{6, 5, 4, 3}}) {
    std::string text;
    for (int d : dims) text += (text.empty() ? "" : "-") + std::to_string(d);
    INFO(text);
    auto m = build_model(text, shape{dims[0], 1, 1}, &err);
    REQUIRE(m);
    REQUIRE(m->params().size() == 2 * (dims.size() - 1));
    size_t offset = 0;
    for (size_t l = 0; l + 1 < dims.size(); ++l) {
      const param_entry &w = m->params()[2 * l], &b = m->params()[2 * l + 1];
      CHECK(w.name == "dense_" + std::to_string(l) + "/kernel");
      CHECK(w.dims == std::vector<size_t>{size_t(dims[l]), size_t(dims[l + 1])});
      CHECK(w.offset == offset);
      CHECK(b.name == "dense_" + std::to_string(l) + "/bias");
      CHECK(b.offset == offset + w.count);
      offset += w.count + b.count;
    }
    for (uint64_t seed : {1, 42}) CHECK(init_params(*m, seed) == old_mlp_init(dims, seed));
  }
  // 28x28 images of one channel are the same 784 features.
  auto img = build_model("784-64-32-10", shape{1, 28, 28}, &err);
  REQUIRE(img);
  CHECK(init_params(*img, 42) == old_mlp_init({784, 64, 32, 10}, 42));
}

TEST_CASE("a backend's loss and hits accumulate until taken", "[kernels]") {
  auto be = make_cpu_backend();
  const float logits[4] = {0.0f, 1.0f, 2.0f, 0.0f};
  const int32_t labels[2] = {1, 1};
  float dl[4];
  be->softmax_xent(dl, logits, labels, 2, 2, 0.5f);
  be->softmax_xent(nullptr, logits, labels, 2, 2, 0.0f);
  double loss = 10.0;
  int64_t correct = 5;
  be->take_metrics(&loss, &correct);
  const double l1 = std::log(1 + std::exp(-1.0)), l2 = std::log(1 + std::exp(2.0));
  CHECK(loss == Approx(10.0 + 2 * (l1 + l2)).epsilon(1e-12));
  CHECK(correct == 7);  // row 0's argmax is its label, row 1's is not; twice
  be->take_metrics(&loss, &correct);  // zeroed by the first take
  CHECK(correct == 7);
  CHECK(loss == Approx(10.0 + 2 * (l1 + l2)).epsilon(1e-12));
}

TEST_CASE("im2col gathers patches with zero padding, col2im is its adjoint, nchw_to_nhwc transposes", "[kernels]") {
  std::mt19937 rng(6);
  conv_geometry g;
  g.H = 5, g.W = 6, g.C = 3, g.KH = 2, g.KW = 3, g.SH = 2, g.SW = 1, g.PH = 1, g.PW = 1, g.OH = 3, g.OW = 6;
  const int B = 2;
  const size_t in_n = size_t(B) * g.H * g.W * g.C, col_n = size_t(B) * g.OH * g.OW * g.patch();
  auto x = randv(in_n, rng), c = randv(col_n, rng);
  std::vector<float> col(col_n, 99.f), dx(in_n, 99.f);
  cpu::im2col(col.data(), x.data(), g, B);
  size_t wrong = 0;
  for (int b = 0; b < B; ++b)
    for (int oy = 0; oy < g.OH; ++oy)
      for (int ox = 0; ox < g.OW; ++ox)
        for (int kh = 0; kh < g.KH; ++kh)
          for (int kw = 0; kw < g.KW; ++kw)
            for (int ch = 0; ch < g.C; ++ch) {
              const int iy = oy * g.SH - g.PH + kh, ix = ox * g.SW - g.PW + kw;
              const bool in = iy >= 0 && iy < g.H && ix >= 0 && ix < g.W;
              const float want = in ? x[((size_t(b) * g.H + iy) * g.W + ix) * g.C + ch] : 0.0f;
              wrong += col[((size_t(b) * g.OH + oy) * g.OW + ox) * g.patch() + (size_t(kh) * g.KW + kw) * g.C + ch] != want;
            }
  CHECK(wrong == 0);
  // <im2col(x), c> == <x, col2im(c)>
  cpu::col2im(dx.data(), c.data(), g, B);
  double lhs = 0, rhs = 0;
  for (size_t i = 0; i < col_n; ++i) lhs += double(col[i]) * c[i];
  for (size_t i = 0; i < in_n; ++i) rhs += double(x[i]) * dx[i];
  CHECK(lhs == Approx(rhs).epsilon(1e-5));

  const int C = 3, H = 2, W = 4;
  std::vector<float> nchw(size_t(B) * C * H * W), nhwc(nchw.size());
  for (size_t i = 0; i < nchw.size(); ++i) nchw[i] = float(i);
  cpu::nchw_to_nhwc(nhwc.data(), nchw.data(), B, C, H, W);
  wrong = 0;
  for (int b = 0; b < B; ++b)
    for (int ch = 0; ch < C; ++ch)
      for (int y = 0; y < H; ++y)
        for (int xx = 0; xx < W; ++xx)
          wrong += nhwc[((size_t(b) * H + y) * W + xx) * C + ch] != nchw[((size_t(b) * C + ch) * H + y) * W + xx];
  CHECK(wrong == 0);
}

TEST_CASE("max pooling: the first of equal maxima wins, overlapping windows add their gradients", "[kernels]") {
  conv_geometry g;
  g.H = 3, g.W = 3, g.C = 1, g.KH = 2, g.KW = 2, g.SH = 1, g.SW = 1, g.OH = 2, g.OW = 2;
  const std::vector<float> x = {1, 5, 5,   //
                                5, 2, 0,   //
                                0, 0, -1};
  std::vector<float> out(4);
  std::vector<int32_t> arg(4);
  cpu::maxpool_forward(out.data(), arg.data(), x.data(), g, 1);
  CHECK(out == std::vector<float>{5, 5, 5, 2});
  CHECK(arg == std::vector<int32_t>{1, 1, 3, 4});  // window (0,0): 5 at index 1 comes before 5 at index 3
  std::vector<float> din(9, 99.f);
  const std::vector<float> dout = {1, 2, 4, 8};
  cpu::maxpool_backward(din.data(), dout.data(), arg.data(), g, 1);
  CHECK(din == std::vector<float>{0, 3, 0, 4, 8, 0, 0, 0, 0});
}

TEST_CASE("dropout keeps by its key, scales the kept, and may work in place", "[kernels]") {
  std::mt19937 rng(7);
  const int B = 3;
  const size_t n = 500;
  auto x = randv(size_t(B) * n, rng);
  std::vector<float> out(x.size()), inplace = x;
  cpu::dropout(out.data(), x.data(), B, n, 0.3f, 77, 10);
  cpu::dropout(inplace.data(), inplace.data(), B, n, 0.3f, 77, 10);
  CHECK(out == inplace);
  size_t wrong = 0;
  for (int b = 0; b < B; ++b)
    for (size_t e = 0; e < n; ++e) {
      const bool keep = uniform01(77, 10 + b, e) >= 0.3f;
      wrong += out[b * n + e] != (keep ? x[b * n + e] * (1.0f / 0.7f) : 0.0f);
    }
  CHECK(wrong == 0);
}

namespace {
// What this process writes to stderr (file descriptor 2) while f runs.
template <class F>
std::string stderr_of(F&& f) {
  std::fflush(stderr);
  FILE* tmp = std::tmpfile();
  const int saved = dup(2);
  dup2(fileno(tmp), 2);
  f();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  std::rewind(tmp);
  std::string text;
  char buf[512];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, tmp)) > 0;) text.append(buf, n);
  std::fclose(tmp);
  return text;
}
}  // namespace

TEST_CASE("a device_buffer that outlives its backend leaks with one line on stderr instead of crashing", "[kernels]") {
  auto be = make_cpu_backend();
  const std::weak_ptr<const void> life = be->lifetime();
  CHECK_FALSE(life.expired());
  device_buffer<float> kept(*be, 10);
  device_buffer<int32_t> from(*be, 3), to;
  to = std::move(from);  // the backend's lifetime travels with the memory
  // Destroyed in time: released, silently.
  CHECK(stderr_of([&] { device_buffer<float> in_time(*be, 5); }).empty());
  be.reset();
  CHECK(life.expired());
  // Destroyed after its backend: no call into the dead backend (ASan or a crash would tell), one line each.
  const std::string said = stderr_of([&] {
    { device_buffer<float> gone = std::move(kept); }
    { device_buffer<int32_t> gone = std::move(to); }
    { device_buffer<float> empty; }  // owns nothing: nothing to say
  });
  CHECK(said ==
        "ringmaster: a device_buffer of 40 bytes outlived its backend cpu; its memory is leaked\n"
        "ringmaster: a device_buffer of 12 bytes outlived its backend cpu; its memory is leaked\n");
}
