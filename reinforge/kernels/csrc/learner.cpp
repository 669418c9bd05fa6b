// Fused forward and backward of the decoder's elementwise blocks on CPU, for the learner's
// forward (reinforge.models.decoder.decoder_layers, through reinforge.kernels'
// autograd functions): RMSNorm and SwiGLU.
//
// Why: in PyTorch each is a chain of small ops whose backward is autograd through the chain
// (RMSNorm: pow, mean, add, rsqrt, mul, mul forward and about ten ops back; SwiGLU: silu, mul and
// five back), each a pass over [tokens, width] memory. On the built-in model's SFT batch (3,328
// tokens) they were ~50 ms of a ~190 ms forward + backward whose matmuls take ~125 ms; fused,
// each is one pass forward and one back.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include "attention.h"
#include "gemm.h"
#include "learner_attention.h"
#include "rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using reinforge_kernels::attention_backward;
using reinforge_kernels::attention_forward;
using reinforge_kernels::Geometry;
using reinforge_kernels::product;
using reinforge_kernels::with_head_dim;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous() && t.dim() == 2,
              name, " must be a contiguous 2-D float32 CPU tensor");
}

// y = x / sqrt(mean(x^2) + eps) * w over the last dim of x [R, E]; also 1 / sqrt(mean(x^2) + eps) [R].
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm_forward: x");
  const int64_t R = x.size(0), E = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == E, "rms_norm_forward: w must be [E] float32");
  auto y = at::empty({R, E}, x.options());
  auto rstd = at::empty({R}, x.options());
  reinforge_kernels::rms_norm_rows(y.data_ptr<float>(), rstd.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(),
                                   R, E, (float)eps);
  return {y, rstd};
}

// With g = dy * w and r = rstd: dx = r g - x r^3 (g . x) / E (plus `add` [R, E] when given: a
// residual's gradient); dw = sum over rows of dy * x * r.
void rms_norm_backward_rows(float* dxp, float* dwp, const float* dyp, const float* xp, const float* wp, const float* rp,
                            const float* add, int64_t R, int64_t E) {
  const int threads = at::get_num_threads();
  std::vector<float> partial((size_t)threads * E, 0.f);   // dw per thread, summed below
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    float* dw = partial.data() + (size_t)at::get_thread_num() * E;
    for (int64_t r = r0; r < r1; ++r) {
      const float* dyr = dyp + r * E;
      const float* xr = xp + r * E;
      const float inv = rp[r];
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < E; ++i) dot += dyr[i] * wp[i] * xr[i];
      const float c = inv * inv * inv * dot / E;
      float* dxr = dxp + r * E;
      const float* ar = add ? add + r * E : nullptr;
#pragma omp simd
      for (int64_t i = 0; i < E; ++i) {
        dxr[i] = inv * dyr[i] * wp[i] - xr[i] * c + (ar ? ar[i] : 0.f);
        dw[i] += dyr[i] * xr[i] * inv;
      }
    }
  });
  for (int64_t i = 0; i < E; ++i) {
    float s = 0.f;
    for (int t = 0; t < threads; ++t) s += partial[(size_t)t * E + i];
    dwp[i] = s;
  }
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                     const at::Tensor& rstd) {
  check_rows(dy, "rms_norm_backward: dy");
  check_rows(x, "rms_norm_backward: x");
  const int64_t R = x.size(0), E = x.size(1);
  TORCH_CHECK(dy.sizes() == x.sizes() && w.numel() == E && rstd.numel() == R && rstd.is_contiguous() && w.is_contiguous());
  auto dx = at::empty({R, E}, x.options());
  auto dw = at::empty({E}, w.options());
  rms_norm_backward_rows(dx.data_ptr<float>(), dw.data_ptr<float>(), dy.data_ptr<float>(), x.data_ptr<float>(),
                         w.data_ptr<float>(), rstd.data_ptr<float>(), nullptr, R, E);
  return {dx, dw};
}

// gu [R, 2I] = [gate | up] -> silu(gate) * up [R, I].
at::Tensor swiglu_forward(const at::Tensor& gu) {
  check_rows(gu, "swiglu_forward: gu");
  const int64_t R = gu.size(0), I = gu.size(1) / 2;
  auto a = at::empty({R, I}, gu.options());
  reinforge_kernels::swiglu_rows(a.data_ptr<float>(), gu.data_ptr<float>(), R, I);
  return a;
}

