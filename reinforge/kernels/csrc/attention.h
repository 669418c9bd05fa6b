// Attention's inner loops, shared by decode.cpp (the decoding step's `attend`) and learner.cpp (the
// learner layer's attention forward and backward): a query's scores against keys stored transposed
// ([D, stride]: 8 key positions load as one vector) and the probability-weighted sum of value rows.
//
// Why independent accumulators: a score is D multiply-adds into one sum, and a weighted sum n of them
// into each output; as one dependent chain each waits the FMA's latency (4 cycles) at every step. Split
// into several partial sums the CPU overlaps them: the decoding step's attention (64 rows x 8 heads of
// 16 dims, ~30 keys; perf, 1 thread) went from 0.48 to 0.38 of the time of its layer's projections, and
// a 64-row step of the built-in model from 2.25 to 2.08 ms. The rest of it is reading the KV cache.
#pragma once

#include <cstdint>
#include <cstring>

namespace reinforge_kernels {

template <int D>
inline void axpy(float* __restrict y, float a, const float* __restrict x) {
#pragma omp simd
  for (int d = 0; d < D; ++d) y[d] += a * x[d];
}

// out[j] = x . cols[:, j] for the NB * 8 columns from j: NB independent accumulators, so that the
// D multiply-adds of each are not one dependent chain.
template <int D, int NB>
inline void score_blocks(float* __restrict out, const float* __restrict x, const float* __restrict cols, int64_t L8,
                         int64_t j) {
  float acc[NB][8] = {};
  for (int d = 0; d < D; ++d) {
    const float xd = x[d];
    const float* c = cols + d * L8 + j;
    for (int b = 0; b < NB; ++b)
#pragma omp simd
      for (int i = 0; i < 8; ++i) acc[b][i] += xd * c[b * 8 + i];
  }
  std::memcpy(out + j, acc, sizeof acc);
}

// out[j] = x . cols[:, j] for j < n, n rounded up to 8 (cols [D, L8] is zero-filled past its keys).
template <int D>
inline void scores8(float* __restrict out, const float* __restrict x, const float* __restrict cols, int64_t L8, int64_t n) {
  const int64_t n8 = (n + 7) / 8 * 8;
  int64_t j = 0;
  for (; j + 32 <= n8; j += 32) score_blocks<D, 4>(out, x, cols, L8, j);
  for (; j < n8; j += 8) score_blocks<D, 1>(out, x, cols, L8, j);
}

// A softmax's numerators in place: p[j] = exp(p[j] - top) for j < n, 0 for j in [n, padded(n)); their sum.
// It runs over whole 16-float vectors (p must have room for padded(n)): attention rows hold a few dozen
// keys, and a loop over exactly n took the scalar exp for every key past the last whole vector (under 16
// keys, all of them). At the default RL step's learner shape (8 prompt + 8 completion tokens) the
// no-grad forward went from 36.6 to 31.8 ms, the backward from 69.3 to 66.0 (BENCHMARKS.md).
constexpr int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }

inline float exp_shifted(float* __restrict p, int64_t n, float top) {
  float sum = 0.f;
  for (int64_t j = 0; j < n; j += 16) {   // a loop of 16 exactly: one vector, no scalar remainder
    float* q = p + j;
    const int64_t m = n - j;
    float part = 0.f;
#pragma omp simd reduction(+ : part)
    for (int i = 0; i < 16; ++i) {
      const float e = expf(i < m ? q[i] - top : 0.f);
      q[i] = i < m ? e : 0.f;
      part += q[i];
    }
    sum += part;
  }
  return sum;
}

// y = sum_{j < n} w[j] rows[j] (rows [n, D]), in 4 interleaved partial sums (independent chains).
template <int D>
inline void weighted_rows(float* __restrict y, const float* __restrict w, const float* __restrict rows, int64_t n) {
  float acc[4][D] = {};
  int64_t j = 0;
  for (; j + 4 <= n; j += 4)
    for (int u = 0; u < 4; ++u) {
      const float wj = w[j + u];
      const float* r = rows + (j + u) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[u][d] += wj * r[d];
    }
  for (; j < n; ++j) axpy<D>(acc[0], w[j], rows + j * D);
#pragma omp simd
  for (int d = 0; d < D; ++d) y[d] = (acc[0][d] + acc[1][d]) + (acc[2][d] + acc[3][d]);
}

}  // namespace reinforge_kernels
