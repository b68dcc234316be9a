// gpu_bench: throughput of one replica on the cuda backend, and the bandwidth of the ring's reduction.
//
//   ./build/gpu_bench [seconds per measurement, default 1.5]     # needs a GPU; exits 77 without one
//
// Training: Adam, random data (8 batches cycled), warm-up, then timed steps with cudaDeviceSynchronize
// before the clock stops; the MLPs and the Keras convnet ("cnn": conv 32 3x3, max-pool, conv 64 3x3,
// max-pool, dropout 0.5, dense 10 over 1x28x28 images). Two numbers per model and batch:
//   device  the batches already on the GPU: forward, backward and update only;
//   staged  what actors/replica.cpp adds per step: the batch copied in from the host.
// Whole jobs: ringmaster::train() (loaders, replicas, reducers, coordinator) on random data in memory,
// 1 replica on cuda:0 and 2 replicas sharing it (cuda:0,0: the ring runs device to device); samples/s
// of the second epoch (the first warms cuBLAS up).
// Reduction: add_inplace on 64 MB buffers against cudaMemcpy device-to-device on the same buffers, with
// bytes counted as moved (add: read dst + read src + write dst; memcpy: read + write), and a count of
// wrong results; then the ring itself: 2 reducer actors all-reducing 64 MB buffers that both live on
// cuda:0 (busbw as nccl-tests). Lines starting with RESULT are read by tools/gpu-check.sh.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "actors/local_ring.hpp"
#include "actors/training.hpp"
#include "kernels/backend.hpp"
#include "kernels/cuda_kernels.hpp"
#include "kernels/model.hpp"

using namespace ringmaster;
using clock_type = std::chrono::steady_clock;