// d gate = da * up * s (1 + gate (1 - s)), s = sigmoid(gate); d up = da * silu(gate). With `act`
// [R, I] given, the forward's silu(gate) * up is written there in the same pass. Row r's [gate | up] is
// gu.row(r): a [R, 2I] tensor's row, or a row of the rollout's activation record read where it lies.
struct GateUpRows {
  const float* base;
  int64_t stride;
  const int64_t* index;   // null: row r is base + r stride
  const float* row(int64_t r) const { return base + (index ? index[r] : r) * stride; }
};

at::Tensor swiglu_backward_into(const at::Tensor& da, const GateUpRows& gu, float* act) {
  check_rows(da, "swiglu_backward: da");
  const int64_t R = da.size(0), I = da.size(1);
  auto dgu = at::empty({R, 2 * I}, da.options());
  const float* dap = da.data_ptr<float>();
  float* dp = dgu.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gu.row(r);
      const float* d = dap + r * I;
      float* o = dp + r * 2 * I;
      float* a = act ? act + r * I : nullptr;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float s = 1.f / (1.f + expf(-g[i]));
        o[i] = d[i] * g[I + i] * s * (1.f + g[i] * (1.f - s));
        o[I + i] = d[i] * g[i] * s;
        if (a) a[i] = g[i] * s * g[I + i];
      }
    }
  });
  return dgu;
}

at::Tensor swiglu_backward(const at::Tensor& da, const at::Tensor& gu) {
  check_rows(gu, "swiglu_backward: gu");
  TORCH_CHECK(da.dim() == 2 && gu.size(0) == da.size(0) && gu.size(1) == 2 * da.size(1),
              "swiglu_backward: da must be [R, I] for gu [R, 2I]");
  return swiglu_backward_into(da, GateUpRows{gu.data_ptr<float>(), gu.size(1), nullptr}, nullptr);
}

// ---------------------------------------------------------------------------------------------
// One decoder layer of the learner (pre-norm attention with rotary, SwiGLU MLP), forward and
// backward as one op each (`train_layer_forward`, `train_layer_backward`; reinforge.kernels._TrainLayer).
//
// Why: the learner's forward + backward on the built-in model at RL shapes (~1,000 tokens, 4
// layers) took ~85 ms of which ~57 ms were matmuls: the rest was ~70 small autograd ops per layer
// (rotary through complex views, the gathers and concatenations of shared prompt keys, batched
// GEMMs of a few dozen keys per query, masking, softmax) and the autograd engine between them.
// Here the rest is a few loops; the forward's products and the input gradients run against packed
// weights (gemm.h), the weight gradients as ATen matmuls.
//
// A pass runs B rows of S positions, tokens as rows x [B S, E]. Row b's token t sits at rotary
// position pos0[b] + t and attends to (Geometry):
//   - the first pre_len[b] positions of prefix slot slot[b] (a shared prompt's keys/values
//     pk, pv [P, Lp, kv, D], the k, v outputs of another pass), when a prefix is given;
//   - its own keys 0..t (causal). Rows are right-padded, so a real query never sees a padded key;
//     padded queries see real and padded keys, and nothing reads them (their gradient is 0).
// Queries and keys are in the interleaved rotary layout (pairs 2i, 2i + 1), as in decode.cpp.

