#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <optional>

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
// into: a tensor of the packed shape to write (the panels of weights no longer used: a large model's panels
// are fresh pages otherwise, whose first writes cost more than the packing); undefined: a new tensor.
inline at::Tensor pack_weight(const at::Tensor& w, bool transposed = false, const at::Tensor& into = at::Tensor()) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "pack_weight: a 2-D float32 CPU tensor");
  const at::Tensor src = w.contiguous();
  const int64_t N = w.size(transposed ? 1 : 0), K = w.size(transposed ? 0 : 1), P = (N + PANEL - 1) / PANEL;
  const bool reuse = into.defined() && into.dim() == 3 && into.size(0) == P && into.size(1) == K &&
                     into.size(2) == PANEL && into.is_contiguous() && into.scalar_type() == at::kFloat &&
                     into.device().is_cpu();
  TORCH_CHECK(!into.defined() || reuse, "pack_weight: `into` must be a contiguous float32 CPU tensor [", P, ", ", K,
              ", ", PANEL, "]");
  auto out = reuse ? into : at::empty({P, K, PANEL}, w.options());
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
      // Row k of the panel gathers element k of 32 rows of w: written in order, read from 32 rows whose
      // current cache lines stay in L1 for 16 k each. (Column by column, each write touched another line of a
      // panel larger than L1 at a 0.5B model's widths: 2 GB/s, a fifth of a 0.5B model's generate call.)
      const float* rows = s + p * PANEL * K;
      for (int64_t k = 0; k < K; ++k) {
        float* out = panel + k * PANEL;
        for (int64_t j = 0; j < cols; ++j) out[j] = rows[j * K + k];
        std::fill(out + cols, out + PANEL, 0.f);
      }
    }
  });
  return out;
}

// Cache lines of the next panel to fetch while a panel is being multiplied: `lines` lines from `from`, `step`
// (1 or 2) of them per k. See panel_block.
struct Prefetch {
  const char* from;
  int64_t lines;
  int step;
};

// R rows of c (+)= a . panel (+ bias), 32 columns, `cols` of them stored (the last panel may be short).
template <int R>
inline void panel_rows(float* c, int64_t ldc, const float* a, int64_t lda, const float* panel, const float* bias,
                       int64_t K, int64_t cols, bool accumulate, Prefetch next = {nullptr, 0, 1}) {
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
  auto step = [&](int64_t k) {
    const v16 b0 = load16(panel + k * PANEL), b1 = load16(panel + k * PANEL + 16);
    for (int r = 0; r < R; ++r) {
      const float x = a[r * lda + k];
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
    }
  };
  const int64_t fetching = std::min(K, (next.lines + next.step - 1) / next.step);
  int64_t k = 0;
  for (; k < fetching; ++k) {
    for (int i = 0; i < next.step; ++i) __builtin_prefetch(next.from + (k * next.step + i) * 64, 0, 2);
    step(k);
  }
  for (; k < K; ++k) step(k);
  for (int r = 0; r < R; ++r) {
    store16(tmp, acc[r][0]);
    store16(tmp + 16, acc[r][1]);
    std::memcpy(c + r * ldc, tmp, sizeof(float) * cols);
  }
}

