// The CUDA kernels and backend against their CPU twins (ggml's rule: every kernel on every backend checked
// against the CPU result with a tolerance, or exactly where the CPU result is exact), and GPU training
// against CPU training from the same parameters.
//
// Its own executable with its own main: without a GPU it prints "SKIPPED: ..." and exits 77, which ctest
// reports as skipped (SKIP_RETURN_CODE), never as passed.
//
//   ./build/tests/ringmaster_cuda_tests            # all GPU tests
//   ./build/tests/ringmaster_cuda_tests "[train]"  # only the training comparisons
#define CATCH_CONFIG_RUNNER
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <vector>

#include "actors/local_ring.hpp"
#include "actors/training.hpp"
#include "kernels/backend.hpp"
#include "kernels/counter_rng.hpp"
#include "kernels/cpu_kernels.hpp"
#include "kernels/cuda_kernels.hpp"
#include "kernels/layers.hpp"
#include "kernels/model.hpp"

using namespace ringmaster;

namespace {

// A stream and a cuBLAS handle on GPU 0 for calling ringmaster::cuda directly. The stream is a blocking
// one, so the plain cudaMemset / cudaMemcpy below (legacy default stream) are ordered with the kernels.
// With scratch (as the backend's context), or without (the kernels' fallback paths).
struct gpu {
  cuda::cuda_context ctx;
  explicit gpu(bool with_scratch = true) {
    RM_CUDA_CHECK(cudaSetDevice(0));
    RM_CUDA_CHECK(cudaStreamCreate(&ctx.stream));
    RM_CUBLAS_CHECK(cublasCreate(&ctx.blas));
    RM_CUBLAS_CHECK(cublasSetStream(ctx.blas, ctx.stream));
    RM_CUDA_CHECK(cudaDeviceGetAttribute(&ctx.sm_count, cudaDevAttrMultiProcessorCount, 0));
    if (with_scratch) {
      RM_CUDA_CHECK(cudaMalloc(&ctx.scratch, cuda::default_scratch_floats * sizeof(float)));
      ctx.scratch_floats = cuda::default_scratch_floats;
    }
  }
  ~gpu() {
    cudaDeviceSynchronize();
    if (ctx.scratch) cudaFree(ctx.scratch);
    cublasDestroy(ctx.blas);
    cudaStreamDestroy(ctx.stream);
  }
};

// A device array. New arrays are POISONED (every byte 0xFF: a NaN in every float) so that an element a
// kernel forgets to write fails the comparison instead of passing by luck.
template <class T>
struct dev {
  T* p = nullptr;
  size_t n = 0;
  explicit dev(size_t count) : n(count) {
    RM_CUDA_CHECK(cudaMalloc(&p, (n ? n : 1) * sizeof(T)));
    RM_CUDA_CHECK(cudaMemset(p, 0xFF, n * sizeof(T)));
  }
  explicit dev(const std::vector<T>& h) : dev(h.size()) {
    RM_CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~dev() { cudaFree(p); }
  dev(const dev&) = delete;
  dev& operator=(const dev&) = delete;
  std::vector<T> host() const {
    RM_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> h(n);
    RM_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

std::vector<float> randv(size_t n, std::mt19937& rng, float lo = -1, float hi = 1) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Elementwise |got - want| / max(|got|, |want|, floor) with floor = 0.1 * rms(want). Float sums round in
// proportion to the size of their terms, not of their result, so an entry far below the array's typical
// size is compared against a tenth of that size. (Measured on the CPU: two float GEMMs with K = 512..1024
// summed in different orders differ by up to ~2e-5 on this scale, and by ~2e-4 with a 0.01 * rms floor.)
// Non-finite results (the poison) always count as bad.
struct comparison {
  double worst = 0;
  size_t bad = 0, first_bad = 0;
};
comparison compare(const std::vector<float>& got, const std::vector<float>& want, double tol = 1e-4) {
  comparison c;
  REQUIRE(got.size() == want.size());
  if (want.empty()) return c;
  double sq = 0;
  for (float w : want) sq += double(w) * w;
  const double floor = std::max(0.1 * std::sqrt(sq / double(want.size() ? want.size() : 1)), 1e-30);
  for (size_t i = 0; i < got.size(); ++i) {
    const double a = got[i], b = want[i];
    const double e = std::abs(a - b) / std::max({std::abs(a), std::abs(b), floor});
    if (!(e <= tol)) {
      if (!c.bad) c.first_bad = i;
      ++c.bad;
    }
    if (std::isfinite(e)) c.worst = std::max(c.worst, e);
  }
  return c;
}

// max |got - want| / max |want| over a whole tensor: how far apart two computations of it are relative to
// its scale (infinite when got holds a non-finite value). Rounding differences of long sums are
// proportional to the sizes of their terms, not of their result, so this is the measure for results of
// many summed terms (a gradient) where an elementwise one would rate near-cancelled entries.
double normwise(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  double d = 0, m = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) && std::isfinite(want[i])) return INFINITY;
    d = std::max(d, std::abs(double(got[i]) - double(want[i])));
    m = std::max(m, std::abs(double(want[i])));
  }
  return m > 0 ? d / m : (d > 0 ? INFINITY : 0.0);
}

#define CHECK_CLOSE(got, want) CHECK_CLOSE_TOL(got, want, 1e-4)
#define CHECK_CLOSE_TOL(got, want, tol)                                                              \
  do {                                                                                               \
    const comparison cmp_ = compare((got), (want), (tol));                                           \
    INFO(#got << ": worst relative error " << cmp_.worst << ", " << cmp_.bad << " bad of "          \
              << (want).size() << " (first at " << cmp_.first_bad << ": got "                        \
              << (cmp_.bad ? (got)[cmp_.first_bad] : 0.0f) << ", want "                              \
              << (cmp_.bad ? (want)[cmp_.first_bad] : 0.0f) << ")");                                 \
    CHECK(cmp_.bad == 0);                                                                            \
  } while (0)

struct dense_shape {
  int B, IN, OUT;
};
// Odd sizes, B = 1, OUT not a multiple of 4, and the MNIST MLP's own layers.
const dense_shape dense_shapes[] = {{1, 1, 1},     {1, 784, 512},   {7, 13, 5},     {3, 5, 4},
                                    {33, 100, 10}, {128, 784, 512}, {64, 3, 1},     {256, 257, 255},
                                    {1024, 512, 10}, {1000, 64, 33}};

}  // namespace

TEST_CASE("dense forward, with and without ReLU, matches the CPU", "[kernels]") {
  gpu g;
  std::mt19937 rng(1);
  for (const dense_shape& s : dense_shapes) {
    for (bool relu : {false, true}) {
      INFO("B " << s.B << " IN " << s.IN << " OUT " << s.OUT << (relu ? " relu" : ""));
      auto in = randv(size_t(s.B) * s.IN, rng), w = randv(size_t(s.IN) * s.OUT, rng), b = randv(s.OUT, rng);
      std::vector<float> want(size_t(s.B) * s.OUT);
      if (relu) cpu::dense_relu_forward(want.data(), in.data(), w.data(), b.data(), s.B, s.IN, s.OUT);
      else cpu::dense_forward(want.data(), in.data(), w.data(), b.data(), s.B, s.IN, s.OUT);
      dev<float> d_in(in), d_w(w), d_b(b), d_out(want.size());
      if (relu) cuda::dense_relu_forward(g.ctx, d_out.p, d_in.p, d_w.p, d_b.p, s.B, s.IN, s.OUT);
      else cuda::dense_forward(g.ctx, d_out.p, d_in.p, d_w.p, d_b.p, s.B, s.IN, s.OUT);
      CHECK_CLOSE(d_out.host(), want);
    }
  }
}

