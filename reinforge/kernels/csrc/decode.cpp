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
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = start; i < end; ++i) {
    const float e = expf(scores[i] - top);
    scores[i] = e;
    sum += e;
  }
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
    std::vector<float> scores(C);
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

// One decoder layer (pre-norm, SwiGLU MLP) for one new token of each of B rows, x [B, E] updated in
// place: x += o(attention(rope(qkv(norm(x))))); x += down(silu(gate) * up)(norm(x)).
// rot [B, D/2, 2]: each row's (cos, sin) per rotary pair. q_norm/k_norm: Qwen3's per-head RMSNorm.
// qkv_p, o_p, gate_up_p, down_p: the projections' weights as `product` reads them (gemm.h): packed or plain.
// split_rows: 1 splits the rows between the threads, 0 splits each step's work, -1 chooses (ROW_SPLIT_BYTES).
void decode_layer(at::Tensor x, const at::Tensor& input_norm, const at::Tensor& qkv_p, const std::optional<at::Tensor>& qkv_b,
                  const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, const at::Tensor& o_p,
                  const std::optional<at::Tensor>& o_b, const at::Tensor& post_norm, const at::Tensor& gate_up_p,
                  const at::Tensor& down_p, const at::Tensor& rot, at::Tensor k_cache, at::Tensor v_cache,
                  const at::Tensor& positions, int64_t heads, double eps, int64_t window, int64_t split_rows) {
  const int64_t B = x.size(0), E = x.size(1), KV = k_cache.size(1), D = k_cache.size(2), I = down_p.size(1);
  const int64_t H = heads, N = (H + 2 * KV) * D;
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat, "decode_layer: x must be contiguous float32");
  check_cache(k_cache, v_cache, positions, B, H, D);
  TORCH_CHECK(qkv_p.size(1) == E && o_p.size(1) == H * D && gate_up_p.size(1) == E && rot.is_contiguous() &&
              rot.size(0) == B && rot.size(1) == D / 2, "decode_layer: weight shapes do not match the cache");
  for (const std::optional<at::Tensor>* t : {&qkv_b, &o_b})
    TORCH_CHECK(!*t || ((*t)->is_contiguous() && (*t)->scalar_type() == at::kFloat), "decode_layer: float32 biases");
  const float epsf = (float)eps;
  auto h = at::empty({B, E}, x.options());
  auto qkv = at::empty({B, N}, x.options());
  auto attn = at::empty({B, H * D}, x.options());
  auto gu = at::empty({B, 2 * I}, x.options());          // [B, 2I]: gate | up
  auto act = at::empty({B, I}, x.options());
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *qkvp = qkv.data_ptr<float>();
  float *ap = attn.data_ptr<float>(), *gup = gu.data_ptr<float>(), *actp = act.data_ptr<float>();
  const float* rp = rot.data_ptr<float>();

  // The layer for rows [b0, b1). Inside a parallel region ATen's parallel_for runs its body inline, so the
  // steps below split their work between the threads only when this runs outside one (split_rows 0).
  auto layer = [&](int64_t b0, int64_t b1) {
    const int64_t M = b1 - b0;
    rms_norm_rows(hp + b0 * E, nullptr, xp + b0 * E, input_norm.data_ptr<float>(), M, E, epsf);
    product(qkvp + b0 * N, N, hp + b0 * E, E, qkv_p, qkv_b ? qkv_b->data_ptr<float>() : nullptr, M, N, E, false);
    if (q_norm) {   // Qwen3: RMSNorm of each query and key head before rotary
      at::parallel_for(b0, b1, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t b = r0; b < r1; ++b) {
          rms_norm_rows(qkvp + b * N, nullptr, qkvp + b * N, q_norm->data_ptr<float>(), H, D, epsf);
          rms_norm_rows(qkvp + b * N + H * D, nullptr, qkvp + b * N + H * D, k_norm->data_ptr<float>(), KV, D, epsf);
        }
      });
    }
    at::parallel_for(b0, b1, 16, [&](int64_t r0, int64_t r1) {   // rotary of queries and keys: pair times (cos + i sin)
      for (int64_t b = r0; b < r1; ++b) {
        const float* cs = rp + b * D;
        for (int64_t head = 0; head < H + KV; ++head) {
          float* v = qkvp + b * N + head * D;
          for (int64_t i = 0; i < D / 2; ++i) {
            const float re = v[2 * i], im = v[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
            v[2 * i] = re * c - im * s;
            v[2 * i + 1] = re * s + im * c;
          }
        }
      }
    });
    with_head_dim(D, [&](auto d) {
      attention_rows<decltype(d)::value>(Rows{ap, H * D}, Rows{qkvp, N}, Rows{qkvp + H * D, N},
                                         Rows{qkvp + (H + KV) * D, N}, k_cache, v_cache, positions.data_ptr<int64_t>(),
                                         b0, b1, H, 1.f / std::sqrt((float)D), window);
    });
    product(xp + b0 * E, E, ap + b0 * H * D, H * D, o_p, nullptr, M, E, H * D, true);
    if (o_b) {
      const float* ob = o_b->data_ptr<float>();
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t e = 0; e < E; ++e) xp[b * E + e] += ob[e];
    }
    rms_norm_rows(hp + b0 * E, nullptr, xp + b0 * E, post_norm.data_ptr<float>(), M, E, epsf);
    product(gup + b0 * 2 * I, 2 * I, hp + b0 * E, E, gate_up_p, nullptr, M, 2 * I, E, false);
    swiglu_rows(actp + b0 * I, gup + b0 * 2 * I, M, I);
    product(xp + b0 * E, E, actp + b0 * I, I, down_p, nullptr, M, E, I, true);
  };
  if (split_rows < 0) {
    const int64_t weights = qkv_p.numel() + o_p.numel() + gate_up_p.numel() + down_p.numel();
    split_rows = at::get_num_threads() > 1 && B > 1 && weights * (int64_t)sizeof(float) <= ROW_SPLIT_BYTES;
  }
  if (split_rows)
    at::parallel_for(0, B, 1, layer);
  else
    layer(0, B);
}

