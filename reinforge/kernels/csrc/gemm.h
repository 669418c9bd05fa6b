#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace reinforge_kernels {

// Products of activations with weight matrices, against weights packed into panels (decode.cpp's
// decoding step, learner.cpp's train_layer).
//
// Why: at decoding shapes (tens of rows, K of a few hundred) MKL's sgemm spent about as long
// packing each weight matrix, at every call, as multiplying with it (perf on the 2-core CPU:
// 10% of a generate() in sgemm_scopy against 14% in its kernel). The weights do not change
// during a generation, so they are packed once per DecoderWeights (pack_weight) into 32-column
// panels of w^T, and each step runs a register-blocked kernel over them: 6 rows x 32 columns of
// accumulators, one broadcast of a and two vector loads of the panel per k. On the built-in
// model's 16 projections of a 64-row step: 0.72-0.77 ms against 1.19-1.21 ms for at::mm. The
// learner's layer (learner.cpp) runs its forward products and its input gradients the same way
// (weights packed once per forward, both ways): at 960 rows 4.2 ms against 5.1 ms per layer pass.

typedef float v16 __attribute__((vector_size(64)));
inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

constexpr int64_t PANEL = 32;

// w [N, K] -> [ceil(N / 32), K, 32]: panel p holds columns 32p..32p+31 of w^T, zero past N, so
// that gemm_packed computes a w^T. transposed: w is [K, N] and gemm_packed computes a w.
inline at::Tensor pack_weight(const at::Tensor& w, bool transposed = false) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "pack_weight: a 2-D float32 CPU tensor");
  const at::Tensor src = w.contiguous();
  const int64_t N = w.size(transposed ? 1 : 0), K = w.size(transposed ? 0 : 1), P = (N + PANEL - 1) / PANEL;
  auto out = at::empty({P, K, PANEL}, w.options());
  const float* s = src.data_ptr<float>();
  float* d = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(PANEL, N - p * PANEL);
      float* panel = d + p * K * PANEL;
      if (transposed) {   // row k of the panel is a contiguous piece of row k of w
        for (int64_t k = 0; k < K; ++k) {
          std::memcpy(panel + k * PANEL, s + k * N + p * PANEL, sizeof(float) * cols);
          std::fill(panel + k * PANEL + cols, panel + (k + 1) * PANEL, 0.f);
        }
        continue;
      }
      for (int64_t j = 0; j < PANEL; ++j) {
        float* col = panel + j;
        if (j < cols)
          for (int64_t k = 0; k < K; ++k) col[k * PANEL] = s[(p * PANEL + j) * K + k];
        else
          for (int64_t k = 0; k < K; ++k) col[k * PANEL] = 0.f;
      }
    }
  });
  return out;
}

// R rows of c (+)= a . panel (+ bias), 32 columns, `cols` of them stored (the last panel may be short).
template <int R>
inline void panel_rows(float* c, int64_t ldc, const float* a, int64_t lda, const float* panel, const float* bias,
                       int64_t K, int64_t cols, bool accumulate) {
  v16 acc[R][2];
  float tmp[PANEL];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      if (accumulate) {
        std::memset(tmp, 0, sizeof tmp);
        std::memcpy(tmp, c + r * ldc, sizeof(float) * cols);
        acc[r][h] = load16(tmp + 16 * h);
      } else if (bias) {
        std::memset(tmp, 0, sizeof tmp);
        std::memcpy(tmp, bias, sizeof(float) * cols);
        acc[r][h] = load16(tmp + 16 * h);
      } else {
        acc[r][h] = v16{};
      }
    }
  for (int64_t k = 0; k < K; ++k) {
    const v16 b0 = load16(panel + k * PANEL), b1 = load16(panel + k * PANEL + 16);
    for (int r = 0; r < R; ++r) {
      const float x = a[r * lda + k];
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
    }
  }
  for (int r = 0; r < R; ++r) {
    store16(tmp, acc[r][0]);
    store16(tmp + 16, acc[r][1]);
    std::memcpy(c + r * ldc, tmp, sizeof(float) * cols);
  }
}

// c [M, N] (+)= a [M, K] w^T (+ bias [N]) with w packed by pack_weight; panels split over threads.
inline void gemm_packed(float* c, int64_t ldc, const float* a, int64_t lda, const at::Tensor& packed, const float* bias,
                        int64_t M, int64_t N, int64_t K, bool accumulate) {
  const int64_t P = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat && packed.size(2) == PANEL &&
              P == (N + PANEL - 1) / PANEL && packed.size(1) == K && lda >= K,
              "gemm_packed: a packed weight does not match its product (pack_weight)");
  const float* wp = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = wp + p * K * PANEL;
      const float* pb = bias ? bias + p * PANEL : nullptr;
      const int64_t cols = std::min(PANEL, N - p * PANEL);
      float* cp = c + p * PANEL;
      int64_t m = 0;
      for (; m + 6 <= M; m += 6) panel_rows<6>(cp + m * ldc, ldc, a + m * lda, lda, panel, pb, K, cols, accumulate);
      switch (M - m) {
        case 5: panel_rows<5>(cp + m * ldc, ldc, a + m * lda, lda, panel, pb, K, cols, accumulate); break;
        case 4: panel_rows<4>(cp + m * ldc, ldc, a + m * lda, lda, panel, pb, K, cols, accumulate); break;
        case 3: panel_rows<3>(cp + m * ldc, ldc, a + m * lda, lda, panel, pb, K, cols, accumulate); break;
        case 2: panel_rows<2>(cp + m * ldc, ldc, a + m * lda, lda, panel, pb, K, cols, accumulate); break;
        case 1: panel_rows<1>(cp + m * ldc, ldc, a + m * lda, lda, panel, pb, K, cols, accumulate); break;
        default: break;
      }
    }
  });
}

}  // namespace reinforge_kernels