TEST_CASE("dense backward matches the CPU, with and without din", "[kernels]") {
  gpu g;
  std::mt19937 rng(2);
  for (const dense_shape& s : dense_shapes) {
    for (bool with_din : {true, false}) {
      INFO("B " << s.B << " IN " << s.IN << " OUT " << s.OUT << (with_din ? "" : " din null"));
      auto in = randv(size_t(s.B) * s.IN, rng), w = randv(size_t(s.IN) * s.OUT, rng);
      auto dout = randv(size_t(s.B) * s.OUT, rng);
      std::vector<float> din(size_t(s.B) * s.IN), dw(size_t(s.IN) * s.OUT), db(s.OUT);
      cpu::dense_backward(with_din ? din.data() : nullptr, dw.data(), db.data(), dout.data(), in.data(), w.data(),
                          s.B, s.IN, s.OUT);
      dev<float> d_in(in), d_w(w), d_dout(dout), d_din(din.size()), d_dw(dw.size()), d_db(db.size());
      cuda::dense_backward(g.ctx, with_din ? d_din.p : nullptr, d_dw.p, d_db.p, d_dout.p, d_in.p, d_w.p, s.B, s.IN,
                           s.OUT);
      CHECK_CLOSE(d_dw.host(), dw);
      CHECK_CLOSE(d_db.host(), db);
      if (with_din) CHECK_CLOSE(d_din.host(), din);
      else CHECK(std::isnan(d_din.host()[0]));  // din null: the buffer was not touched
    }
  }
}

TEST_CASE("dense backward over tall matrices (convolutions' patch rows): bias sums by row ranges", "[kernels]") {
  // A convolution's dense_backward has B*OH*OW rows: the cnn's first conv at batch 128 has 86528 rows of
  // 9 x 32. Its bias gradient is summed by row ranges through the context's scratch (several blocks),
  // or by one block per 32 columns without scratch; both must match the CPU, and each must give the
  // same bits on every run.
  std::mt19937 rng(12);
  const dense_shape tall[] = {{86528, 9, 32}, {15488, 288, 64}, {4096, 5, 3}, {20000, 1, 1}, {5000, 17, 3000}};
  for (bool with_scratch : {true, false}) {
    gpu g(with_scratch);
    for (const dense_shape& s : tall) {
      INFO("B " << s.B << " IN " << s.IN << " OUT " << s.OUT << (with_scratch ? "" : " without scratch"));
      auto in = randv(size_t(s.B) * s.IN, rng), w = randv(size_t(s.IN) * s.OUT, rng);
      auto dout = randv(size_t(s.B) * s.OUT, rng);
      std::vector<float> dw(size_t(s.IN) * s.OUT), db(s.OUT);
      cpu::dense_backward(nullptr, dw.data(), db.data(), dout.data(), in.data(), w.data(), s.B, s.IN, s.OUT);
      dev<float> d_in(in), d_w(w), d_dout(dout), d_dw(dw.size()), d_db(db.size());
      cuda::dense_backward(g.ctx, nullptr, d_dw.p, d_db.p, d_dout.p, d_in.p, d_w.p, s.B, s.IN, s.OUT);
      const std::vector<float> first = d_db.host();
      CHECK_CLOSE(d_dw.host(), dw);
      CHECK_CLOSE(first, db);
      cuda::dense_backward(g.ctx, nullptr, d_dw.p, d_db.p, d_dout.p, d_in.p, d_w.p, s.B, s.IN, s.OUT);
      CHECK(d_db.host() == first);  // no atomics: the same bits again
    }
  }
}

TEST_CASE("relu forward and backward match the CPU, also in place", "[kernels]") {
  gpu g;
  std::mt19937 rng(3);
  for (size_t n : {size_t(1), size_t(5), size_t(4096), size_t(1000003)}) {
    INFO("n " << n);
    auto x = randv(n, rng), dout = randv(n, rng);
    x[0] = 0.0f;  // exactly zero: the mask is out > 0, so no gradient
    std::vector<float> out(n), din(n);
    cpu::relu_forward(out.data(), x.data(), n);
    cpu::relu_backward(din.data(), dout.data(), out.data(), n);
    dev<float> d_x(x), d_out(n), d_dout(dout), d_din(n);
    cuda::relu_forward(g.ctx, d_out.p, d_x.p, n);
    CHECK_CLOSE(d_out.host(), out);
    cuda::relu_backward(g.ctx, d_din.p, d_dout.p, d_out.p, n);
    CHECK_CLOSE(d_din.host(), din);
    cuda::relu_backward(g.ctx, d_dout.p, d_dout.p, d_out.p, n);  // din aliases dout, as the mlp calls it
    CHECK_CLOSE(d_dout.host(), din);
  }
}

TEST_CASE("softmax cross-entropy matches the CPU: loss, hits, gradient", "[kernels]") {
  gpu g;
  std::mt19937 rng(4);
  const std::pair<int, int> shapes[] = {{1, 2}, {7, 10}, {128, 10}, {1024, 10}, {33, 37}, {5, 100}, {3, 1000}};
  for (auto [B, C] : shapes) {
    for (bool with_grad : {true, false}) {
      INFO("B " << B << " C " << C << (with_grad ? "" : " no gradient"));
      auto logits = randv(size_t(B) * C, rng, -8, 8);
      std::vector<int32_t> labels(B);
      std::uniform_int_distribution<int> cls(0, C - 1);
      for (auto& y : labels) y = cls(rng);
      // Ties: row 0 all equal (argmax must be index 0, as the CPU's scan); a bad label on two rows.
      for (int c = 0; c < C; ++c) logits[c] = 0.5f;
      labels[0] = 0;
      if (B > 2) labels[1] = -1, labels[2] = C;
      // Start the accumulators off zero: both versions add into them.
      double loss = 1.5;
      int64_t correct = 3;
      std::vector<float> dl(size_t(B) * C);
      cpu::softmax_xent(with_grad ? dl.data() : nullptr, &loss, &correct, logits.data(), labels.data(), B, C,
                        1.0f / B);
      dev<float> d_logits(logits), d_dl(dl.size());
      dev<int32_t> d_labels(labels);
      dev<double> d_loss(std::vector<double>{1.5});
      dev<int64_t> d_correct(std::vector<int64_t>{3});
      cuda::softmax_xent(g.ctx, with_grad ? d_dl.p : nullptr, d_loss.p, d_correct.p, d_logits.p, d_labels.p, B, C,
                         1.0f / B);
      CHECK(d_loss.host()[0] == Approx(loss).epsilon(1e-6));  // both in double: far tighter than 1e-4
      CHECK(d_correct.host()[0] == correct);
      if (with_grad) CHECK_CLOSE(d_dl.host(), dl);
    }
  }
}

