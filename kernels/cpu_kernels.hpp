// CPU kernels: plain functions over pointers and sizes (row-major, float32).
// kernels/cuda_kernels.hpp declares CUDA twins with the same signatures.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ringmaster::cpu {

// Denormal floats are ~100x slower on x86; Adam's second moments drift into that range as training
// goes on. Flush them to zero on the calling thread (as TensorFlow's CPU executor does). Cheap: call often.
void flush_denormals_on_this_thread();
// Keeps OpenBLAS (when built with it) from starting its own threads.
void use_one_blas_thread();

// out (B, OUT) = in (B, IN) * w (IN, OUT) + b (OUT)
void dense_forward(float* out, const float* in, const float* w, const float* b, int B, int IN, int OUT);
// Same, followed by ReLU, in one pass over out.
void dense_relu_forward(float* out, const float* in, const float* w, const float* b, int B, int IN, int OUT);
// dw (IN, OUT) = in^T * dout; db (OUT) = column sums of dout; din (B, IN) = dout * w^T.
// Overwrites dw, db; din may be null (first layer: no gradient for the input needed).
void dense_backward(float* din, float* dw, float* db, const float* dout, const float* in, const float* w,
                    int B, int IN, int OUT);
void relu_forward(float* out, const float* in, size_t n);
// din = dout where out > 0, else 0. din may alias dout.
void relu_backward(float* din, const float* dout, const float* out, size_t n);
// Numerically stable softmax + sparse categorical cross-entropy over logits (B, C).
// Adds the summed loss to *loss_sum and the number of argmax hits to *correct.
// If dlogits is not null it receives (softmax - onehot) * grad_scale (grad_scale = 1 / global batch).
// A label outside [0, C) counts as a miss with zero gradient.
void softmax_xent(float* dlogits, double* loss_sum, int64_t* correct, const float* logits,
                  const int32_t* labels, int B, int C, float grad_scale);
// Keras Adam (TF >= 2.11): alpha = lr * sqrt(1 - b2^t) / (1 - b1^t); m += (g - m)(1 - b1);
// v += (g^2 - v)(1 - b2); w -= alpha * m / (sqrt(v) + eps). t is the 1-based step.
void adam_update(float* w, float* m, float* v, const float* g, size_t n, float lr, float b1, float b2,
                 float eps, int64_t t);
// Keras SGD with momentum: vel = momentum * vel - lr * g; w += vel.
void sgd_update(float* w, float* vel, const float* g, size_t n, float lr, float momentum);
// dst += src (the ring all-reduce's reduction).
void add_inplace(float* dst, const float* src, size_t n);

}  // namespace ringmaster::cpu
