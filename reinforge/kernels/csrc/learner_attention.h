// The learner layer's attention (learner.cpp, train_layer_forward / train_layer_backward): the softmax of
// each query's scores against its row's keys (a shared prompt's, then its own, causal) and its gradients.
//
// Where the head dim is whole 16-float vectors, queries run in blocks of 8 against keys in blocks of 16
// (`score_tile`, `weighted_tile`): every product of the forward and the backward (scores, values, and the
// gradients of queries, keys and values) is then 8 independent vector FMAs per vector load, as a matrix
// product's register block, where a query at a time made one FMA per load. Why: at the multiply-tool task's
// SFT shape (64 rows of 74 tokens, head dim 16) the attention took ~14% of a step's forward and backward, at
// ~15 GFLOP/s (perf, Intel Xeon). Blocked, its share of the samples fell from 12.3% to 9.7% there and from
// 8.4% to 6.8% at the RL step's (8 prompts x 8 rows of 16 tokens); most of what is left is reading the rows
// it gathers (KeyBlock), not arithmetic. The per-query code stays for the other head dims (8).
#pragma once

#include <ATen/Parallel.h>

#include "attention.h"
#include "gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace reinforge_kernels {

struct Geometry {
  int64_t B, S, H, KV, Lp;
  const int64_t* slot;      // [B], or null: no prefix
  const int64_t* pre_len;   // [B], or null
  float scale;
  int64_t prefix(int64_t b) const { return slot ? pre_len[b] : 0; }
};

template <int D>
inline float dot(const float* __restrict a, const float* __restrict b) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// The keys and values one (row, kv head) attends over, gathered: its prefix's pre_len keys, then its
// own S, as rows [L, D] and transposed [D, Lt] (Lt: L rounded up to 16, zero-filled), so that a
// query's scores are D vector FMAs per 8 or 16 keys (as decode.cpp's attend).
template <int D>
struct KeyBlock {
  int64_t n_pre = 0, L = 0, Lt = 0;
  std::vector<float> k, v, kt, vt;
  void gather(const Geometry& g, int64_t b, int64_t kvh, const float* kp, const float* vp, const float* pk,
              const float* pv, bool transposed_values) {
    const int64_t step = g.KV * D;
    n_pre = g.prefix(b);
    L = n_pre + g.S;
    Lt = padded(L);
    k.resize(L * D);
    v.resize(L * D);
    kt.assign(D * Lt, 0.f);
    if (transposed_values) vt.assign(D * Lt, 0.f);
    for (int64_t j = 0; j < L; ++j) {
      const int64_t off = j < n_pre ? g.slot[b] * g.Lp * step + j * step : (b * g.S + j - n_pre) * step;
      const float* kr = (j < n_pre ? pk : kp) + off + kvh * D;
      const float* vr = (j < n_pre ? pv : vp) + off + kvh * D;
      std::memcpy(&k[j * D], kr, sizeof(float) * D);
      std::memcpy(&v[j * D], vr, sizeof(float) * D);
      for (int d = 0; d < D; ++d) kt[d * Lt + j] = kr[d];
      if (transposed_values)
        for (int d = 0; d < D; ++d) vt[d * Lt + j] = vr[d];
    }
  }
};

// attention_forward a query at a time: the head dims that are not whole 16-float vectors.
template <int D>
void attention_forward_per_query(const Geometry& g, const float* q, const float* k, const float* v, const float* pk,
                       const float* pv, float* out, float* lse, int64_t b_begin, int64_t b_end) {
  const int64_t G = g.H / g.KV;
  at::parallel_for(b_begin * g.KV, b_end * g.KV, 4, [&](int64_t i0, int64_t i1) {
    KeyBlock<D> kb;
    std::vector<float> p((size_t)padded(g.Lp + g.S));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / g.KV, kvh = i % g.KV;
      kb.gather(g, b, kvh, k, v, pk, pv, false);
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h)
        for (int64_t t = 0; t < g.S; ++t) {
          const int64_t at = (b * g.S + t) * g.H + h, n = kb.n_pre + t + 1;
          float qs[D];
          for (int d = 0; d < D; ++d) qs[d] = q[at * D + d] * g.scale;
          scores8<D>(p.data(), qs, kb.kt.data(), kb.Lt, n);
          float top = p[0];
          for (int64_t j = 1; j < n; ++j) top = std::max(top, p[j]);
          const float sum = exp_shifted(p.data(), n, top);
          float acc[D];
          weighted_rows<D>(acc, p.data(), kb.v.data(), n);
          const float inv = 1.f / sum;
          for (int d = 0; d < D; ++d) out[at * D + d] = acc[d] * inv;
          lse[at] = top + logf(sum);
        }
    }
  });
}

