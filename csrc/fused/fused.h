// Host launchers of the fused kernels (csrc/fused/*.cu), called by bindings.cpp. Pointers are
// device pointers of contiguous tensors; `dtype` is a tripod::DType code; every launcher
// returns the launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tripod {

// dtype codes shared by the kernels and the bindings.
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// RMSNorm over the last dimension: y = w * (x / rms(x)). rstd: [rows] float, saved.
cudaError_t rms_norm_forward(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                             int cols, float eps, int dtype, cudaStream_t stream);
// dx [rows, cols] and per-block partial dw [blocks, cols] (float; sum over dim 0).
cudaError_t rms_norm_backward(const void* dy, const void* x, const void* w, const float* rstd,
                              void* dx, float* dw_partial, int blocks, int64_t rows, int cols,
                              int dtype, cudaStream_t stream);

// LayerNorm: y = (x - mean) * rstd * w + b. mean, rstd: [rows] float, saved.
cudaError_t layer_norm_forward(const void* x, const void* w, const void* b, void* y, float* mean,
                               float* rstd, int64_t rows, int cols, float eps, int dtype,
                               cudaStream_t stream);
// dx, and per-block partial dw and db [blocks, cols] (float).
cudaError_t layer_norm_backward(const void* dy, const void* x, const void* w, const float* mean,
                                const float* rstd, void* dx, float* dw_partial,
                                float* db_partial, int blocks, int64_t rows, int cols, int dtype,
                                cudaStream_t stream);

// Rotary embedding, rotate-half layout, on x [s, rest, d] with cos/sin [s, d] (float).
// sign = +1 applies the rotation (forward), -1 its inverse (the backward of forward).
cudaError_t rotary(const void* x, const float* cos, const float* sin, void* y, int64_t seq,
                   int64_t rest, int dim, float sign, int dtype, cudaStream_t stream);

// SwiGLU on h [rows, 2f] = [gate | up]: y [rows, f] = silu(gate) * up.
cudaError_t swiglu_forward(const void* h, void* y, int64_t rows, int f, int dtype,
                           cudaStream_t stream);
cudaError_t swiglu_backward(const void* dy, const void* h, void* dh, int64_t rows, int f,
                            int dtype, cudaStream_t stream);

// Cross-entropy over vocabulary-split logits [rows, vocab_local]. Columns whose global id
// (vocab_start + column) is >= vocab_size are padding and excluded.
cudaError_t ce_row_max(const void* logits, float* row_max, int64_t rows, int vocab_local,
                       int64_t vocab_start, int64_t vocab_size, int dtype, cudaStream_t stream);
// With the global row max: sum of exp(logit - max) and the target's (logit - max), 0 when the
// target is on another rank.
cudaError_t ce_row_stats(const void* logits, const float* row_max, const int64_t* target,
                         float* sum_exp, float* predicted, int64_t rows, int vocab_local,
                         int64_t vocab_start, int64_t vocab_size, int dtype,
                         cudaStream_t stream);
// d/dlogits of grad_loss * loss + grad_lse * logsumexp, recomputing the softmax on the fly.
cudaError_t ce_backward(const void* logits, const float* row_max, const float* sum_exp,
                        const int64_t* target, const float* grad_loss, const float* grad_lse,
                        void* grad_logits, int64_t rows, int vocab_local, int64_t vocab_start,
                        int64_t vocab_size, int dtype, cudaStream_t stream);

}  // namespace tripod
