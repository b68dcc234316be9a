// CPU kernels through Eigen. Built with the host's vector instructions (-march=native by default).
#include "kernels/cpu_kernels.hpp"

#include <Eigen/Core>
#if RINGMASTER_HAVE_CBLAS
#include <cblas.h>
#endif
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/counter_rng.hpp"
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace ringmaster::cpu {

using mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using map = Eigen::Map<mat>;
using cmap = Eigen::Map<const mat>;
using cvec = Eigen::Map<const Eigen::RowVectorXf>;

void flush_denormals_on_this_thread() {
#if defined(__SSE__)
  _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ | DAZ
#endif
}

namespace {

void eigen_gemm(bool ta, bool tb, int M, int N, int K, const float* A, const float* B, float* C) {
  map c(C, M, N);
  if (ta && tb) c.noalias() = cmap(A, K, M).transpose() * cmap(B, N, K).transpose();
  else if (ta) c.noalias() = cmap(A, K, M).transpose() * cmap(B, K, N);
  else if (tb) c.noalias() = cmap(A, M, K) * cmap(B, N, K).transpose();
  else c.noalias() = cmap(A, M, K) * cmap(B, K, N);
}

#if RINGMASTER_HAVE_CBLAS
// Whether OpenBLAS's kernel is the faster one for this CPU and this build of Eigen. OpenBLAS picks its
// kernel when it loads, by CPU model: Debian 12's 0.3.21 does not know newer CPUs (Xeon family 6 model
// 207 here, AVX-512) and falls back to its SSE3 "Prescott" kernel, 18-28 GFLOP/s on our backward shapes
// against Eigen's 92-111 (AVX-512, one thread, same run): training took 1.7x longer. Measured here too,
// Eigen's AVX-512 code matched or beat OpenBLAS's own AVX-512 kernels (SkylakeX 86-91, Cooperlake 88-105
// GFLOP/s); on AVX2 machines OpenBLAS's Haswell and Zen kernels measured 20-25% faster than Eigen's.
bool openblas_is_faster() {
#if defined(__AVX512F__)
  return false;
#elif defined(__AVX2__)
  std::string core = openblas_get_corename();  // "Haswell" in a DYNAMIC_ARCH build, "HASWELL" in others
  for (char& c : core) c = char(std::tolower(static_cast<unsigned char>(c)));
  for (const char* k : {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids"})
    if (core == k) return true;
  return false;  // a fallback older than the vectors Eigen was built for
#else
  return true;  // Eigen built without AVX2: OpenBLAS's kernel is at least as wide
#endif
}
#endif

// C (M, N) = op(A) (M, K) * op(B) (K, N), row-major; op transposes when ta / tb. The backward pass's
// GEMMs: OpenBLAS's where it is faster (above), else Eigen's. The choice depends only on the CPU and the
// build, so reruns on one machine stay bit-identical.
void gemm(bool ta, bool tb, int M, int N, int K, const float* A, const float* B, float* C) {
#if RINGMASTER_HAVE_CBLAS
  static const bool blas = openblas_is_faster();  // a property of the machine, fixed while the process runs
  if (blas)
    return cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A,
                       ta ? M : K, B, tb ? K : N, 0.0f, C, N);
#endif
  eigen_gemm(ta, tb, M, N, K, A, B, C);
}

}  // namespace

#if RINGMASTER_HAVE_CBLAS
extern "C" void openblas_set_num_threads(int);
void use_one_blas_thread() { openblas_set_num_threads(1); }
std::string gemm_name() { return openblas_is_faster() ? std::string("openblas (") + openblas_get_corename() + ")" : "eigen"; }
#else
void use_one_blas_thread() {}
std::string gemm_name() { return "eigen"; }
#endif

// The forward pass must be batch-invariant: a sample's activations must not depend on how many other
// samples share its GEMM, or N replicas (B/N rows each) and one replica (B rows) round differently, a
// ReLU near zero flips, and the runs drift apart. Eigen's GEMM gives every whole block of 4 rows the same
// bits whatever the batch (the rest is padded, below); OpenBLAS switches to its small-matrix kernel below
// some M*N*K (e.g. 12x784x64) and rounds differently there, so the forward stays on Eigen.
// Eigen computes a row-major product in blocks of 4 rows; the last M % 4 rows take another path, and a
// product with rows + IN + OUT < 20 is computed coefficient by coefficient. Either rounds differently.
// So whole blocks of 4 are computed in place and the rest (or a call too small) goes through a padded
// copy of at least 4 and at least 20 - IN - OUT rows: a sample's bits then never depend on the batch.
namespace {
constexpr int row_block = 4, coeff_threshold = 20;

template <class F>
void padded(float* out, const float* in, int B, int IN, int OUT, F&& f) {
  if (B <= 0) return;
  int direct = B / row_block * row_block;
  if (direct + IN + OUT < coeff_threshold) direct = 0;
  if (direct) f(out, in, direct);
  const int rest = B - direct;
  if (!rest) return;
  int rows = std::max(row_block, coeff_threshold - IN - OUT);
  rows = (std::max(rows, rest) + row_block - 1) / row_block * row_block;
  std::vector<float> x(size_t(rows) * IN, 0.0f), y(size_t(rows) * OUT);
  std::copy(in + size_t(direct) * IN, in + size_t(B) * IN, x.begin());
  f(y.data(), x.data(), rows);
  std::copy(y.begin(), y.begin() + ptrdiff_t(size_t(rest) * OUT), out + size_t(direct) * OUT);
}
}  // namespace

void dense_forward(float* out, const float* in, const float* w, const float* b, int B, int IN, int OUT) {
  padded(out, in, B, IN, OUT, [&](float* o, const float* x, int rows) {
    map y(o, rows, OUT);
    y.noalias() = cmap(x, rows, IN) * cmap(w, IN, OUT);
    y.rowwise() += cvec(b, OUT);
  });
}

// max(v, 0), but a NaN stays NaN (as PyTorch's relu): a NaN let through reaches the loss, which stops
// the job at once; turned into 0 it would train on to the end on garbage. -0 becomes +0.
inline float relu(float v) { return !(v <= 0.0f) ? v : 0.0f; }  // NaN <= 0 is false

void dense_relu_forward(float* out, const float* in, const float* w, const float* b, int B, int IN, int OUT) {
  padded(out, in, B, IN, OUT, [&](float* o, const float* x, int rows) {
    map y(o, rows, OUT);
    y.noalias() = cmap(x, rows, IN) * cmap(w, IN, OUT);
    y.rowwise() += cvec(b, OUT);
    for (float* v = o; v != o + size_t(rows) * OUT; ++v) *v = relu(*v);  // Eigen's max leaves NaN to the CPU
  });
}

void dense_backward(float* din, float* dw, float* db, const float* dout, const float* in, const float* w,
                    int B, int IN, int OUT) {
  gemm(true, false, IN, OUT, B, in, dout, dw);  // (IN, OUT) = in^T (IN, B) * dout (B, OUT)
  Eigen::Map<Eigen::RowVectorXf>(db, OUT) = cmap(dout, B, OUT).colwise().sum();
  if (din) gemm(false, true, B, IN, OUT, dout, w, din);  // (B, IN) = dout (B, OUT) * w^T (OUT, IN)
}

void relu_forward(float* out, const float* in, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = relu(in[i]);
}

void relu_backward(float* din, const float* dout, const float* __restrict out, size_t n) {
  for (size_t i = 0; i < n; ++i) din[i] = out[i] > 0.0f ? dout[i] : 0.0f;
}

void softmax_xent(float* dlogits, double* loss_sum, int64_t* correct, const float* logits,
                  const int32_t* labels, int B, int C, float grad_scale) {
  double loss = 0.0;
  int64_t hits = 0;
  for (int i = 0; i < B; ++i) {
    const float* z = logits + size_t(i) * C;
    int arg = 0;
    for (int c = 1; c < C; ++c)
      if (z[c] > z[arg]) arg = c;
    const float zmax = z[arg];
    double sum = 0.0;
    for (int c = 0; c < C; ++c) sum += std::exp(double(z[c] - zmax));
    const double log_sum = std::log(sum);
    const int y = labels[i];
    const bool valid = y >= 0 && y < C;
    if (valid) {
      loss += log_sum - double(z[y] - zmax);  // -log softmax(z)_y, stable
      hits += (arg == y);
    }
    if (dlogits) {
      float* d = dlogits + size_t(i) * C;
      for (int c = 0; c < C; ++c) {
        const double p = std::exp(double(z[c] - zmax) - log_sum);
        d[c] = valid ? float((p - (c == y ? 1.0 : 0.0)) * grad_scale) : 0.0f;
      }
    }
  }
  *loss_sum += loss;
  *correct += hits;
}

// The element-wise loops below are written for the compiler's vectorizer: restrict pointers, and the
// project builds with -fno-math-errno so std::sqrt becomes one vector instruction (with errno it blocks
// vectorization, which made the Adam step half as slow as the whole forward/backward).
namespace {

// One element of the Adam update: its coefficients folded once per call, in double as Keras does.
struct adam_coeffs {
  float alpha, c1, c2, eps;
  adam_coeffs(float lr, float b1, float b2, float eps_, int64_t t) : c1(1.0f - b1), c2(1.0f - b2), eps(eps_) {
    const double b1t = std::pow(double(b1), double(t)), b2t = std::pow(double(b2), double(t));
    alpha = float(lr * std::sqrt(1.0 - b2t) / (1.0 - b1t));
  }
  // w, m, v, g in; the new w, m, v out.
  void step(float w, float m, float v, float g, float* wo, float* mo, float* vo) const {
    const float mi = m + (g - m) * c1;
    const float vi = v + (g * g - v) * c2;
    *mo = mi;
    *vo = vi;
    *wo = w - alpha * mi / (std::sqrt(vi) + eps);
  }
};

inline float sgd_velocity(float vel, float g, float lr, float momentum) { return momentum * vel - lr * g; }

}  // namespace

void adam_update(float* __restrict w, float* __restrict m, float* __restrict v, const float* __restrict g,
                 size_t n, float lr, float b1, float b2, float eps, int64_t t) {
  const adam_coeffs a(lr, b1, b2, eps, t);
  for (size_t i = 0; i < n; ++i) a.step(w[i], m[i], v[i], g[i], &w[i], &m[i], &v[i]);
}

void sgd_update(float* __restrict w, float* __restrict vel, const float* __restrict g, size_t n, float lr,
                float momentum) {
  for (size_t i = 0; i < n; ++i) {
    vel[i] = sgd_velocity(vel[i], g[i], lr, momentum);
    w[i] += vel[i];
  }
}

void add_inplace(float* __restrict dst, const float* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

// ---- convolution and pooling (channels-last) -------------------------------------------------------

void im2col(float* col, const float* x, const conv_geometry& g, int B) {
  const size_t rowlen = size_t(g.KW) * g.C;  // one kernel row of a patch: KW pixels of C channels
  float* c = col;
  for (int b = 0; b < B; ++b) {
    const float* img = x + size_t(b) * g.H * g.W * g.C;
    for (int oy = 0; oy < g.OH; ++oy)
      for (int ox = 0; ox < g.OW; ++ox) {
        const int x0 = ox * g.SW - g.PW;
        const bool inside_x = x0 >= 0 && x0 + g.KW <= g.W;
        for (int kh = 0; kh < g.KH; ++kh, c += rowlen) {
          const int iy = oy * g.SH - g.PH + kh;
          if (iy < 0 || iy >= g.H) {
            std::memset(c, 0, rowlen * sizeof(float));
          } else if (inside_x) {  // the common case: one contiguous run of KW*C floats
            // A plain loop: for runs of a few floats (one channel) a memcpy call costs 4x more.
            const float* __restrict src = img + (size_t(iy) * g.W + x0) * g.C;
            for (size_t i = 0; i < rowlen; ++i) c[i] = src[i];
          } else {
            for (int kw = 0; kw < g.KW; ++kw) {
              const int ix = x0 + kw;
              float* dst = c + size_t(kw) * g.C;
              if (ix < 0 || ix >= g.W) std::memset(dst, 0, size_t(g.C) * sizeof(float));
              else std::memcpy(dst, img + (size_t(iy) * g.W + ix) * g.C, size_t(g.C) * sizeof(float));
            }
          }
        }
      }
  }
}

void col2im(float* dx, const float* col, const conv_geometry& g, int B) {
  std::memset(dx, 0, size_t(B) * g.H * g.W * g.C * sizeof(float));
  const size_t rowlen = size_t(g.KW) * g.C;
  const float* c = col;
  for (int b = 0; b < B; ++b) {
    float* img = dx + size_t(b) * g.H * g.W * g.C;
    for (int oy = 0; oy < g.OH; ++oy)
      for (int ox = 0; ox < g.OW; ++ox) {
        const int x0 = ox * g.SW - g.PW;
        const bool inside_x = x0 >= 0 && x0 + g.KW <= g.W;
        for (int kh = 0; kh < g.KH; ++kh, c += rowlen) {
          const int iy = oy * g.SH - g.PH + kh;
          if (iy < 0 || iy >= g.H) continue;
          float* __restrict row = img + size_t(iy) * g.W * g.C;
          if (inside_x) {  // one contiguous run of KW*C floats, as im2col copied it
            float* __restrict d = row + size_t(x0) * g.C;
            for (size_t i = 0; i < rowlen; ++i) d[i] += c[i];
            continue;
          }
          for (int kw = 0; kw < g.KW; ++kw) {
            const int ix = x0 + kw;
            if (ix < 0 || ix >= g.W) continue;
            float* __restrict d = row + size_t(ix) * g.C;
            const float* s = c + size_t(kw) * g.C;
            for (int ch = 0; ch < g.C; ++ch) d[ch] += s[ch];
          }
        }
      }
  }
}

namespace {
// o = p, a = at + channel index: a window's first cell.
void pool_take(float* __restrict o, int32_t* __restrict a, const float* __restrict p, int32_t at, int C) {
  for (int ch = 0; ch < C; ++ch) o[ch] = p[ch], a[ch] = at + ch;
}
// Where p beats the maximum so far, it becomes the maximum: strict '>', so the first of equals stays;
// a NaN beats all and stays, arg naming the last NaN (as relu, it must reach the loss). Written as selects so the compiler
// vectorizes it (it was 14% of a CNN step as a branchy loop).
void pool_merge(float* __restrict o, int32_t* __restrict a, const float* __restrict p, int32_t at, int C) {
  for (int ch = 0; ch < C; ++ch) {
    const bool more = p[ch] > o[ch] || p[ch] != p[ch];
    o[ch] = more ? p[ch] : o[ch];
    a[ch] = more ? at + ch : a[ch];
  }
}
}  // namespace

void maxpool_forward(float* out, int32_t* arg, const float* in, const conv_geometry& g, int B) {
  const size_t in_sample = size_t(g.H) * g.W * g.C;
  for (int b = 0; b < B; ++b) {
    const float* img = in + size_t(b) * in_sample;
    for (int oy = 0; oy < g.OH; ++oy)
      for (int ox = 0; ox < g.OW; ++ox) {
        float* o = out + ((size_t(b) * g.OH + oy) * g.OW + ox) * g.C;
        int32_t* a = arg + ((size_t(b) * g.OH + oy) * g.OW + ox) * g.C;
        bool first = true;
        for (int kh = 0; kh < g.KH; ++kh) {
          const int iy = oy * g.SH - g.PH + kh;
          if (iy < 0 || iy >= g.H) continue;
          for (int kw = 0; kw < g.KW; ++kw) {
            const int ix = ox * g.SW - g.PW + kw;
            if (ix < 0 || ix >= g.W) continue;
            const int32_t at = int32_t((size_t(iy) * g.W + ix) * g.C);
            if (first) pool_take(o, a, img + at, at, g.C);
            else pool_merge(o, a, img + at, at, g.C);
            first = false;
          }
        }
        if (first)  // a window entirely in the padding (only with absurd padding): zero, routed nowhere
          for (int ch = 0; ch < g.C; ++ch) o[ch] = 0.0f, a[ch] = -1;
      }
  }
}

void maxpool_backward(float* din, const float* dout, const int32_t* arg, const conv_geometry& g, int B) {
  const size_t in_sample = size_t(g.H) * g.W * g.C, out_sample = size_t(g.OH) * g.OW * g.C;
  std::memset(din, 0, size_t(B) * in_sample * sizeof(float));
  for (int b = 0; b < B; ++b) {
    float* d = din + size_t(b) * in_sample;
    const float* go = dout + size_t(b) * out_sample;
    const int32_t* a = arg + size_t(b) * out_sample;
    for (size_t i = 0; i < out_sample; ++i)
      if (a[i] >= 0) d[a[i]] += go[i];
  }
}

void dropout(float* out, const float* in, int B, size_t per_sample, float rate, uint64_t stream,
             int64_t first_sample) {
  const float scale = 1.0f / (1.0f - rate);
  for (int b = 0; b < B; ++b) {
    const int64_t sample = first_sample + b;
    const float* x = in + size_t(b) * per_sample;
    float* y = out + size_t(b) * per_sample;
    for (size_t e = 0; e < per_sample; ++e) y[e] = uniform01(stream, sample, e) >= rate ? x[e] * scale : 0.0f;
  }
}

void nchw_to_nhwc(float* out, const float* in, int B, int C, int H, int W) {
  const size_t hw = size_t(H) * W;
  for (int b = 0; b < B; ++b) {
    const float* s = in + size_t(b) * C * hw;
    float* d = out + size_t(b) * C * hw;
    for (size_t p = 0; p < hw; ++p)
      for (int c = 0; c < C; ++c) d[p * C + c] = s[size_t(c) * hw + p];
  }
}

}  // namespace ringmaster::cpu