// The rows of each group whose keys only its own threads add to, for the backward: a prefix slot's rows
// (order[first[s]] .. order[first[s + 1] - 1]), or each row alone where there is no prefix.
struct RowGroups {
  std::vector<int64_t> order, first;
  explicit RowGroups(const Geometry& g) : order(g.B) {
    if (g.slot) {
      int64_t P = 0;
      for (int64_t b = 0; b < g.B; ++b) P = std::max(P, g.slot[b] + 1);
      first.assign(P + 1, 0);
      for (int64_t b = 0; b < g.B; ++b) ++first[g.slot[b] + 1];
      for (int64_t s = 0; s < P; ++s) first[s + 1] += first[s];
      std::vector<int64_t> fill(first.begin(), first.end() - 1);
      for (int64_t b = 0; b < g.B; ++b) order[fill[g.slot[b]]++] = b;
    } else {
      first.resize(g.B + 1);
      for (int64_t b = 0; b <= g.B; ++b) first[b] = b;
      for (int64_t b = 0; b < g.B; ++b) order[b] = b;
    }
  }
};

// One thread's scratch in the backward: per (row, head) the softmax P and ds = P (dout . v - delta) of every query
// [S, padded(Lp + S)] (read only where the query sees the key), the scaled queries [S, D], and the row's key and
// value gradients dkb, dvb [L, D], summed over its heads.
struct BackwardScratch {
  std::vector<float> P, DS, QS, dkb, dvb;
};

// The backward's work, split by (row group, kv head) so that no two threads add to the same key: for each row b
// of a group, its keys and values gathered (values transposed too), dkb and dvb zeroed, `heads(b, kvh, kb,
// scratch)` adding its heads' gradients into them, then dkb, dvb added to dk, dv (its own keys) or dpk, dpv (its
// prefix's).
template <int D, typename F>
void backward_by_row_groups(const Geometry& g, const RowGroups& rg, const float* k, const float* v, const float* pk,
                            const float* pv, float* dk, float* dv, float* dpk, float* dpv, F&& heads) {
  const int64_t step = g.KV * D, groups = (int64_t)rg.first.size() - 1, Lmax = padded(g.Lp + g.S);
  at::parallel_for(0, groups * g.KV, 1, [&](int64_t i0, int64_t i1) {
    KeyBlock<D> kb;
    BackwardScratch s;
    s.P.resize((size_t)(g.S * Lmax));
    s.DS.resize(s.P.size());
    s.QS.resize((size_t)(g.S * D));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t group = i / g.KV, kvh = i % g.KV;
      for (int64_t r = rg.first[group]; r < rg.first[group + 1]; ++r) {
        const int64_t b = rg.order[r];
        kb.gather(g, b, kvh, k, v, pk, pv, true);
        s.dkb.assign(kb.L * D, 0.f);
        s.dvb.assign(kb.L * D, 0.f);
        heads(b, kvh, kb, s);
        for (int64_t j = 0; j < kb.L; ++j) {
          const int64_t off = j < kb.n_pre ? g.slot[b] * g.Lp * step + j * step : (b * g.S + j - kb.n_pre) * step;
          axpy<D>((j < kb.n_pre ? dpk : dk) + off + kvh * D, 1.f, &s.dkb[j * D]);
          axpy<D>((j < kb.n_pre ? dpv : dv) + off + kvh * D, 1.f, &s.dvb[j * D]);
        }
      }
    }
  });
}

