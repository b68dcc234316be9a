// CPU kernels: plain functions over pointers and sizes (row-major, float32).
// kernels/cuda_kernels.hpp declares CUDA twins with the same signatures.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/backend.hpp"

namespace ringmaster::cpu {

// Denormal floats are ~100x slower on x86; Adam's second moments drift into that range as training
// goes on. Flush them to zero on the calling thread (as TensorFlow's CPU executor does). Cheap: call often.
void flush_denormals_on_this_thread();
// Keeps OpenBLAS (when built with it) from starting its own threads.
void use_one_blas_thread();
// Whose GEMM the backward pass runs on this machine: "eigen", or "openblas (KERNEL)" (see gemm()).
std::string gemm_name();

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

// Convolution as im2col + the dense kernels: col (B*OH*OW, KH*KW*C) holds, per output pixel, its input
// patch in (kh, kw, c) order, zeros where the patch hangs over the padding. x is (B, H, W, C).
void im2col(float* col, const float* x, const conv_geometry& g, int B);
// The adjoint: dx (B, H, W, C) = the sum of every patch row's entries back at their pixels (overwrites dx).
void col2im(float* dx, const float* col, const conv_geometry& g, int B);
// out (B, OH, OW, C) = the max of each window (padding ignored); arg = where it was, as an index into
// the sample's (H, W, C) input. The first of equal maxima wins (scan order kh, kw).
void maxpool_forward(float* out, int32_t* arg, const float* in, const conv_geometry& g, int B);
// din (B, H, W, C) = dout routed back to the recorded maxima (overwrites din; overlapping windows add).
void maxpool_backward(float* din, const float* dout, const int32_t* arg, const conv_geometry& g, int B);
// Inverted dropout over B samples of per_sample floats: element e of sample s (the batch's first sample
// being first_sample) is kept, times 1/(1-rate), when uniform01(stream, first_sample + s, e) >= rate.
// The same call on dL/dy gives dL/dx (the mask is a function of its key). out may alias in.
void dropout(float* out, const float* in, int B, size_t per_sample, float rate, uint64_t stream,
             int64_t first_sample);
// (B, C, H, W) -> (B, H, W, C).
void nchw_to_nhwc(float* out, const float* in, int B, int C, int H, int W);

}  // namespace ringmaster::cpu