namespace {

struct train_numbers {
  double device_sps = 0, staged_sps = 0, loss = 0;
};

// Runs step(i) for at least `seconds` after 10 warm-up steps; returns steps per second.
template <class Step>
double steps_per_second(Step&& step, double seconds) {
  int i = 0;
  for (; i < 10; ++i) step(i);
  RM_CUDA_CHECK(cudaDeviceSynchronize());
  const auto t0 = clock_type::now();
  int steps = 0;
  double elapsed = 0;
  do {
    for (int k = 0; k < 10; ++k, ++steps) step(i++);
    elapsed = std::chrono::duration<double>(clock_type::now() - t0).count();
  } while (elapsed < seconds);
  RM_CUDA_CHECK(cudaDeviceSynchronize());
  elapsed = std::chrono::duration<double>(clock_type::now() - t0).count();
  return steps / elapsed;
}

// The models benchmarked: "784-..." MLPs take 784 features, "cnn" 1x28x28 images (the same 784 floats).
std::shared_ptr<const model> bench_model(const std::string& name) {
  std::string err;
  auto m = build_model(name, name == "cnn" ? shape{1, 28, 28} : shape{784, 1, 1}, &err);
  if (!m) throw std::runtime_error(name + ": " + err);
  return m;
}

train_numbers bench_training(const std::string& model_name, int batch, double seconds) {
  std::string err;
  auto m = bench_model(model_name);
  auto be = make_backend("cuda:0", &err);
  if (!be) throw std::runtime_error(err);
  network net(*be, m, batch, optimizer_config{});
  net.set_params(init_params(*m, 42).data());

  const int nb = 8;  // distinct batches, cycled
  const size_t in = m->input().size(), bx = size_t(batch) * in;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> pixel(0, 1);
  std::vector<float> hx(nb * bx);
  std::vector<int32_t> hy(size_t(nb) * batch);
  for (auto& v : hx) v = pixel(rng);
  for (auto& v : hy) v = int32_t(rng() % uint32_t(m->classes()));
  device_buffer<float> dx(*be, hx.size()), sx(*be, bx);
  device_buffer<int32_t> dy(*be, hy.size()), sy(*be, size_t(batch));
  be->copy_in(dx.data(), hx.data(), hx.size() * sizeof(float));
  be->copy_in(dy.data(), hy.data(), hy.size() * sizeof(int32_t));
  const float scale = 1.0f / float(batch);
  // Where step i's batch sits in its epoch (dropout masks): a new mask every step, as in training.
  auto key = [batch](int i) { return sample_key{42, 0, int64_t(i) * batch}; };

  train_numbers r;
  double loss = 0;
  int64_t count = 0;
  auto device_step = [&](int i) {
    const int k = i % nb;
    batch_metrics bm = net.forward_backward(dx.data() + k * bx, dy.data() + size_t(k) * batch, batch, scale, key(i));
    net.apply(net.grads());
    loss += bm.loss_sum, count += bm.count;
  };
  auto staged_step = [&](int i) {
    const int k = i % nb;
    be->copy_in(sx.data(), hx.data() + k * bx, bx * sizeof(float));
    be->copy_in(sy.data(), hy.data() + size_t(k) * batch, size_t(batch) * sizeof(int32_t));
    net.forward_backward(sx.data(), sy.data(), batch, scale, key(i));
    net.apply(net.grads());
  };
  r.device_sps = batch * steps_per_second(device_step, seconds);
  r.loss = loss / double(count);  // mean training loss over the device run: finite, near ln(classes) or below
  r.staged_sps = batch * steps_per_second(staged_step, seconds);
  return r;
}

struct bandwidth_numbers {
  double add_gbps = 0, memcpy_gbps = 0;
  size_t wrong = 0;
};

bandwidth_numbers bench_add(size_t bytes, int iters) {
  cuda::cuda_context ctx;
  RM_CUDA_CHECK(cudaSetDevice(0));
  RM_CUDA_CHECK(cudaStreamCreate(&ctx.stream));
  RM_CUDA_CHECK(cudaDeviceGetAttribute(&ctx.sm_count, cudaDevAttrMultiProcessorCount, 0));
  const size_t n = bytes / sizeof(float);
  float *dst = nullptr, *src = nullptr, *copy = nullptr;
  RM_CUDA_CHECK(cudaMalloc(&dst, bytes));
  RM_CUDA_CHECK(cudaMalloc(&src, bytes));
  RM_CUDA_CHECK(cudaMalloc(&copy, bytes));
  RM_CUDA_CHECK(cudaMemset(dst, 0, bytes));
  std::vector<float> h(n, 2.0f);
  RM_CUDA_CHECK(cudaMemcpy(src, h.data(), bytes, cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1;
  RM_CUDA_CHECK(cudaEventCreate(&e0));
  RM_CUDA_CHECK(cudaEventCreate(&e1));
  float ms = 0;
  bandwidth_numbers r;

  for (int i = 0; i < 3; ++i) cuda::add_inplace(ctx, dst, src, n);  // warm-up
  RM_CUDA_CHECK(cudaEventRecord(e0, ctx.stream));
  for (int i = 0; i < iters; ++i) cuda::add_inplace(ctx, dst, src, n);
  RM_CUDA_CHECK(cudaEventRecord(e1, ctx.stream));
  RM_CUDA_CHECK(cudaEventSynchronize(e1));
  RM_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  r.add_gbps = 3.0 * double(bytes) * iters / (ms * 1e-3) / 1e9;

  for (int i = 0; i < 3; ++i) RM_CUDA_CHECK(cudaMemcpyAsync(copy, src, bytes, cudaMemcpyDeviceToDevice, ctx.stream));
  RM_CUDA_CHECK(cudaEventRecord(e0, ctx.stream));
  for (int i = 0; i < iters; ++i)
    RM_CUDA_CHECK(cudaMemcpyAsync(copy, src, bytes, cudaMemcpyDeviceToDevice, ctx.stream));
  RM_CUDA_CHECK(cudaEventRecord(e1, ctx.stream));
  RM_CUDA_CHECK(cudaEventSynchronize(e1));
  RM_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  r.memcpy_gbps = 2.0 * double(bytes) * iters / (ms * 1e-3) / 1e9;

  // Every element was 0 + 2 added (3 + iters) times: exact in float.
  RM_CUDA_CHECK(cudaMemcpy(h.data(), dst, bytes, cudaMemcpyDeviceToHost));
  const float want = 2.0f * float(3 + iters);
  for (float v : h) r.wrong += (v != want);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(dst);
  cudaFree(src);
  cudaFree(copy);
  cudaStreamDestroy(ctx.stream);
  return r;
}

// samples/s of a whole local job's second epoch: `replicas` replicas on cuda:0, random data.
double bench_job(const std::string& model, int batch, int replicas) {
  auto data = std::make_shared<dataset>();
  data->count = 61440;
  data->channels = 1;  // (1, 28, 28): the MLPs read it as 784 features, the cnn as an image
  data->rows = 28;
  data->cols = 28;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> pixel(0, 1);
  data->pixels.resize(data->count * data->features());
  for (auto& v : data->pixels) v = pixel(rng);
  data->labels.resize(data->count);
  for (auto& v : data->labels) v = int32_t(rng() % 10);
  train_config c;
  c.model = model;
  c.replicas = replicas;
  c.devices.assign(size_t(replicas), "cuda:0");
  c.global_batch = batch;
  c.epochs = 2;
  c.train = data;
  c.evaluate = false;
  train_result r = train(c);
  if (!r.ok) throw std::runtime_error("job on " + std::to_string(replicas) + " replicas: " + r.error);
  return double(r.history[1].samples) / r.history[1].seconds;
}

struct ring_numbers {
  double median_us = 0, busbw_gbps = 0;
  size_t wrong = 0;
};

// 2 reducers, buffers of `bytes` each on cuda:0: the median all-reduce time over `iters`, buffers refilled
// (untimed) before each. Rank r's element i is (r + 1) + (i % 64): the sums are exact.
ring_numbers bench_device_ring(size_t bytes, int iters) {
  const int ranks = 2;
  const size_t n = bytes / sizeof(float);
  std::string err;
  std::vector<std::unique_ptr<backend>> bes;
  std::vector<device_buffer<float>> bufs;
  std::vector<std::vector<float>> fill(ranks, std::vector<float>(n));
  for (int r = 0; r < ranks; ++r) {
    bes.push_back(make_backend("cuda:0", &err));
    if (!bes.back()) throw std::runtime_error(err);
    bufs.emplace_back(*bes.back(), n);
    for (size_t i = 0; i < n; ++i) fill[r][i] = float(r + 1) + float(i % 64);
  }
  ring_numbers out;
  std::vector<double> times;
  {
    caf::actor_system_config cfg;
    configure(cfg, 0);
    caf::actor_system sys{cfg};
    local_ring ring(sys, ranks);
    for (int it = 0; it < iters + 2; ++it) {  // 2 warm-ups
      for (int r = 0; r < ranks; ++r) bes[r]->copy_in(bufs[r].data(), fill[r].data(), bytes);
      const auto t0 = clock_type::now();
      std::string e = ring.allreduce({bufs[0].data(), bufs[1].data()}, n, {bes[0].get(), bes[1].get()});
      const double us = std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
      if (!e.empty()) throw std::runtime_error("device ring: " + e);
      if (it >= 2) times.push_back(us);
    }
  }
  for (int r = 0; r < ranks; ++r) {
    std::vector<float> h(n);
    bes[r]->copy_out(h.data(), bufs[r].data(), bytes);
    for (size_t i = 0; i < n; ++i) out.wrong += h[i] != 3.0f + 2.0f * float(i % 64);
  }
  std::sort(times.begin(), times.end());
  out.median_us = times[times.size() / 2];
  out.busbw_gbps = double(bytes) / (out.median_us * 1e-6) / 1e9 * 2.0 * (ranks - 1) / ranks;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 1.5;
  const char* usage = "usage: gpu_bench [SECONDS]   (seconds per measurement, 0.1..600, default 1.5; needs a GPU: exits 77 without one)\n";
  if (argc > 2) {
    std::fprintf(stderr, "gpu_bench: one argument at most, SECONDS\n%s", usage);
    return 2;
  }
  if (argc == 2 && (std::string(argv[1]) == "-h" || std::string(argv[1]) == "--help")) {
    std::printf("%s", usage);
    return 0;
  }
  if (argc == 2) {
    char* end = nullptr;
    seconds = std::strtod(argv[1], &end);
    if (end == argv[1] || *end || !(seconds >= 0.1 && seconds <= 600)) {
      std::fprintf(stderr, "gpu_bench: SECONDS must be a number in 0.1..600, not '%s' (see --help)\n", argv[1]);
      return 2;
    }
  }
  if (cuda_device_count() == 0) {
    std::string why;
    make_cuda_backend(0, &why);
    std::printf("gpu_bench: SKIPPED: %s\n", why.c_str());
    return 77;
  }
  try {
    cudaDeviceProp prop{};
    RM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int runtime = 0, driver = 0;
    RM_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    RM_CUDA_CHECK(cudaDriverGetVersion(&driver));
    std::printf("gpu_bench: %s, %d SMs, CUDA runtime %d, driver %d; Adam, random data, %.1f s per figure\n",
                prop.name, prop.multiProcessorCount, runtime, driver, seconds);
    std::printf("%-16s %6s %14s %14s %10s\n", "model", "batch", "device s/s", "staged s/s", "mean loss");
    for (const char* model : {"784-512-512-10", "784-64-10", "cnn"}) {
      for (int batch : {128, 1024}) {
        train_numbers t = bench_training(model, batch, seconds);
        std::printf("%-16s %6d %14.0f %14.0f %10.4f\n", model, batch, t.device_sps, t.staged_sps, t.loss);
        std::printf("RESULT train %s %d %.0f %.0f %.4f\n", model, batch, t.device_sps, t.staged_sps, t.loss);
        std::fflush(stdout);
      }
    }
    const size_t bytes = size_t(64) << 20;
    bandwidth_numbers b = bench_add(bytes, 20);
    std::printf("add_inplace 64 MB: %.0f GB/s; cudaMemcpy D2D 64 MB: %.0f GB/s; ratio %.3f; wrong results %zu\n",
                b.add_gbps, b.memcpy_gbps, b.add_gbps / b.memcpy_gbps, b.wrong);
    std::printf("RESULT add %.1f %.1f %.3f %zu\n", b.add_gbps, b.memcpy_gbps, b.add_gbps / b.memcpy_gbps, b.wrong);
    std::fflush(stdout);
    ring_numbers ring = bench_device_ring(bytes, 10);
    std::printf("ring all-reduce, 2 reducers on cuda:0, 64 MB: median %.0f us, busbw %.0f GB/s; wrong results %zu\n",
                ring.median_us, ring.busbw_gbps, ring.wrong);
    std::printf("RESULT ring %.0f %.1f %zu\n", ring.median_us, ring.busbw_gbps, ring.wrong);
    std::printf("%-16s %6s %16s %16s\n", "whole job", "batch", "1 x cuda:0 s/s", "2 x cuda:0 s/s");
    for (const char* model : {"784-512-512-10", "784-64-10", "cnn"}) {
      for (int batch : {128, 1024}) {
        const double one = bench_job(model, batch, 1), two = bench_job(model, batch, 2);
        std::printf("%-16s %6d %16.0f %16.0f\n", model, batch, one, two);
        std::printf("RESULT job %s %d %.0f %.0f\n", model, batch, one, two);
        std::fflush(stdout);
      }
    }
    return b.wrong || ring.wrong ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_bench: %s\n", e.what());
    return 1;
  }
}
