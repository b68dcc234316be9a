// The CUDA kernels and backend against their CPU twins (ggml's rule: every kernel on every backend checked
// against the CPU result with a tolerance, or exactly where the CPU result is exact), and GPU training
// against CPU training from the same parameters. This file: the dense, softmax, optimizer and add kernels,
// the cuda backend itself, and the main; test_cuda_layers.cpp: the layer primitives (convolution, pooling,
// dropout, layout); test_cuda_training.cpp: training twins, a whole local job, the ring on GPU buffers.
// Shared helpers: cuda_test_util.hpp.
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
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.hpp"
#include "kernels/backend.hpp"
#include "kernels/counter_rng.hpp"
#include "kernels/cpu_kernels.hpp"
#include "kernels/cuda_kernels.hpp"

using namespace ringmaster;
using namespace ringmaster::test;

namespace {

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
