// RMSNorm and LayerNorm, forward and backward, one block per row.
//
// Forward saves per-row statistics (rstd; and mean for LayerNorm). Backward computes dx row by
// row and accumulates the weight (and bias) gradients per block into a [blocks, cols] float
// buffer that the caller sums over its first dimension, so no atomics are needed.

#include "common.cuh"
#include "fused.h"

namespace tripod {
namespace {

template <typename T>
__global__ void rms_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                   T* __restrict__ y, float* __restrict__ rstd, int cols,
                                   float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  T* yr = y + row * cols;
  float sum_sq = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = to_float(xr[c]);
    sum_sq += v * v;
  }
  const float r = rsqrtf(block_sum(sum_sq, scratch) / cols + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    // As the PyTorch path: normalise in float, round to the storage type, then scale.
    const float normed = to_float(from_float<T>(to_float(xr[c]) * r));
    yr[c] = from_float<T>(to_float(w[c]) * normed);
  }
}

template <typename T>
__global__ void rms_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                    const T* __restrict__ w, const float* __restrict__ rstd,
                                    T* __restrict__ dx, float* __restrict__ dw_partial,
                                    int64_t rows, int cols) {
  __shared__ float scratch[32];
  float* dw = dw_partial + static_cast<int64_t>(blockIdx.x) * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) dw[c] = 0.0f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    const T* dyr = dy + row * cols;
    const float r = rstd[row];
    float dot = 0.0f;  // sum over the row of (dy * w) * n, with n = x * rstd
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float n = to_float(xr[c]) * r;
      const float g = to_float(dyr[c]);
      dot += g * to_float(w[c]) * n;
      dw[c] += g * n;
    }
    const float mean_dot = block_sum(dot, scratch) / cols;
    T* dxr = dx + row * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float n = to_float(xr[c]) * r;
      const float dn = to_float(dyr[c]) * to_float(w[c]);
      dxr[c] = from_float<T>(r * (dn - n * mean_dot));
    }
  }
}

template <typename T>
__global__ void layer_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                     const T* __restrict__ b, T* __restrict__ y,
                                     float* __restrict__ mean_out, float* __restrict__ rstd,
                                     int cols, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  float sum = 0.0f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) sum += to_float(xr[c]);
  const float mean = block_sum(sum, scratch) / cols;
  float sum_sq = 0.0f;  // two passes: no cancellation in the variance
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = to_float(xr[c]) - mean;
    sum_sq += d * d;
  }
  const float r = rsqrtf(block_sum(sum_sq, scratch) / cols + eps);
  if (threadIdx.x == 0) {
    mean_out[row] = mean;
    rstd[row] = r;
  }
  T* yr = y + row * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (to_float(xr[c]) - mean) * r;
    yr[c] = from_float<T>(xhat * to_float(w[c]) + to_float(b[c]));
  }
}

template <typename T>
__global__ void layer_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                      const T* __restrict__ w, const float* __restrict__ mean,
                                      const float* __restrict__ rstd, T* __restrict__ dx,
                                      float* __restrict__ dw_partial,
                                      float* __restrict__ db_partial, int64_t rows, int cols) {
  __shared__ float scratch[32];
  float* dw = dw_partial + static_cast<int64_t>(blockIdx.x) * cols;
  float* db = db_partial + static_cast<int64_t>(blockIdx.x) * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    dw[c] = 0.0f;
    db[c] = 0.0f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * cols;
    const T* dyr = dy + row * cols;
    const float m = mean[row], r = rstd[row];
    float sum_g = 0.0f, sum_gx = 0.0f;  // of g = dy * w, and of g * xhat
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float xhat = (to_float(xr[c]) - m) * r;
      const float d = to_float(dyr[c]);
      const float g = d * to_float(w[c]);
      sum_g += g;
      sum_gx += g * xhat;
      dw[c] += d * xhat;
      db[c] += d;
    }
    const float mean_g = block_sum(sum_g, scratch) / cols;
    const float mean_gx = block_sum(sum_gx, scratch) / cols;
    T* dxr = dx + row * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float xhat = (to_float(xr[c]) - m) * r;
      const float g = to_float(dyr[c]) * to_float(w[c]);
      dxr[c] = from_float<T>(r * (g - mean_g - xhat * mean_gx));
    }
  }
}

}  // namespace

cudaError_t rms_norm_forward(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                             int cols, float eps, int dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int threads = block_size_for(cols);
  TRIPOD_DISPATCH(dtype, rms_forward_kernel<scalar_t><<<rows, threads, 0, stream>>>(
                             static_cast<const scalar_t*>(x), static_cast<const scalar_t*>(w),
                             static_cast<scalar_t*>(y), rstd, cols, eps));
  return cudaGetLastError();
}

cudaError_t rms_norm_backward(const void* dy, const void* x, const void* w, const float* rstd,
                              void* dx, float* dw_partial, int blocks, int64_t rows, int cols,
                              int dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int threads = block_size_for(cols);
  TRIPOD_DISPATCH(dtype, rms_backward_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
                             static_cast<const scalar_t*>(dy), static_cast<const scalar_t*>(x),
                             static_cast<const scalar_t*>(w), rstd,
                             static_cast<scalar_t*>(dx), dw_partial, rows, cols));
  return cudaGetLastError();
}

cudaError_t layer_norm_forward(const void* x, const void* w, const void* b, void* y, float* mean,
                               float* rstd, int64_t rows, int cols, float eps, int dtype,
                               cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int threads = block_size_for(cols);
  TRIPOD_DISPATCH(dtype, layer_forward_kernel<scalar_t><<<rows, threads, 0, stream>>>(
                             static_cast<const scalar_t*>(x), static_cast<const scalar_t*>(w),
                             static_cast<const scalar_t*>(b), static_cast<scalar_t*>(y), mean,
                             rstd, cols, eps));
  return cudaGetLastError();
}

cudaError_t layer_norm_backward(const void* dy, const void* x, const void* w, const float* mean,
                                const float* rstd, void* dx, float* dw_partial,
                                float* db_partial, int blocks, int64_t rows, int cols, int dtype,
                                cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int threads = block_size_for(cols);
  TRIPOD_DISPATCH(dtype, layer_backward_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
                             static_cast<const scalar_t*>(dy), static_cast<const scalar_t*>(x),
                             static_cast<const scalar_t*>(w), mean, rstd,
                             static_cast<scalar_t*>(dx), dw_partial, db_partial, rows, cols));
  return cudaGetLastError();
}

}  // namespace tripod