TEST_CASE("softmax cross-entropy counts hits as the CPU does when logits hold NaNs", "[kernels]") {
  gpu g;
  const int C = 40;  // more than a warp's 32 lanes: the NaNs sit in different lanes and rounds
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::vector<float>> rows;
  std::vector<float> r(C);
  for (int c = 0; c < C; ++c) r[c] = float(c % 7);  // max 6 first at index 6
  rows.push_back(r);
  auto with = [&](std::vector<int> at) {
    auto x = r;
    for (int i : at) x[size_t(i)] = nan;
    return x;
  };
  rows.push_back(with({0}));           // CPU: stays at 0
  rows.push_back(with({6}));           // the first max is NaN: the next 6 (index 13)
  rows.push_back(with({3, 33, 39}));   // NaNs elsewhere: unchanged
  rows.push_back(with({6, 13, 20, 27, 34}));  // every 6 gone: the first 5
  std::vector<float> all(C, nan);
  rows.push_back(all);
  const int B = int(rows.size());
  std::vector<float> logits;
  for (auto& x : rows) logits.insert(logits.end(), x.begin(), x.end());
  for (int y : {0, 5, 6, 13}) {
    INFO("every label " << y);
    std::vector<int32_t> labels(B, y);
    double loss = 0;
    int64_t correct = 0;
    cpu::softmax_xent(nullptr, &loss, &correct, logits.data(), labels.data(), B, C, 1.0f);
    dev<float> d_logits(logits);
    dev<int32_t> d_labels(labels);
    dev<double> d_loss(std::vector<double>{0});
    dev<int64_t> d_correct(std::vector<int64_t>{0});
    cuda::softmax_xent(g.ctx, nullptr, d_loss.p, d_correct.p, d_logits.p, d_labels.p, B, C, 1.0f);
    CHECK(d_correct.host()[0] == correct);
  }
}

TEST_CASE("adam and sgd updates match the CPU, aligned and not", "[kernels]") {
  gpu g;
  std::mt19937 rng(5);
  // offset 1 makes every pointer 4 bytes off a 16-byte boundary: the scalar path instead of float4.
  for (size_t n : {size_t(1), size_t(3), size_t(4), size_t(5), size_t(1023), size_t(1000003)}) {
    for (size_t offset : {size_t(0), size_t(1)}) {
      for (int64_t t : {int64_t(1), int64_t(7)}) {
        INFO("n " << n << " offset " << offset << " t " << t);
        auto w = randv(n + offset, rng), m = randv(n + offset, rng), v = randv(n + offset, rng, 0, 1);
        auto grad = randv(n + offset, rng);
        dev<float> d_w(w), d_m(m), d_v(v), d_g(grad);
        // lr 0.01: a step large enough that an element the kernel skips is caught.
        cpu::adam_update(w.data() + offset, m.data() + offset, v.data() + offset, grad.data() + offset, n, 0.01f,
                         0.9f, 0.999f, 1e-7f, t);
        cuda::adam_update(g.ctx, d_w.p + offset, d_m.p + offset, d_v.p + offset, d_g.p + offset, n, 0.01f, 0.9f,
                          0.999f, 1e-7f, t);
        CHECK_CLOSE(d_w.host(), w);
        CHECK_CLOSE(d_m.host(), m);
        CHECK_CLOSE(d_v.host(), v);

        auto sw = randv(n + offset, rng), vel = randv(n + offset, rng);
        dev<float> d_sw(sw), d_vel(vel);
        cpu::sgd_update(sw.data() + offset, vel.data() + offset, grad.data() + offset, n, 0.01f, 0.9f);
        cuda::sgd_update(g.ctx, d_sw.p + offset, d_vel.p + offset, d_g.p + offset, n, 0.01f, 0.9f);
        CHECK_CLOSE(d_sw.host(), sw);
        CHECK_CLOSE(d_vel.host(), vel);
      }
    }
  }
}

TEST_CASE("add_inplace matches the CPU for any size and alignment", "[kernels]") {
  gpu g;
  std::mt19937 rng(6);
  for (size_t n : {size_t(1), size_t(3), size_t(4), size_t(17), size_t(1 << 20) + 3}) {
    for (auto [od, os] : {std::pair<size_t, size_t>{0, 0}, {1, 1}, {0, 3}, {2, 0}}) {
      INFO("n " << n << " dst offset " << od << " src offset " << os);
      auto dst = randv(n + od, rng), src = randv(n + os, rng);
      dev<float> d_dst(dst), d_src(src);
      cpu::add_inplace(dst.data() + od, src.data() + os, n);
      cuda::add_inplace(g.ctx, d_dst.p + od, d_src.p + os, n);
      CHECK_CLOSE(d_dst.host(), dst);
    }
  }
}

// ---- convolution, pooling, dropout, layout: the new primitives against their CPU twins ----------------

namespace {

// Bit-for-bit equality (NaNs included: a poisoned, unwritten element never equals the CPU's value).
template <class T>
size_t differing(const std::vector<T>& got, const std::vector<T>& want, size_t* first = nullptr) {
  REQUIRE(got.size() == want.size());
  size_t n = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T))) {
      if (!n && first) *first = i;
      ++n;
    }
  return n;
}

#define CHECK_SAME(got, want)                                                                       \
  do {                                                                                              \
    size_t at_ = 0;                                                                                 \
    const auto g_ = (got);                                                                          \
    const size_t n_ = differing(g_, (want), &at_);                                                  \
    INFO(#got << ": " << n_ << " of " << (want).size() << " differ in their bits"                   \
              << (n_ ? " (first at " + std::to_string(at_) + ": got " + std::to_string(g_[at_]) +   \
                           ", want " + std::to_string((want)[at_]) + ")"                           \
                     : std::string()));                                                             \
    CHECK(n_ == 0);                                                                                 \
  } while (0)

// A window over (H, W, C) input with TensorFlow's 'valid' or 'same' output size and leading padding,
// as kernels/layers.cpp computes them.
struct window_case {
  int H, W, C, KH, KW, SH, SW;
  bool same;
};
conv_geometry geometry_of(const window_case& w) {
  conv_geometry g;
  g.H = w.H, g.W = w.W, g.C = w.C, g.KH = w.KH, g.KW = w.KW, g.SH = w.SH, g.SW = w.SW;
  auto axis = [&](int in, int k, int s, int* out, int* pad) {
    if (w.same) {
      *out = (in + s - 1) / s;
      *pad = std::max((*out - 1) * s + k - in, 0) / 2;
    } else {
      *out = (in - k) / s + 1;
      *pad = 0;
    }
  };
  axis(w.H, w.KH, w.SH, &g.OH, &g.PH);
  axis(w.W, w.KW, w.SW, &g.OW, &g.PW);
  return g;
}
std::string describe(const conv_geometry& g) {
  std::ostringstream s;
  s << "input " << g.H << "x" << g.W << "x" << g.C << ", window " << g.KH << "x" << g.KW << ", stride " << g.SH << "x"
    << g.SW << ", padding " << g.PH << "," << g.PW << " -> " << g.OH << "x" << g.OW;
  return s.str();
}

