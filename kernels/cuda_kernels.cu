// CUDA twins of kernels/cpu_kernels.cpp. Dense layers go through cuBLAS (FP32, no TF32: the results must
// match the CPU within 1e-4); everything else is a small kernel over pointers and sizes.
//
// Row-major through column-major cuBLAS: a row-major (R, C) array is the column-major (C, R) array of its
// transpose, so row-major Y = A * B is computed as the column-major Y^T = B^T * A^T with the operands
// swapped and no explicit transposes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/cuda_kernels.hpp"
#include "kernels/cuda_launch.cuh"

namespace ringmaster::cuda {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("CUDA error at ") + file + ":" + std::to_string(line) + ": " + call +
                           ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

void throw_cublas_error(cublasStatus_t st, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string("cuBLAS error at ") + file + ":" + std::to_string(line) + ": " + call +
                           ": " + cublasGetStatusName(st) + " (" + cublasGetStatusString(st) + ")");
}

namespace {

// ---- dense ------------------------------------------------------------------------------------------

// out (B, OUT) += b, then ReLU if asked. The GEMM wrote out; this is the one extra pass over it.
template <bool RELU, class I>
__global__ void bias_act_kernel(I n, float* out, const float* b, int OUT) {
  RM_GRID_STRIDE(I, i, n) {
    const float v = out[i] + b[i % I(OUT)];
    out[i] = RELU ? (!(v <= 0.0f) ? v : 0.0f) : v;  // NaN stays NaN, as on the CPU (cpu_kernels.cpp: relu)
  }
}

// db (OUT) = column sums of dout (B, OUT). A block owns 32 columns of a range of rows; its 32 rows of
// threads each sum every 32nd row of the range (coalesced: a warp reads 32 neighbouring columns of one
// row), then one thread per column adds the 32 partial sums in a fixed order. With one range (gridDim.y
// 1) that is the column sum; tall matrices (a convolution's B*OH*OW rows) are cut into gridDim.y ranges
// whose sums go to part (gridDim.y, OUT) and are added in order by column_finish_kernel. No atomics, so
// the result is the same on every run and replica.
constexpr int colsum_rows = 32;
__global__ void column_sum_kernel(float* part, const float* dout, int B, int OUT, int rows_per_range) {
  __shared__ float sums[colsum_rows][33];  // 33: no bank conflicts on the column read below
  const int col = blockIdx.x * 32 + threadIdx.x;
  const int r0 = blockIdx.y * rows_per_range;
  const int r1 = min(B, r0 + rows_per_range);
  float s = 0.0f;
  if (col < OUT) {
#pragma unroll 4
    for (int r = r0 + threadIdx.y; r < r1; r += colsum_rows) s += dout[size_t(r) * OUT + col];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < OUT) {
    float t = 0.0f;
    for (int k = 0; k < colsum_rows; ++k) t += sums[k][threadIdx.x];
    part[size_t(blockIdx.y) * OUT + col] = t;
  }
}

__global__ void column_finish_kernel(float* db, const float* part, int ranges, int OUT) {
  RM_GRID_STRIDE(int, col, OUT) {
    float t = 0.0f;
    for (int k = 0; k < ranges; ++k) t += part[size_t(k) * OUT + col];
    db[col] = t;
  }
}

void column_sum(const cuda_context& ctx, float* db, const float* dout, int B, int OUT) {
  const int col_blocks = (OUT + 31) / 32;
  // Row ranges of at least 2048 rows, about two blocks per SM in all, as many as the scratch holds. A
  // function of (B, OUT, the GPU, the scratch size) only: every run and replica sums alike.
  int ranges = 1;
  if (ctx.scratch && B >= 4096) {
    const size_t fit = ctx.scratch_floats / size_t(OUT);
    ranges = std::min({B / 2048, std::max(1, 2 * ctx.sm_count / col_blocks), int(std::min<size_t>(fit, 65535))});
    ranges = std::max(ranges, 1);
  }
  if (ranges == 1) {
    column_sum_kernel<<<dim3(col_blocks, 1), dim3(32, colsum_rows), 0, ctx.stream>>>(db, dout, B, OUT, B);
    RM_CUDA_CHECK(cudaGetLastError());
    return;
  }
  const int per = (B + ranges - 1) / ranges;
  ranges = (B + per - 1) / per;  // no empty range at the end
  column_sum_kernel<<<dim3(col_blocks, ranges), dim3(32, colsum_rows), 0, ctx.stream>>>(ctx.scratch, dout, B, OUT, per);
  RM_CUDA_CHECK(cudaGetLastError());
  column_finish_kernel<<<grid_for(ctx, size_t(OUT)), threads_per_block, 0, ctx.stream>>>(db, ctx.scratch, ranges, OUT);
  RM_CUDA_CHECK(cudaGetLastError());
}

// out (B, OUT) = in (B, IN) * w (IN, OUT), i.e. column-major out^T (OUT, B) = w^T (OUT, IN) * in^T (IN, B).
void gemm_forward(const cuda_context& ctx, float* out, const float* in, const float* w, int B, int IN, int OUT) {
  const float one = 1.0f, zero = 0.0f;
  RM_CUBLAS_CHECK(cublasSgemm(ctx.blas, CUBLAS_OP_N, CUBLAS_OP_N, OUT, B, IN, &one, w, OUT, in, IN, &zero, out, OUT));
}

template <bool RELU>
void dense_forward_impl(const cuda_context& ctx, float* out, const float* in, const float* w, const float* b, int B,
                        int IN, int OUT) {
  if (B <= 0 || OUT <= 0) return;
  gemm_forward(ctx, out, in, w, B, IN, OUT);
  const size_t n = size_t(B) * OUT;
  if (fits32(n))
    bias_act_kernel<RELU, uint32_t><<<grid_for(ctx, n), threads_per_block, 0, ctx.stream>>>(uint32_t(n), out, b, OUT);
  else
    bias_act_kernel<RELU, size_t><<<grid_for(ctx, n), threads_per_block, 0, ctx.stream>>>(n, out, b, OUT);
  RM_CUDA_CHECK(cudaGetLastError());
}

// ---- elementwise ------------------------------------------------------------------------------------

__global__ void relu_forward_kernel(float* out, const float* in, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = !(in[i] <= 0.0f) ? in[i] : 0.0f;  // NaN stays NaN (NaN <= 0 is false)
}

// din may alias dout: each element is read, then written, by the same thread.
__global__ void relu_backward_kernel(float* din, const float* dout, const float* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    din[i] = out[i] > 0.0f ? dout[i] : 0.0f;
}

// ---- softmax + cross-entropy ----------------------------------------------------------------------

constexpr int softmax_warps = 8;  // rows per block, one warp per row

// One warp per row of logits (B, C): argmax, max, log-sum-exp (in double, as the CPU), then the gradient.
// Each block adds its rows' loss and hits to the device scalars with one atomic each.
__global__ void softmax_xent_kernel(float* dlogits, double* loss_sum, unsigned long long* correct,
                                    const float* logits, const int32_t* labels, int B, int C, float grad_scale) {
  __shared__ double block_loss[softmax_warps];
  __shared__ unsigned int block_hits[softmax_warps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * softmax_warps + warp;  // uniform across the warp: shuffles are safe
  double loss = 0.0;
  unsigned int hit = 0;
  if (row < B) {
    const float* z = logits + size_t(row) * C;
    // Greatest value, lowest index on ties: the CPU's strict '>' scan from index 0 picks the same one.
    // NaNs as on the CPU too: its scan never moves to a NaN, and stays at 0 when z[0] is one.
    float best = -INFINITY;
    int arg = 0x7fffffff;  // none yet
    for (int c = lane; c < C; c += 32)
      if (!isnan(z[c]) && (z[c] > best || arg == 0x7fffffff)) best = z[c], arg = c;
    for (int off = 16; off > 0; off /= 2) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, off);
      const int oa = __shfl_xor_sync(0xffffffffu, arg, off);
      if (ob > best || (ob == best && oa < arg)) best = ob, arg = oa;
    }
    arg = __shfl_sync(0xffffffffu, arg, 0);  // one answer for the whole warp
    if (arg == 0x7fffffff || isnan(z[0])) arg = 0;
    const float zmax = z[arg];
    double sum = 0.0;
    for (int c = lane; c < C; c += 32) sum += exp(double(z[c] - zmax));
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    sum = __shfl_sync(0xffffffffu, sum, 0);
    const double log_sum = log(sum);
    const int y = labels[row];
    const bool valid = y >= 0 && y < C;
    if (valid) {
      loss = log_sum - double(z[y] - zmax);  // -log softmax(z)_y, stable
      hit = (arg == y);
    }
    if (dlogits) {
      float* d = dlogits + size_t(row) * C;
      for (int c = lane; c < C; c += 32) {
        const double p = exp(double(z[c] - zmax) - log_sum);
        d[c] = valid ? float((p - (c == y ? 1.0 : 0.0)) * grad_scale) : 0.0f;
      }
    }
  }
  if (lane == 0) {
    block_loss[warp] = loss;
    block_hits[warp] = hit;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double l = 0.0;
    unsigned long long h = 0;
    for (int k = 0; k < softmax_warps; ++k) l += block_loss[k], h += block_hits[k];
    atomicAdd(loss_sum, l);
    if (h) atomicAdd(correct, h);
  }
}

