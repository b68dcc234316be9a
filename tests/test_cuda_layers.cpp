// The layer primitives (convolution, pooling, dropout, layout) on the GPU against their CPU twins, one by
// one through ringmaster::cuda and once through the cuda backend. Part of ringmaster_cuda_tests (main in
// test_cuda.cpp: without a GPU it exits 77, reported as skipped).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "kernels/backend.hpp"
#include "kernels/counter_rng.hpp"
#include "kernels/cpu_kernels.hpp"
#include "kernels/cuda_kernels.hpp"

using namespace ringmaster;
using namespace ringmaster::test;

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

TEST_CASE("relu_forward matches the CPU bit for bit, zeros, negative zeros and NaNs included, and the fused relu keeps a NaN", "[kernels][conv]") {
  gpu g;
  std::mt19937 rng(24);
  auto x = randv(100003, rng);
  x[0] = 0.0f, x[1] = -0.0f, x[2] = std::numeric_limits<float>::quiet_NaN(), x[3] = -INFINITY, x[4] = INFINITY;
  std::vector<float> y(x.size());
  cpu::relu_forward(y.data(), x.data(), x.size());
  dev<float> d_x(x), d_y(x.size());
  cuda::relu_forward(g.ctx, d_y.p, d_x.p, x.size());
  CHECK_SAME(d_y.host(), y);
  // Fused into a dense layer's bias, as on the CPU: a NaN input stays NaN (made 0, it reached no loss).
  const int IN = 2, OUT = 3;
  std::vector<float> in = {std::numeric_limits<float>::quiet_NaN(), 1.0f}, w = {1, -1, 0, 1, 1, 1}, b = {0, 0, -5}, want(OUT);
  cpu::dense_relu_forward(want.data(), in.data(), w.data(), b.data(), 1, IN, OUT);
  dev<float> d_in(in), d_w(w), d_b(b), d_out(OUT);
  cuda::dense_relu_forward(g.ctx, d_out.p, d_in.p, d_w.p, d_b.p, 1, IN, OUT);
  for (float v : want) CHECK(std::isnan(v));
  for (float v : d_out.host()) CHECK(std::isnan(v));
}

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