// Rotary of `heads` heads of token row `src` (stride between heads D) into dst, by (cos, sin)
// pairs cs [D/2, 2]; inverse: the transposed rotation (the backward).
template <bool inverse>
inline void rotate(float* dst, const float* src, const float* cs, int64_t heads, int64_t D) {
  for (int64_t hd = 0; hd < heads; ++hd)
    for (int64_t i = 0; i < D / 2; ++i) {
      const float re = src[hd * D + 2 * i], im = src[hd * D + 2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
      dst[hd * D + 2 * i] = inverse ? re * c + im * s : re * c - im * s;
      dst[hd * D + 2 * i + 1] = inverse ? im * c - re * s : re * s + im * c;
    }
}

struct LayerArgs {
  Geometry g;
  int64_t M, E, D, I, N;
};

LayerArgs layer_args(const at::Tensor& x, int64_t I, const at::Tensor& rot,
                     const at::Tensor& pos0, const std::optional<at::Tensor>& pk, const std::optional<at::Tensor>& slot, const std::optional<at::Tensor>& pre_len, int64_t heads,
                     int64_t kv_heads, int64_t S) {
  check_rows(x, "train_layer: x");
  const int64_t M = x.size(0), D = rot.size(1) * 2, B = M / S;
  TORCH_CHECK(S > 0 && M == B * S, "train_layer: x must hold B rows of S positions");
  TORCH_CHECK(rot.scalar_type() == at::kFloat && rot.is_contiguous() && rot.dim() == 3 && rot.size(2) == 2,
              "train_layer: rot must be [L, D/2, 2] float32");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "train_layer: heads must be a multiple of kv_heads");
  TORCH_CHECK(pos0.scalar_type() == at::kLong && pos0.is_contiguous() && pos0.numel() == B, "train_layer: pos0 must be [B] int64");
  const int64_t* p0 = pos0.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(p0[b] >= 0 && p0[b] + S <= rot.size(0), "train_layer: row ", b, " runs past the rotary table");
  Geometry g{B, S, heads, kv_heads, 0, nullptr, nullptr, 1.f / std::sqrt((float)D)};
  if (pk) {
    TORCH_CHECK(slot && pre_len && slot->is_contiguous() && pre_len->is_contiguous() && slot->numel() == B &&
                pre_len->numel() == B && pk->is_contiguous() && pk->dim() == 4 && pk->size(2) == kv_heads &&
                pk->size(3) == D, "train_layer: prefix keys [P, Lp, kv, D] need [B] slot and pre_len");
    g.Lp = pk->size(1);
    g.slot = slot->data_ptr<int64_t>();
    g.pre_len = pre_len->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(g.slot[b] >= 0 && g.slot[b] < pk->size(0) && g.pre_len[b] >= 0 && g.pre_len[b] <= g.Lp,
                  "train_layer: row ", b, "'s prefix is outside the prefix keys");
  }
  return {g, M, x.size(1), D, I, (heads + 2 * kv_heads) * D};
}

// A [n] float32 vector the kernels read through its data pointer (norm weights, biases).
void check_vector(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, "train_layer: ", name,
              " must be a contiguous float32 vector of ", n);
}

