// The native engine's whole decoding step on CPU in one call (`decode_step`: the embedding, every layer of
// decode_layer.h, the final norm, the head and the sampler), and whole generations in one call
// (`decode_loop`: steps until every row has ended, each row's tokens recorded as it goes).
//
// Why: around a step of the built-in model the session's own work in Python (which rows ended, the records of
// the new tokens, the arguments of the next call) took ~0.45 ms, ~40% of the step's time in the kernels (8
// prompts x 8 rows x 16 tokens, Intel Xeon): a generation took 36.6 ms stepping, 29.8 ms in one call. The ~30
// small torch ops and 6 kernel calls that one call per step replaced were ~6% of it (28.4 -> 26.8 ms,
// BENCHMARKS.md).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "decode_layer.h"
#include "gemm.h"
#include "rows.h"
#include "sampling.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <vector>

namespace {

using reinforge_kernels::check_cache_layout;
using reinforge_kernels::check_sampling;
using reinforge_kernels::data_or_null;
using reinforge_kernels::Layer;
using reinforge_kernels::layer_rows;
using reinforge_kernels::layer_weights;
using reinforge_kernels::product;
using reinforge_kernels::Record;
using reinforge_kernels::rms_norm_rows;
using reinforge_kernels::sample_rows;
using reinforge_kernels::split_by_rows;
using reinforge_kernels::Step;

// The per-layer tensors of the ops' `weights`, in this order (an empty or absent one: none).
constexpr int PER_LAYER = 10;   // input_norm, qkv_p, qkv_b, q_norm, k_norm, o_p, o_b, post_norm, gate_up_p, down_p

// The decoder as the step reads it, its shapes checked once: embed [V', E] (V' >= V), layer l's tensors
// weights[PER_LAYER l ...] and caches k_caches[l], v_caches[l] (decode_layer.h's layouts), rot [L, D/2, 2]
// the rotary table by position, the final norm and the [V, E] head as `product` reads it. The layers refer
// to this record's own tensors, so it is built in place and never copied.
struct Decoder {
  std::vector<std::optional<at::Tensor>> w;
  std::vector<at::Tensor> kc, vc;
  std::vector<Layer> stack;
  const at::Tensor &embed, &rot, &final_norm, &head;
  int64_t V, E, H, KV, D, I, largest = 0;
  float eps;
  int64_t window;

  Decoder(const at::Tensor& embed_, const c10::List<std::optional<at::Tensor>>& weights, at::TensorList k_caches,
          at::TensorList v_caches, const at::Tensor& rot_, const at::Tensor& final_norm_, const at::Tensor& head_,
          int64_t vocab, int64_t heads, double eps_, int64_t window_)
      : w(weights.vec()), kc(k_caches.begin(), k_caches.end()), vc(v_caches.begin(), v_caches.end()), embed(embed_),
        rot(rot_), final_norm(final_norm_), head(head_), V(vocab), E(embed_.size(1)), H(heads), eps((float)eps_),
        window(window_) {
    const int64_t layers = kc.size();
    TORCH_CHECK(layers > 0 && (int64_t)w.size() == PER_LAYER * layers && (int64_t)vc.size() == layers,
                "decode_step: ", PER_LAYER, " weights and a key and value cache per layer");
    TORCH_CHECK(embed.scalar_type() == at::kFloat && embed.is_contiguous() && embed.dim() == 2 && embed.size(0) >= V,
                "decode_step: embed must be a contiguous float32 [V, E]");
    KV = kc[0].size(1), D = kc[0].size(2), I = w[9]->size(1);
    TORCH_CHECK(rot.is_contiguous() && rot.dim() == 3 && rot.size(1) == D / 2 && rot.size(2) == 2,
                "decode_step: rot must be [L, D/2, 2]");
    for (int64_t l = 0; l < layers; ++l) {
      const std::optional<at::Tensor>* t = w.data() + PER_LAYER * l;
      for (int i : {0, 1, 5, 7, 8, 9})
        TORCH_CHECK(t[i] && t[i]->defined(), "decode_step: layer ", l, " lacks weight ", i);
      check_cache_layout(kc[l], vc[l], 0, H, D);
      TORCH_CHECK(kc[l].size(1) == KV && kc[l].size(0) == kc[0].size(0) && vc[l].size(0) == kc[0].size(0) &&
                  kc[l].size(3) == kc[0].size(3),
                  "decode_step: layer ", l, "'s caches differ from layer 0's");
      TORCH_CHECK(t[1]->size(1) == E && t[5]->size(1) == H * D && t[8]->size(1) == E && t[9]->size(1) == I,
                  "decode_step: layer ", l, "'s shapes differ from layer 0's");
      stack.push_back(Layer{t[0]->data_ptr<float>(), *t[1], data_or_null(t[2]), data_or_null(t[3]), data_or_null(t[4]),
                            *t[5], data_or_null(t[6]), t[7]->data_ptr<float>(), *t[8], *t[9], kc[l], vc[l]});
      largest = std::max(largest, layer_weights(stack.back()));
    }
  }
  Decoder(const Decoder&) = delete;