// splitmix64's finaliser (Steele, Lea and Flood, OOPSLA 2014), as reinforge.rollout.sampling.mix64.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A float's bit pattern: for non-negative floats, ordered as the floats are.
inline uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

// The top-p threshold of one row's probabilities p [V]: the smallest float bit pattern t with
// sum(p_i : bits(p_i) > t) < top_p, so that the nucleus is every token with bits(p_i) >= t: the tokens
// whose strictly more likely tokens hold less than top_p of the mass (Holtzman et al., arXiv
// 1904.09751; rollout.sampling.filter_logits), ties at the threshold all kept. Non-negative floats
// order as their bits, so t is found digit by digit, most significant first (a radix select): one
// pass per digit builds the mass of each digit value among the tokens that share the digits found
// so far, and the digit is the lowest value whose higher values, with the mass above the prefix,
// hold less than top_p. Three passes over the row where a sort takes V log V.
inline uint32_t nucleus_threshold(const float* p, int64_t V, double top_p, std::vector<double>& mass) {
  constexpr int SHIFTS[3] = {20, 8, 0}, WIDTHS[3] = {11, 12, 8};     // 31 bits: 11 + 12 + 8
  uint32_t prefix = 0;          // the digits found so far, in place
  double above = 0.0;           // the mass of tokens whose bits exceed every value with this prefix
  for (int level = 0; level < 3; ++level) {
    const int shift = SHIFTS[level], values = 1 << WIDTHS[level];
    const uint32_t high = level ? ~0u << (SHIFTS[level - 1]) : 0u;    // the bits fixed already
    mass.assign(values, 0.0);
    for (int64_t i = 0; i < V; ++i) {
      const uint32_t bits = float_bits(p[i]);
      if ((bits & high) == prefix) mass[(bits >> shift) & (values - 1)] += p[i];   // above it: in `above`
    }
    int digit = values - 1;
    double higher = above;      // mass above digit `digit` within the prefix, plus `above`
    while (digit > 0 && higher + mass[digit] < top_p) higher += mass[digit--];
    prefix |= (uint32_t)digit << shift;
    above = higher;
  }
  return prefix;
}