// Rows [0, M) of one panel's product: blocks of R rows, then the remainder (R <= 12). Every output
// element is accumulated over k in the same order whatever R is, so R changes the speed only: how
// many accumulators stay in registers (2 R vectors of 16 floats, plus 2 for the panel) against how
// often the panel is re-read. The best R depends on the CPU's registers (32 zmm with AVX-512, where
// 6-12 fit; AVX2 splits each 16-float vector into two of its 16 ymm, so fewer fit) and caches.
// `next`: the panel this thread multiplies next (null: none), fetched into L2 a share per block of rows while
// this one is multiplied. A large model's weights come from memory once per decoding step: without the fetch
// a panel's first block of rows waited on them, then its other blocks computed from cache, one after the
// other (at 32 rows of a 0.5B model's projections, ~26 of 50 ms were that wait on an Intel Xeon).
template <int R>
inline void panel_block(float* cp, int64_t ldc, const float* a, int64_t lda, const float* panel, const float* pb,
                        int64_t M, int64_t K, int64_t cols, bool accumulate, const float* next = nullptr) {
  const int64_t blocks = (M + R - 1) / R, lines = next ? K * PANEL * (int64_t)sizeof(float) / 64 : 0;
  const int64_t share = (lines + blocks - 1) / std::max<int64_t>(blocks, 1);
  const int step = share > K ? 2 : 1;
  auto fetch = [&](int64_t m) {   // the share of the block of rows starting at m
    const int64_t first = std::min(lines, m / R * share);
    return Prefetch{reinterpret_cast<const char*>(next) + first * 64, std::min(share, lines - first), step};
  };
  int64_t m = 0;
  for (; m + R <= M; m += R)
    panel_rows<R>(cp + m * ldc, ldc, a + m * lda, lda, panel, pb, K, cols, accumulate, fetch(m));
  float* c = cp + m * ldc;
  const float* am = a + m * lda;
  const Prefetch tail = fetch(m);
  switch (M - m) {
#define REINFORGE_TAIL(n) case n: panel_rows<n>(c, ldc, am, lda, panel, pb, K, cols, accumulate, tail); break;
    REINFORGE_TAIL(1) REINFORGE_TAIL(2) REINFORGE_TAIL(3) REINFORGE_TAIL(4) REINFORGE_TAIL(5) REINFORGE_TAIL(6)
    REINFORGE_TAIL(7) REINFORGE_TAIL(8) REINFORGE_TAIL(9) REINFORGE_TAIL(10) REINFORGE_TAIL(11)
#undef REINFORGE_TAIL
    default: break;
  }
}

// The candidates of the row block, and the one gemm_packed uses: chosen per machine by timing on first use
// (reinforge/kernels/tuning.py, `set_row_block`); 6 until then. One value for the process (a static of an
// inline function is shared by every translation unit of the library).
constexpr int ROW_BLOCKS[] = {2, 3, 4, 6, 8, 10, 12};
inline int& row_block() {
  static int r = 6;
  return r;
}

// A panel of K > WIDE_K rows (over 32 KB) outgrows L1, and each block of rows reads it again from L2: there
// fewer, larger blocks can win where they lose on narrow panels, so wide products have a row block of their own,
// timed apart (on an Intel Xeon, 12 rows took 35 ms where 6 took 41 on 32 rows of a 0.5B model's projections).
constexpr int64_t WIDE_K = 256;
inline int& row_block_wide() {
  static int r = 6;
  return r;
}

inline void check_row_block(int64_t rows, const char* who) {
  TORCH_CHECK(std::find(std::begin(ROW_BLOCKS), std::end(ROW_BLOCKS), rows) != std::end(ROW_BLOCKS), who,
              ": the row block must be one of 2, 3, 4, 6, 8, 10, 12, got ", rows);
}

