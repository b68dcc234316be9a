// The CUDA kernels and backend against their CPU twins (ggml's rule: every kernel on every backend checked
// against the CPU result with a tolerance), and GPU training against CPU training.
//
// Its own executable with its own main: without a GPU it prints "SKIPPED: ..." and exits 77, which ctest
// reports as skipped (SKIP_RETURN_CODE), never as passed.
//
//   ./build/tests/ringmaster_cuda_tests            # all GPU tests
//   ./build/tests/ringmaster_cuda_tests "[train]"  # only the training comparisons
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <cstdio>
#include <random>
#include <vector>

#include "actors/local_ring.hpp"
#include "actors/training.hpp"
#include "kernels/backend.hpp"
#include "kernels/cpu_kernels.hpp"
#include "kernels/cuda_kernels.hpp"
#include "kernels/model.hpp"

using namespace ringmaster;

namespace {

// A stream and a cuBLAS handle on GPU 0 for calling ringmaster::cuda directly. The stream is a blocking
// one, so the plain cudaMemset / cudaMemcpy below (legacy default stream) are ordered with the kernels.
struct gpu {
  cuda::cuda_context ctx;
  gpu() {
    RM_CUDA_CHECK(cudaSetDevice(0));
    RM_CUDA_CHECK(cudaStreamCreate(&ctx.stream));
    RM_CUBLAS_CHECK(cublasCreate(&ctx.blas));
    RM_CUBLAS_CHECK(cublasSetStream(ctx.blas, ctx.stream));
    RM_CUDA_CHECK(cudaDeviceGetAttribute(&ctx.sm_count, cudaDevAttrMultiProcessorCount, 0));
  }
  ~gpu() {
    cudaDeviceSynchronize();
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

#define CHECK_CLOSE(got, want)                                                                       \
  do {                                                                                               \
    const comparison cmp_ = compare((got), (want));                                                  \
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

struct train_case {
  const char* model;
  optimizer_config::kind_t opt;
  int batch;
  double tol;  // on max |gpu - cpu| / max |cpu| after 20 steps
};

}  // namespace

TEST_CASE("20 training steps on the GPU equal 20 on the CPU", "[train]") {
  // How close two correct float implementations stay depends on the case, so each has its bound. Measured on
  // the CPU with a backend that sums the dense layers in another order (same data and steps as here):
  //   784-64-10 adam        1.1e-6 (elementwise 1.3e-5)    784-512-512-10 sgd   2.4e-7 (1.1e-6)
  //   100-48-33-10 sgd      8.0e-8 (7.5e-7)                784-512-512-10 adam  6.3e-4 (3.6e-3)
  // Adam on the wide model amplifies rounding: m / sqrt(v) of a gradient that nearly cancels (or of a hidden
  // unit on the ReLU edge) is O(1) whatever its size, so a last-bit difference becomes a visible step.
  // That case is held to 1e-2 only (a wrong kernel is off by far more) and its figure is reported.
  const train_case cases[] = {{"784-64-10", optimizer_config::adam, 64, 1e-4},
                              {"784-512-512-10", optimizer_config::sgd, 128, 1e-4},
                              {"100-48-33-10", optimizer_config::sgd, 37, 1e-4},
                              {"784-512-512-10", optimizer_config::adam, 128, 1e-2}};
  for (const train_case& tc : cases) {
    INFO(tc.model << (tc.opt == optimizer_config::adam ? " adam" : " sgd") << " batch " << tc.batch);
    model_spec spec;
    std::string err;
    REQUIRE(parse_model_spec(tc.model, &spec, &err));
    optimizer_config opt;
    opt.kind = tc.opt;
    opt.lr = tc.opt == optimizer_config::adam ? 1e-3f : 1e-2f;
    auto cpu_be = make_cpu_backend();
    auto gpu_be = make_backend("cuda:0", &err);
    REQUIRE(gpu_be);
    mlp cpu_net(*cpu_be, spec, tc.batch, opt), gpu_net(*gpu_be, spec, tc.batch, opt);
    const auto init = init_params(spec, 42);
    cpu_net.set_params(init.data());
    gpu_net.set_params(init.data());
    device_buffer<float> x(*gpu_be, size_t(tc.batch) * spec.dims[0]);
    device_buffer<int32_t> y(*gpu_be, size_t(tc.batch));
    std::mt19937 rng(8);
    std::uniform_int_distribution<int> cls(0, spec.dims.back() - 1);
    for (int step = 0; step < 20; ++step) {
      auto hx = randv(size_t(tc.batch) * spec.dims[0], rng, 0, 1);  // like pixels in [0, 1]
      std::vector<int32_t> hy(tc.batch);
      for (auto& v : hy) v = cls(rng);
      gpu_be->copy_in(x.data(), hx.data(), hx.size() * sizeof(float));
      gpu_be->copy_in(y.data(), hy.data(), hy.size() * sizeof(int32_t));
      const float scale = 1.0f / tc.batch;
      batch_metrics mc = cpu_net.forward_backward(hx.data(), hy.data(), tc.batch, scale);
      batch_metrics mg = gpu_net.forward_backward(x.data(), y.data(), tc.batch, scale);
      INFO("step " << step);
      CHECK(mg.loss_sum == Approx(mc.loss_sum).epsilon(1e-4));
      CHECK(std::abs(mg.correct - mc.correct) <= 1);  // an argmax on a knife edge may flip
      cpu_net.apply(cpu_net.grads());
      gpu_net.apply(gpu_net.grads());
    }
    std::vector<float> pc(cpu_net.size()), pg(gpu_net.size());
    cpu_net.get_params(pc.data());
    gpu_net.get_params(pg.data());
    // As tests/test_training.cpp compares N replicas with one: the largest difference relative to the
    // weights' scale, and elementwise with a 1e-2 floor.
    double d = 0, m = 0, elem = 0;
    for (size_t i = 0; i < pc.size(); ++i) {
      const double a = pg[i], b = pc[i];
      d = std::max(d, std::abs(a - b));
      m = std::max(m, std::abs(b));
      elem = std::max(elem, std::abs(a - b) / std::max({std::abs(a), std::abs(b), 1e-2}));
      if (!std::isfinite(a)) elem = INFINITY;
    }
    WARN(tc.model << (tc.opt == optimizer_config::adam ? " adam" : " sgd") << " batch " << tc.batch
                  << ": GPU vs CPU after 20 steps: max |a-b| / max |b| = " << d / m << ", max elementwise " << elem);
    CHECK(d / m <= tc.tol);
    CHECK(elem <= 10 * tc.tol);  // single small weights drift ~10x further (figures above)
  }
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
  device_buffer<float> d(*be, 1024);
  for (int i = 0; i < 1024; ++i) pinned[i] = float(i);
  be->copy(d.data(), pinned, 1024 * sizeof(float));  // copy() takes host sources too
  be->synchronize();
  std::vector<float> back(1024);
  be->copy_out(back.data(), d.data(), 1024 * sizeof(float));
  CHECK(back[1023] == 1023.0f);
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