// One token per row of fp32 logits [B, V] with no top-k / min-p filter, as
// reinforge.rollout.sampling.sample_tokens with keyed_uniforms: temperature > 0 draws from
// softmax(logits / T) by inverting its CDF (accumulated in double, as torch's cumsum) at the
// uniform of draw `counters[b]` of stream `keys[b]`; temperature 0 takes the argmax (first of
// ties) with the untempered log-prob. top_p < 1: from the nucleus (`nucleus_threshold`),
// renormalised, with the log-prob under it. tokens [B] int64 and logprobs [B] float32 are written.
void sample(at::Tensor tokens, at::Tensor logprobs, const at::Tensor& logits, double temperature,
            const at::Tensor& keys, const at::Tensor& counters, double top_p) {
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.device().is_cpu(),
              "sample: logits must be contiguous float32 on the CPU");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&tokens, &keys, &counters})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == B, "sample: [B] int64 tensors");
  TORCH_CHECK(logprobs.scalar_type() == at::kFloat && logprobs.is_contiguous() && logprobs.size(0) == B);
  const float* lp = logits.data_ptr<float>();
  const int64_t* kp = keys.data_ptr<int64_t>();
  const int64_t* cp = counters.data_ptr<int64_t>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* op = logprobs.data_ptr<float>();
  const bool greedy = temperature <= 0;
  const float t = greedy ? 1.f : (float)temperature;
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "sample: top_p must be in (0, 1]");
  at::parallel_for(0, B, 16, [&](int64_t b0, int64_t b1) {
    std::vector<float> scores(V), cdf(V);
    std::vector<double> mass;
    for (int64_t b = b0; b < b1; ++b) {
      const float* row = lp + b * V;
      int64_t best = 0;
      for (int64_t i = 0; i < V; ++i) {
        scores[i] = t == 1.f ? row[i] : row[i] / t;
        if (scores[i] > scores[best]) best = i;
      }
      const float top = scores[best];
      float sum = 0.f;
      for (int64_t i = 0; i < V; ++i) sum += expf(scores[i] - top);
      const float log_total = top + logf(sum);
      if (greedy) {
        tp[b] = best;
        op[b] = scores[best] - log_total;
        continue;
      }
      double acc = 0.0;
      float log_kept = 0.f;     // log of the nucleus's mass: 0 without top-p
      if (top_p < 1.0) {
        for (int64_t i = 0; i < V; ++i) cdf[i] = expf(scores[i] - log_total);      // the probabilities
        const uint32_t threshold = nucleus_threshold(cdf.data(), V, top_p, mass);
        for (int64_t i = 0; i < V; ++i) {
          if (float_bits(cdf[i]) >= threshold) acc += (double)cdf[i];
          cdf[i] = (float)acc;
        }
        log_kept = logf((float)acc);
      } else {
        for (int64_t i = 0; i < V; ++i) {
          acc += (double)expf(scores[i] - log_total);
          cdf[i] = (float)acc;
        }
      }
      const uint64_t z = mix64((uint64_t)kp[b] + (uint64_t)(cp[b] + 1) * 0x9E3779B97F4A7C15ull);
      const float u = (float)(z >> 40) * 0x1p-24f * cdf[V - 1];
      const int64_t token = std::min<int64_t>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin(), V - 1);
      tp[b] = token;
      op[b] = scores[token] - log_total - log_kept;
    }
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
  m.def("sample(Tensor(a!) tokens, Tensor(b!) logprobs, Tensor logits, float temperature, Tensor keys, "
        "Tensor counters, float top_p=1.0) -> ()", &sample);
}