  // Each layer's activations kept in record [layers, R, T, Record::width_of(...)] (float32, contiguous): layer l's
  // rows from record[l].
  void keep_in(at::Tensor& record) {
    const int64_t width = Record::width_of(E, H, D, I, (H + 2 * KV) * D);
    TORCH_CHECK(record.scalar_type() == at::kFloat && record.is_contiguous() && record.dim() == 4 &&
                record.size(0) == (int64_t)stack.size() && record.size(3) == width,
                "decode_loop: record must be a contiguous float32 [layers, rows, T, ", width, "]");
    for (int64_t l = 0; l < (int64_t)stack.size(); ++l) stack[l].record = record[l].data_ptr<float>();
  }

  int64_t slots() const { return kc[0].size(0); }
  int64_t capacity() const { return std::min(kc[0].size(3), rot.size(0)); }   // positions a row may write
};

// Scratch of a step of up to B rows: the layers' (Step), the hidden rows x [B, E] and logits [B, V].
struct Scratch {
  Step s;
  at::Tensor x, logits;
  Scratch(const Decoder& m, int64_t B)
      : s(B, m.E, m.H, m.KV, m.D, m.I, m.embed.options()), x(at::empty({B, m.E}, m.embed.options())),
        logits(at::empty({B, m.V}, m.embed.options())) {}
};

// One decoding step of B rows: row b's newest token tokens[b] at position pos[b] of cache slot slots[b] (null:
// slot b), sampled at draw counters[b] of stream keys[b]; writes next[b] and logprobs[b]. Where the layers'
// weights are small (ROW_SPLIT_BYTES) and there are threads, each thread runs the whole step for its rows, with
// no synchronisation until the end; else each part splits its work. Each row's numbers are the same whichever
// rows share the step and whatever its slot.
// With `rec`, each row's activations are kept in the layers' records (decode_layer.h, `Record`).
void step_rows(const Decoder& m, Scratch& scratch, int64_t B, const int64_t* tokens, const int64_t* pos,
               const int64_t* slots, const int64_t* keys, const int64_t* counters, int64_t* next, float* logprobs,
               double temperature, double top_p, int64_t split_rows, const Record* rec = nullptr) {
  const int64_t E = m.E, V = m.V;
  float *xp = scratch.x.data_ptr<float>(), *lp = scratch.logits.data_ptr<float>();
  const float* embed = m.embed.data_ptr<float>();
  auto body = [&](int64_t b0, int64_t b1) {   // embedding, the layers, the final norm
    for (int64_t b = b0; b < b1; ++b) std::memcpy(xp + b * E, embed + tokens[b] * E, sizeof(float) * E);
    for (const Layer& L : m.stack)
      layer_rows(L, scratch.s, xp, m.rot.data_ptr<float>(), pos, pos, slots, b0, b1, m.eps, m.window, rec);
    rms_norm_rows(xp + b0 * E, nullptr, xp + b0 * E, m.final_norm.data_ptr<float>(), b1 - b0, E, m.eps);
  };
  auto tail = [&](int64_t b0, int64_t b1) {   // the head, then sampling
    product(lp + b0 * V, V, xp + b0 * E, E, m.head, nullptr, b1 - b0, V, E, false);
    at::parallel_for(b0, b1, 16, [&](int64_t r0, int64_t r1) {
      sample_rows(next, logprobs, lp, V, r0, r1, temperature, keys, counters, top_p);
    });
  };
  if (split_rows < 0) split_rows = split_by_rows(B, m.largest);
  const bool head_split = split_rows && split_by_rows(B, m.head.numel());
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

void check_row(const Decoder& m, int64_t token, int64_t position, const char* who) {
  TORCH_CHECK(token >= 0 && token < m.embed.size(0), who, ": a token id outside the embedding");
  TORCH_CHECK(position >= 0 && position < m.capacity(), who, ": position ", position,
              " is outside the cache or past the rotary table (", m.capacity(), ")");
}

// A whole decoding step of B rows, one call (what `decode_layer` per layer, then the final norm, the head
// and `sample` do in turn; the same numbers, bit for bit): tokens [B] (each row's newest token) at
// positions [B], row b in cache slot b; writes each row's next token and its log-prob into next [B],
// logprobs [B]. split_rows: 1 splits the rows between the threads, 0 each part's work, -1 chooses.
void decode_step(at::Tensor next, at::Tensor logprobs, const at::Tensor& tokens, const at::Tensor& positions,
                 const at::Tensor& embed, const c10::List<std::optional<at::Tensor>>& weights,
                 at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& rot, const at::Tensor& final_norm,
                 const at::Tensor& head, int64_t vocab, int64_t heads, double eps, int64_t window, double temperature,
                 const at::Tensor& keys, const at::Tensor& counters, double top_p, int64_t split_rows) {
  const Decoder m(embed, weights, k_caches, v_caches, rot, final_norm, head, vocab, heads, eps, window);
  const int64_t B = tokens.size(0);
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous(), "decode_step: tokens must be [B] int64");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == B,
              "decode_step: positions must be [B] int64");
  TORCH_CHECK(B <= m.slots(), "decode_step: ", B, " rows for ", m.slots(), " cache slots");
  check_sampling(next, logprobs, keys, counters, B, top_p);
  const int64_t *tok = tokens.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) check_row(m, tok[b], pos[b], "decode_step");
  Scratch scratch(m, B);
  step_rows(m, scratch, B, tok, pos, nullptr, keys.data_ptr<int64_t>(), counters.data_ptr<int64_t>(),
            next.data_ptr<int64_t>(), logprobs.data_ptr<float>(), temperature, top_p, split_rows);
}

