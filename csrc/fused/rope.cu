// Rotary position embedding in the rotate-half layout: for position p and the pair of
// channels (j, j + d/2) with angle a = cos/sin[p, j]:
//   y_j = x_j cos a - x_{j+d/2} sin a,   y_{j+d/2} = x_{j+d/2} cos a + x_j sin a.
// The inverse rotation (sign = -1) is the backward of the forward one.

#include "common.cuh"
#include "fused.h"

namespace tripod {
namespace {

template <typename T>
__global__ void rotary_kernel(const T* __restrict__ x, const float* __restrict__ cos_table,
                              const float* __restrict__ sin_table, T* __restrict__ y,
                              int64_t pairs, int64_t rest, int dim, float sign) {
  const int half = dim / 2;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(i % half);
    const int64_t vector = i / half;       // index over [s, rest]
    const int64_t position = vector / rest;
    const int64_t base = vector * dim;
    const float c = cos_table[position * dim + j];
    const float s = sign * sin_table[position * dim + j];
    const float a = to_float(x[base + j]);
    const float b = to_float(x[base + j + half]);
    y[base + j] = from_float<T>(a * c - b * s);
    y[base + j + half] = from_float<T>(b * c + a * s);
  }
}

}  // namespace

cudaError_t rotary(const void* x, const float* cos, const float* sin, void* y, int64_t seq,
                   int64_t rest, int dim, float sign, int dtype, cudaStream_t stream) {
  if (dim % 2) return cudaErrorInvalidValue;
  const int64_t pairs = seq * rest * (dim / 2);
  if (pairs == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t wanted = (pairs + threads - 1) / threads;
  const int blocks = static_cast<int>(wanted < 65535 * 8 ? wanted : 65535 * 8);
  TRIPOD_DISPATCH(dtype, rotary_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
                             static_cast<const scalar_t*>(x), cos, sin,
                             static_cast<scalar_t*>(y), pairs, rest, dim, sign));
  return cudaGetLastError();
}

}  // namespace tripod
