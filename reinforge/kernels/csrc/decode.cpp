// The native engine's decoding step on CPU, fused: one call per decoder layer (`decode_layer`),
// whose attention (`decode_attention`, also callable alone) writes each row's new key/value into the
// KV cache and attends over that row's keys in one pass, and one call to draw every row's next token
// (`sample`: temperature or greedy, top-p, no top-k filter). step.cpp runs a whole step, or whole
// generations, in one call; the layer itself is decode_layer.h's.
//
// Why: at RL rollout shapes (hundreds of rows of a small model) a decoding step in PyTorch is ~35
// ops per layer (norms, rotary, thousands of tiny batched GEMMs for attention, masking, softmax,
// SwiGLU), each a dispatch and a pass over memory; the matmuls are a minority of the time. Here
// everything between the projections is one loop over the rows, and the projections run against
// weights packed once per generation (`pack_weight`, `gemm_packed` in gemm.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "decode_layer.h"
#include "gemm.h"
#include "sampling.h"

#include <cstdint>
#include <optional>

namespace {

using reinforge_kernels::attention_rows;
using reinforge_kernels::check_cache;
using reinforge_kernels::check_sampling;
using reinforge_kernels::data_or_null;
using reinforge_kernels::Layer;
using reinforge_kernels::layer_rows;
using reinforge_kernels::layer_weights;
using reinforge_kernels::pack_weight;
using reinforge_kernels::Rows;
using reinforge_kernels::sample_rows;
using reinforge_kernels::split_by_rows;
using reinforge_kernels::Step;
using reinforge_kernels::with_head_dim;

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
                                       positions.data_ptr<int64_t>(), nullptr, 0, B, H, (float)scale, window);
  });
}

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
    layer_rows(L, s, xp, rot.data_ptr<float>(), nullptr, positions.data_ptr<int64_t>(), nullptr, b0, b1,
               (float)eps, window);
  };
  if (split_rows < 0) split_rows = split_by_rows(B, layer_weights(L));
  if (split_rows)
    at::parallel_for(0, B, 1, rows);
  else
    rows(0, B);
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
  m.def("sample(Tensor(a!) tokens, Tensor(b!) logprobs, Tensor logits, float temperature, Tensor keys, "
        "Tensor counters, float top_p=1.0) -> ()", &sample);
}