// Convolution geometries: C = 1, 3, 32; kernels 1x1, 3x3, 5x5 and non-square; stride 1 and 2; 'same'
// padding with PH, PW > 0 (5x5 stride 2 on 11x10 pads 2 rows and 1 column before).
const window_case conv_cases[] = {
    {28, 28, 1, 3, 3, 1, 1, false},   // the cnn's first convolution
    {13, 13, 32, 3, 3, 1, 1, false},  // its second
    {9, 7, 3, 3, 3, 1, 1, true},      // 'same', PH = PW = 1
    {11, 10, 3, 5, 5, 2, 2, true},    // 5x5 stride 2 'same': PH 2, PW 1
    {10, 10, 32, 5, 5, 1, 1, true},   // 5x5 'same', PH = PW = 2
    {15, 15, 32, 3, 3, 2, 2, false},  // 3x3 stride 2
    {9, 9, 32, 1, 1, 2, 2, false},    // 1x1 stride 2: pixels no patch reads
    {6, 5, 3, 1, 1, 1, 1, false},     // 1x1 stride 1: a plain copy
    {8, 9, 1, 3, 5, 2, 1, true},      // non-square window and stride
    {4, 4, 3, 3, 3, 2, 2, true},      // 'same' padded after the image only (PH = PW = 0)
};
// Pooling windows: the cnn's, odd sizes (rows and columns in no window), overlapping windows, padding
// (windows hanging over the edge), stride larger than the window.
const window_case pool_cases[] = {
    {26, 26, 32, 2, 2, 2, 2, false}, {11, 11, 64, 2, 2, 2, 2, false}, {9, 9, 3, 3, 3, 2, 2, false},
    {9, 8, 1, 3, 3, 1, 1, true},     {7, 8, 3, 2, 2, 3, 3, false},    {5, 5, 1, 1, 1, 1, 1, false},
    {12, 7, 32, 3, 2, 2, 2, true},
};

}  // namespace

TEST_CASE("im2col and col2im match the CPU over strides, paddings, channels and kernel sizes", "[kernels][conv]") {
  gpu g;
  std::mt19937 rng(20);
  for (const window_case& wc : conv_cases) {
    const conv_geometry geo = geometry_of(wc);
    for (int B : {1, 3, 64}) {
      INFO(describe(geo) << ", batch " << B);
      const size_t xs = size_t(B) * geo.H * geo.W * geo.C, cols = size_t(B) * geo.OH * geo.OW * geo.patch();
      // im2col is a copy: the same bits, zeros over the padding.
      auto x = randv(xs, rng);
      std::vector<float> col(cols);
      cpu::im2col(col.data(), x.data(), geo, B);
      dev<float> d_x(x), d_col(cols);  // d_col poisoned: an element im2col skips stays NaN
      cuda::im2col(g.ctx, d_col.p, d_x.p, geo, B);
      CHECK_SAME(d_col.host(), col);
      // col2im sums: within 1e-5 (it adds in the CPU's order, so the bits should agree too).
      auto dcol = randv(cols, rng);
      std::vector<float> dx(xs);
      cpu::col2im(dx.data(), dcol.data(), geo, B);
      dev<float> d_dcol(dcol), d_dx(xs);
      cuda::col2im(g.ctx, d_dx.p, d_dcol.p, geo, B);
      const std::vector<float> got = d_dx.host();
      CHECK_CLOSE_TOL(got, dx, 1e-5);
      if (const size_t n = differing(got, dx)) WARN(describe(geo) << ": col2im differs from the CPU in " << n << " bits");
    }
  }
}

TEST_CASE("max pooling matches the CPU exactly: first maximum on ties, NaNs, routing back", "[kernels][conv]") {
  gpu g;
  std::mt19937 rng(21);
  std::uniform_int_distribution<int> level(-2, 1);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const window_case& wc : pool_cases) {
    const conv_geometry geo = geometry_of(wc);
    for (int B : {1, 4, 32}) {
      for (bool ties : {false, true}) {
        INFO(describe(geo) << ", batch " << B << (ties ? ", few levels (ties) and NaNs" : ""));
        const size_t xs = size_t(B) * geo.H * geo.W * geo.C, outs = size_t(B) * geo.OH * geo.OW * geo.C;
        auto x = randv(xs, rng);
        if (ties) {
          for (auto& v : x) v = float(level(rng));  // 4 levels: most windows hold equal maxima
          for (size_t i = 5; i < xs; i += 23) x[i] = nan;
        }
        std::vector<float> out(outs);
        std::vector<int32_t> arg(outs);
        cpu::maxpool_forward(out.data(), arg.data(), x.data(), geo, B);
        dev<float> d_x(x), d_out(outs);
        dev<int32_t> d_arg(outs);  // poisoned: -1 everywhere, so also check the outputs, not only arg
        cuda::maxpool_forward(g.ctx, d_out.p, d_arg.p, d_x.p, geo, B);
        CHECK_SAME(d_out.host(), out);
        CHECK_SAME(d_arg.host(), arg);
        // Backward from the CPU's arg (the GPU's is the same, checked above); overlapping windows add.
        auto dout = randv(outs, rng);
        std::vector<float> din(xs);
        cpu::maxpool_backward(din.data(), dout.data(), arg.data(), geo, B);
        dev<float> d_dout(dout), d_din(xs);
        dev<int32_t> d_carg(arg);
        cuda::maxpool_backward(g.ctx, d_din.p, d_dout.p, d_carg.p, geo, B);
        CHECK_SAME(d_din.host(), din);
      }
    }
  }
}

TEST_CASE("dropout masks match the CPU bit for bit, in place too", "[kernels][conv]") {
  gpu g;
  std::mt19937 rng(22);
  for (float rate : {0.5f, 0.1f, 0.75f}) {
    for (size_t per : {size_t(1), size_t(37), size_t(1600), size_t(21632)}) {
      for (int B : {1, 7, 128}) {
        for (int64_t first : {int64_t(0), int64_t(1000), int64_t(123456789012)}) {
          INFO("rate " << rate << ", " << per << " per sample, batch " << B << ", first sample " << first);
          const uint64_t stream = dropout_stream(42, 7, 3);
          auto x = randv(size_t(B) * per, rng);
          std::vector<float> y(x.size());
          cpu::dropout(y.data(), x.data(), B, per, rate, stream, first);
          dev<float> d_x(x), d_y(x.size());
          cuda::dropout(g.ctx, d_y.p, d_x.p, B, per, rate, stream, first);
          CHECK_SAME(d_y.host(), y);
          cuda::dropout(g.ctx, d_x.p, d_x.p, B, per, rate, stream, first);  // out aliases in
          CHECK_SAME(d_x.host(), y);
        }
      }
    }
  }
}

TEST_CASE("nchw_to_nhwc matches the CPU bit for bit", "[kernels][conv]") {
  gpu g;
  std::mt19937 rng(23);
  for (int C : {1, 3, 32}) {
    for (auto [H, W] : {std::pair<int, int>{28, 28}, {7, 5}, {1, 1}}) {
      for (int B : {1, 4, 128}) {
        INFO("B " << B << " C " << C << " H " << H << " W " << W);
        auto x = randv(size_t(B) * C * H * W, rng);
        std::vector<float> y(x.size());
        cpu::nchw_to_nhwc(y.data(), x.data(), B, C, H, W);
        dev<float> d_x(x), d_y(x.size());
        cuda::nchw_to_nhwc(g.ctx, d_y.p, d_x.p, B, C, H, W);
        CHECK_SAME(d_y.host(), y);
      }
    }
  }
}

