// CUDA twins of the convolution, pooling, dropout and layout kernels of kernels/cpu_kernels.cpp, bit for
// bit the CPU's results (the same additions in the same order; no atomics).
#include <cstdint>

#include "kernels/counter_rng.hpp"
#include "kernels/cuda_kernels.hpp"
#include "kernels/cuda_launch.cuh"

namespace ringmaster::cuda {
namespace {

// ---- convolution and pooling over channels-last images -------------------------------------------------
// One thread per OUTPUT element everywhere, the backward passes included (gathers): each element is
// written exactly once, by one thread, with no atomics, and sums run in the CPU twin's order.

// First and last output positions (along one axis) whose window [o*S - P, o*S - P + K) covers input
// position i, clamped to [0, O); empty (first > last) when none does.
__device__ __forceinline__ void covering(int i, int K, int S, int P, int O, int* first, int* last) {
  const int lo = i + P - K + 1;  // o*S >= lo
  *first = lo <= 0 ? 0 : (lo + S - 1) / S;
  *last = min(O - 1, (i + P) / S);  // o*S <= i + P (i + P >= 0)
}

// col (B*OH*OW, KH*KW*C): element i is (b, oy, ox, kh, kw, c) row-major.
template <class I>
__global__ void im2col_kernel(I n, float* col, const float* x, conv_geometry g) {
  RM_GRID_STRIDE(I, i, n) {
    I t = i;
    const int c = int(t % I(g.C));
    t /= I(g.C);
    const int kw = int(t % I(g.KW));
    t /= I(g.KW);
    const int kh = int(t % I(g.KH));
    t /= I(g.KH);
    const int ox = int(t % I(g.OW));
    t /= I(g.OW);
    const int oy = int(t % I(g.OH));
    const I b = t / I(g.OH);
    const int iy = oy * g.SH - g.PH + kh, ix = ox * g.SW - g.PW + kw;
    col[i] = iy >= 0 && iy < g.H && ix >= 0 && ix < g.W ? x[((b * I(g.H) + I(iy)) * I(g.W) + I(ix)) * I(g.C) + I(c)]
                                                        : 0.0f;
  }
}

// dx (B, H, W, C): element i is (b, iy, ix, c). cpu::col2im adds patch rows in output-pixel order (oy,
// then ox) into a zeroed dx; here the same terms are added to 0.0f in the same order.
template <class I>
__global__ void col2im_kernel(I n, float* dx, const float* col, conv_geometry g) {
  const I patch = I(g.KH) * I(g.KW) * I(g.C);
  RM_GRID_STRIDE(I, i, n) {
    I t = i;
    const int c = int(t % I(g.C));
    t /= I(g.C);
    const int ix = int(t % I(g.W));
    t /= I(g.W);
    const int iy = int(t % I(g.H));
    const I b = t / I(g.H);
    int oy0, oy1, ox0, ox1;
    covering(iy, g.KH, g.SH, g.PH, g.OH, &oy0, &oy1);
    covering(ix, g.KW, g.SW, g.PW, g.OW, &ox0, &ox1);
    float s = 0.0f;
    for (int oy = oy0; oy <= oy1; ++oy) {
      const int kh = iy + g.PH - oy * g.SH;  // in [0, KH) by the choice of oy0, oy1
      const I row0 = (b * I(g.OH) + I(oy)) * I(g.OW);
      for (int ox = ox0; ox <= ox1; ++ox) {
        const int kw = ix + g.PW - ox * g.SW;
        s += col[(row0 + I(ox)) * patch + I((kh * g.KW + kw) * g.C + c)];
      }
    }
    dx[i] = s;
  }
}

// out, arg (B, OH, OW, C): element i is (b, oy, ox, c). cpu::maxpool_forward's scan: the window's pixels
// inside the image in (kh, kw) order, the first taken, a later one only when strictly greater or NaN (a
// NaN stays once taken; arg names the last NaN), as on the CPU.
template <class I>
__global__ void maxpool_forward_kernel(I n, float* out, int32_t* arg, const float* in, conv_geometry g) {
  RM_GRID_STRIDE(I, i, n) {
    I t = i;
    const int c = int(t % I(g.C));
    t /= I(g.C);
    const int ox = int(t % I(g.OW));
    t /= I(g.OW);
    const int oy = int(t % I(g.OH));
    const I b = t / I(g.OH);
    const float* img = in + b * (I(g.H) * I(g.W) * I(g.C));
    float best = 0.0f;
    int32_t at = -1;  // a window wholly in the padding: 0, routed nowhere
    bool first = true;
    for (int kh = 0; kh < g.KH; ++kh) {
      const int iy = oy * g.SH - g.PH + kh;
      if (iy < 0 || iy >= g.H) continue;
      for (int kw = 0; kw < g.KW; ++kw) {
        const int ix = ox * g.SW - g.PW + kw;
        if (ix < 0 || ix >= g.W) continue;
        const int32_t a = int32_t((iy * g.W + ix) * g.C + c);
        const float p = img[a];
        if (first || p > best || p != p) best = p, at = a;  // a NaN stays, as on the CPU (pool_merge)
        first = false;
      }
    }
    out[i] = best;
    arg[i] = at;
  }
}

// din (B, H, W, C): element i is (b, iy, ix, c); it collects dout of every window covering it whose
// recorded maximum is this element, in (oy, ox) order as cpu::maxpool_backward's scan over dout.
template <class I>
__global__ void maxpool_backward_kernel(I n, float* din, const float* dout, const int32_t* arg, conv_geometry g) {
  RM_GRID_STRIDE(I, i, n) {
    I t = i;
    const int c = int(t % I(g.C));
    t /= I(g.C);
    const int ix = int(t % I(g.W));
    t /= I(g.W);
    const int iy = int(t % I(g.H));
    const I b = t / I(g.H);
    const int32_t me = int32_t((iy * g.W + ix) * g.C + c);
    int oy0, oy1, ox0, ox1;
    covering(iy, g.KH, g.SH, g.PH, g.OH, &oy0, &oy1);
    covering(ix, g.KW, g.SW, g.PW, g.OW, &ox0, &ox1);
    float s = 0.0f;
    for (int oy = oy0; oy <= oy1; ++oy)
      for (int ox = ox0; ox <= ox1; ++ox) {
        const I o = ((b * I(g.OH) + I(oy)) * I(g.OW) + I(ox)) * I(g.C) + I(c);
        if (arg[o] == me) s += dout[o];
      }
    din[i] = s;
  }
}

// Element i is (sample b, element e). Each thread reads its element before writing it: out may alias in.
template <class I>
__global__ void dropout_kernel(I n, float* out, const float* in, I per_sample, float rate, float scale,
                               uint64_t stream, int64_t first_sample) {
  RM_GRID_STRIDE(I, i, n) {
    const I b = i / per_sample, e = i - b * per_sample;
    const float x = in[i];
    out[i] = uniform01(stream, first_sample + int64_t(b), uint64_t(e)) >= rate ? x * scale : 0.0f;
  }
}

// out (B, H, W, C): element i is (b, p = y * W + x, c), read from in (B, C, H, W).
template <class I>
__global__ void nchw_to_nhwc_kernel(I n, float* out, const float* in, int C, I hw) {
  RM_GRID_STRIDE(I, i, n) {
    I t = i;
    const I c = t % I(C);
    t /= I(C);
    const I p = t % hw;
    const I b = t / hw;
    out[i] = in[(b * I(C) + c) * hw + p];
  }
}

}  // namespace

// ---- convolution and pooling ----------------------------------------------------------------------------

void im2col(const cuda_context& ctx, float* col, const float* x, const conv_geometry& g, int B) {
  const size_t n = size_t(B) * g.OH * g.OW * g.patch(), in = size_t(B) * g.H * g.W * g.C;
  if (!n) return;
  RM_LAUNCH_INDEXED(im2col_kernel, ctx, n, std::max(n, in), col, x, g);
}

void col2im(const cuda_context& ctx, float* dx, const float* col, const conv_geometry& g, int B) {
  const size_t n = size_t(B) * g.H * g.W * g.C, cols = size_t(B) * g.OH * g.OW * g.patch();
  if (!n) return;
  RM_LAUNCH_INDEXED(col2im_kernel, ctx, n, std::max(n, cols), dx, col, g);
}

void maxpool_forward(const cuda_context& ctx, float* out, int32_t* arg, const float* in, const conv_geometry& g,
                     int B) {
  const size_t n = size_t(B) * g.OH * g.OW * g.C, ins = size_t(B) * g.H * g.W * g.C;
  if (!n) return;
  RM_LAUNCH_INDEXED(maxpool_forward_kernel, ctx, n, std::max(n, ins), out, arg, in, g);
}

void maxpool_backward(const cuda_context& ctx, float* din, const float* dout, const int32_t* arg,
                      const conv_geometry& g, int B) {
  const size_t n = size_t(B) * g.H * g.W * g.C, outs = size_t(B) * g.OH * g.OW * g.C;
  if (!n) return;
  RM_LAUNCH_INDEXED(maxpool_backward_kernel, ctx, n, std::max(n, outs), din, dout, arg, g);
}

void dropout(const cuda_context& ctx, float* out, const float* in, int B, size_t per_sample, float rate,
             uint64_t stream, int64_t first_sample) {
  const size_t n = size_t(B > 0 ? B : 0) * per_sample;
  if (!n) return;
  const float scale = 1.0f / (1.0f - rate);  // as cpu::dropout, in float on the host
  if (fits32(n))
    dropout_kernel<uint32_t><<<grid_for(ctx, n), threads_per_block, 0, ctx.stream>>>(
        uint32_t(n), out, in, uint32_t(per_sample), rate, scale, stream, first_sample);
  else
    dropout_kernel<size_t><<<grid_for(ctx, n), threads_per_block, 0, ctx.stream>>>(n, out, in, per_sample, rate,
                                                                                   scale, stream, first_sample);
  RM_CUDA_CHECK(cudaGetLastError());
}

void nchw_to_nhwc(const cuda_context& ctx, float* out, const float* in, int B, int C, int H, int W) {
  const size_t hw = size_t(H > 0 ? H : 0) * size_t(W > 0 ? W : 0), n = size_t(B > 0 ? B : 0) * size_t(C > 0 ? C : 0) * hw;
  if (!n) return;
  if (fits32(n))
    nchw_to_nhwc_kernel<uint32_t><<<grid_for(ctx, n), threads_per_block, 0, ctx.stream>>>(uint32_t(n), out, in, C,
                                                                                          uint32_t(hw));
  else
    nchw_to_nhwc_kernel<size_t><<<grid_for(ctx, n), threads_per_block, 0, ctx.stream>>>(n, out, in, C, hw);
  RM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringmaster::cuda