// The rows in cache slots 0..live-1 decoded to their ends in one call, as a decoding session's steps would
// (rollout/session.py): a row has ended once its newest token is one of `eos` or it holds `max_new` tokens;
// until then each step samples its next token from draw generated + drawn of its stream keys, at position
// length (then length += 1), records it and its log-prob in column `generated` of out_tokens and
// out_logprobs [slots, T] (then generated += 1) and makes it the newest (`last`). last, length and generated
// [slots] are the session's, updated in place. Rows that end leave the step, so it shrinks; every row's
// numbers are those of `decode_step` on the session's own schedule, bit for bit. Returns the steps run.
int64_t decode_loop(at::Tensor out_tokens, at::Tensor out_logprobs, at::Tensor last, at::Tensor length,
                    at::Tensor generated, const at::Tensor& drawn, const at::Tensor& keys, const at::Tensor& eos,
                    int64_t max_new, int64_t live, const at::Tensor& embed,
                    const c10::List<std::optional<at::Tensor>>& weights, at::TensorList k_caches,
                    at::TensorList v_caches, const at::Tensor& rot, const at::Tensor& final_norm,
                    const at::Tensor& head, int64_t vocab, int64_t heads, double eps, int64_t window,
                    double temperature, double top_p, int64_t split_rows, std::optional<at::Tensor> record) {
  Decoder m(embed, weights, k_caches, v_caches, rot, final_norm, head, vocab, heads, eps, window);
  if (record) {
    m.keep_in(*record);
    TORCH_CHECK(record->size(1) >= live, "decode_loop: a record shorter than the live rows");
  }
  const int64_t kept_cols = record ? record->size(2) : 0;
  TORCH_CHECK(live >= 0 && live <= m.slots(), "decode_loop: ", live, " live rows for ", m.slots(), " cache slots");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&last, &length, &generated, &drawn, &keys, &eos})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1, "decode_loop: int64 vectors");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&last, &length, &generated, &drawn, &keys})
    TORCH_CHECK(t->size(0) >= live, "decode_loop: a state vector shorter than the live rows");
  const int64_t T = out_tokens.size(1);
  TORCH_CHECK(out_tokens.scalar_type() == at::kLong && out_tokens.is_contiguous() && out_tokens.size(0) >= live &&
              out_logprobs.scalar_type() == at::kFloat && out_logprobs.is_contiguous() &&
              out_logprobs.sizes() == out_tokens.sizes() && T >= max_new,
              "decode_loop: out_tokens and out_logprobs must be [slots, T >= max_new] int64 and float32");
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "decode_loop: top_p must be in (0, 1]");
  int64_t *lastp = last.data_ptr<int64_t>(), *lenp = length.data_ptr<int64_t>(), *gp = generated.data_ptr<int64_t>();
  const int64_t *drawnp = drawn.data_ptr<int64_t>(), *keyp = keys.data_ptr<int64_t>(), *eosp = eos.data_ptr<int64_t>();
  const int64_t n_eos = eos.numel();
  auto ended = [&](int64_t s) { return gp[s] >= max_new || std::find(eosp, eosp + n_eos, lastp[s]) != eosp + n_eos; };
  std::vector<int64_t> rows;   // the slots of the rows still decoding
  for (int64_t s = 0; s < live; ++s) {
    if (ended(s)) continue;
    TORCH_CHECK(gp[s] >= 0, "decode_loop: a negative token count");
    check_row(m, lastp[s], lenp[s] + max_new - gp[s] - 1, "decode_loop");   // its last step's position
    check_row(m, lastp[s], lenp[s], "decode_loop");
    rows.push_back(s);
  }
  const int64_t n0 = rows.size();
  Scratch scratch(m, std::max<int64_t>(n0, 1));
  std::vector<int64_t> tok(n0), pos(n0), key(n0), counter(n0), next(n0), at(n0);
  const Record rec{at.data(), record ? record->size(3) : 0};
  std::vector<float> logprob(n0);
  int64_t* out_t = out_tokens.data_ptr<int64_t>();
  float* out_l = out_logprobs.data_ptr<float>();
  int64_t steps = 0;
  for (; !rows.empty(); ++steps) {
    const int64_t n = rows.size();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = rows[i];
      tok[i] = lastp[s], pos[i] = lenp[s], key[i] = keyp[s], counter[i] = gp[s] + drawnp[s];
      at[i] = gp[s] >= 1 && gp[s] - 1 < kept_cols ? s * kept_cols + gp[s] - 1 : -1;
    }
    step_rows(m, scratch, n, tok.data(), pos.data(), rows.data(), key.data(), counter.data(), next.data(),
              logprob.data(), temperature, top_p, split_rows, record ? &rec : nullptr);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = rows[i];
      out_t[s * T + gp[s]] = next[i];
      out_l[s * T + gp[s]] = logprob[i];
      lenp[s] += 1, gp[s] += 1, lastp[s] = next[i];
      if (!ended(s)) rows[kept++] = s;
    }
    rows.resize(kept);
  }
  if (record) {   // positions no step read before the longest row's last: zeros, finite for the learner (a row's pass
    int64_t longest = 0;   // runs to its bucket's longest row, no further)
    for (int64_t s = 0; s < live; ++s) longest = std::max(longest, std::min(gp[s] - 1, kept_cols));
    for (int64_t l = 0; l < record->size(0); ++l)
      for (int64_t s = 0; s < live; ++s) {
        const int64_t from = std::min(std::max<int64_t>(gp[s] - 1, 0), longest);
        float* r = m.stack[l].record + (s * kept_cols + from) * rec.width;
        std::fill(r, r + (longest - from) * rec.width, 0.f);
      }
  }
  return steps;
}

