// Kernels against double-precision finite differences and reference formulas.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/backend.hpp"
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
double ref_loss(const model_spec& s, const std::vector<double>& p, const std::vector<float>& x,
                const std::vector<int32_t>& y, int B) {
  std::vector<double> a(x.begin(), x.end());
  for (size_t l = 0; l < s.layers(); ++l) {
    const int IN = s.dims[l], OUT = s.dims[l + 1];
    std::vector<double> o(size_t(B) * OUT);
    for (int i = 0; i < B; ++i)
      for (int j = 0; j < OUT; ++j) {
        double acc = p[s.bias_offset(l) + j];
        for (int k = 0; k < IN; ++k) acc += a[size_t(i) * IN + k] * p[s.weight_offset(l) + size_t(k) * OUT + j];
        o[size_t(i) * OUT + j] = (l + 1 < s.layers()) ? std::max(0.0, acc) : acc;
      }
    a = o;
  }
  const int C = s.dims.back();
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
  model_spec s;
  std::string err;
  REQUIRE(parse_model_spec("6-5-4-3", &s, &err));
  std::mt19937 rng(4);
  const int B = 4;
  auto x = randv(size_t(B) * 6, rng);
  std::vector<int32_t> y = {0, 2, 1, 2};
  auto be = make_cpu_backend();
  mlp m(*be, s, B, {});
  std::vector<float> p = init_params(s, 7);
  for (auto& v : p) v += 0.05f;  // nonzero biases
  m.set_params(p.data());
  batch_metrics bm = m.forward_backward(x.data(), y.data(), B, 1.0f / B);
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

TEST_CASE("model specs parse and Glorot init is bounded and deterministic", "[kernels]") {
  model_spec s;
  std::string err;
  REQUIRE(parse_model_spec("784-512-512-10", &s, &err));
  CHECK(s.param_count() == size_t(784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10));
  CHECK(s.str() == "784-512-512-10");
  for (const char* bad : {"", "784", "784--10", "784-x-10", "784-0-10", "784-10-1", "-784-10"}) {
    INFO(bad);
    CHECK_FALSE(parse_model_spec(bad, &s, &err));
    CHECK(err.find("model spec") != std::string::npos);
  }
  REQUIRE(parse_model_spec("100-50-10", &s, &err));
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
  for (int j = 0; j < 50; ++j) CHECK(a[s.bias_offset(0) + j] == 0.0f);
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
