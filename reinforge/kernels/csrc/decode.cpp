// The native engine's decoding step on CPU, fused: one call per decoder layer
// (`decode_layer`), whose attention (`decode_attention`, also callable alone) writes each row's new
// key/value into the KV cache and attends over that row's keys in one pass, and one call to draw
// every row's next token (`sample`: temperature or greedy, no top-k / top-p filter).
//
// Why: at RL rollout shapes (hundreds of rows of a small model) a decoding step in PyTorch is ~35
// ops per layer (norms, rotary, thousands of tiny batched GEMMs for attention, masking, softmax,
// SwiGLU), each a dispatch and a pass over memory; the matmuls are a minority of the time. Here
// everything between the projections is one loop over the rows, and the projections run against
// weights packed once per generation (`pack_weight`, `gemm_packed` in gemm.h).
//
// Layouts (reinforge.rollout.kv_cache.KVCache with keys_last): k_cache [slots, kv, D, C] (keys
// transposed: 8 key positions load as one vector), v_cache [slots, kv, C, D]; row b lives in slot
// b. Head h reads kv head h / (H / kv) (grouped-query attention). Sliding window: a query at
// position p sees keys p - window + 1 .. p (window <= 0: all). Queries and keys are rotated in
// the interleaved layout (pairs 2i, 2i + 1; `_interleave_heads` reorders the weights).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "attention.h"
#include "gemm.h"
#include "rows.h"
#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using reinforge_kernels::rms_norm_rows;
using reinforge_kernels::swiglu_rows;
using reinforge_kernels::product;
using reinforge_kernels::pack_weight;
using reinforge_kernels::with_head_dim;
using reinforge_kernels::sample_rows;

// A [rows, cols] float block in memory: element (r, c) at data[r * stride + c].
struct Rows {
  float* data;
  int64_t stride;
  float* row(int64_t r) const { return data + r * stride; }
};

// One query head over keys [start, end) of one slot: kt [D, C], vv [C, D]; out [D]; scores [C].
// Scores 8 keys at a time from start's block of 8 to end's (attention.h: independent accumulators); the
// positions of those blocks outside [start, end), inside the cache, hold finite keys whose scores are
// computed and not read. Keys past the cache's last whole block of 8, if any, are scored one by one.
template <int D>
void attend(const float* __restrict q, float scale, const float* __restrict kt, const float* __restrict vv,
            int64_t C, int64_t start, int64_t end, float* __restrict scores, float* __restrict out) {
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
}

// Rows b in [b_begin, b_end) of q [B, H * D], k_new and v_new [B, KV * D]: write keys/values at positions[b],
// attend; out [B, H * D].
template <int D>
void attention_rows(Rows out, Rows q, Rows k_new, Rows v_new, at::Tensor& k_cache, at::Tensor& v_cache,
                    const int64_t* pos, int64_t b_begin, int64_t b_end, int64_t H, float scale, int64_t window) {
  const int64_t KV = k_cache.size(1), C = k_cache.size(3), G = H / KV;
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  at::parallel_for(b_begin, b_end, 8, [&](int64_t b0, int64_t b1) {
    std::vector<float> scores(C + 16);   // exp_shifted's room past any start
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p = pos[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      for (int64_t g = 0; g < KV; ++g) {
        float* kt = kc + b * ks0 + g * ks1;
        float* vv = vc + b * vs0 + g * vs1;
        const float* kn = k_new.row(b) + g * D;
        const float* vn = v_new.row(b) + g * D;
        for (int d = 0; d < D; ++d) {
          kt[d * C + p] = kn[d];
          vv[p * D + d] = vn[d];
        }
        for (int64_t h = g * G; h < (g + 1) * G; ++h)
          attend<D>(q.row(b) + h * D, scale, kt, vv, C, start, p + 1, scores.data(), out.row(b) + h * D);
      }
    }
  });
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& positions, int64_t B,
                 int64_t H, int64_t D) {
  for (const at::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "reinforge_kernels: float32 CPU caches only");
  const int64_t KV = k_cache.size(1), C = k_cache.size(3);
  TORCH_CHECK(KV > 0 && H % KV == 0 && k_cache.size(0) >= B && k_cache.size(2) == D && k_cache.stride(3) == 1 &&
              k_cache.stride(2) == C, "reinforge_kernels: k_cache must be [slots, kv, D, C] with contiguous [D, C] blocks");
  TORCH_CHECK(v_cache.size(0) >= B && v_cache.size(1) == KV && v_cache.size(2) == C && v_cache.size(3) == D &&
              v_cache.stride(3) == 1 && v_cache.stride(2) == D,
              "reinforge_kernels: v_cache must be [slots, kv, C, D] with contiguous [C, D] blocks");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == B,
              "reinforge_kernels: positions must be [B] int64");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pos[b] >= 0 && pos[b] < C, "reinforge_kernels: position ", pos[b], " is outside the cache (", C, ")");
}