// ---- optimizers and the ring's reduction --------------------------------------------------------------
// Each has a scalar kernel and a float4 kernel; the float4 one runs when every pointer is 16-byte aligned
// (cudaMalloc gives 256), and the scalar one finishes the last n % 4 elements.

__device__ __forceinline__ void adam_one(float& w, float& m, float& v, float g, float alpha, float c1, float c2,
                                         float eps) {
  // The CPU's order of operations, so both round the same way (up to FMA contraction).
  const float mi = m + (g - m) * c1;
  const float vi = v + (g * g - v) * c2;
  m = mi;
  v = vi;
  w -= alpha * mi / (sqrtf(vi) + eps);
}

__global__ void adam_kernel(float* w, float* m, float* v, const float* g, size_t n, float alpha, float c1, float c2,
                            float eps) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    adam_one(w[i], m[i], v[i], g[i], alpha, c1, c2, eps);
}

__global__ void adam_kernel4(float4* w, float4* m, float4* v, const float4* g, size_t n4, float alpha, float c1,
                             float c2, float eps) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
    float4 wi = w[i], mi = m[i], vi = v[i];
    const float4 gi = g[i];
    adam_one(wi.x, mi.x, vi.x, gi.x, alpha, c1, c2, eps);
    adam_one(wi.y, mi.y, vi.y, gi.y, alpha, c1, c2, eps);
    adam_one(wi.z, mi.z, vi.z, gi.z, alpha, c1, c2, eps);
    adam_one(wi.w, mi.w, vi.w, gi.w, alpha, c1, c2, eps);
    w[i] = wi, m[i] = mi, v[i] = vi;
  }
}

