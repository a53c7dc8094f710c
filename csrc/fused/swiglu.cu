// SwiGLU: y = silu(gate) * up, with h = [gate | up] along the last dimension.
//   d gate = dy * up * silu'(gate),  silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))
//   d up   = dy * silu(gate)

#include "common.cuh"
#include "fused.h"

namespace tripod {
namespace {

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict__ h, T* __restrict__ y, int64_t n,
                                      int f) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / f, col = i % f;
    const float g = to_float(h[row * 2 * f + col]);
    const float u = to_float(h[row * 2 * f + f + col]);
    y[i] = from_float<T>(g * sigmoid(g) * u);
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ h,
                                       T* __restrict__ dh, int64_t n, int f) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / f, col = i % f;
    const float g = to_float(h[row * 2 * f + col]);
    const float u = to_float(h[row * 2 * f + f + col]);
    const float d = to_float(dy[i]);
    const float sg = sigmoid(g);
    dh[row * 2 * f + col] = from_float<T>(d * u * sg * (1.0f + g * (1.0f - sg)));
    dh[row * 2 * f + f + col] = from_float<T>(d * g * sg);
  }
}

int blocks_for(int64_t n, int threads) {
  const int64_t wanted = (n + threads - 1) / threads;
  return static_cast<int>(wanted < 65535 * 8 ? wanted : 65535 * 8);
}

}  // namespace

cudaError_t swiglu_forward(const void* h, void* y, int64_t rows, int f, int dtype,
                           cudaStream_t stream) {
  const int64_t n = rows * f;
  if (n == 0) return cudaSuccess;
  TRIPOD_DISPATCH(dtype, swiglu_forward_kernel<scalar_t><<<blocks_for(n, 256), 256, 0, stream>>>(
                             static_cast<const scalar_t*>(h), static_cast<scalar_t*>(y), n, f));
  return cudaGetLastError();
}

cudaError_t swiglu_backward(const void* dy, const void* h, void* dh, int64_t rows, int f,
                            int dtype, cudaStream_t stream) {
  const int64_t n = rows * f;
  if (n == 0) return cudaSuccess;
  TRIPOD_DISPATCH(dtype,
                  swiglu_backward_kernel<scalar_t><<<blocks_for(n, 256), 256, 0, stream>>>(
                      static_cast<const scalar_t*>(dy), static_cast<const scalar_t*>(h),
                      static_cast<scalar_t*>(dh), n, f));
  return cudaGetLastError();
}

}  // namespace tripod