TEST_CASE("relu_forward matches the CPU bit for bit, zeros, negative zeros and NaNs included", "[kernels][conv]") {
  gpu g;
  std::mt19937 rng(24);
  auto x = randv(100003, rng);
  x[0] = 0.0f, x[1] = -0.0f, x[2] = std::numeric_limits<float>::quiet_NaN(), x[3] = -INFINITY, x[4] = INFINITY;
  std::vector<float> y(x.size());
  cpu::relu_forward(y.data(), x.data(), x.size());
  dev<float> d_x(x), d_y(x.size());
  cuda::relu_forward(g.ctx, d_y.p, d_x.p, x.size());
  CHECK_SAME(d_y.host(), y);
}

namespace {

// Captures what this process writes to stderr (file descriptor 2) until finish().
class stderr_capture {
 public:
  stderr_capture() : file_(std::tmpfile()) {
    std::fflush(stderr);
    saved_ = dup(2);
    dup2(fileno(file_), 2);
  }
  ~stderr_capture() { finish(); }
  std::string finish() {
    if (saved_ < 0) return text_;
    std::fflush(stderr);
    dup2(saved_, 2);
    close(saved_);
    saved_ = -1;
    std::rewind(file_);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, file_)) > 0) text_.append(buf, n);
    std::fclose(file_);
    return text_;
  }

 private:
  FILE* file_;
  int saved_ = -1;
  std::string text_;
};

}  // namespace

TEST_CASE("the cuda backend's new primitives: the same results as the CPU backend's", "[backend][conv]") {
  // The overrides in kernels/cuda_backend.cpp, each called once through the backend interface (argument
  // order, device, stream), against the CPU backend on the same input.
  std::string err;
  auto gb = make_backend("cuda:0", &err);
  INFO(err);
  REQUIRE(gb);
  auto cb = make_cpu_backend();
  CHECK(gb->native_stream() != nullptr);
  CHECK(cb->native_stream() == nullptr);
  std::mt19937 rng(25);
  const int B = 3;
  const conv_geometry geo = geometry_of({11, 10, 3, 5, 5, 2, 2, true});
  const size_t xs = size_t(B) * geo.H * geo.W * geo.C, cols = size_t(B) * geo.OH * geo.OW * geo.patch();
  const size_t outs = size_t(B) * geo.OH * geo.OW * geo.C;
  auto x = randv(xs, rng), dcol = randv(cols, rng), dout = randv(outs, rng);
  auto on_gpu = [&](const std::vector<float>& h) {
    auto d = std::make_unique<device_buffer<float>>(*gb, h.size());
    gb->copy_in(d->data(), h.data(), h.size() * sizeof(float));
    return d;
  };
  auto back = [&](const device_buffer<float>& d) {
    std::vector<float> h(d.size());
    gb->copy_out(h.data(), d.data(), h.size() * sizeof(float));
    return h;
  };
  auto gx = on_gpu(x), gdcol = on_gpu(dcol), gdout = on_gpu(dout);
  device_buffer<float> gcol(*gb, cols), gdx(*gb, xs), gout(*gb, outs), gdin(*gb, xs), gy(*gb, xs), gr(*gb, xs);
  device_buffer<int32_t> garg(*gb, outs);
  std::vector<float> col(cols), dx(xs), out(outs), din(xs), y(xs), r(xs);
  std::vector<int32_t> arg(outs);

  cb->im2col(col.data(), x.data(), geo, B);
  gb->im2col(gcol.data(), gx->data(), geo, B);
  CHECK_SAME(back(gcol), col);
  cb->col2im(dx.data(), dcol.data(), geo, B);
  gb->col2im(gdx.data(), gdcol->data(), geo, B);
  CHECK_CLOSE_TOL(back(gdx), dx, 1e-5);
  cb->maxpool_forward(out.data(), arg.data(), x.data(), geo, B);
  gb->maxpool_forward(gout.data(), garg.data(), gx->data(), geo, B);
  CHECK_SAME(back(gout), out);
  std::vector<int32_t> harg(outs);
  gb->copy_out(harg.data(), garg.data(), outs * sizeof(int32_t));
  CHECK_SAME(harg, arg);
  cb->maxpool_backward(din.data(), dout.data(), arg.data(), geo, B);
  gb->maxpool_backward(gdin.data(), gdout->data(), garg.data(), geo, B);
  CHECK_SAME(back(gdin), din);
  const uint64_t stream = dropout_stream(1, 2, 3);
  cb->dropout(y.data(), x.data(), B, xs / B, 0.5f, stream, 77);
  gb->dropout(gy.data(), gx->data(), B, xs / B, 0.5f, stream, 77);
  CHECK_SAME(back(gy), y);
  cb->nchw_to_nhwc(r.data(), x.data(), B, geo.C, geo.H, geo.W);
  gb->nchw_to_nhwc(gr.data(), gx->data(), B, geo.C, geo.H, geo.W);
  CHECK_SAME(back(gr), r);
  cb->relu_forward(r.data(), x.data(), xs);
  gb->relu_forward(gr.data(), gx->data(), xs);
  CHECK_SAME(back(gr), r);
}

TEST_CASE("a device_buffer that outlives its cuda backend leaks with a message instead of crashing", "[backend]") {
  std::string err;
  auto be = make_backend("cuda:0", &err);
  INFO(err);
  REQUIRE(be);
  auto buf = std::make_unique<device_buffer<float>>(*be, 256);
  device_buffer<float> moved = std::move(*buf);  // the lifetime travels with the memory
  buf.reset();
  be.reset();
  stderr_capture cap;
  { device_buffer<float> gone = std::move(moved); }
  const std::string said = cap.finish();
  CHECK(said == "ringmaster: a device_buffer of 1024 bytes outlived its backend cuda:0; its memory is leaked\n");
}

TEST_CASE("the cuda backend: zeroed memory, copies, errors, host metrics", "[backend]") {
  std::string err;
  auto be = make_backend("cuda:0", &err);
  INFO(err);
  REQUIRE(be);
  CHECK_FALSE(be->is_host());
  CHECK(be->name() == "cuda:0");
  const int n = cuda_device_count();
  CHECK(n >= 1);
  CHECK_FALSE(make_backend("cuda:" + std::to_string(n), &err));
  CHECK(err == "cuda:" + std::to_string(n) + " requested but only " + std::to_string(n) + " CUDA device(s)");

  const size_t count = 1000;
  float* a = static_cast<float*>(be->alloc(count * sizeof(float)));
  float* b = static_cast<float*>(be->alloc(count * sizeof(float)));
  std::vector<float> h(count, 7.0f);
  be->copy_out(h.data(), a, count * sizeof(float));
  CHECK(h == std::vector<float>(count, 0.0f));  // alloc zero-fills
  std::mt19937 rng(7);
  auto x = randv(count, rng);
  be->copy_in(a, x.data(), count * sizeof(float));
  be->copy(b, a, count * sizeof(float));
  be->add_inplace(b, a, count);
  be->synchronize();
  be->copy_out(h.data(), b, count * sizeof(float));
  for (auto& v : x) v += v;
  CHECK(h == x);
  be->release(a);
  be->release(b);

  // softmax_xent through the backend accumulates on the device; take_metrics adds to host values and
  // starts again from zero.
  device_buffer<float> logits(*be, 4), dl(*be, 4);
  device_buffer<int32_t> labels(*be, 2);
  const float lg[4] = {0.0f, 1.0f, 2.0f, 0.0f};
  const int32_t lb[2] = {1, 1};
  be->copy_in(logits.data(), lg, sizeof lg);
  be->copy_in(labels.data(), lb, sizeof lb);
  double loss = 10.0;
  int64_t correct = 5;
  be->softmax_xent(dl.data(), logits.data(), labels.data(), 2, 2, 0.5f);
  be->softmax_xent(dl.data(), logits.data(), labels.data(), 2, 2, 0.5f);  // twice: the sums add up
  be->take_metrics(&loss, &correct);
  const double l1 = std::log(1 + std::exp(-1.0)), l2 = std::log(1 + std::exp(2.0));
  CHECK(loss == Approx(10.0 + 2 * (l1 + l2)).epsilon(1e-9));
  CHECK(correct == 7);
  be->take_metrics(&loss, &correct);  // nothing since: unchanged
  CHECK(loss == Approx(10.0 + 2 * (l1 + l2)).epsilon(1e-9));
  CHECK(correct == 7);
}