// attention_backward a query at a time: the head dims that are not whole 16-float vectors.
template <int D>
void attention_backward_per_query(const Geometry& g, const float* q, const float* k, const float* v, const float* pk,
                                  const float* pv, const float* out, const float* lse, const float* dout, float* dq,
                                  float* dk, float* dv, float* dpk, float* dpv, const RowGroups& rg) {
  const int64_t G = g.H / g.KV;
  backward_by_row_groups<D>(g, rg, k, v, pk, pv, dk, dv, dpk, dpv, [&](int64_t b, int64_t kvh,
                                                                       const KeyBlock<D>& kb, BackwardScratch& s) {
    std::vector<float> &P = s.P, &DS = s.DS, &QS = s.QS, &dkb = s.dkb, &dvb = s.dvb;
    const int64_t Lt = kb.Lt, Lr = padded(kb.L);
    for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
      const float* dO = dout + (b * g.S * g.H + h) * D;     // query t's at dO + t * H * D
      for (int64_t t = 0; t < g.S; ++t) {     // P, ds and dq, a query at a time
        const int64_t at = (b * g.S + t) * g.H + h, n = kb.n_pre + t + 1;
        float* p = &P[t * Lr];
        float* ds = &DS[t * Lr];
        float* qs = &QS[t * D];
        const float* dot_ = dout + at * D;
        for (int d = 0; d < D; ++d) qs[d] = q[at * D + d] * g.scale;
        const float delta = dot<D>(dot_, out + at * D), m = lse[at];
        scores8<D>(p, qs, kb.kt.data(), Lt, n);
        scores8<D>(ds, dot_, kb.vt.data(), Lt, n);
        for (int64_t j = 0; j < n; j += 16)     // 16 at a time, as exp_shifted
#pragma omp simd
          for (int i = 0; i < 16; ++i) {
            const bool seen = j + i < n;
            const float e = expf(seen ? p[j + i] - m : 0.f);
            p[j + i] = seen ? e : 0.f;
            ds[j + i] = seen ? e * (ds[j + i] - delta) : 0.f;
          }
        float dqa[D];
        weighted_rows<D>(dqa, ds, kb.k.data(), n);
        for (int d = 0; d < D; ++d) dq[at * D + d] = dqa[d] * g.scale;
      }
      // dk_j += sum_t ds[t, j] qs_t; dv_j += sum_t P[t, j] dout_t: a key at a time, over the
      // queries that see it (all for a prefix key, t >= its position for an own key)
      for (int64_t j = 0; j < kb.L; ++j) {
        const int64_t t0 = j < kb.n_pre ? 0 : j - kb.n_pre;
        float ak[2][D] = {}, av[2][D] = {};
        int64_t t = t0;
        for (; t + 2 <= g.S; t += 2)
          for (int u = 0; u < 2; ++u) {
            const float dsj = DS[(t + u) * Lr + j], pj = P[(t + u) * Lr + j];
            const float* qt = &QS[(t + u) * D];
            const float* ot = dO + (t + u) * g.H * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) {
              ak[u][d] += dsj * qt[d];
              av[u][d] += pj * ot[d];
            }
          }
        for (; t < g.S; ++t) {
          axpy<D>(ak[0], DS[t * Lr + j], &QS[t * D]);
          axpy<D>(av[0], P[t * Lr + j], dO + t * g.H * D);
        }
#pragma omp simd
        for (int d = 0; d < D; ++d) {
          dkb[j * D + d] += ak[0][d] + ak[1][d];
          dvb[j * D + d] += av[0][d] + av[1][d];
        }
      }
    }
  });
}

// Queries in a block of the blocked kernels; a block of key rows of `weighted_tile` holds up to 24 vectors.
constexpr int QB = 8;
template <int D>
constexpr int row_block() { return std::max(1, std::min(8, 24 / (D / 16))); }

