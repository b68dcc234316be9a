// CUDA kernels: the twins of kernels/cpu_kernels.hpp, same names, same argument order, same semantics
// (row-major float32, W is (IN, OUT)), with a cuda_context first. All pointers are device pointers
// unless a comment says otherwise. Every function only enqueues work on ctx.stream (no host sync).
//
// Errors: every CUDA and cuBLAS call goes through RM_CUDA_CHECK / RM_CUBLAS_CHECK, which throw
// std::runtime_error naming file:line, the call and the error string. Nothing here calls exit().
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/backend.hpp"  // conv_geometry

namespace ringmaster::cuda {

// What a kernel needs to run: the stream everything is ordered on, a cuBLAS handle bound to that
// stream, and the SM count (to size grid-stride launches). Owned by the backend, not by this file.
// scratch: optional device memory (scratch_floats floats) for kernels' partial results, used only in
// stream order; without it (null) those kernels take a slower path with the same semantics.
struct cuda_context {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int sm_count = 1;
  float* scratch = nullptr;
  size_t scratch_floats = 0;
};
// The scratch size the backend gives its context: enough for the column sums of any layer width up to
// 16384 over 16 row chunks.
constexpr size_t default_scratch_floats = size_t(1) << 18;

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t st, const char* call, const char* file, int line);

#define RM_CUDA_CHECK(call)                                                                 \
  do {                                                                                      \
    const cudaError_t rm_err_ = (call);                                                     \
    if (rm_err_ != cudaSuccess) ::ringmaster::cuda::throw_cuda_error(rm_err_, #call, __FILE__, __LINE__); \
  } while (0)

#define RM_CUBLAS_CHECK(call)                                                               \
  do {                                                                                      \
    const cublasStatus_t rm_st_ = (call);                                                   \
    if (rm_st_ != CUBLAS_STATUS_SUCCESS)                                                    \
      ::ringmaster::cuda::throw_cublas_error(rm_st_, #call, __FILE__, __LINE__);            \
  } while (0)

// out (B, OUT) = in (B, IN) * w (IN, OUT) + b (OUT)
void dense_forward(const cuda_context& ctx, float* out, const float* in, const float* w, const float* b, int B,
                   int IN, int OUT);
// Same, followed by ReLU (fused into the bias pass).
void dense_relu_forward(const cuda_context& ctx, float* out, const float* in, const float* w, const float* b,
                        int B, int IN, int OUT);
// dw (IN, OUT) = in^T * dout; db (OUT) = column sums of dout; din (B, IN) = dout * w^T.
// Overwrites dw, db; din may be null.
void dense_backward(const cuda_context& ctx, float* din, float* dw, float* db, const float* dout, const float* in,
                    const float* w, int B, int IN, int OUT);
void relu_forward(const cuda_context& ctx, float* out, const float* in, size_t n);
// din = dout where out > 0, else 0. din may alias dout.
void relu_backward(const cuda_context& ctx, float* din, const float* dout, const float* out, size_t n);
// Softmax + sparse categorical cross-entropy over logits (B, C), as cpu::softmax_xent, except that
// loss_sum and correct are DEVICE scalars the kernel adds into (atomically; the caller zeroes them and
// copies them back). dlogits may be null.
void softmax_xent(const cuda_context& ctx, float* dlogits, double* loss_sum, int64_t* correct,
                  const float* logits, const int32_t* labels, int B, int C, float grad_scale);
// Keras Adam, one fused pass; alpha is computed on the host in double exactly as the CPU does.
void adam_update(const cuda_context& ctx, float* w, float* m, float* v, const float* g, size_t n, float lr,
                 float b1, float b2, float eps, int64_t t);
// Keras SGD with momentum: vel = momentum * vel - lr * g; w += vel.
void sgd_update(const cuda_context& ctx, float* w, float* vel, const float* g, size_t n, float lr,
                float momentum);
// dst += src. Bandwidth-bound: grid-stride, float4 when both pointers are 16-byte aligned.
void add_inplace(const cuda_context& ctx, float* dst, const float* src, size_t n);

// ---- convolution and pooling over channels-last images, as in kernels/cpu_kernels.hpp ----------------
// Each writes every element of its output (no memset needed first) and uses no atomics: the results are
// the same on every run. Where the CPU twin's result is exact the GPU's is bit for bit the same.

// col (B*OH*OW, KH*KW*C) = each output pixel's input patch in (kh, kw, c) order, zeros over the padding.
// A copy: bit-identical to cpu::im2col.
void im2col(const cuda_context& ctx, float* col, const float* x, const conv_geometry& g, int B);
// dx (B, H, W, C) = the sum of the patch entries that came from each pixel. A gather (one thread per
// pixel and channel) adding the covering patches in cpu::col2im's order (output pixel row-major): the
// same float additions in the same order, so the same bits.
void col2im(const cuda_context& ctx, float* dx, const float* col, const conv_geometry& g, int B);
// out (B, OH, OW, C) = each window's max; arg = its index in the sample's (H, W, C) input; the FIRST
// maximum in (kh, kw) scan order wins (strict '>'), NaNs as in cpu::maxpool_forward; a window wholly
// in the padding gives 0 and -1. Bit-identical to the CPU.
void maxpool_forward(const cuda_context& ctx, float* out, int32_t* arg, const float* in, const conv_geometry& g,
                     int B);
// din (B, H, W, C) = dout routed back to the recorded maxima: a gather over the windows covering each
// input element, in the CPU's order. `arg` must come from maxpool_forward with the same geometry (an
// index outside its window is never found, where the CPU would still route to it).
void maxpool_backward(const cuda_context& ctx, float* din, const float* dout, const int32_t* arg,
                      const conv_geometry& g, int B);
// Inverted dropout, the mask from uniform01(stream, first_sample + s, e) (kernels/counter_rng.hpp), as
// cpu::dropout: bit-identical. out may alias in.
void dropout(const cuda_context& ctx, float* out, const float* in, int B, size_t per_sample, float rate,
             uint64_t stream, int64_t first_sample);
// (B, C, H, W) -> (B, H, W, C). A copy: bit-identical.
void nchw_to_nhwc(const cuda_context& ctx, float* out, const float* in, int B, int C, int H, int W);

}  // namespace ringmaster::cuda