namespace {

// What a model's layers make of one batch, layer by layer, run through the layer API on a backend as
// network::forward runs them (the same parameter layout, workspaces and sample key): to see where the CPU
// and the GPU part ways, and why.
struct layer_trace {
  std::vector<std::vector<float>> out;    // per layer: its output (B, out)
  std::vector<std::vector<int32_t>> arg;  // per max_pool2d layer: where each maximum was; others empty
};

layer_trace trace_forward(backend& be, const model& m, const std::vector<float>& params, const std::vector<float>& x,
                          int B, const sample_key& key) {
  layer_trace t;
  device_buffer<float> p(be, params.size()), in(be, x.size()), nhwc;
  be.copy_in(p.data(), params.data(), params.size() * sizeof(float));
  be.copy_in(in.data(), x.data(), x.size() * sizeof(float));
  const float* cur = in.data();
  const shape& s = m.input();
  if (s.c > 1 && !s.flat()) {  // as network::forward: an input with several channels goes channels-last
    nhwc = device_buffer<float>(be, x.size());
    be.nchw_to_nhwc(nhwc.data(), in.data(), B, s.c, s.h, s.w);
    cur = nhwc.data();
  }
  std::vector<device_buffer<float>> outs, works;
  for (size_t l = 0; l < m.layers().size(); ++l) {
    const model::entry& e = m.layers()[l];
    outs.emplace_back(be, size_t(B) * e.out.size());
    works.emplace_back(be, e.impl->workspace(e.in, e.out, B));
    std::vector<const float*> pv;
    std::vector<float*> gv(e.param_count + 1, nullptr);  // forward writes no gradient
    for (size_t k = e.first_param; k < e.first_param + e.param_count; ++k) pv.push_back(p.data() + m.params()[k].offset);
    pv.push_back(nullptr);
    layer_io io{be};
    io.batch = B;
    io.in = e.in;
    io.out = e.out;
    io.x = cur;
    io.y = outs.back().data();
    io.params = pv.data();
    io.grads = gv.data();
    io.work = works.back().data();
    io.training = true;
    io.key = key;
    io.layer_index = l;
    e.impl->forward(io);
    std::vector<float> h(outs.back().size());
    be.copy_out(h.data(), outs.back().data(), h.size() * sizeof(float));
    t.out.push_back(std::move(h));
    std::vector<int32_t> a;
    if (e.impl->type() == "max_pool2d") {  // its workspace starts with the recorded maxima
      a.resize(size_t(B) * e.out.size());
      be.copy_out(a.data(), works.back().data(), a.size() * sizeof(int32_t));
    }
    t.arg.push_back(std::move(a));
    cur = outs.back().data();
  }
  be.synchronize();
  return t;
}

// A layer whose output passed a ReLU: the relu layer, or a layer with a fused one (activation "relu").
bool relu_output(const layer& l) {
  if (l.type() == "relu") return true;
  const json c = l.config();
  return c.is_object() && c.contains("activation") && c["activation"] == "relu";
}

// Where two runs of one batch from the same parameters sit on opposite sides of a discontinuity of the
// backward pass: a ReLU output that is zero on one side and positive on the other, or a max-pool window
// whose maximum is another element (two values equal within rounding). The forward values still agree
// (both functions are continuous there; the traces are compared first), but that sample's gradient
// legitimately differs by far more than rounding: a discrete flip, not a wrong kernel.
struct flip_report {
  std::vector<char> sample;  // per sample: it has a flip
  size_t samples = 0, places = 0;
  std::string first;  // the first flip, described
};

flip_report find_flips(const model& m, const layer_trace& c, const layer_trace& g, int B) {
  flip_report f;
  f.sample.assign(size_t(B), 0);
  for (size_t l = 0; l < m.layers().size(); ++l) {
    const model::entry& e = m.layers()[l];
    const bool relu = relu_output(*e.impl), pool = !c.arg[l].empty();
    if (!relu && !pool) continue;
    const size_t per = e.out.size();
    for (size_t i = 0; i < size_t(B) * per; ++i) {
      const bool flip = relu ? (c.out[l][i] > 0.0f) != (g.out[l][i] > 0.0f) : c.arg[l][i] != g.arg[l][i];
      if (!flip) continue;
      const size_t b = i / per;
      ++f.places;
      if (!f.sample[b]) f.sample[b] = 1, ++f.samples;
      if (f.first.empty()) {
        std::ostringstream s;
        s << e.name << ", sample " << b << ", element " << i % per << ": ";
        if (relu) s << "output CPU " << c.out[l][i] << ", GPU " << g.out[l][i];
        else s << "maximum at CPU " << c.arg[l][i] << ", GPU " << g.arg[l][i] << " (value " << c.out[l][i] << ")";
        f.first = s.str();
      }
    }
  }
  return f;
}

// Samples with a valid label whose logits' first maximum differs: their hit counts on one side only.
int64_t argmax_flips(const std::vector<float>& c, const std::vector<float>& g, const std::vector<int32_t>& labels,
                     int C) {
  int64_t n = 0;
  auto argmax = [C](const float* z) {
    int a = 0;
    for (int k = 1; k < C; ++k)
      if (z[k] > z[a]) a = k;
    return a;
  };
  for (size_t b = 0; b < labels.size(); ++b)
    if (labels[b] >= 0 && labels[b] < C) n += argmax(&c[b * C]) != argmax(&g[b * C]);
  return n;
}

struct twin_case {
  std::string model;
  shape input;
  optimizer_config::kind_t opt;
  int batch, steps;
  double act_tol, grad_tol;  // normwise() bounds: each layer's forward output, each parameter's gradient
  sample_key key;            // step s uses first_sample + s * batch
};

// Trains the model on the CPU for tc.steps steps of random data, and at every step gives the GPU the same
// parameters and batch and compares, in order:
//   1. every layer's forward output (trace_forward), within act_tol: a wrong forward kernel fails here;
//   2. the rounding flips between the two forwards (find_flips): reported, and the labels of the samples
//      holding one set to -1 for this step (zero gradient on both sides, exactly), since a flipped ReLU
//      or max-pool choice legitimately changes that sample's gradient. More than a quarter of the batch
//      flipping is not rounding: that fails;
//   3. network::forward_backward: loss, hits (up to the argmax flips) and every parameter's gradient
//      within grad_tol: a wrong backward kernel fails here, at every step;
//   4. network::apply of the same (CPU) gradient with the same optimizer history: the updated parameters
//      within 1e-4: a wrong optimizer kernel fails here.
// Nothing accumulates: each step starts from the CPU's parameters, so a flip at one step cannot grow into
// a difference at a later one (which is what a comparison after N independent steps measures).
void twin_steps(const twin_case& tc) {
  // Every element must also be within 1e-2 of its counterpart (compare(), 0.1 rms floor): catches garbage
  // (an unwritten, poisoned element) too small to move the normwise figure.
  const double elementwise_tol = 1e-2;
  std::string err;
  auto m = build_model(tc.model, tc.input, &err);
  INFO(tc.model << ": " << err);
  REQUIRE(m);
  optimizer_config opt;
  opt.kind = tc.opt;
  opt.lr = tc.opt == optimizer_config::adam ? 1e-3f : 1e-2f;
  const std::string label = m->label() + (tc.opt == optimizer_config::adam ? " adam" : " sgd") + " batch " +
                            std::to_string(tc.batch);
  INFO(label);
  auto cpu_be = make_cpu_backend();
  auto gpu_be = make_backend("cuda:0", &err);
  INFO(err);
  REQUIRE(gpu_be);
  const int B = tc.batch;
  const size_t n = m->param_count(), xs = size_t(B) * m->input().size();
  double worst_act = 0, worst_grad = 0, worst_update = 0;
  std::string act_at, grad_at, first_flip;
  int flip_steps = 0, first_flip_step = -1;
  size_t masked = 0;
  {
    network cpu_net(*cpu_be, m, B, opt), gpu_net(*gpu_be, m, B, opt);
    std::vector<float> params = init_params(*m, 42);
    cpu_net.set_params(params.data());
    device_buffer<float> x(*gpu_be, xs), grad(*gpu_be, n);
    device_buffer<int32_t> y(*gpu_be, size_t(B));
    std::mt19937 rng(8);
    std::uniform_int_distribution<int> cls(0, m->classes() - 1);
    for (int step = 0; step < tc.steps; ++step) {
      INFO("step " << step);
      auto hx = randv(xs, rng, 0, 1);  // like pixels in [0, 1]
      std::vector<int32_t> hy(static_cast<size_t>(B));
      for (auto& v : hy) v = cls(rng);
      sample_key key = tc.key;
      key.first_sample += int64_t(step) * B;

      // 1. the forward pass, layer by layer
      const layer_trace tc_cpu = trace_forward(*cpu_be, *m, params, hx, B, key);
      const layer_trace tc_gpu = trace_forward(*gpu_be, *m, params, hx, B, key);
      for (size_t l = 0; l < m->layers().size(); ++l) {
        INFO("forward output of " << m->layers()[l].name);
        const double d = normwise(tc_gpu.out[l], tc_cpu.out[l]);
        if (d > worst_act) worst_act = d, act_at = m->layers()[l].name;
        CHECK(d <= tc.act_tol);
        CHECK_CLOSE_TOL(tc_gpu.out[l], tc_cpu.out[l], elementwise_tol);
      }

      // 2. knife edges
      const flip_report f = find_flips(*m, tc_cpu, tc_gpu, B);
      INFO(f.places << " rounding flips in " << f.samples << " samples; first: " << f.first);
      REQUIRE(f.samples <= size_t(B) / 4);  // more is not rounding
      if (f.samples) {
        if (!flip_steps++) first_flip_step = step, first_flip = f.first;
        masked += f.samples;
      }
      std::vector<int32_t> ym = hy;
      for (size_t b = 0; b < ym.size(); ++b)
        if (f.sample[b]) ym[b] = -1;

      // 3. forward and backward through the networks
      gpu_net.set_params(params.data());
      gpu_be->copy_in(x.data(), hx.data(), xs * sizeof(float));
      gpu_be->copy_in(y.data(), ym.data(), ym.size() * sizeof(int32_t));
      const float scale = 1.0f / float(B);
      const batch_metrics mc = cpu_net.forward_backward(hx.data(), ym.data(), B, scale, key);
      const batch_metrics mg = gpu_net.forward_backward(x.data(), y.data(), B, scale, key);
      CHECK(mg.loss_sum == Approx(mc.loss_sum).epsilon(1e-4));
      CHECK(std::abs(mg.correct - mc.correct) <= argmax_flips(tc_cpu.out.back(), tc_gpu.out.back(), ym, m->classes()));
      std::vector<float> gc(cpu_net.grads(), cpu_net.grads() + n), gg(n);
      gpu_be->copy_out(gg.data(), gpu_net.grads(), n * sizeof(float));
      for (const param_entry& p : m->params()) {
        INFO("gradient of " << p.name);
        const std::vector<float> a(gg.begin() + ptrdiff_t(p.offset), gg.begin() + ptrdiff_t(p.offset + p.count));
        const std::vector<float> b(gc.begin() + ptrdiff_t(p.offset), gc.begin() + ptrdiff_t(p.offset + p.count));
        const double d = normwise(a, b);
        if (d > worst_grad) worst_grad = d, grad_at = p.name;
        CHECK(d <= tc.grad_tol);
        CHECK_CLOSE_TOL(a, b, elementwise_tol);
      }

      // 4. the update, from the same parameters, gradient and optimizer history
      gpu_be->copy_in(grad.data(), gc.data(), n * sizeof(float));
      cpu_net.apply(cpu_net.grads());
      gpu_net.apply(grad.data());
      std::vector<float> pg(n);
      cpu_net.get_params(params.data());
      gpu_net.get_params(pg.data());
      const double d = normwise(pg, params);
      worst_update = std::max(worst_update, d);
      CHECK(d <= 1e-6);  // one update from the same inputs: a few float roundings, no sums
      CHECK_CLOSE(pg, params);
    }
  }
  std::ostringstream flips;
  if (flip_steps)
    flips << "rounding flips at " << flip_steps << " of " << tc.steps << " steps, first at step " << first_flip_step
          << " (" << first_flip << "); " << masked << " sample(s) masked out of those steps' gradient comparison";
  else
    flips << "no rounding flips";
  WARN(label << ": GPU vs CPU from the same parameters, " << tc.steps << " steps: forward worst " << worst_act
             << " (" << act_at << "), gradients worst " << worst_grad << " (" << grad_at << "), update worst "
             << worst_update << "; " << flips.str());
}

}  // namespace