// out[q * ldo + j0 .. + 16) = sum_d a[q * lda + d] cols[d * ldc + j0 .. + 16) for q < R: R rows of a against 16
// columns of cols [D, ldc]. One vector load of cols serves R FMAs into R independent accumulators.
template <int D, int R>
inline void score_tile(float* __restrict out, int64_t ldo, const float* __restrict a, int64_t lda,
                       const float* __restrict cols, int64_t ldc, int64_t j0) {
  v16 acc[R] = {};
  for (int d = 0; d < D; ++d) {
    const v16 c = load16(cols + d * ldc + j0);
    for (int r = 0; r < R; ++r) acc[r] += a[r * lda + d] * c;
  }
  for (int r = 0; r < R; ++r) store16(out + r * ldo + j0, acc[r]);
}

// y[r * ldy ..] (+)= sum_{i in [i0, i1)} w[r * wr + i * wi] x[i * ldx .. + D) for r < R: R weighted sums of the
// rows of x (D floats each), one load of a row serving R of them.
template <int D, int R>
inline void weighted_tile(float* __restrict y, int64_t ldy, const float* __restrict w, int64_t wr, int64_t wi,
                          const float* __restrict x, int64_t ldx, int64_t i0, int64_t i1, bool add) {
  constexpr int C = D / 16;
  v16 acc[R][C] = {};
  for (int64_t i = i0; i < i1; ++i) {
    v16 xr[C];
    for (int c = 0; c < C; ++c) xr[c] = load16(x + i * ldx + 16 * c);
    for (int r = 0; r < R; ++r) {
      const float wv = w[r * wr + i * wi];
      for (int c = 0; c < C; ++c) acc[r][c] += wv * xr[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float* yp = y + r * ldy + 16 * c;
      store16(yp, add ? load16(yp) + acc[r][c] : acc[r][c]);
    }
}

// f(std::integral_constant<int, n>{}) for a block's row count n in [1, N] (the last block of a pass may be short).
template <int N, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_rows<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// out [t, j) = a_t . cols[:, j) for the rows t in [0, n) of a (stride lda) into out rows of stride ldo, in blocks
// of QB rows by 16 columns: a block's columns up to padded(seen + its last row + 1) (row t sees keys j < seen + t
// + 1; past them, out is left for the caller to mask).
template <int D>
inline void scores_rows(float* out, int64_t ldo, const float* a, int64_t lda, const float* cols, int64_t ldc,
                        int64_t n, int64_t seen) {
  for (int64_t t0 = 0; t0 < n; t0 += QB)
    with_rows<QB>(n - t0, [&](auto r) {
      const int64_t width = padded(seen + t0 + decltype(r)::value);
      for (int64_t j0 = 0; j0 < width; j0 += 16)
        score_tile<D, decltype(r)::value>(out + t0 * ldo, ldo, a + t0 * lda, lda, cols, ldc, j0);
    });
}

// y rows [0, n) (stride ldy) (+)= sum_i w(r, i) x_i, w(r, i) = w[r * wr + i * wi], over the i where w may be
// nonzero: i in [r + lo, r + hi] clipped to [0, i1) (the causal band: w is 0 outside it), taken per block of rows.
template <int D>
inline void weighted_rows_blocked(float* y, int64_t ldy, const float* w, int64_t wr, int64_t wi, const float* x,
                                  int64_t ldx, int64_t n, int64_t lo, int64_t hi, int64_t i1, bool add) {
  constexpr int RB = row_block<D>();
  for (int64_t r0 = 0; r0 < n; r0 += RB)
    with_rows<RB>(n - r0, [&](auto r) {
      constexpr int R = decltype(r)::value;
      weighted_tile<D, R>(y + r0 * ldy, ldy, w + r0 * wr, wr, wi, x, ldx, std::max<int64_t>(0, r0 + lo),
                          std::min<int64_t>(i1, r0 + R - 1 + hi + 1), add);
    });
}

// attention_forward with queries in blocks (head dims of whole vectors): for each (row, kv head) and head, the
// scores of QB queries against 16 keys at a time into P [QB, Lt], their softmax (a row's keys past its own
// are 0), then P V.
template <int D>
void attention_forward_blocked(const Geometry& g, const float* q, const float* k, const float* v, const float* pk,
                               const float* pv, float* out, float* lse, int64_t b_begin, int64_t b_end) {
  const int64_t G = g.H / g.KV, HD = g.H * D;
  at::parallel_for(b_begin * g.KV, b_end * g.KV, 4, [&](int64_t i0, int64_t i1) {
    KeyBlock<D> kb;
    std::vector<float> P((size_t)QB * padded(g.Lp + g.S)), qs((size_t)QB * D), o((size_t)QB * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / g.KV, kvh = i % g.KV;
      kb.gather(g, b, kvh, k, v, pk, pv, false);
      const int64_t Lt = kb.Lt;
      for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h)
        for (int64_t t0 = 0; t0 < g.S; t0 += QB) {
          const int64_t nq = std::min<int64_t>(QB, g.S - t0), seen = kb.n_pre + t0 + nq;   // keys the block sees
          const float* qb = q + ((b * g.S + t0) * g.H + h) * D;
          for (int64_t r = 0; r < nq; ++r)
            for (int d = 0; d < D; ++d) qs[r * D + d] = qb[r * HD + d] * g.scale;
          scores_rows<D>(P.data(), Lt, qs.data(), D, kb.kt.data(), Lt, nq, kb.n_pre + t0);
          float inv[QB];
          for (int64_t r = 0; r < nq; ++r) {
            float* p = &P[r * Lt];
            const int64_t n = kb.n_pre + t0 + r + 1;
            float top = p[0];
            for (int64_t j = 1; j < n; ++j) top = std::max(top, p[j]);
            const float sum = exp_shifted(p, n, top);
            std::fill(p + padded(n), p + padded(seen), 0.f);
            inv[r] = 1.f / sum;
            lse[(b * g.S + t0 + r) * g.H + h] = top + logf(sum);
          }
          weighted_rows_blocked<D>(o.data(), D, P.data(), Lt, 1, kb.v.data(), D, nq, -seen, kb.n_pre + t0, seen, false);
          for (int64_t r = 0; r < nq; ++r)
            for (int d = 0; d < D; ++d) out[((b * g.S + t0 + r) * g.H + h) * D + d] = o[r * D + d] * inv[r];
        }
    }
  });
}

// attention_backward with queries in blocks (head dims of whole vectors). Per (row, head): P and ds = P (dout v - delta)
// of every query [S, Lt] (0 past the query's keys), dq = scale ds K; then dk = ds^T qs and dv = P^T dout, keys in
// blocks, each over the queries that see it.
template <int D>
void attention_backward_blocked(const Geometry& g, const float* q, const float* k, const float* v, const float* pk,
                                const float* pv, const float* out, const float* lse, const float* dout, float* dq,
                                float* dk, float* dv, float* dpk, float* dpv, const RowGroups& rg) {
  const int64_t G = g.H / g.KV, HD = g.H * D;
  backward_by_row_groups<D>(g, rg, k, v, pk, pv, dk, dv, dpk, dpv, [&](int64_t b, int64_t kvh,
                                                                       const KeyBlock<D>& kb, BackwardScratch& s) {
    std::vector<float> &P = s.P, &DS = s.DS, &QS = s.QS, &dkb = s.dkb, &dvb = s.dvb;
    const int64_t Lt = kb.Lt, L = kb.L, n_pre = kb.n_pre;
    for (int64_t h = kvh * G; h < (kvh + 1) * G; ++h) {
      const int64_t base = (b * g.S * g.H + h) * D;    // query t's rows of q, out, dout, dq at base + t * HD
      for (int64_t t = 0; t < g.S; ++t)
        for (int d = 0; d < D; ++d) QS[t * D + d] = q[base + t * HD + d] * g.scale;
      scores_rows<D>(P.data(), Lt, QS.data(), D, kb.kt.data(), Lt, g.S, n_pre);
      scores_rows<D>(DS.data(), Lt, dout + base, HD, kb.vt.data(), Lt, g.S, n_pre);
      for (int64_t t = 0; t < g.S; ++t) {
        const int64_t at = (b * g.S + t) * g.H + h, n = n_pre + t + 1;
        const float m = lse[at];
        float delta = 0.f;
        for (int d = 0; d < D; ++d) delta += dout[at * D + d] * out[at * D + d];
        float* p = &P[t * Lt];
        float* ds = &DS[t * Lt];
        for (int64_t j = 0; j < padded(n); j += 16)
#pragma omp simd
          for (int u = 0; u < 16; ++u) {
            const bool seen = j + u < n;
            const float e = expf(seen ? p[j + u] - m : 0.f);
            p[j + u] = seen ? e : 0.f;
            ds[j + u] = seen ? e * (ds[j + u] - delta) : 0.f;
          }
        std::fill(p + padded(n), p + Lt, 0.f);
        std::fill(ds + padded(n), ds + Lt, 0.f);
      }
      // dq_t = scale sum_j ds[t, j] k_j over the keys t sees (n_pre + t + 1 of them; ds is 0 past them)
      weighted_rows_blocked<D>(dq + base, HD, DS.data(), Lt, 1, kb.k.data(), D, g.S, -L, n_pre, L, false);
      for (int64_t t = 0; t < g.S; ++t)
        for (int d = 0; d < D; ++d) dq[base + t * HD + d] *= g.scale;
      // dk_j += sum_t ds[t, j] qs_t, dv_j += sum_t P[t, j] dout_t over the queries that see key j (t >= j - n_pre)
      weighted_rows_blocked<D>(dkb.data(), D, DS.data(), 1, Lt, QS.data(), D, L, -n_pre, g.S, g.S, true);
      weighted_rows_blocked<D>(dvb.data(), D, P.data(), 1, Lt, dout + base, HD, L, -n_pre, g.S, g.S, true);
    }
  });
}

// out [B, S, H, D] = softmax(scale q k^T) v over the keys of Geometry, for rows b in [b_begin, b_end); lse
// [B, S, H] the log of each softmax's normaliser (for the backward's recomputation).
template <int D>
void attention_forward(const Geometry& g, const float* q, const float* k, const float* v, const float* pk,
                       const float* pv, float* out, float* lse, int64_t b_begin, int64_t b_end) {
  if constexpr (D % 16 == 0)
    attention_forward_blocked<D>(g, q, k, v, pk, pv, out, lse, b_begin, b_end);
  else

    attention_forward_per_query<D>(g, q, k, v, pk, pv, out, lse, b_begin, b_end);
}

// The gradients of attention_forward: dq [B, S, H, D] (written), dk, dv [B, S, kv, D] and dpk, dpv
// [P, Lp, kv, D] (added to). With p the softmax, delta = dout . out:
//   dv_j += p_j dout;  ds_j = p_j (dout . v_j - delta);  dq = scale sum_j ds_j k_j;  dk_j += scale ds_j q.
// Work is split by (prefix slot, kv head), or (row, kv head) with no prefix, so that no two
// threads add to the same key.
template <int D>
void attention_backward(const Geometry& g, const float* q, const float* k, const float* v, const float* pk,
                        const float* pv, const float* out, const float* lse, const float* dout, float* dq, float* dk,
                        float* dv, float* dpk, float* dpv) {
  const RowGroups rg(g);
  if constexpr (D % 16 == 0)
    attention_backward_blocked<D>(g, q, k, v, pk, pv, out, lse, dout, dq, dk, dv, dpk, dpv, rg);
  else

    attention_backward_per_query<D>(g, q, k, v, pk, pv, out, lse, dout, dq, dk, dv, dpk, dpv, rg);
}

}  // namespace reinforge_kernels
