// The decoder layer of the native engine's decoding step on CPU, shared by decode.cpp (`decode_layer`,
// `decode_attention`) and step.cpp (`decode_step`, `decode_loop`: the whole step, and whole generations, in one
// call): each row's new key/value written into the KV cache and attended over in one pass (`attention_rows`),
// the projections against packed weights (gemm.h), everything between them one loop over the rows.
//
// Layouts (reinforge.rollout.kv_cache.KVCache with keys_last): k_cache [slots, kv, D, C] (keys
// transposed: 8 key positions load as one vector), v_cache [slots, kv, C, D]; row b lives in slot
// b, or slots[b] where a slot map is given. Head h reads kv head h / (H / kv) (grouped-query attention).
// Sliding window: a query at position p sees keys p - window + 1 .. p (window <= 0: all). Queries and keys
// are rotated in the interleaved layout (pairs 2i, 2i + 1; `_interleave_heads` reorders the weights).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "attention.h"
#include "gemm.h"
#include "rows.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace reinforge_kernels {

// A [rows, cols] float block in memory: element (r, c) at data[r * stride + c].
struct Rows {
  float* data;
  int64_t stride;
  float* row(int64_t r) const { return data + r * stride; }
};

// One query head over keys [start, end) of one slot: kt [D, C], vv [C, D]; out [D]; scores [C]; where lse is not
// null, *lse = log sum_j exp(scale q . k_j), as the learner's attention keeps it for its backward (learner_attention.h).
// Scores 8 keys at a time from start's block of 8 to end's (attention.h: independent accumulators); the
// positions of those blocks outside [start, end), inside the cache, hold finite keys whose scores are
// computed and not read. Keys past the cache's last whole block of 8, if any, are scored one by one.
template <int D>
inline void attend(const float* __restrict q, float scale, const float* __restrict kt, const float* __restrict vv,
            int64_t C, int64_t start, int64_t end, float* __restrict scores, float* __restrict out,
            float* lse = nullptr) {
  float qs[D];
  for (int d = 0; d < D; ++d) qs[d] = q[d] * scale;
  const int64_t blocks_end = std::min((end + 7) / 8 * 8, C / 8 * 8);
  int64_t j = start / 8 * 8;
  for (; j + 32 <= blocks_end; j += 32) reinforge_kernels::score_blocks<D, 4>(scores, qs, kt, C, j);
  for (; j + 8 <= blocks_end; j += 8) reinforge_kernels::score_blocks<D, 1>(scores, qs, kt, C, j);
  for (; j < end; ++j) {
    float a = 0.f;
    for (int d = 0; d < D; ++d) a += qs[d] * kt[d * C + j];
    scores[j] = a;
  }
  float top = scores[start];
#pragma omp simd reduction(max : top)
  for (int64_t i = start + 1; i < end; ++i) top = std::max(top, scores[i]);
  const float sum = reinforge_kernels::exp_shifted(scores + start, end - start, top);
  float acc[D];
  reinforge_kernels::weighted_rows<D>(acc, scores + start, vv + start * D, end - start);
  const float inv = 1.f / sum;
#pragma omp simd
  for (int d = 0; d < D; ++d) out[d] = acc[d] * inv;
  if (lse) *lse = top + logf(sum);
}

// Rows b in [b_begin, b_end) of q [B, H * D], k_new and v_new [B, KV * D]: write keys/values at positions[b] of
// slot b (slots[b] where slots is not null), attend; out [B, H * D], and each head's log-sum-exp into lse [B, H]
// where it is not null.
template <int D>
inline void attention_rows(Rows out, Rows q, Rows k_new, Rows v_new, at::Tensor& k_cache, at::Tensor& v_cache,
                           const int64_t* pos, const int64_t* slots, int64_t b_begin, int64_t b_end, int64_t H,
                           float scale, int64_t window, float* lse = nullptr) {
  const int64_t KV = k_cache.size(1), C = k_cache.size(3), G = H / KV;
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  at::parallel_for(b_begin, b_end, 8, [&](int64_t b0, int64_t b1) {
    std::vector<float> scores(C + 16);   // exp_shifted's room past any start
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p = pos[b], slot = slots ? slots[b] : b;
      const int64_t start = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      for (int64_t g = 0; g < KV; ++g) {
        float* kt = kc + slot * ks0 + g * ks1;
        float* vv = vc + slot * vs0 + g * vs1;
        const float* kn = k_new.row(b) + g * D;
        const float* vn = v_new.row(b) + g * D;
        for (int d = 0; d < D; ++d) {
          kt[d * C + p] = kn[d];
          vv[p * D + d] = vn[d];
        }
        for (int64_t h = g * G; h < (g + 1) * G; ++h)
          attend<D>(q.row(b) + h * D, scale, kt, vv, C, start, p + 1, scores.data(), out.row(b) + h * D,
                    lse ? lse + b * H + h : nullptr);
      }
    }
  });
}