// The learner's copy of a decoding's record (decode_layer.h, `Record`): of data [layers, R, T, width] the tokens
// index [n] (r T + t), each layer's fields split at `sizes` (summing to at most width), as contiguous [n, size]
// tensors, layer by layer. One pass over each kept row, the threads splitting the rows (index_select per field
// copied a field's few floats at a time). `copy` (empty: all): which fields to copy (nonzero); the others come
// back as empty tensors (the learner reads gate|up in place, learner.cpp `gate_up_of`).
std::vector<at::Tensor> record_gather(const at::Tensor& data, const at::Tensor& index, at::IntArrayRef sizes,
                                      at::IntArrayRef copy) {
  TORCH_CHECK(data.scalar_type() == at::kFloat && data.is_contiguous() && data.dim() == 4,
              "record_gather: data must be a contiguous float32 [layers, R, T, width]");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.is_contiguous() && index.dim() == 1,
              "record_gather: index must be [n] int64");
  const int64_t L = data.size(0), RT = data.size(1) * data.size(2), W = data.size(3), n = index.size(0);
  const int64_t F = sizes.size();
  std::vector<int64_t> offset(F + 1, 0);
  for (int64_t f = 0; f < F; ++f) offset[f + 1] = offset[f] + sizes[f];
  TORCH_CHECK(offset[F] <= W, "record_gather: fields wider than a record row");
  TORCH_CHECK(copy.empty() || (int64_t)copy.size() == F, "record_gather: one copy flag per field");
  auto copied = [&](int64_t f) { return copy.empty() || copy[f] != 0; };
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(idx[i] >= 0 && idx[i] < RT, "record_gather: a token outside the record");
  std::vector<at::Tensor> out;
  std::vector<float*> dst;
  for (int64_t l = 0; l < L; ++l)
    for (int64_t f = 0; f < F; ++f) {
      out.push_back(at::empty({copied(f) ? n : 0, sizes[f]}, data.options()));
      dst.push_back(copied(f) ? out.back().data_ptr<float>() : nullptr);
    }
  const float* src = data.data_ptr<float>();
  at::parallel_for(0, L * n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t l = i / n, m = i % n;
      const float* row = src + (l * RT + idx[m]) * W;
      for (int64_t f = 0; f < F; ++f)
        if (dst[l * F + f]) std::memcpy(dst[l * F + f] + m * sizes[f], row + offset[f], sizeof(float) * sizes[f]);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(reinforge_kernels, m) {
  m.def("decode_step(Tensor(a!) next, Tensor(b!) logprobs, Tensor tokens, Tensor positions, Tensor embed, "
        "Tensor?[] weights, Tensor(c!)[] k_caches, Tensor(d!)[] v_caches, Tensor rot, Tensor final_norm, Tensor head, "
        "int vocab, int heads, float eps, int window, float temperature, Tensor keys, Tensor counters, "
        "float top_p=1.0, int split_rows=-1) -> ()", &decode_step);
  m.def("decode_loop(Tensor(a!) out_tokens, Tensor(b!) out_logprobs, Tensor(c!) last, Tensor(d!) length, "
        "Tensor(e!) generated, Tensor drawn, Tensor keys, Tensor eos, int max_new, int live, Tensor embed, "
        "Tensor?[] weights, Tensor(f!)[] k_caches, Tensor(g!)[] v_caches, Tensor rot, Tensor final_norm, "
        "Tensor head, int vocab, int heads, float eps, int window, float temperature, float top_p=1.0, "
        "int split_rows=-1, Tensor(h!)? record=None) -> int", &decode_loop);
  m.def("record_gather(Tensor data, Tensor index, int[] sizes, int[] copy=[]) -> Tensor[]", &record_gather);
}
