// CPU kernels through Eigen. Built with the host's vector instructions (-march=native by default).
#include "kernels/cpu_kernels.hpp"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>

namespace ringmaster::cpu {

using mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using map = Eigen::Map<mat>;
using cmap = Eigen::Map<const mat>;
using cvec = Eigen::Map<const Eigen::RowVectorXf>;

void dense_forward(float* out, const float* in, const float* w, const float* b, int B, int IN, int OUT) {
  map y(out, B, OUT);
  y.noalias() = cmap(in, B, IN) * cmap(w, IN, OUT);
  y.rowwise() += cvec(b, OUT);
}

void dense_relu_forward(float* out, const float* in, const float* w, const float* b, int B, int IN, int OUT) {
  map y(out, B, OUT);
  y.noalias() = cmap(in, B, IN) * cmap(w, IN, OUT);
  y = (y.rowwise() + cvec(b, OUT)).cwiseMax(0.0f);
}

void dense_backward(float* din, float* dw, float* db, const float* dout, const float* in, const float* w,
                    int B, int IN, int OUT) {
  cmap dy(dout, B, OUT);
  map(dw, IN, OUT).noalias() = cmap(in, B, IN).transpose() * dy;
  Eigen::Map<Eigen::RowVectorXf>(db, OUT) = dy.colwise().sum();
  if (din) map(din, B, IN).noalias() = dy * cmap(w, IN, OUT).transpose();
}

void relu_forward(float* out, const float* in, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = in[i] > 0.0f ? in[i] : 0.0f;
}

void relu_backward(float* din, const float* dout, const float* out, size_t n) {
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

void adam_update(float* w, float* m, float* v, const float* g, size_t n, float lr, float b1, float b2,
                 float eps, int64_t t) {
  const double b1t = std::pow(double(b1), double(t)), b2t = std::pow(double(b2), double(t));
  const float alpha = float(lr * std::sqrt(1.0 - b2t) / (1.0 - b1t));
  const float c1 = 1.0f - b1, c2 = 1.0f - b2;
  for (size_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = m[i] + (gi - m[i]) * c1;
    const float vi = v[i] + (gi * gi - v[i]) * c2;
    m[i] = mi;
    v[i] = vi;
    w[i] -= alpha * mi / (std::sqrt(vi) + eps);
  }
}

void sgd_update(float* w, float* vel, const float* g, size_t n, float lr, float momentum) {
  for (size_t i = 0; i < n; ++i) {
    vel[i] = momentum * vel[i] - lr * g[i];
    w[i] += vel[i];
  }
}

void add_inplace(float* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace ringmaster::cpu