// The caches' layout (float32 CPU, k [slots >= B, kv, D, C] and v [slots >= B, kv, C, D] with contiguous blocks, kv
// dividing H); returns C, the positions a slot holds.
inline int64_t check_cache_layout(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t B, int64_t H,
                                  int64_t D) {
  for (const at::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "reinforge_kernels: float32 CPU caches only");
  const int64_t KV = k_cache.size(1), C = k_cache.size(3);
  TORCH_CHECK(KV > 0 && H % KV == 0 && k_cache.size(0) >= B && k_cache.size(2) == D && k_cache.stride(3) == 1 &&
              k_cache.stride(2) == C, "reinforge_kernels: k_cache must be [slots, kv, D, C] with contiguous [D, C] blocks");
  TORCH_CHECK(v_cache.size(0) >= B && v_cache.size(1) == KV && v_cache.size(2) == C &&
              v_cache.size(3) == D && v_cache.stride(3) == 1 && v_cache.stride(2) == D,
              "reinforge_kernels: v_cache must be [slots, kv, C, D] with contiguous [C, D] blocks");
  return C;
}

// The layout (check_cache_layout) and positions [B] int64 inside the cache.
inline void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& positions, int64_t B,
                        int64_t H, int64_t D) {
  const int64_t C = check_cache_layout(k_cache, v_cache, B, H, D);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == B,
              "reinforge_kernels: positions must be [B] int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pos[b] >= 0 && pos[b] < C, "reinforge_kernels: position ", pos[b], " is outside the cache (", C, ")");
}

// Whether decode_layer splits the rows between the threads, each running the whole layer for its rows with
// no synchronisation inside it, rather than running each step (norm, product, attention, ...) over all rows
// with the threads splitting that step's work: a parallel region and its barrier per step, ~8 a layer.
// At the built-in model's size a region costs about as much as the work it splits (perf on an Intel Xeon
// under KVM: a fifth of a 64-row generation's samples in OpenMP's waits). Each thread then reads every weight
// of the layer, which is cheap while the layer's weights stay in cache and doubles the memory traffic of a
// large model, whose decoding step is bound by it: so rows are split only while the layer's weights are
// within `ROW_SPLIT_BYTES`. Every row's sums run in the same order either way: the results are identical.
constexpr int64_t ROW_SPLIT_BYTES = 4 << 20;

// One decoder layer's tensors as the decoding step reads them: norms [E], the projections' weights as
// `product` reads them (gemm.h: packed or plain), biases and Qwen3's per-head q/k norms (null: none), and
// the layer's cache.
struct Layer {
  const float* input_norm;
  const at::Tensor& qkv_p;
  const float* qkv_b;
  const float* q_norm;
  const float* k_norm;
  const at::Tensor& o_p;
  const float* o_b;
  const float* post_norm;
  const at::Tensor& gate_up_p;
  const at::Tensor& down_p;
  at::Tensor& k_cache;
  at::Tensor& v_cache;
  float* record = nullptr;   // this layer's activation record (`Record`), or null
};