TEST_CASE("training steps on the GPU match the CPU's from the same parameters", "[train]") {
  // Bounds on rounding, not on a trajectory: every step starts from the CPU's parameters. (Comparing the
  // weights after 20 steps each side took on its own measured flips, not kernels: 784-512-512-10 sgd
  // agreed to 1.8e-7..4.8e-7 per step for 9 steps, then a ReLU flipped and the runs parted by 1.5e-2.)
  // Measured on the CPU against a twin summing every dense layer sequentially in float (the worst order):
  // forward <= 1.7e-6, gradients <= 1.1e-6 normwise; a broken kernel is off by 1e-2 or more.
  const twin_case cases[] = {{"784-64-10", shape{784, 1, 1}, optimizer_config::adam, 64, 20, 1e-4, 1e-4, {}},
                             {"784-512-512-10", shape{784, 1, 1}, optimizer_config::sgd, 128, 20, 1e-4, 1e-4, {}},
                             {"100-48-33-10", shape{100, 1, 1}, optimizer_config::sgd, 37, 20, 1e-4, 1e-4, {}},
                             {"784-512-512-10", shape{784, 1, 1}, optimizer_config::adam, 128, 20, 1e-4, 1e-4, {}}};
  for (const twin_case& tc : cases) twin_steps(tc);
}

