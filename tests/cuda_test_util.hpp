// Shared by the GPU tests (test_cuda.cpp, test_cuda_layers.cpp, test_cuda_training.cpp): a stream and
// cuBLAS handle on GPU 0, poisoned device arrays, random data, and the elementwise comparison behind
// CHECK_CLOSE.
#pragma once
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kernels/cuda_kernels.hpp"
#include "tests/test_util.hpp"  // randv

namespace ringmaster::test {

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

// Elementwise |got - want| / max(|got|, |want|, floor) with floor = 0.1 * rms(want). Float sums round in
// proportion to the size of their terms, not of their result, so an entry far below the array's typical
// size is compared against a tenth of that size. (Measured on the CPU: two float GEMMs with K = 512..1024
// summed in different orders differ by up to ~2e-5 on this scale, and by ~2e-4 with a 0.01 * rms floor.)
// Non-finite results (the poison) always count as bad.
struct comparison {
  double worst = 0;
  size_t bad = 0, first_bad = 0;
};
inline comparison compare(const std::vector<float>& got, const std::vector<float>& want, double tol = 1e-4) {
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

}  // namespace ringmaster::test

#define CHECK_CLOSE(got, want) CHECK_CLOSE_TOL(got, want, 1e-4)
#define CHECK_CLOSE_TOL(got, want, tol)                                                              \
  do {                                                                                               \
    const ringmaster::test::comparison cmp_ = ringmaster::test::compare((got), (want), (tol));       \
    INFO(#got << ": worst relative error " << cmp_.worst << ", " << cmp_.bad << " bad of "           \
              << (want).size() << " (first at " << cmp_.first_bad << ": got "                        \
              << (cmp_.bad ? (got)[cmp_.first_bad] : 0.0f) << ", want "                              \
              << (cmp_.bad ? (want)[cmp_.first_bad] : 0.0f) << ")");                                 \
    CHECK(cmp_.bad == 0);                                                                            \
  } while (0)
