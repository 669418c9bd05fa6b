// Row loops shared by decode.cpp (the decoding step) and learner.cpp (the learner's autograd ops).
#pragma once

#include <ATen/Parallel.h>

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace reinforge_kernels {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight for `rows` vectors of length n (x + r * n);
// rstd[r] = 1 / sqrt(mean(x[r]^2) + eps) when rstd is not null. out may be x.
inline void rms_norm_rows(float* out, float* rstd, const float* x, const float* weight, int64_t rows, int64_t n,
                          float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / n + eps);
      if (rstd) rstd[r] = inv;
      float* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * inv * weight[i];
    }
  });
}

// out[r] = silu(gate[r]) * up[r] of gate_up rows [gate | up] (2I wide), out rows I wide.
inline void swiglu_rows(float* out, const float* gate_up, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gate_up + r * 2 * I;
      float* o = out + r * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * g[I + i];
    }
  });
}

// f(std::integral_constant<int, D>{}) for a head dim the kernels are compiled for (kernels.HEAD_DIMS).
template <typename F>
void with_head_dim(int64_t D, F&& f) {
  switch (D) {
#define REINFORGE_HEAD_DIM(DD) case DD: f(std::integral_constant<int, DD>{}); break;
    REINFORGE_HEAD_DIM(8) REINFORGE_HEAD_DIM(16) REINFORGE_HEAD_DIM(32) REINFORGE_HEAD_DIM(64)
    REINFORGE_HEAD_DIM(80) REINFORGE_HEAD_DIM(96) REINFORGE_HEAD_DIM(128) REINFORGE_HEAD_DIM(256)
#undef REINFORGE_HEAD_DIM
    default: TORCH_CHECK(false, "reinforge_kernels: head_dim ", D, " is not compiled in");
  }
}

}  // namespace reinforge_kernels