__device__ __forceinline__ void sgd_one(float& w, float& vel, float g, float lr, float momentum) {
  vel = momentum * vel - lr * g;
  w += vel;
}

__global__ void sgd_kernel(float* w, float* vel, const float* g, size_t n, float lr, float momentum) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    sgd_one(w[i], vel[i], g[i], lr, momentum);
}

__global__ void sgd_kernel4(float4* w, float4* vel, const float4* g, size_t n4, float lr, float momentum) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
    float4 wi = w[i], vi = vel[i];
    const float4 gi = g[i];
    sgd_one(wi.x, vi.x, gi.x, lr, momentum);
    sgd_one(wi.y, vi.y, gi.y, lr, momentum);
    sgd_one(wi.z, vi.z, gi.z, lr, momentum);
    sgd_one(wi.w, vi.w, gi.w, lr, momentum);
    w[i] = wi, vel[i] = vi;
  }
}

__global__ void add_kernel(float* dst, const float* src, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    dst[i] += src[i];
}

__global__ void add_kernel4(float4* dst, const float4* src, size_t n4) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
    float4 d = dst[i];
    const float4 s = src[i];
    d.x += s.x, d.y += s.y, d.z += s.z, d.w += s.w;
    dst[i] = d;
  }
}

}  // namespace

// ---- the public functions ---------------------------------------------------------------------------------

void dense_forward(const cuda_context& ctx, float* out, const float* in, const float* w, const float* b, int B,
                   int IN, int OUT) {
  dense_forward_impl<false>(ctx, out, in, w, b, B, IN, OUT);
}

void dense_relu_forward(const cuda_context& ctx, float* out, const float* in, const float* w, const float* b,
                        int B, int IN, int OUT) {
  dense_forward_impl<true>(ctx, out, in, w, b, B, IN, OUT);
}

void dense_backward(const cuda_context& ctx, float* din, float* dw, float* db, const float* dout, const float* in,
                    const float* w, int B, int IN, int OUT) {
  if (IN <= 0 || OUT <= 0) return;
  if (B <= 0) {  // empty batch: zero gradients, as the CPU's empty sums
    RM_CUDA_CHECK(cudaMemsetAsync(dw, 0, size_t(IN) * OUT * sizeof(float), ctx.stream));
    RM_CUDA_CHECK(cudaMemsetAsync(db, 0, size_t(OUT) * sizeof(float), ctx.stream));
    return;
  }
  const float one = 1.0f, zero = 0.0f;
  // dw (IN, OUT) = in^T * dout  <=>  column-major dw^T (OUT, IN) = dout^T (OUT, B) * in (B, IN),
  // where dout^T is dout's own memory and in is the transpose of in's memory (OP_T).
  RM_CUBLAS_CHECK(cublasSgemm(ctx.blas, CUBLAS_OP_N, CUBLAS_OP_T, OUT, IN, B, &one, dout, OUT, in, IN, &zero, dw, OUT));
  // db (OUT) = column sums of dout (B, OUT)
  column_sum(ctx, db, dout, B, OUT);
  // din (B, IN) = dout * w^T  <=>  column-major din^T (IN, B) = w (IN, OUT) * dout^T (OUT, B),
  // where w is the transpose of w's memory (OP_T) and dout^T is dout's memory.
  if (din)
    RM_CUBLAS_CHECK(
        cublasSgemm(ctx.blas, CUBLAS_OP_T, CUBLAS_OP_N, IN, B, OUT, &one, w, OUT, dout, OUT, &zero, din, IN));
}