Rows rows_of(const at::Tensor& t) {   // a [B, H, D] or [B, N] tensor whose rows are contiguous
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), "reinforge_kernels: float32 CPU tensors only");
  TORCH_CHECK(t.stride(-1) == 1 && (t.dim() == 2 || t.stride(1) == t.size(2)), "reinforge_kernels: rows must be contiguous");
  return Rows{t.data_ptr<float>(), t.stride(0)};
}

// q [B, H, D]; k_new, v_new [B, KV, D] (rows contiguous); out [B, H, D] contiguous.
void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& positions, double scale, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  check_cache(k_cache, v_cache, positions, B, H, D);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && k_new.size(0) == B && k_new.size(1) == k_cache.size(1) &&
              k_new.size(2) == D && v_new.sizes() == k_new.sizes(), "decode_attention: shapes do not match");
  with_head_dim(D, [&](auto d) {
    attention_rows<decltype(d)::value>(rows_of(out), rows_of(q), rows_of(k_new), rows_of(v_new), k_cache, v_cache,
                                       positions.data_ptr<int64_t>(), 0, B, H, (float)scale, window);
  });
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
};

// The widths of a layer (E model, H and KV heads of D, I the MLP's, N = (H + 2 KV) D of q|k|v) and the
// step's scratch rows: h [B, E], qkv [B, N], attn [B, H D], gu [B, 2I], act [B, I].
struct Step {
  int64_t E, H, KV, D, I, N;
  float *h, *qkv, *attn, *gu, *act;
  std::vector<at::Tensor> memory;

  Step(int64_t B, int64_t E_, int64_t H_, int64_t KV_, int64_t D_, int64_t I_, const at::TensorOptions& opts)
      : E(E_), H(H_), KV(KV_), D(D_), I(I_), N((H_ + 2 * KV_) * D_) {
    for (int64_t width : {E, N, H * D, 2 * I, I}) memory.push_back(at::empty({B, width}, opts));
    h = memory[0].data_ptr<float>(), qkv = memory[1].data_ptr<float>(), attn = memory[2].data_ptr<float>();
    gu = memory[3].data_ptr<float>(), act = memory[4].data_ptr<float>();
  }
};

// One decoder layer (pre-norm, SwiGLU MLP) for rows [b0, b1) of x [B, E], in place:
// x += o(attention(rope(qkv(norm(x))))); x += down(silu(gate) * up)(norm(x)). Row b's rotary factors
// (cos, sin) per pair are at rot + (rot_at ? rot_at[b] : b) * D; its new key/value go to position pos[b].
// Inside a parallel region ATen's parallel_for runs its body inline, so the steps below split their work
// between the threads only when this runs outside one. One copy serves decode_layer and decode_step.
__attribute__((noinline)) void layer_rows(const Layer& L, const Step& s, float* xp, const float* rot,
                                          const int64_t* rot_at, const int64_t* pos, int64_t b0, int64_t b1,
                                          float eps, int64_t window) {
  const int64_t M = b1 - b0, E = s.E, H = s.H, KV = s.KV, D = s.D, I = s.I, N = s.N;
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
                                       Rows{s.qkv + (H + KV) * D, N}, L.k_cache, L.v_cache, pos, b0, b1, H,
                                       1.f / std::sqrt((float)D), window);
  });
  product(xp + b0 * E, E, s.attn + b0 * H * D, H * D, L.o_p, nullptr, M, E, H * D, true);
  if (L.o_b)
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t e = 0; e < E; ++e) xp[b * E + e] += L.o_b[e];
  rms_norm_rows(s.h + b0 * E, nullptr, xp + b0 * E, L.post_norm, M, E, eps);
  product(s.gu + b0 * 2 * I, 2 * I, s.h + b0 * E, E, L.gate_up_p, nullptr, M, 2 * I, E, false);
  swiglu_rows(s.act + b0 * I, s.gu + b0 * 2 * I, M, I);
  product(xp + b0 * E, E, s.act + b0 * I, I, L.down_p, nullptr, M, E, I, true);
}