// x [B S, E] -> (x_out [B S, E], k, v [B, S, kv, D]: this pass's rotated keys and values, then
// what the backward needs: q [B, S, H, D] rotated, attn [B S, H D], lse [B, S, H], x_mid [B S, E]
// (after the attention's residual), gate_up [B S, 2I]).
std::vector<at::Tensor> train_layer_forward(
    const at::Tensor& x, const at::Tensor& input_norm, const at::Tensor& qkv_p, const std::optional<at::Tensor>& qkv_b,
    const at::Tensor& o_p, const std::optional<at::Tensor>& o_b, const at::Tensor& post_norm, const at::Tensor& gate_up_p,
    const at::Tensor& down_p, const at::Tensor& rot, const at::Tensor& pos0, const std::optional<at::Tensor>& pk,
    const std::optional<at::Tensor>& pv, const std::optional<at::Tensor>& slot,
    const std::optional<at::Tensor>& pre_len, int64_t heads, int64_t kv_heads, int64_t S, double eps) {
  const LayerArgs a = layer_args(x, down_p.size(1), rot, pos0, pk, slot, pre_len, heads, kv_heads, S);
  const Geometry& g = a.g;
  const int64_t M = a.M, E = a.E, D = a.D, H = g.H, KV = g.KV;
  check_vector(input_norm, E, "input_norm");
  check_vector(post_norm, E, "post_norm");
  if (qkv_b) check_vector(*qkv_b, a.N, "qkv_b");
  if (o_b) check_vector(*o_b, E, "o_b");
  auto opts = x.options();
  auto h = at::empty({M, E}, opts), qkv = at::empty({M, a.N}, opts), attn = at::empty({M, H * D}, opts);
  auto q = at::empty({g.B, S, H, D}, opts), k = at::empty({g.B, S, KV, D}, opts), v = at::empty({g.B, S, KV, D}, opts);
  auto lse = at::empty({g.B, S, H}, opts), x_mid = at::empty({M, E}, opts), x_out = at::empty({M, E}, opts);
  auto gate_up = at::empty({M, 2 * a.I}, opts), act = at::empty({M, a.I}, opts);
  const float* rp = rot.data_ptr<float>();
  const int64_t* p0 = pos0.data_ptr<int64_t>();
  float *hp = h.data_ptr<float>(), *src = qkv.data_ptr<float>(), *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  float *vp = v.data_ptr<float>(), *ap = attn.data_ptr<float>(), *mid = x_mid.data_ptr<float>();
  float *outp = x_out.data_ptr<float>(), *gup = gate_up.data_ptr<float>(), *actp = act.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *qkv_bp = qkv_b ? qkv_b->data_ptr<float>() : nullptr;
  const float* o_bp = o_b ? o_b->data_ptr<float>() : nullptr;
  const float epsf = (float)eps;
  auto rows = [&](int64_t b0, int64_t b1) {   // the layer for rows [b0, b1): token rows [m0, m0 + n)
    const int64_t m0 = b0 * S, n = (b1 - b0) * S;
    reinforge_kernels::rms_norm_rows(hp + m0 * E, nullptr, xp + m0 * E, input_norm.data_ptr<float>(), n, E, epsf);
    product(src + m0 * a.N, a.N, hp + m0 * E, E, qkv_p, qkv_bp, n, a.N, E, false);
    at::parallel_for(m0, m0 + n, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t m = r0; m < r1; ++m) {
        const float* cs = rp + (p0[m / S] + m % S) * D;
        const float* row = src + m * a.N;
        rotate<false>(qp + m * H * D, row, cs, H, D);
        rotate<false>(kp + m * KV * D, row + H * D, cs, KV, D);
        std::memcpy(vp + m * KV * D, row + (H + KV) * D, sizeof(float) * KV * D);
      }
    });
    with_head_dim(D, [&](auto d) {
      attention_forward<decltype(d)::value>(g, qp, kp, vp, pk ? pk->data_ptr<float>() : nullptr,
                                            pv ? pv->data_ptr<float>() : nullptr, ap, lse.data_ptr<float>(), b0, b1);
    });
    std::memcpy(mid + m0 * E, xp + m0 * E, sizeof(float) * n * E);
    product(mid + m0 * E, E, ap + m0 * H * D, H * D, o_p, nullptr, n, E, H * D, true);
    if (o_bp)
      for (int64_t m = m0; m < m0 + n; ++m)
        for (int64_t e = 0; e < E; ++e) mid[m * E + e] += o_bp[e];
    reinforge_kernels::rms_norm_rows(hp + m0 * E, nullptr, mid + m0 * E, post_norm.data_ptr<float>(), n, E, epsf);
    product(gup + m0 * 2 * a.I, 2 * a.I, hp + m0 * E, E, gate_up_p, nullptr, n, 2 * a.I, E, false);
    reinforge_kernels::swiglu_rows(actp + m0 * a.I, gup + m0 * 2 * a.I, n, a.I);
    std::memcpy(outp + m0 * E, mid + m0 * E, sizeof(float) * n * E);
    product(outp + m0 * E, E, actp + m0 * a.I, a.I, down_p, nullptr, n, E, a.I, true);
  };
  // Each thread runs the whole layer for its rows (no synchronisation inside it) where there are rows for every
  // thread; else each part splits its work. Why: each part was a parallel region of its own, ~8 a layer, whose
  // threads sleep in between with the CLI's short libgomp spin (cli.py). On an Intel Xeon (alternating builds,
  // 8 x 8 rows of 16 tokens): the no-grad forward 24.7 -> 24.0 ms, the engine's generate (its prefill runs
  // this) 32.5 -> 31.0 ms. A product's rows sum alike either way, so the packed products give the same numbers.
  if (at::get_num_threads() > 1 && g.B >= at::get_num_threads())
    at::parallel_for(0, g.B, 1, rows);
  else
    rows(0, g.B);
  return {x_out, k, v, q, attn, lse, x_mid, gate_up};
}

// The backward's [gate | up] rows (`GateUpRows`): gate_up [M, 2I] itself, or, with `rows` [M], row rows[m] of
// gate_up [n, width] from column `offset` on: the rollout's activation record, read in place (models/replay.py;
// copying it out was most of the record's gather).
GateUpRows gate_up_of(const at::Tensor& gate_up, const std::optional<at::Tensor>& rows, int64_t offset, int64_t M,
                      int64_t I) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() && gate_up.dim() == 2,
              "train_layer_backward: gate_up must be a contiguous 2-D float32 tensor");
  if (!rows) {
    TORCH_CHECK(gate_up.size(0) == M && gate_up.size(1) == 2 * I, "train_layer_backward: gate_up must be [M, 2I]");
    return {gate_up.data_ptr<float>(), 2 * I, nullptr};
  }
  TORCH_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->numel() == M,
              "train_layer_backward: gate_up_rows must be [M] int64");
  TORCH_CHECK(I > 0 && offset >= 0 && offset + 2 * I <= gate_up.size(1),
              "train_layer_backward: gate|up columns outside the record's rows");
  const int64_t* r = rows->data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(r[m] >= 0 && r[m] < gate_up.size(0), "train_layer_backward: a gate_up row outside the record");
  return {gate_up.data_ptr<float>() + offset, gate_up.size(1), r};
}