// c [M, N] (+)= a [M, K] w^T (+ bias [N]) with w packed by pack_weight; panels split over threads.
// rows: the row block (one of ROW_BLOCKS; 0 = the chosen one for K: row_block() or row_block_wide()).
inline void gemm_packed(float* c, int64_t ldc, const float* a, int64_t lda, const at::Tensor& packed, const float* bias,
                        int64_t M, int64_t N, int64_t K, bool accumulate, int rows = 0) {
  const int64_t P = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kFloat && packed.size(2) == PANEL &&
              P == (N + PANEL - 1) / PANEL && packed.size(1) == K && lda >= K,
              "gemm_packed: a packed weight does not match its product (pack_weight)");
  const int R = rows ? rows : K > WIDE_K ? row_block_wide() : row_block();
  const float* wp = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* panel = wp + p * K * PANEL;
      const float* pb = bias ? bias + p * PANEL : nullptr;
      const float* next = p + 1 < p1 ? panel + K * PANEL : nullptr;
      const int64_t cols = std::min(PANEL, N - p * PANEL);
      float* cp = c + p * PANEL;
      switch (R) {
#define REINFORGE_BLOCK(n) case n: panel_block<n>(cp, ldc, a, lda, panel, pb, M, K, cols, accumulate, next); break;
        REINFORGE_BLOCK(2) REINFORGE_BLOCK(3) REINFORGE_BLOCK(4) REINFORGE_BLOCK(8) REINFORGE_BLOCK(10)
        REINFORGE_BLOCK(12)
#undef REINFORGE_BLOCK
        default: panel_block<6>(cp, ldc, a, lda, panel, pb, M, K, cols, accumulate, next); break;
      }
    }
  });
}

// c [M, N] (+)= a [M, K] w^T (+ bias [N], not added when accumulating, as gemm_packed), where w is a projection
// as a DecoderWeights holds it for the kernels (models/decoder.py, `packed`): packed panels (3-D, pack_weight)
// run gemm_packed; the plain matrix (2-D [N, K], any strides: the backward's products with w pass the view
// w^T) runs ATen's matmul, MKL's sgemm on x86. Which is faster depends on the CPU and the rows: on an Intel
// Xeon (AVX-512) MKL took 0.88-0.93 ms at 1,024 x 128 x 1,024 where the panels took 1.06-1.30 ms, while on
// the AMD EPYC they were tuned on the panels won at decoding shapes. The learner's choice is timed per machine
// (reinforge/kernels/tuning.py); results agree to float rounding. The rollout engine keeps the panels: each
// row's sums run in one order whatever the other rows, so its samples do not depend on the batch, bit for bit.
inline void product(float* c, int64_t ldc, const float* a, int64_t lda, const at::Tensor& w, const float* bias,
                    int64_t M, int64_t N, int64_t K, bool accumulate, int rows = 0) {
  if (w.dim() == 3) return gemm_packed(c, ldc, a, lda, w, bias, M, N, K, accumulate, rows);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == N && w.size(1) == K && w.scalar_type() == at::kFloat && lda >= K && ldc >= N,
              "product: a plain weight must be a float32 [N, K] matrix matching its product");
  if (M == 0) return;
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  at::Tensor out = at::from_blob(c, {M, N}, {ldc, 1}, opts);
  const at::Tensor x = at::from_blob(const_cast<float*>(a), {M, K}, {lda, 1}, opts);
  if (accumulate)
    out.addmm_(x, w.t());
  else if (bias)
    at::addmm_out(out, at::from_blob(const_cast<float*>(bias), {N}, opts), x, w.t());
  else
    at::mm_out(out, x, w.t());
}

// a [M, K] w^T (+ bias) with w packed by pack_weight (N columns), with row block `rows` (0: the chosen one),
// or with w plain ([N, K], through ATen, `product`): for timing the candidates and testing that they agree.
inline at::Tensor packed_matmul(const at::Tensor& a, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                int64_t N, int64_t rows) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kFloat && a.is_contiguous(), "packed_matmul: a contiguous 2-D float32 a");
  if (rows != 0) check_row_block(rows, "packed_matmul");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == at::kFloat && bias->numel() == N),
              "packed_matmul: the bias must be N contiguous float32 values");
  auto c = at::empty({a.size(0), N}, a.options());
  product(c.data_ptr<float>(), N, a.data_ptr<float>(), a.size(1), packed, bias ? bias->data_ptr<float>() : nullptr,
          a.size(0), N, a.size(1), false, static_cast<int>(rows));
  return c;
}

inline void set_row_block(int64_t rows, bool wide) {
  check_row_block(rows, "set_row_block");
  (wide ? row_block_wide() : row_block()) = static_cast<int>(rows);
}

}  // namespace reinforge_kernels