// What a decoding step keeps of each token it runs, for the learner's backward to use in place of its own forward
// (reinforge.kernels.replay_layer): per layer and token one row of `width_of` floats, the fields in this order:
// q|k|v after rotary [N], the attention's output [H D], the residual after the attention x_mid [E], gate|up [2I],
// the layer's output [E], the attention's log-sum-exp per head [H], then padding to whole 64-byte lines (so that
// where the widths are multiples of 16 floats each field is written with streaming stores: the record is read back
// by the learner later, not by this step). Row b of a step goes to row at[b] of every layer's record (at[b] < 0: not
// kept). reinforge.models.replay.RecordShape holds the same layout.
struct Record {
  const int64_t* at;
  int64_t width;
  static int64_t width_of(int64_t E, int64_t H, int64_t D, int64_t I, int64_t N) {
    return (N + H * D + 2 * E + 2 * I + H + 15) / 16 * 16;
  }
};

// n floats from src to dst, with streaming stores where dst is 64-byte aligned and n whole lines (the writer
// fences once it has written its rows); else memcpy.
inline void stream_floats(float* dst, const float* src, int64_t n) {
#if defined(__AVX512F__)
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0 && n % 16 == 0) {
    for (int64_t i = 0; i < n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
    return;
  }
#endif
  std::memcpy(dst, src, sizeof(float) * n);
}

// The widths of a layer (E model, H and KV heads of D, I the MLP's, N = (H + 2 KV) D of q|k|v) and the
// step's scratch rows: h [B, E], qkv [B, N], attn [B, H D], gu [B, 2I], act [B, I], lse [B, H].
struct Step {
  int64_t E, H, KV, D, I, N;
  float *h, *qkv, *attn, *gu, *act, *lse;
  std::vector<at::Tensor> memory;

  Step(int64_t B, int64_t E_, int64_t H_, int64_t KV_, int64_t D_, int64_t I_, const at::TensorOptions& opts)
      : E(E_), H(H_), KV(KV_), D(D_), I(I_), N((H_ + 2 * KV_) * D_) {
    for (int64_t width : {E, N, H * D, 2 * I, I, H}) memory.push_back(at::empty({B, width}, opts));
    h = memory[0].data_ptr<float>(), qkv = memory[1].data_ptr<float>(), attn = memory[2].data_ptr<float>();
    gu = memory[3].data_ptr<float>(), act = memory[4].data_ptr<float>(), lse = memory[5].data_ptr<float>();
  }
};