// The gradients of train_layer_forward from d x_out [B S, E] and, when this pass's keys/values
// are another pass's prefix, dk, dv [B, S, kv, D]: (dx, d input_norm, d qkv_w, d qkv_b, d o_w,
// d o_b, d post_norm, d gate_up_w, d down_w, d pk, d pv); the bias and prefix gradients are empty
// tensors where there is none. gate_up_rows, gate_up_offset: gate_up's rows are read where they lie in the
// activation record (`gate_up_of`; `intermediate` is then I).
std::vector<at::Tensor> train_layer_backward(
    const at::Tensor& dout, const std::optional<at::Tensor>& dk_in, const std::optional<at::Tensor>& dv_in,
    const at::Tensor& x, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& attn,
    const at::Tensor& lse, const at::Tensor& x_mid, const at::Tensor& gate_up, const at::Tensor& input_norm,
    const at::Tensor& qkv_t, bool qkv_bias, const at::Tensor& o_t, bool o_bias, const at::Tensor& post_norm,
    const at::Tensor& gate_up_t, const at::Tensor& down_t, const at::Tensor& rot, const at::Tensor& pos0,
    const std::optional<at::Tensor>& pk, const std::optional<at::Tensor>& pv,
    const std::optional<at::Tensor>& slot, const std::optional<at::Tensor>& pre_len, int64_t heads, int64_t kv_heads,
    int64_t S, double eps, const std::optional<at::Tensor>& gate_up_rows, int64_t gate_up_offset,
    int64_t intermediate) {
  const int64_t I = gate_up_rows ? intermediate : gate_up.size(1) / 2;
  const LayerArgs a = layer_args(x, I, rot, pos0, pk, slot, pre_len, heads, kv_heads, S);
  const GateUpRows gate_up_at = gate_up_of(gate_up, gate_up_rows, gate_up_offset, a.M, I);
  const Geometry& g = a.g;
  const int64_t M = a.M, E = a.E, D = a.D, H = g.H, KV = g.KV;
  check_vector(input_norm, E, "input_norm");
  check_vector(post_norm, E, "post_norm");
  check_rows(dout, "train_layer_backward: dout");
  auto opts = x.options();
  // MLP: x_out = x_mid + down(swiglu(gate_up(norm(x_mid))))
  auto act = at::empty({M, a.I}, opts);    // recomputed in the backward's pass over gate_up
  auto d_act = at::empty({M, a.I}, opts);     // dout down_w
  product(d_act.data_ptr<float>(), a.I, dout.data_ptr<float>(), E, down_t, nullptr, M, a.I, E, false);
  auto d_gate_up = swiglu_backward_into(d_act, gate_up_at, act.data_ptr<float>());
  auto d_down_w = at::mm(dout.t(), act);
  auto h = at::empty({M, E}, opts);
  auto rstd = at::empty({M}, opts);
  reinforge_kernels::rms_norm_rows(h.data_ptr<float>(), rstd.data_ptr<float>(), x_mid.data_ptr<float>(),
                                   post_norm.data_ptr<float>(), M, E, (float)eps);
  auto d_gate_up_w = at::mm(d_gate_up.t(), h);
  auto dh = at::empty({M, E}, opts);
  product(dh.data_ptr<float>(), E, d_gate_up.data_ptr<float>(), 2 * a.I, gate_up_t, nullptr, M, E, 2 * a.I, false);
  auto d_mid = at::empty({M, E}, opts);
  auto d_post_norm = at::empty({E}, opts);
  rms_norm_backward_rows(d_mid.data_ptr<float>(), d_post_norm.data_ptr<float>(), dh.data_ptr<float>(),
                         x_mid.data_ptr<float>(), post_norm.data_ptr<float>(), rstd.data_ptr<float>(),
                         dout.data_ptr<float>(), M, E);
  // attention: x_mid = x + o(attn)
  auto d_o_w = at::mm(d_mid.t(), attn);
  auto d_o_b = o_bias ? d_mid.sum(0) : at::empty({0}, opts);
  auto d_attn = at::empty({M, H * D}, opts);
  product(d_attn.data_ptr<float>(), H * D, d_mid.data_ptr<float>(), E, o_t, nullptr, M, H * D, E, false);
  auto dq = at::empty({g.B, S, H, D}, opts);
  auto dk = dk_in ? dk_in->contiguous().clone() : at::zeros({g.B, S, KV, D}, opts);
  auto dv = dv_in ? dv_in->contiguous().clone() : at::zeros({g.B, S, KV, D}, opts);
  auto dpk = pk ? at::zeros_like(*pk) : at::empty({0}, opts);
  auto dpv = pv ? at::zeros_like(*pv) : at::empty({0}, opts);
  with_head_dim(D, [&](auto d) {
    attention_backward<decltype(d)::value>(
        g, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), pk ? pk->data_ptr<float>() : nullptr,
        pv ? pv->data_ptr<float>() : nullptr, attn.data_ptr<float>(), lse.data_ptr<float>(), d_attn.data_ptr<float>(),
        dq.data_ptr<float>(), dk.data_ptr<float>(), dv.data_ptr<float>(), pk ? dpk.data_ptr<float>() : nullptr,
        pv ? dpv.data_ptr<float>() : nullptr);
  });
  // qkv = qkv_proj(norm(x)), then rotary of q and k
  auto d_qkv = at::empty({M, a.N}, opts);
  const float* rp = rot.data_ptr<float>();
  const int64_t* p0 = pos0.data_ptr<int64_t>();
  float* dqkv = d_qkv.data_ptr<float>();
  const float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* cs = rp + (p0[m / S] + m % S) * D;
      float* row = dqkv + m * a.N;
      rotate<true>(row, dqp + m * H * D, cs, H, D);
      rotate<true>(row + H * D, dkp + m * KV * D, cs, KV, D);
      std::memcpy(row + (H + KV) * D, dvp + m * KV * D, sizeof(float) * KV * D);
    }
  });
  auto d_qkv_b = qkv_bias ? d_qkv.sum(0) : at::empty({0}, opts);
  reinforge_kernels::rms_norm_rows(h.data_ptr<float>(), rstd.data_ptr<float>(), x.data_ptr<float>(),
                                   input_norm.data_ptr<float>(), M, E, (float)eps);
  auto d_qkv_w = at::mm(d_qkv.t(), h);
  auto dh1 = at::empty({M, E}, opts);
  product(dh1.data_ptr<float>(), E, d_qkv.data_ptr<float>(), a.N, qkv_t, nullptr, M, E, a.N, false);
  auto dx = at::empty({M, E}, opts);
  auto d_input_norm = at::empty({E}, opts);
  rms_norm_backward_rows(dx.data_ptr<float>(), d_input_norm.data_ptr<float>(), dh1.data_ptr<float>(), x.data_ptr<float>(),
                         input_norm.data_ptr<float>(), rstd.data_ptr<float>(), d_mid.data_ptr<float>(), M, E);
  return {dx, d_input_norm, d_qkv_w, d_qkv_b, d_o_w, d_o_b, d_post_norm, d_gate_up_w, d_down_w, dpk, dpv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(reinforge_kernels, m) {
  m.def("rms_norm_forward(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)", &rms_norm_forward);
  m.def("rms_norm_backward(Tensor dy, Tensor x, Tensor w, Tensor rstd) -> (Tensor, Tensor)", &rms_norm_backward);
  m.def("swiglu_forward(Tensor gu) -> Tensor", &swiglu_forward);
  m.def("swiglu_backward(Tensor da, Tensor gu) -> Tensor", &swiglu_backward);
  m.def("train_layer_forward(Tensor x, Tensor input_norm, Tensor qkv_p, Tensor? qkv_b, Tensor o_p, Tensor? o_b, "
        "Tensor post_norm, Tensor gate_up_p, Tensor down_p, Tensor rot, Tensor pos0, Tensor? pk, "
        "Tensor? pv, Tensor? slot, Tensor? pre_len, int heads, int kv_heads, int S, float eps) -> Tensor[]",
        &train_layer_forward);
  m.def("train_layer_backward(Tensor dout, Tensor? dk_in, Tensor? dv_in, Tensor x, Tensor q, Tensor k, Tensor v, "
        "Tensor attn, Tensor lse, Tensor x_mid, Tensor gate_up, Tensor input_norm, Tensor qkv_t, bool qkv_bias, "
        "Tensor o_t, bool o_bias, Tensor post_norm, Tensor gate_up_t, Tensor down_t, Tensor rot, Tensor pos0, "
        "Tensor? pk, Tensor? pv, Tensor? slot, Tensor? pre_len, int heads, int kv_heads, int S, "
        "float eps, Tensor? gate_up_rows=None, int gate_up_offset=0, int intermediate=0) -> Tensor[]",
        &train_layer_backward);
}