const float* data_or_null(const std::optional<at::Tensor>& t) {
  if (!t || !t->defined() || t->numel() == 0) return nullptr;
  TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat, "reinforge_kernels: float32 contiguous vectors");
  return t->data_ptr<float>();
}

bool split_by_rows(int64_t B, int64_t weight_elements) {   // ROW_SPLIT_BYTES, for a layer of this many weights
  return at::get_num_threads() > 1 && B > 1 && weight_elements * (int64_t)sizeof(float) <= ROW_SPLIT_BYTES;
}

int64_t layer_weights(const Layer& L) { return L.qkv_p.numel() + L.o_p.numel() + L.gate_up_p.numel() + L.down_p.numel(); }

// One decoder layer for one new token of each of B rows, x [B, E] updated in place (`layer_rows`).
// rot [B, D/2, 2]: each row's (cos, sin) per rotary pair. q_norm/k_norm: Qwen3's per-head RMSNorm.
// split_rows: 1 splits the rows between the threads, 0 splits each step's work, -1 chooses (ROW_SPLIT_BYTES).
void decode_layer(at::Tensor x, const at::Tensor& input_norm, const at::Tensor& qkv_p, const std::optional<at::Tensor>& qkv_b,
                  const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, const at::Tensor& o_p,
                  const std::optional<at::Tensor>& o_b, const at::Tensor& post_norm, const at::Tensor& gate_up_p,
                  const at::Tensor& down_p, const at::Tensor& rot, at::Tensor k_cache, at::Tensor v_cache,
                  const at::Tensor& positions, int64_t heads, double eps, int64_t window, int64_t split_rows) {
  const int64_t B = x.size(0), E = x.size(1), KV = k_cache.size(1), D = k_cache.size(2), I = down_p.size(1);
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "decode_layer: x must be contiguous float32");
  check_cache(k_cache, v_cache, positions, B, heads, D);
  TORCH_CHECK(qkv_p.size(1) == E && o_p.size(1) == heads * D && gate_up_p.size(1) == E && rot.is_contiguous() &&
              rot.size(0) == B && rot.size(1) == D / 2, "decode_layer: weight shapes do not match the cache");
  const Layer L{input_norm.data_ptr<float>(), qkv_p, data_or_null(qkv_b), data_or_null(q_norm), data_or_null(k_norm),
                o_p, data_or_null(o_b), post_norm.data_ptr<float>(), gate_up_p, down_p, k_cache, v_cache};
  const Step s(B, E, heads, KV, D, I, x.options());
  float* xp = x.data_ptr<float>();
  auto rows = [&](int64_t b0, int64_t b1) {
    layer_rows(L, s, xp, rot.data_ptr<float>(), nullptr, positions.data_ptr<int64_t>(), b0, b1, (float)eps, window);
  };
  if (split_rows < 0) split_rows = split_by_rows(B, layer_weights(L));
  if (split_rows)
    at::parallel_for(0, B, 1, rows);
  else
    rows(0, B);
}

void check_sampling(const at::Tensor& tokens, const at::Tensor& logprobs, const at::Tensor& keys,
                    const at::Tensor& counters, int64_t B, double top_p) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&tokens, &keys, &counters})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == B, "sample: [B] int64 tensors");
  TORCH_CHECK(logprobs.scalar_type() == at::kFloat && logprobs.is_contiguous() && logprobs.size(0) == B,
              "sample: [B] float32 log-probs");
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "sample: top_p must be in (0, 1]");
}

// The per-layer tensors of decode_step's `weights`, in this order (an empty or absent one: none).
constexpr int PER_LAYER = 10;   // input_norm, qkv_p, qkv_b, q_norm, k_norm, o_p, o_b, post_norm, gate_up_p, down_p

