// PyTorch bindings of the fused kernels (module `tripod_fused`). Each function checks its
// tensors, allocates outputs and launches on the CUDA stream whose handle it is given
// (torch.cuda.current_stream().cuda_stream), so only torch/extension.h and the CUDA runtime
// are needed. engine/ops wraps them in autograd functions beside the plain PyTorch versions.

#include <cuda_runtime.h>
#include <torch/extension.h>

#include <algorithm>
#include <tuple>

#include "fused.h"

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return tripod::kFloat32;
    case at::kHalf:
      return tripod::kFloat16;
    case at::kBFloat16:
      return tripod::kBFloat16;
    default:
      TORCH_CHECK(false, "fused kernels take float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void ok(cudaError_t status) {
  TORCH_CHECK(status == cudaSuccess, "fused kernel launch failed: ", cudaGetErrorString(status));
}

cudaStream_t as_stream(int64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

int backward_blocks(int64_t rows) {
  int device = 0, sms = 1;
  ok(cudaGetDevice(&device));
  ok(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, 4LL * sms)));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& w,
                                                double eps, int64_t stream) {
  check(x, "x");
  check(w, "weight");
  const int cols = static_cast<int>(x.size(-1));
  const int64_t rows = x.numel() / cols;
  auto y = at::empty_like(x);
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  ok(tripod::rms_norm_forward(x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr<float>(),
                              rows, cols, static_cast<float>(eps), dtype_code(x), as_stream(stream)));
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                const at::Tensor& w, const at::Tensor& rstd, int64_t stream) {
  check(dy, "grad");
  check(x, "x");
  const int cols = static_cast<int>(x.size(-1));
  const int64_t rows = x.numel() / cols;
  const int blocks = backward_blocks(rows);
  auto dx = at::empty_like(x);
  auto partial = at::empty({blocks, cols}, x.options().dtype(at::kFloat));
  ok(tripod::rms_norm_backward(dy.data_ptr(), x.data_ptr(), w.data_ptr(),
                               rstd.data_ptr<float>(), dx.data_ptr(),
                               partial.data_ptr<float>(), blocks, rows, cols, dtype_code(x),
                               as_stream(stream)));
  return {dx, partial.sum(0).to(w.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x,
                                                              const at::Tensor& w,
                                                              const at::Tensor& b, double eps, int64_t stream) {
  check(x, "x");
  check(w, "weight");
  check(b, "bias");
  const int cols = static_cast<int>(x.size(-1));
  const int64_t rows = x.numel() / cols;
  auto y = at::empty_like(x);
  auto mean = at::empty({rows}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  ok(tripod::layer_norm_forward(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(),
                                mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, cols,
                                static_cast<float>(eps), dtype_code(x), as_stream(stream)));
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(const at::Tensor& dy,
                                                              const at::Tensor& x,
                                                              const at::Tensor& w,
                                                              const at::Tensor& mean,
                                                              const at::Tensor& rstd, int64_t stream) {
  check(dy, "grad");
  check(x, "x");
  const int cols = static_cast<int>(x.size(-1));
  const int64_t rows = x.numel() / cols;
  const int blocks = backward_blocks(rows);
  auto dx = at::empty_like(x);
  auto dw = at::empty({blocks, cols}, x.options().dtype(at::kFloat));
  auto db = at::empty({blocks, cols}, x.options().dtype(at::kFloat));
  ok(tripod::layer_norm_backward(dy.data_ptr(), x.data_ptr(), w.data_ptr(),
                                 mean.data_ptr<float>(), rstd.data_ptr<float>(), dx.data_ptr(),
                                 dw.data_ptr<float>(), db.data_ptr<float>(), blocks, rows, cols,
                                 dtype_code(x), as_stream(stream)));
  return {dx, dw.sum(0).to(w.scalar_type()), db.sum(0).to(w.scalar_type())};
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  bool inverse, int64_t stream) {
  check(x, "x");
  check(cos, "cos");
  check(sin, "sin");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "cos/sin tables must be float32");
  const int dim = static_cast<int>(x.size(-1));
  const int64_t seq = x.size(0);
  const int64_t rest = x.numel() / (seq * dim);
  auto y = at::empty_like(x);
  ok(tripod::rotary(x.data_ptr(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr(),
                    seq, rest, dim, inverse ? -1.0f : 1.0f, dtype_code(x), as_stream(stream)));
  return y;
}

at::Tensor swiglu_fwd(const at::Tensor& h, int64_t stream) {
  check(h, "input");
  const int f = static_cast<int>(h.size(-1) / 2);
  auto sizes = h.sizes().vec();
  sizes.back() = f;
  auto y = at::empty(sizes, h.options());
  ok(tripod::swiglu_forward(h.data_ptr(), y.data_ptr(), h.numel() / (2 * f), f, dtype_code(h),
                            as_stream(stream)));
  return y;
}

at::Tensor swiglu_bwd(const at::Tensor& dy, const at::Tensor& h, int64_t stream) {
  check(dy, "grad");
  check(h, "input");
  const int f = static_cast<int>(h.size(-1) / 2);
  auto dh = at::empty_like(h);
  ok(tripod::swiglu_backward(dy.data_ptr(), h.data_ptr(), dh.data_ptr(), h.numel() / (2 * f), f,
                             dtype_code(h), as_stream(stream)));
  return dh;
}

at::Tensor ce_max(const at::Tensor& logits, int64_t vocab_start, int64_t vocab_size, int64_t stream) {
  check(logits, "logits");
  const int vocab = static_cast<int>(logits.size(-1));
  const int64_t rows = logits.numel() / vocab;
  auto out = at::empty({rows}, logits.options().dtype(at::kFloat));
  ok(tripod::ce_row_max(logits.data_ptr(), out.data_ptr<float>(), rows, vocab, vocab_start,
                        vocab_size, dtype_code(logits), as_stream(stream)));
  return out;
}

std::tuple<at::Tensor, at::Tensor> ce_stats(const at::Tensor& logits, const at::Tensor& row_max,
                                            const at::Tensor& target, int64_t vocab_start,
                                            int64_t vocab_size, int64_t stream) {
  check(logits, "logits");
  check(target, "target");
  TORCH_CHECK(target.scalar_type() == at::kLong, "target must be int64");
  const int vocab = static_cast<int>(logits.size(-1));
  const int64_t rows = logits.numel() / vocab;
  auto sum_exp = at::empty({rows}, logits.options().dtype(at::kFloat));
  auto predicted = at::empty({rows}, logits.options().dtype(at::kFloat));
  ok(tripod::ce_row_stats(logits.data_ptr(), row_max.data_ptr<float>(),
                          target.data_ptr<int64_t>(), sum_exp.data_ptr<float>(),
                          predicted.data_ptr<float>(), rows, vocab, vocab_start, vocab_size,
                          dtype_code(logits), as_stream(stream)));
  return {sum_exp, predicted};
}

at::Tensor ce_bwd(const at::Tensor& logits, const at::Tensor& row_max, const at::Tensor& sum_exp,
                  const at::Tensor& target, const at::Tensor& grad_loss,
                  const at::Tensor& grad_lse, int64_t vocab_start, int64_t vocab_size, int64_t stream) {
  check(logits, "logits");
  check(grad_loss, "grad_loss");
  check(grad_lse, "grad_lse");
  const int vocab = static_cast<int>(logits.size(-1));
  const int64_t rows = logits.numel() / vocab;
  auto grad = at::empty_like(logits);
  ok(tripod::ce_backward(logits.data_ptr(), row_max.data_ptr<float>(), sum_exp.data_ptr<float>(),
                         target.data_ptr<int64_t>(), grad_loss.data_ptr<float>(),
                         grad_lse.data_ptr<float>(), grad.data_ptr(), rows, vocab, vocab_start,
                         vocab_size, dtype_code(logits), as_stream(stream)));
  return grad;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tripod fused CUDA kernels: norms, rotary embedding, SwiGLU, cross-entropy";
  m.def("rms_norm_fwd", &rms_norm_fwd);
  m.def("rms_norm_bwd", &rms_norm_bwd);
  m.def("layer_norm_fwd", &layer_norm_fwd);
  m.def("layer_norm_bwd", &layer_norm_bwd);
  m.def("rotary", &rotary);
  m.def("swiglu_fwd", &swiglu_fwd);
  m.def("swiglu_bwd", &swiglu_bwd);
  m.def("ce_max", &ce_max);
  m.def("ce_stats", &ce_stats);
  m.def("ce_bwd", &ce_bwd);
}