TEST_CASE("the cnn trains on the GPU as on the CPU from the same parameters, dropout on", "[train][conv]") {
  // The Keras convnet: conv 3x3 (fused ReLU), max-pool, conv, max-pool, flatten, dropout 0.5, dense; the
  // same sample key on both sides, so the same dropout masks. Its first convolution sums 86528 patch rows
  // per weight at batch 128 (sequential float: 4.4e-6 normwise), and ReLU or max-pool flips are likelier
  // than in the MLPs (find_flips handles them; the CPU twin above met one in 3 steps).
  twin_steps({"cnn", shape{1, 28, 28}, optimizer_config::adam, 128, 3, 1e-4, 1e-4, sample_key{7, 1, 0}});
  // Several input channels (the NCHW -> NHWC step), 'same' padding, a pointwise (1x1) convolution, a
  // strided 'valid' one with a fused ReLU, separate ReLU layers, dropout on an image-shaped input.
  using namespace layers;
  const std::string custom = sequential{conv2d(8, 3, 1, "same"), relu(), max_pool2d(2), conv2d(4, 1), relu(),
                                        conv2d(6, 3, 2, "valid", "relu"), dropout(0.25), flatten(), dense(10)}
                                 .text();
  twin_steps({custom, shape{3, 12, 12}, optimizer_config::sgd, 16, 3, 1e-4, 1e-4, sample_key{3, 0, 40}});
}

TEST_CASE("a whole local job with GPU replicas trains like the same job on CPUs", "[train]") {
  // Synthetic data: 640 samples of 784 features, 10 steps of 64 per epoch.
  auto data = std::make_shared<dataset>();
  data->count = 640;
  data->rows = 28;
  data->cols = 28;
  std::mt19937 rng(9);
  data->pixels = randv(data->count * data->features(), rng, 0, 1);
  data->labels.resize(data->count);
  for (size_t i = 0; i < data->count; ++i) data->labels[i] = int32_t(rng() % 10);
  auto run = [&](const std::vector<std::string>& devices) {
    train_config c;
    c.model = "784-64-10";
    c.replicas = int(devices.size());
    c.devices = devices;
    c.global_batch = 64;
    c.epochs = 2;
    c.train = data;
    c.test = data;  // exercises evaluate() on the device too
    return train(c);
  };
  train_result cpu = run({"cpu", "cpu"}), gpu = run({"cuda:0", "cuda:0"});
  INFO(gpu.error);
  REQUIRE(cpu.ok);
  REQUIRE(gpu.ok);
  CHECK(gpu.identical);
  REQUIRE(gpu.weights.size() == cpu.weights.size());
  double d = 0, m = 0;
  for (size_t i = 0; i < cpu.weights.size(); ++i) {
    d = std::max(d, std::abs(double(gpu.weights[i]) - cpu.weights[i]));
    m = std::max(m, std::abs(double(cpu.weights[i])));
  }
  WARN("local job, 2 GPU replicas vs 2 CPU replicas: max |a-b| / max |b| = " << d / m);
  CHECK(d / m <= 1e-4);
  CHECK(gpu.history.back().val_accuracy == Approx(cpu.history.back().val_accuracy).margin(2.0 / 640));
}

TEST_CASE("the ring sums GPU buffers on the GPUs: shared device, and across devices where there are several", "[ring]") {
  std::vector<std::vector<int>> layouts = {{0, 0}, {0, 0, 0}};
  if (cuda_device_count() > 1) layouts.push_back({0, 1}), layouts.push_back({1, 0, 1});
  caf::actor_system_config cfg;
  configure(cfg, 0);
  caf::actor_system sys{cfg};
  std::string err;
  for (const auto& layout : layouts) {
    const int n = int(layout.size());
    std::vector<std::unique_ptr<backend>> bes;
    for (int g : layout) {
      bes.push_back(make_backend("cuda:" + std::to_string(g), &err));
      INFO(err);
      REQUIRE(bes.back());
      CHECK(bes.back()->device() == g);
    }
    {
      local_ring ring(sys, n);
      // 5 floats: some chunks empty; 40000: copied chunks (< 64 KB each); 3000001: read in place.
      for (size_t len : {size_t(5), size_t(40000), size_t(3000001)}) {
        INFO(n << " ranks, " << len << " floats");
        std::vector<device_buffer<float>> bufs;
        std::vector<float*> ptrs;
        std::vector<backend*> devs;
        for (int r = 0; r < n; ++r) {
          bufs.emplace_back(*bes[r], len);
          ptrs.push_back(bufs.back().data());
          devs.push_back(bes[r].get());
        }
        for (int rep = 0; rep < 2; ++rep) {  // the second time reuses the reducers' staging buffers
          for (int r = 0; r < n; ++r) {
            std::vector<float> h(len);
            for (size_t i = 0; i < len; ++i) h[i] = float(r + 1) + float(i % 64);
            bes[r]->copy_in(ptrs[r], h.data(), len * sizeof(float));
          }
          REQUIRE(ring.allreduce(ptrs, len, devs) == "");
          size_t wrong = 0;
          for (int r = 0; r < n; ++r) {
            std::vector<float> h(len);
            bes[r]->copy_out(h.data(), ptrs[r], len * sizeof(float));
            for (size_t i = 0; i < len; ++i) wrong += h[i] != float(n * (n + 1) / 2) + float(n) * float(i % 64);
          }
          CHECK(wrong == 0);
        }
      }
    }  // the ring ends before the backends it staged on
  }
  // Pinned host memory for chunks that leave the process.
  auto be = make_backend("cuda:0", &err);
  REQUIRE(be);
  std::shared_ptr<void> host = be->alloc_host(1024 * sizeof(float));
  float* pinned = static_cast<float*>(host.get());
  REQUIRE(pinned);
  {
    device_buffer<float> d(*be, 1024);  // device memory goes before its backend (pinned memory need not)
    for (int i = 0; i < 1024; ++i) pinned[i] = float(i);
    be->copy(d.data(), pinned, 1024 * sizeof(float));  // copy() takes host sources too
    be->synchronize();
    std::vector<float> back(1024);
    be->copy_out(back.data(), d.data(), 1024 * sizeof(float));
    CHECK(back[1023] == 1023.0f);
  }
  be.reset();  // pinned memory outlives its backend (ZeroMQ may still hold a chunk)
  pinned[5] = 1.0f;
  host.reset();
}

int main(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::string why;
    make_cuda_backend(0, &why);  // only for its message: no device, no driver, or no CUDA in this build
    if (why.rfind("no CUDA device: ", 0) == 0) why = why.substr(16);
    std::printf("SKIPPED: no CUDA device (%s)\n", why.c_str());
    return 77;
  }
  const int failed = Catch::Session().run(argc, argv);
  return failed == 77 ? 1 : failed;  // 77 failures must not read as "skipped"
}