// A whole decoding step of B rows, one call (what `decode_layer` per layer, then the final norm, the head
// and `sample` do in turn; the same numbers, bit for bit): tokens [B] (each row's newest token, embedded by
// `embed` [V, E]) at positions [B]; layer l's tensors weights[PER_LAYER l ...] and cache k_caches[l],
// v_caches[l]; rot [L, D/2, 2] the rotary table by position; head: the [V, E] head as `product` reads it.
// Writes each row's next token and its log-prob into next [B], logprobs [B]. Where the layers' weights are
// small (ROW_SPLIT_BYTES) and there are threads, each thread runs the whole step for its rows, with no
// synchronisation until the end; else each part splits its work. Why: the ~30 small torch ops and 6 kernel
// calls around a step were ~6% of the built-in model's 64-row generation (28.4 -> 26.8 ms, BENCHMARKS.md).
void decode_step(at::Tensor next, at::Tensor logprobs, const at::Tensor& tokens, const at::Tensor& positions,
                 const at::Tensor& embed, const c10::List<std::optional<at::Tensor>>& weights,
                 at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& rot, const at::Tensor& final_norm,
                 const at::Tensor& head, int64_t vocab, int64_t heads, double eps, int64_t window, double temperature,
                 const at::Tensor& keys, const at::Tensor& counters, double top_p, int64_t split_rows) {
  const int64_t B = tokens.size(0), V = vocab, E = embed.size(1), layers = k_caches.size();
  TORCH_CHECK(layers > 0 && (int64_t)weights.size() == PER_LAYER * layers && (int64_t)v_caches.size() == layers,
              "decode_step: ", PER_LAYER, " weights and a key and value cache per layer");
  TORCH_CHECK(embed.scalar_type() == at::kFloat && embed.is_contiguous() && embed.dim() == 2 && embed.size(0) >= V,
              "decode_step: embed must be a contiguous float32 [V, E]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous(), "decode_step: tokens must be [B] int64");
  check_sampling(next, logprobs, keys, counters, B, top_p);
  const std::vector<std::optional<at::Tensor>> w = weights.vec();
  const int64_t KV = k_caches[0].size(1), D = k_caches[0].size(2), I = w[9]->size(1);
  TORCH_CHECK(rot.is_contiguous() && rot.dim() == 3 && rot.size(1) == D / 2 && rot.size(2) == 2,
              "decode_step: rot must be [L, D/2, 2]");
  std::vector<at::Tensor> kc(k_caches.begin(), k_caches.end()), vc(v_caches.begin(), v_caches.end());
  std::vector<Layer> stack;
  int64_t largest = 0;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t l = 0; l < layers; ++l) {
    const std::optional<at::Tensor>* t = w.data() + PER_LAYER * l;
    for (int i : {0, 1, 5, 7, 8, 9}) TORCH_CHECK(t[i] && t[i]->defined(), "decode_step: layer ", l, " lacks weight ", i);
    check_cache(kc[l], vc[l], positions, B, heads, D);
    TORCH_CHECK(t[1]->size(1) == E && t[5]->size(1) == heads * D && t[8]->size(1) == E && t[9]->size(1) == I &&
                kc[l].size(1) == KV && kc[l].size(2) == D, "decode_step: layer ", l, "'s shapes differ from layer 0's");
    stack.push_back(Layer{t[0]->data_ptr<float>(), *t[1], data_or_null(t[2]), data_or_null(t[3]), data_or_null(t[4]),
                          *t[5], data_or_null(t[6]), t[7]->data_ptr<float>(), *t[8], *t[9], kc[l], vc[l]});
    largest = std::max(largest, layer_weights(stack.back()));
  }
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] < rot.size(0), "decode_step: position ", pos[b], " is past the rotary table");
    TORCH_CHECK(tokens.data_ptr<int64_t>()[b] >= 0 && tokens.data_ptr<int64_t>()[b] < embed.size(0),
                "decode_step: a token id outside the embedding");
  }
  const Step s(B, E, heads, KV, D, I, embed.options());
  auto x = at::empty({B, E}, embed.options()), logits = at::empty({B, V}, embed.options());
  float *xp = x.data_ptr<float>(), *lp = logits.data_ptr<float>();
  const float epsf = (float)eps;
  auto body = [&](int64_t b0, int64_t b1) {   // embedding, the layers, the final norm
    for (int64_t b = b0; b < b1; ++b)
      std::memcpy(xp + b * E, embed.data_ptr<float>() + tokens.data_ptr<int64_t>()[b] * E, sizeof(float) * E);
    for (const Layer& L : stack) layer_rows(L, s, xp, rot.data_ptr<float>(), pos, pos, b0, b1, epsf, window);
    rms_norm_rows(xp + b0 * E, nullptr, xp + b0 * E, final_norm.data_ptr<float>(), b1 - b0, E, epsf);
  };
  auto tail = [&](int64_t b0, int64_t b1) {   // the head, then sampling
    product(lp + b0 * V, V, xp + b0 * E, E, head, nullptr, b1 - b0, V, E, false);
    at::parallel_for(b0, b1, 16, [&](int64_t r0, int64_t r1) {
      sample_rows(next.data_ptr<int64_t>(), logprobs.data_ptr<float>(), lp, V, r0, r1, temperature,
                  keys.data_ptr<int64_t>(), counters.data_ptr<int64_t>(), top_p);
    });
  };
  if (split_rows < 0) split_rows = split_by_rows(B, largest);
  const bool head_split = split_rows && split_by_rows(B, head.numel());
  if (split_rows) {
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      body(b0, b1);
      if (head_split) tail(b0, b1);
    });
  } else {
    body(0, B);
  }
  if (!head_split) tail(0, B);
}

