// Cross-entropy over vocabulary-split logits without materialising the softmax. Per row:
//   1. the local maximum (ranks then all-reduce it to the global maximum);
//   2. sum of exp(logit - max) and the target's logit - max (ranks all-reduce both);
//   3. backward: grad = softmax * (grad_loss + grad_lse) - onehot(target) * grad_loss, with the
//      softmax recomputed from the logits and the two row statistics.
// Columns whose global id is >= vocab_size are vocabulary padding and count as -inf.

#include "common.cuh"
#include "fused.h"

namespace tripod {
namespace {

__device__ __forceinline__ bool is_padding(int col, int64_t vocab_start, int64_t vocab_size) {
  return vocab_start + col >= vocab_size;
}

template <typename T>
__global__ void row_max_kernel(const T* __restrict__ logits, float* __restrict__ row_max,
                               int vocab_local, int64_t vocab_start, int64_t vocab_size) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* lr = logits + row * vocab_local;
  float m = -FLT_MAX;
  for (int c = threadIdx.x; c < vocab_local; c += blockDim.x)
    if (!is_padding(c, vocab_start, vocab_size)) m = fmaxf(m, to_float(lr[c]));
  m = block_max(m, scratch);
  if (threadIdx.x == 0) row_max[row] = m;
}

template <typename T>
__global__ void row_stats_kernel(const T* __restrict__ logits, const float* __restrict__ row_max,
                                 const int64_t* __restrict__ target, float* __restrict__ sum_exp,
                                 float* __restrict__ predicted, int vocab_local,
                                 int64_t vocab_start, int64_t vocab_size) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* lr = logits + row * vocab_local;
  const float m = row_max[row];
  float s = 0.0f;
  for (int c = threadIdx.x; c < vocab_local; c += blockDim.x)
    if (!is_padding(c, vocab_start, vocab_size)) s += expf(to_float(lr[c]) - m);
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) {
    sum_exp[row] = s;
    const int64_t local = target[row] - vocab_start;
    predicted[row] = (local >= 0 && local < vocab_local) ? to_float(lr[local]) - m : 0.0f;
  }
}

template <typename T>
__global__ void backward_kernel(const T* __restrict__ logits, const float* __restrict__ row_max,
                                const float* __restrict__ sum_exp,
                                const int64_t* __restrict__ target,
                                const float* __restrict__ grad_loss,
                                const float* __restrict__ grad_lse, T* __restrict__ grad,
                                int vocab_local, int64_t vocab_start, int64_t vocab_size) {
  const int64_t row = blockIdx.x;
  const T* lr = logits + row * vocab_local;
  T* gr = grad + row * vocab_local;
  const float m = row_max[row], inv = 1.0f / sum_exp[row];
  const float gl = grad_loss[row], weight = gl + grad_lse[row];
  const int64_t local = target[row] - vocab_start;
  for (int c = threadIdx.x; c < vocab_local; c += blockDim.x) {
    float value = 0.0f;
    if (!is_padding(c, vocab_start, vocab_size)) value = expf(to_float(lr[c]) - m) * inv * weight;
    if (c == local) value -= gl;
    gr[c] = from_float<T>(value);
  }
}

}  // namespace

cudaError_t ce_row_max(const void* logits, float* row_max, int64_t rows, int vocab_local,
                       int64_t vocab_start, int64_t vocab_size, int dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int threads = block_size_for(vocab_local);
  TRIPOD_DISPATCH(dtype, row_max_kernel<scalar_t><<<rows, threads, 0, stream>>>(
                             static_cast<const scalar_t*>(logits), row_max, vocab_local,
                             vocab_start, vocab_size));
  return cudaGetLastError();
}

cudaError_t ce_row_stats(const void* logits, const float* row_max, const int64_t* target,
                         float* sum_exp, float* predicted, int64_t rows, int vocab_local,
                         int64_t vocab_start, int64_t vocab_size, int dtype,
                         cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int threads = block_size_for(vocab_local);
  TRIPOD_DISPATCH(dtype, row_stats_kernel<scalar_t><<<rows, threads, 0, stream>>>(
                             static_cast<const scalar_t*>(logits), row_max, target, sum_exp,
                             predicted, vocab_local, vocab_start, vocab_size));
  return cudaGetLastError();
}

cudaError_t ce_backward(const void* logits, const float* row_max, const float* sum_exp,
                        const int64_t* target, const float* grad_loss, const float* grad_lse,
                        void* grad_logits, int64_t rows, int vocab_local, int64_t vocab_start,
                        int64_t vocab_size, int dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int threads = block_size_for(vocab_local);
  TRIPOD_DISPATCH(dtype, backward_kernel<scalar_t><<<rows, threads, 0, stream>>>(
                             static_cast<const scalar_t*>(logits), row_max, sum_exp, target,
                             grad_loss, grad_lse, static_cast<scalar_t*>(grad_logits),
                             vocab_local, vocab_start, vocab_size));
  return cudaGetLastError();
}

}  // namespace tripod
