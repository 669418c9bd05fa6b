// Fused forward and backward of the decoder's elementwise blocks on CPU, for the learner's
// forward (reinforge.rollout.native.decoder_layers, through reinforge.kernels'
// autograd functions): RMSNorm and SwiGLU.
//
// Why: in PyTorch each is a chain of small ops whose backward is autograd through the chain
// (RMSNorm: pow, mean, add, rsqrt, mul, mul forward and about ten ops back; SwiGLU: silu, mul and
// five back), each a pass over [tokens, width] memory. On the built-in model's SFT batch (3,328
// tokens) they were ~50 ms of a ~190 ms forward + backward whose matmuls take ~125 ms; fused,
// each is one pass forward and one back.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "rows.h"

#include <cmath>
#include <tuple>
#include <vector>

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous() && t.dim() == 2,
              name, " must be a contiguous 2-D float32 CPU tensor");
}

// y = x / sqrt(mean(x^2) + eps) * w over the last dim of x [R, E]; also 1 / sqrt(mean(x^2) + eps) [R].
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm_forward: x");
  const int64_t R = x.size(0), E = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == E, "rms_norm_forward: w must be [E] float32");
  auto y = at::empty({R, E}, x.options());
  auto rstd = at::empty({R}, x.options());
  reinforge_kernels::rms_norm_rows(y.data_ptr<float>(), rstd.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(),
                                   R, E, (float)eps);
  return {y, rstd};
}

// With g = dy * w and r = rstd: dx = r g - x r^3 (g . x) / E; dw = sum over rows of dy * x * r.
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& rstd) {
  check_rows(dy, "rms_norm_backward: dy");
  check_rows(x, "rms_norm_backward: x");
  const int64_t R = x.size(0), E = x.size(1);
  TORCH_CHECK(dy.sizes() == x.sizes() && w.numel() == E && rstd.numel() == R && rstd.is_contiguous() && w.is_contiguous());
  auto dx = at::empty({R, E}, x.options());
  const int threads = at::get_num_threads();
  std::vector<float> partial((size_t)threads * E, 0.f);   // dw per thread, summed below
  const float* dyp = dy.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* rp = rstd.data_ptr<float>();
  float* dxp = dx.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    float* dw = partial.data() + (size_t)at::get_thread_num() * E;
    for (int64_t r = r0; r < r1; ++r) {
      const float* dyr = dyp + r * E;
      const float* xr = xp + r * E;
      const float inv = rp[r];
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < E; ++i) dot += dyr[i] * wp[i] * xr[i];
      const float c = inv * inv * inv * dot / E;
      float* dxr = dxp + r * E;
#pragma omp simd
      for (int64_t i = 0; i < E; ++i) {
        dxr[i] = inv * dyr[i] * wp[i] - xr[i] * c;
        dw[i] += dyr[i] * xr[i] * inv;
      }
    }
  });
  auto dw = at::empty({E}, w.options());
  float* dwp = dw.data_ptr<float>();
  for (int64_t i = 0; i < E; ++i) {
    float s = 0.f;
    for (int t = 0; t < threads; ++t) s += partial[(size_t)t * E + i];
    dwp[i] = s;
  }
  return {dx, dw};
}

// gu [R, 2I] = [gate | up] -> silu(gate) * up [R, I].
at::Tensor swiglu_forward(const at::Tensor& gu) {
  check_rows(gu, "swiglu_forward: gu");
  const int64_t R = gu.size(0), I = gu.size(1) / 2;
  auto a = at::empty({R, I}, gu.options());
  reinforge_kernels::swiglu_rows(a.data_ptr<float>(), gu.data_ptr<float>(), R, I);
  return a;
}

// d gate = da * up * s (1 + gate (1 - s)), s = sigmoid(gate); d up = da * silu(gate).
at::Tensor swiglu_backward(const at::Tensor& da, const at::Tensor& gu) {
  check_rows(da, "swiglu_backward: da");
  check_rows(gu, "swiglu_backward: gu");
  const int64_t R = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(da.size(0) == R && da.size(1) == I, "swiglu_backward: da must be [R, I]");
  auto dgu = at::empty({R, 2 * I}, gu.options());
  const float* dap = da.data_ptr<float>();
  const float* gp = gu.data_ptr<float>();
  float* dp = dgu.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * 2 * I;
      const float* d = dap + r * I;
      float* o = dp + r * 2 * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float s = 1.f / (1.f + expf(-g[i]));
        o[i] = d[i] * g[I + i] * s * (1.f + g[i] * (1.f - s));
        o[I + i] = d[i] * g[i] * s;
      }
    }
  });
  return dgu;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(reinforge_kernels, m) {
  m.def("rms_norm_forward(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)", &rms_norm_forward);
  m.def("rms_norm_backward(Tensor dy, Tensor x, Tensor w, Tensor rstd) -> (Tensor, Tensor)", &rms_norm_backward);
  m.def("swiglu_forward(Tensor gu) -> Tensor", &swiglu_forward);
  m.def("swiglu_backward(Tensor da, Tensor gu) -> Tensor", &swiglu_backward);
}