// One token per row of fp32 logits [B, V] (`sample_rows`, sampling.h): tokens [B] int64 and
// logprobs [B] float32 are written.
void sample(at::Tensor tokens, at::Tensor logprobs, const at::Tensor& logits, double temperature,
            const at::Tensor& keys, const at::Tensor& counters, double top_p) {
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.device().is_cpu(),
              "sample: logits must be contiguous float32 on the CPU");
  check_sampling(tokens, logprobs, keys, counters, B, top_p);
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    sample_rows(tokens.data_ptr<int64_t>(), logprobs.data_ptr<float>(), logits.data_ptr<float>(), V, b0, b1,
                temperature, keys.data_ptr<int64_t>(), counters.data_ptr<int64_t>(), top_p);
  });
}

}  // namespace

TORCH_LIBRARY(reinforge_kernels, m) {
  m.def("decode_attention(Tensor(o!) out, Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor positions, float scale, int window) -> ()", &decode_attention);
  m.def("pack_weight(Tensor w, bool transposed=False) -> Tensor", [](const at::Tensor& w, bool t) { return pack_weight(w, t); });
  m.def("pack_weight_into(Tensor(a!) into, Tensor w, bool transposed=False) -> ()",
        [](at::Tensor into, const at::Tensor& w, bool t) { pack_weight(w, t, into); });
  m.def("packed_matmul(Tensor a, Tensor packed, Tensor? bias, int n, int rows=0) -> Tensor", &reinforge_kernels::packed_matmul);
  m.def("set_row_block(int rows, bool wide=False) -> ()", &reinforge_kernels::set_row_block);
  m.def("row_block(bool wide=False) -> int", [](bool wide) -> int64_t {
    return wide ? reinforge_kernels::row_block_wide() : reinforge_kernels::row_block();
  });
  m.def("decode_layer(Tensor(x!) x, Tensor input_norm, Tensor qkv_p, Tensor? qkv_b, Tensor? q_norm, Tensor? k_norm, "
        "Tensor o_p, Tensor? o_b, Tensor post_norm, Tensor gate_up_p, Tensor down_p, Tensor rot, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor positions, int heads, float eps, int window, int split_rows=-1) -> ()",
        &decode_layer);
  m.def("decode_step(Tensor(a!) next, Tensor(b!) logprobs, Tensor tokens, Tensor positions, Tensor embed, "
        "Tensor?[] weights, Tensor(c!)[] k_caches, Tensor(d!)[] v_caches, Tensor rot, Tensor final_norm, Tensor head, "
        "int vocab, int heads, float eps, int window, float temperature, Tensor keys, Tensor counters, "
        "float top_p=1.0, int split_rows=-1) -> ()", &decode_step);
  m.def("sample(Tensor(a!) tokens, Tensor(b!) logprobs, Tensor logits, float temperature, Tensor keys, "
        "Tensor counters, float top_p=1.0) -> ()", &sample);
}