void relu_forward(const cuda_context& ctx, float* out, const float* in, size_t n) {
  if (!n) return;
  relu_forward_kernel<<<grid_for(ctx, n), threads_per_block, 0, ctx.stream>>>(out, in, n);
  RM_CUDA_CHECK(cudaGetLastError());
}

void relu_backward(const cuda_context& ctx, float* din, const float* dout, const float* out, size_t n) {
  if (!n) return;
  relu_backward_kernel<<<grid_for(ctx, n), threads_per_block, 0, ctx.stream>>>(din, dout, out, n);
  RM_CUDA_CHECK(cudaGetLastError());
}

void softmax_xent(const cuda_context& ctx, float* dlogits, double* loss_sum, int64_t* correct,
                  const float* logits, const int32_t* labels, int B, int C, float grad_scale) {
  if (B <= 0 || C <= 0) return;
  static_assert(sizeof(int64_t) == sizeof(unsigned long long));
  // Adding as unsigned is the same two's-complement addition; atomicAdd has no int64 overload.
  auto* hits = reinterpret_cast<unsigned long long*>(correct);
  const int blocks = (B + softmax_warps - 1) / softmax_warps;
  softmax_xent_kernel<<<blocks, softmax_warps * 32, 0, ctx.stream>>>(dlogits, loss_sum, hits, logits, labels, B, C,
                                                                     grad_scale);
  RM_CUDA_CHECK(cudaGetLastError());
}

void adam_update(const cuda_context& ctx, float* w, float* m, float* v, const float* g, size_t n, float lr,
                 float b1, float b2, float eps, int64_t t) {
  if (!n) return;
  // Bias corrections folded into one step size, in double on the host exactly as cpu::adam_update.
  const double b1t = std::pow(double(b1), double(t)), b2t = std::pow(double(b2), double(t));
  const float alpha = float(lr * std::sqrt(1.0 - b2t) / (1.0 - b1t));
  const float c1 = 1.0f - b1, c2 = 1.0f - b2;
  size_t done = 0;
  if (aligned16(w) && aligned16(m) && aligned16(v) && aligned16(g) && n >= 4) {
    const size_t n4 = n / 4;
    adam_kernel4<<<grid_for(ctx, n4), threads_per_block, 0, ctx.stream>>>(
        reinterpret_cast<float4*>(w), reinterpret_cast<float4*>(m), reinterpret_cast<float4*>(v),
        reinterpret_cast<const float4*>(g), n4, alpha, c1, c2, eps);
    RM_CUDA_CHECK(cudaGetLastError());
    done = n4 * 4;
  }
  if (done < n) {
    adam_kernel<<<grid_for(ctx, n - done), threads_per_block, 0, ctx.stream>>>(w + done, m + done, v + done, g + done,
                                                                               n - done, alpha, c1, c2, eps);
    RM_CUDA_CHECK(cudaGetLastError());
  }
}

void sgd_update(const cuda_context& ctx, float* w, float* vel, const float* g, size_t n, float lr, float momentum) {
  if (!n) return;
  size_t done = 0;
  if (aligned16(w) && aligned16(vel) && aligned16(g) && n >= 4) {
    const size_t n4 = n / 4;
    sgd_kernel4<<<grid_for(ctx, n4), threads_per_block, 0, ctx.stream>>>(
        reinterpret_cast<float4*>(w), reinterpret_cast<float4*>(vel), reinterpret_cast<const float4*>(g), n4, lr,
        momentum);
    RM_CUDA_CHECK(cudaGetLastError());
    done = n4 * 4;
  }
  if (done < n) {
    sgd_kernel<<<grid_for(ctx, n - done), threads_per_block, 0, ctx.stream>>>(w + done, vel + done, g + done,
                                                                              n - done, lr, momentum);
    RM_CUDA_CHECK(cudaGetLastError());
  }
}

void add_inplace(const cuda_context& ctx, float* dst, const float* src, size_t n) {
  if (!n) return;
  size_t done = 0;
  if (aligned16(dst) && aligned16(src) && n >= 4) {
    const size_t n4 = n / 4;
    add_kernel4<<<grid_for(ctx, n4), threads_per_block, 0, ctx.stream>>>(reinterpret_cast<float4*>(dst),
                                                                         reinterpret_cast<const float4*>(src), n4);
    RM_CUDA_CHECK(cudaGetLastError());
    done = n4 * 4;
  }
  if (done < n) {
    add_kernel<<<grid_for(ctx, n - done), threads_per_block, 0, ctx.stream>>>(dst + done, src + done, n - done);
    RM_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace ringmaster::cuda