// One decoder layer (pre-norm, SwiGLU MLP) for rows [b0, b1) of x [B, E], in place:
// x += o(attention(rope(qkv(norm(x))))); x += down(silu(gate) * up)(norm(x)). Row b's rotary factors
// (cos, sin) per pair are at rot + (rot_at ? rot_at[b] : b) * D; its new key/value go to position pos[b] of
// cache slot b (slots[b] where slots is not null). Inside a parallel region ATen's parallel_for runs its body
// inline, so the steps below split their work between the threads only when this runs outside one. One copy
// serves decode_layer, decode_step and decode_loop. With `rec` and L.record, each row's activations are kept
// there (`Record`).
__attribute__((noinline)) inline void layer_rows(const Layer& L, const Step& s, float* xp, const float* rot,
                                                 const int64_t* rot_at, const int64_t* pos, const int64_t* slots,
                                                 int64_t b0, int64_t b1, float eps, int64_t window,
                                                 const Record* rec = nullptr) {
  const int64_t M = b1 - b0, E = s.E, H = s.H, KV = s.KV, D = s.D, I = s.I, N = s.N;
  if (!L.record) rec = nullptr;
  // row b's record, or null
  auto kept = [&](int64_t b) { return rec && rec->at[b] >= 0 ? L.record + rec->at[b] * rec->width : nullptr; };
  rms_norm_rows(s.h + b0 * E, nullptr, xp + b0 * E, L.input_norm, M, E, eps);
  product(s.qkv + b0 * N, N, s.h + b0 * E, E, L.qkv_p, L.qkv_b, M, N, E, false);
  if (L.q_norm) {   // Qwen3: RMSNorm of each query and key head before rotary
    at::parallel_for(b0, b1, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t b = r0; b < r1; ++b) {
        rms_norm_rows(s.qkv + b * N, nullptr, s.qkv + b * N, L.q_norm, H, D, eps);
        rms_norm_rows(s.qkv + b * N + H * D, nullptr, s.qkv + b * N + H * D, L.k_norm, KV, D, eps);
      }
    });
  }
  at::parallel_for(b0, b1, 16, [&](int64_t r0, int64_t r1) {   // rotary of queries and keys: pair times (cos + i sin)
    for (int64_t b = r0; b < r1; ++b) {
      const float* cs = rot + (rot_at ? rot_at[b] : b) * D;
      for (int64_t head = 0; head < H + KV; ++head) {
        float* v = s.qkv + b * N + head * D;
        for (int64_t i = 0; i < D / 2; ++i) {
          const float re = v[2 * i], im = v[2 * i + 1], c = cs[2 * i], sn = cs[2 * i + 1];
          v[2 * i] = re * c - im * sn;
          v[2 * i + 1] = re * sn + im * c;
        }
      }
    }
  });
  with_head_dim(D, [&](auto d) {
    attention_rows<decltype(d)::value>(Rows{s.attn, H * D}, Rows{s.qkv, N}, Rows{s.qkv + H * D, N},
                                       Rows{s.qkv + (H + KV) * D, N}, L.k_cache, L.v_cache, pos, slots, b0, b1,
                                       H, 1.f / std::sqrt((float)D), window, rec ? s.lse : nullptr);
  });
  product(xp + b0 * E, E, s.attn + b0 * H * D, H * D, L.o_p, nullptr, M, E, H * D, true);
  if (L.o_b)
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t e = 0; e < E; ++e) xp[b * E + e] += L.o_b[e];
  const int64_t mid = N + H * D;   // x_mid's offset in a record row
  if (rec)
    for (int64_t b = b0; b < b1; ++b)
      if (float* r = kept(b)) stream_floats(r + mid, xp + b * E, E);
  rms_norm_rows(s.h + b0 * E, nullptr, xp + b0 * E, L.post_norm, M, E, eps);
  product(s.gu + b0 * 2 * I, 2 * I, s.h + b0 * E, E, L.gate_up_p, nullptr, M, 2 * I, E, false);
  swiglu_rows(s.act + b0 * I, s.gu + b0 * 2 * I, M, I);
  product(xp + b0 * E, E, s.act + b0 * I, I, L.down_p, nullptr, M, E, I, true);
  if (rec) {
    for (int64_t b = b0; b < b1; ++b)
      if (float* r = kept(b)) {
        stream_floats(r, s.qkv + b * N, N);
        stream_floats(r + N, s.attn + b * H * D, H * D);
        stream_floats(r + mid + E, s.gu + b * 2 * I, 2 * I);
        stream_floats(r + mid + E + 2 * I, xp + b * E, E);
        std::memcpy(r + mid + 2 * E + 2 * I, s.lse + b * H, sizeof(float) * H);
      }
#if defined(__AVX512F__)
    _mm_sfence();   // this thread's streaming stores before anyone reads the record
#endif
  }
}

inline const float* data_or_null(const std::optional<at::Tensor>& t) {
  if (!t || !t->defined() || t->numel() == 0) return nullptr;
  TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat, "reinforge_kernels: float32 contiguous vectors");
  return t->data_ptr<float>();
}

inline bool split_by_rows(int64_t B, int64_t weight_elements) {   // ROW_SPLIT_BYTES, for a layer of this many weights
  return at::get_num_threads() > 1 && B > 1 && weight_elements * (int64_t)sizeof(float) <= ROW_SPLIT_BYTES;
}

inline int64_t layer_weights(const Layer& L) { return L.qkv_p.numel() + L.o_p.numel() + L.gate_up_p.numel() + L.down_p.numel(); }

inline void check_sampling(const at::Tensor& tokens, const at::Tensor& logprobs, const at::Tensor& keys,
                    const at::Tensor& counters, int64_t B, double top_p) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&tokens, &keys, &counters})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == B, "sample: [B] int64 tensors");
  TORCH_CHECK(logprobs.scalar_type() == at::kFloat && logprobs.is_contiguous() && logprobs.size(0) == B,
              "sample: [B] float32 log-probs");
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "sample: top_p must be in (0, 1]");
}

}  // namespace reinforge_kernels
