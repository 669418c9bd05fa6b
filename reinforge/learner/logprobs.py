"""Memory-efficient per-token log-probs and entropies: the LM head and the
softmax over the vocabulary in token chunks, with the backward recomputing
each chunk's logits instead of saving them.

The naive path (`sequences.completion_token_stats`) materialises the [N, L, V]
logits and then several [N, T, V] tensors (gathered logits, softmax, the
autograd copies). At V = 151,936 that is 0.6 GB per 1,000 tokens per fp32
copy. Here only the trained completion tokens ([M] of them: no padding, no environment token) reach
the head, and at most two [chunk_size, V] buffers are alive at once; the
forward keeps just three [M] vectors (max logit, log-sum-exp of the shifted
logits, entropy) for the backward.

The head runs in fp32 by default (`fp32_head`), as in ScaleRL (arXiv
2510.13786, fp32 logits at the LM head) and MiniMax-M1 (arXiv 2506.13585,
which traced a training/inference probability mismatch to the bf16 LM head):
log-probs of a 150k-way softmax are sensitive to the head's precision, and
the objective's importance ratios compare them across engines.
"""

from __future__ import annotations

import logging

import torch
from torch.autograd.function import FunctionCtx, once_differentiable
from transformers import PreTrainedModel

from reinforge.learner.head_gemms import split_grads
from reinforge.learner.sequences import SequenceBatch, TokenStats
from reinforge.learner.truncation import Truncation, kept_log_mass
from reinforge.models.lora import linear_weight

log = logging.getLogger(__name__)

# On CUDA a 16-bit head's fp32 logits come from cuBLAS's 16-bit GEMM with fp32 accumulation and
# output (`torch.mm(..., out_dtype=torch.float32)`): the products of bf16/fp16 numbers are exact in
# fp32, so these are the upcast fp32 matmul's logits up to summation order, at the tensor cores' rate
# (an fp32 GEMM runs ~15x slower on an H100/H200) and without an fp32 copy of the [V, E] head. Turned
# off, with a logged reason, if this torch lacks the op.
_FP32_OUT_MM = {"on": True}

# On CUDA each pass over a [chunk, V] fp32 buffer costs ~0.15 ms per 1,024 tokens of Qwen's 151,936-way vocabulary,
# and an op broadcasting a [C, 1] column over it runs below the copy rate: the chunk loops there take the fused
# order of the same formulas (`_fused`), fewer passes and fewer broadcasts, with its own fp32 rounding. The CPU keeps
# the plain order, bit for bit; tests turn the fused order on there ("cpu") to check its numbers.
_FUSED = {"cpu": False}

def _fused(device: torch.device) -> bool:
    """Whether the chunk loops take the fused order (`_FUSED`): on CUDA, or on the CPU when a test asks."""
    return device.type == "cuda" or _FUSED["cpu"]


def _compute_dtype(dtype: torch.dtype, fp32_head: bool) -> torch.dtype:
    """The dtype of the head matmul: at least fp32 when `fp32_head` (fp64 stays fp64, for gradcheck)."""
    return torch.promote_types(dtype, torch.float32) if fp32_head else dtype


def _fp32_out(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether the head's fp32 logits (`dtype`) can come from the 16-bit GEMM with fp32 output (see
    `_FP32_OUT_MM`): on CUDA, hidden and weight of one 16-bit dtype, no bias."""
    return (_FP32_OUT_MM["on"] and dtype == torch.float32 and hidden.device.type == "cuda" and bias is None
            and hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16))


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
    fp32_out: bool = False,
) -> torch.Tensor:
    """z = (h W^T + b) / temperature for one chunk, [C, V], in at least fp32 (a fresh tensor, safe to
    modify); the matmul runs in `weight`'s dtype (the head's compute dtype, cast once by the caller),
    or, `fp32_out`, in hidden's and weight's 16-bit dtype with fp32 accumulation and output."""
    if fp32_out and _FP32_OUT_MM["on"]:
        try:
            logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
            if temperature != 1.0:
                logits.div_(temperature)
            return logits
        except (RuntimeError, TypeError) as err:
            _FP32_OUT_MM["on"] = False
            log.warning("LM head: the 16-bit GEMM with fp32 output is unavailable (%s: %s); upcasting the head "
                        "to fp32 instead", type(err).__name__, str(err)[:200])
    if fp32_out:
        weight = weight.float()
    h = hidden.to(weight.dtype)
    logits = torch.mm(h, weight.t()) if bias is None else torch.addmm(bias, h, weight.t())
    # The softmax statistics are fp32 even when the matmul is not (fp32_head=False).
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class _ChunkedTokenStats(torch.autograd.Function):
    """Per-token log-prob of the target and entropy of softmax(z), z = (h W^T + b) / tau, in chunks.

    Forward, per token (z a row of logits, y its target), with s = z - max_k z_k:
        lse   = max + log sum_k exp(s_k)
        logp  = z_y - lse = s_y - log sum_k exp(s_k)
        H     = lse - sum_k p_k z_k = log sum_k exp(s_k) - sum_k p_k s_k,   p = softmax(z)
    (H = -sum_k p_k log p_k is the same number, but summing 150k fp32 log p of size ~12 drifts
    by ~1e-5; this form stays ~1e-6 from fp64.)

    Backward, with incoming gradients g (for logp) and e (for H), per token:
        d logp / d z_k = [k = y] - p_k
        d H / d z_k    = -p_k (z_k - sum_j p_j z_j)
    The second: H = lse - sum_j p_j z_j, d lse / d z_k = p_k, and with
    d p_j / d z_k = p_j ([j = k] - p_k),
        d (sum_j p_j z_j) / d z_k = p_k + sum_j z_j p_j ([j = k] - p_k) = p_k + p_k z_k - p_k sum_j p_j z_j,
    so d H / d z_k = p_k - p_k - p_k (z_k - sum_j p_j z_j). Since z_k - sum_j p_j z_j
    = log p_k + H (the lse shift cancels), the chunk's logit gradient is
        dz_k = g [k = y] - p_k (g + e (log p_k + H)),
    and dh = dz W / tau, dW = dz^T h / tau, db = sum_tokens dz / tau.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: torch.Tensor,    # [M, H]
        weight: torch.Tensor,    # [V, H]
        bias: torch.Tensor | None,  # [V]
        targets: torch.Tensor,   # [M] long
        temperature: float,
        chunk_size: int,
        fp32_head: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = hidden.shape[0]
        dtype = _compute_dtype(hidden.dtype, fp32_head)
        stats_dtype = torch.promote_types(dtype, torch.float32)
        fp32_out = _fp32_out(hidden, weight, bias, dtype)
        w = weight if fp32_out else weight.to(dtype)  # [V, H], a copy only when the head is upcast
        b = None if bias is None else bias.to(dtype)
        logprobs = hidden.new_empty(m, dtype=stats_dtype)  # [M]
        entropy = hidden.new_empty(m, dtype=stats_dtype)   # [M]
        row_max = hidden.new_empty(m, dtype=stats_dtype)  # [M] max_k z_k
        log_sum = hidden.new_empty(m, dtype=stats_dtype)  # [M] log sum_k exp(z_k - max), so lse = max + log_sum
        fused = _fused(hidden.device)
        for start in range(0, m, chunk_size):
            rows = slice(start, start + chunk_size)
            # Shifted logits z - max, kept as such: log p = (z - max) - log_sum loses no precision
            # to a large lse (fp32 z ~ 20 has an ulp of 2e-6). At most two [C, V] buffers alive.
            shifted = _chunk_logits(hidden[rows], w, b, temperature, fp32_out)  # [C, V]
            row_max[rows] = shifted.amax(dim=-1)
            shifted.sub_(row_max[rows].unsqueeze(1))
            probs = shifted.exp()  # [C, V], unnormalised
            total = probs.sum(dim=-1)  # [C]
            log_sum[rows] = total.log()
            logprobs[rows] = shifted.gather(1, targets[rows].unsqueeze(1)).squeeze(1) - log_sum[rows]
            # H = lse - sum_k p_k z_k = log_sum - sum_k p_k (z_k - max), as sum_k p_k = 1.
            if fused:   # sum_k exp(s_k) s_k / total: the normalisation on [C] numbers, no broadcast pass over [C, V]
                entropy[rows] = log_sum[rows] - probs.mul_(shifted).sum(dim=-1).div_(total)
            else:
                probs.div_(total.unsqueeze(1))
                entropy[rows] = log_sum[rows] - probs.mul_(shifted).sum(dim=-1)
            del shifted, probs
        ctx.save_for_backward(hidden, weight, bias, targets, row_max, log_sum, entropy)
        ctx.temperature, ctx.chunk_size, ctx.fp32_head = temperature, chunk_size, fp32_head
        # An output the loss does not use (the entropy, most often: a metric only) gets None, not zeros,
        # in the backward, which then skips its terms: two passes fewer over each [C, V] chunk.
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, bias, targets, row_max, log_sum, entropy = ctx.saved_tensors
        temperature, chunk_size, fp32_head = ctx.temperature, ctx.chunk_size, ctx.fp32_head
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        m = hidden.shape[0]
        zeros = entropy.new_zeros(m)
        g = zeros if grad_logprobs is None else grad_logprobs.to(entropy.dtype)  # [M]
        e = None if grad_entropy is None else grad_entropy.to(entropy.dtype)     # [M]; None: no entropy term
        dtype = _compute_dtype(hidden.dtype, fp32_head)
        fp32_out = _fp32_out(hidden, weight, bias, dtype)    # the forward's logits, recomputed as it did
        # bf16 head on CUDA: the fp32 logit gradient as two bf16 parts through bf16 GEMMs (`head_gemms.split_grads`; not
        # fp16, whose range would flush the small entries of the gradient)
        split = fp32_out and weight.dtype == torch.bfloat16
        w = None if split else weight.to(dtype)  # [V, H]
        b = None if bias is None else bias.to(dtype)
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # Accumulate over chunks in at least fp32, whatever the parameter dtype.
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=acc_dtype, device=weight.device) if need_b else None
        fused = _fused(hidden.device)
        if fused:   # the 1 / tau of dz = d/dz (.) / tau on the [M] coefficients, not a pass over each [C, V] chunk
            g = g / temperature
            e = None if e is None else e / temperature
            lse = row_max + log_sum     # [M]: log p = z - lse in one broadcast pass
        for start in range(0, m, chunk_size):
            rows = slice(start, start + chunk_size)
            dz = _chunk_logits(hidden[rows], weight if fp32_out else w, b, temperature, fp32_out)  # [C, V], z
            g_c = g[rows].unsqueeze(1)  # [C, 1]
            if fused:
                _fused_logit_grad(dz, lse[rows], g_c, None if e is None else e[rows], entropy[rows])
            else:
                dz.sub_(row_max[rows].unsqueeze(1)).sub_(log_sum[rows].unsqueeze(1))  # log p, as in forward
                if e is None:
                    # dz = g [k = y] - p g: the full form's e (log p + H) term is an exact zero here (the same
                    # numbers), and p is built in the log p buffer.
                    dz.exp_().mul_(g_c).neg_()
                else:
                    p = dz.exp()  # [C, V]
                    # dz = g [k = y] - p (g + e (log p + H)), built in the log p buffer.
                    dz.add_(entropy[rows].unsqueeze(1)).mul_(e[rows].unsqueeze(1)).add_(g_c).mul_(p).neg_()
                    del p
            dz.scatter_add_(1, targets[rows].unsqueeze(1), g_c)
            if temperature != 1.0 and not fused:
                dz.div_(temperature)  # z = logits / tau (x / 1 is x: no pass for it)
            if split:
                try:
                    grad_h = split_grads(dz, hidden[rows], weight, need_h, grad_weight)
                    if need_h:
                        grad_hidden[rows] = grad_h.to(hidden.dtype)
                    continue
                except (RuntimeError, TypeError) as err:
                    split, _FP32_OUT_MM["on"] = False, False
                    log.warning("LM head backward: the 16-bit GEMM with fp32 output failed (%s: %s); upcasting the "
                                "head to fp32 instead", type(err).__name__, str(err)[:200])
            if w is None:
                w = weight.to(dtype)
            dz = dz.to(dtype)
            h = hidden[rows].to(dtype)
            if need_h:
                grad_hidden[rows] = torch.mm(dz, w).to(hidden.dtype)
            if need_w and dz.dtype == grad_weight.dtype:
                grad_weight.addmm_(dz.t(), h)  # in place: no [V, H] temporary per chunk
            elif need_w:
                grad_weight.add_(torch.mm(dz.t(), h))
            if need_b:
                grad_bias.add_(dz.sum(dim=0))
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        if need_b:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _fused_logit_grad(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, e: torch.Tensor | None,
                      entropy: torch.Tensor) -> None:
    """A chunk's logit gradient but its target term, in place of its logits z [C, V], in the fused order
    (`_FUSED`): log p = z - lse in one pass, then dz = -g p (no entropy gradient, `e` None), or
    dz = p (-e log p - (g + e H)) with the bracket in one pass (addcmul) and its product with p in another;
    g [C, 1], e, lse and entropy [C]. The plain order's formula (`_ChunkedTokenStats`), with three broadcast
    passes fewer (one without the entropy term)."""
    logits.sub_(lse.unsqueeze(1))        # log p
    if e is None:
        logits.exp_().mul_(g.neg())
        return
    p = logits.exp()                     # [C, V]
    torch.addcmul(g.neg().sub_((e * entropy).unsqueeze(1)), logits, e.neg().unsqueeze(1), out=logits)
    logits.mul_(p)


class _ChunkedKeptLogMass(torch.autograd.Function):
    """log Z_K = lse_K(z) - lse(z) per token, z = (h W^T + b) / tau and K the sampler's kept set of z
    (learner/truncation.py), in token chunks as `_ChunkedTokenStats` (no [M, V] logits).

    Backward, with incoming gradient g per token and K held fixed (piecewise constant in z):
        d log Z_K / d z_k = pi^K_k [k in K] - p_k,   pi^K = softmax over K,  p = softmax(z),
    each chunk's logits and K recomputed from h; dh = dz W / tau, dW = dz^T h / tau, db = sum dz / tau.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                truncation: Truncation, temperature: float, chunk_size: int, fp32_head: bool) -> torch.Tensor:
        dtype = _compute_dtype(hidden.dtype, fp32_head)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        out = hidden.new_empty(hidden.shape[0], dtype=torch.promote_types(dtype, torch.float32))  # [M]
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            out[rows] = kept_log_mass(_chunk_logits(hidden[rows], w, b, temperature), truncation)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.settings = (truncation, temperature, chunk_size, fp32_head)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor):
        hidden, weight, bias = ctx.saved_tensors
        truncation, temperature, chunk_size, fp32_head = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype = _compute_dtype(hidden.dtype, fp32_head)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=acc_dtype, device=weight.device) if need_b else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z = _chunk_logits(hidden[rows], w, b, temperature)                  # [C, V]
            kept = truncation.kept(z)
            dz = torch.softmax(z.masked_fill(~kept, float("-inf")), dim=-1).sub_(torch.softmax(z, dim=-1))
            dz.mul_(grad[rows].to(dz.dtype).unsqueeze(1)).div_(temperature)
            dz, h = dz.to(dtype), hidden[rows].to(dtype)
            if need_h:
                grad_hidden[rows] = torch.mm(dz, w).to(hidden.dtype)
            if need_w:
                grad_weight.add_(torch.mm(dz.t(), h).to(acc_dtype))
            if need_b:
                grad_bias.add_(dz.sum(dim=0).to(acc_dtype))
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        if need_b:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_kept_log_mass(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          truncation: Truncation, *, temperature: float = 1.0, chunk_size: int = 1024,
                          fp32_head: bool = True) -> torch.Tensor:
    """log Z_K [M] of softmax((hidden W^T + b) / temperature) over the kept set of `truncation`, chunked:
    subtracted from the full log-prob it gives the truncated policy's (learner/truncation.py)."""
    return _ChunkedKeptLogMass.apply(hidden, weight, bias, truncation, float(temperature), int(chunk_size),
                                     bool(fp32_head))


def chunked_token_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    fp32_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy under softmax((hidden W^T + b) / temperature), chunked over tokens.

    hidden [M, H], weight [V, H], bias [V] or None, targets [M] long; returns
    (logprobs [M], entropy [M]), in fp32 (fp64 for fp64 inputs). Equal to
    `log_softmax(logits.float() / temperature)` gathered at `targets`, and to
    its entropy, with gradients to hidden, weight and bias through both
    outputs; at most two [chunk_size, V] fp32 buffers are alive at once, in
    forward and backward (the backward recomputes each chunk's logits), so
    peak memory is ~2 x chunk_size x V x 4 bytes plus the [V, H] weight
    gradient.

    fp32_head: run the head matmul in fp32 (ScaleRL arXiv 2510.13786,
    MiniMax-M1 arXiv 2506.13585); otherwise in the hidden dtype, with the
    softmax statistics still in fp32.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _ChunkedTokenStats.apply(hidden, weight, bias, targets, float(temperature), int(chunk_size), bool(fp32_head))


def completion_token_stats_chunked(
    model: PreTrainedModel,
    batch: SequenceBatch,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    fp32_head: bool = True,
    truncation: Truncation | None = None,
) -> TokenStats:
    """`sequences.completion_token_stats` without the [N, L, V] logits: the model body, then the LM
    head on the valid completion tokens only, chunked (`chunked_token_logprobs_and_entropy`).

    Same contract: [N, T] log-probs and entropies of the completion tokens at
    temperature `temperature`, 0 on padding. Tied input/output embeddings get
    both gradient paths, since the head's weight is the embedding parameter.
    Assumes logits = lm_head(last_hidden_state), as in Llama/Qwen/Mistral; a
    model that rescales or soft-caps its logits is refused.
    """
    config = model.config
    if getattr(config, "final_logit_softcapping", None) is not None or getattr(config, "logit_scale", None) not in (
        None,
        1.0,
    ):
        raise NotImplementedError(
            f"{type(model).__name__} transforms its logits after the LM head; use completion_token_stats"
        )
    hidden = model.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state  # [N, L, H]
    # Position starts[i] - 1 + j predicts completion token j (by column); only the tokens trained on
    # reach the head. An environment token is in the body's input (context) but predicts nothing here.
    t = batch.completion_ids.shape[1]
    positions = batch.starts.unsqueeze(1) - 1 + torch.arange(t, device=batch.starts.device).unsqueeze(0)  # [N, T]
    rows, cols = (batch.completion_mask > 0).nonzero(as_tuple=True)  # [M], [M]
    return head_token_stats(model, batch, hidden[rows, positions[rows, cols]], temperature, chunk_size, fp32_head,
                            truncation)


def head_token_stats(model: PreTrainedModel, batch: SequenceBatch, predictors: torch.Tensor, temperature: float,
                     chunk_size: int, fp32_head: bool, truncation: Truncation | None = None) -> TokenStats:
    """The LM head, chunked, on the hidden states [M, E] that predict the batch's valid completion tokens
    (in the order of `(completion_mask > 0).nonzero()`), scattered back to [N, T] log-probs and entropies.

    `truncation`: log-probs of the sampler's truncated distribution (learner/truncation.py); the
    entropies stay the full distribution's. The head's own weight goes in, so tied input/output
    embeddings get both gradient paths; a LoRA head (lm_head in model.lora.target_modules) computes
    with W + (alpha / r) B A (`models.lora`).
    """
    weight, bias = linear_weight(model.get_output_embeddings())
    n, t = batch.completion_ids.shape
    rows, cols = (batch.completion_mask > 0).nonzero(as_tuple=True)  # [M], [M]
    logprobs, entropy = chunked_token_logprobs_and_entropy(
        predictors, weight, bias, batch.completion_ids[rows, cols],
        temperature=temperature, chunk_size=chunk_size, fp32_head=fp32_head,
    )
    if truncation is not None:   # log pi^K = log p - log Z_K (learner/truncation.py)
        logprobs = logprobs - chunked_kept_log_mass(predictors, weight, bias, truncation, temperature=temperature,
                                                    chunk_size=chunk_size, fp32_head=fp32_head)
    # Scatter back to [N, T]; times the mask as in the naive path (a no-op for a 0/1 mask).
    mask = batch.completion_mask[rows, cols].to(logprobs.dtype)
    out_logprobs = logprobs.new_zeros(n, t).index_put((rows, cols), logprobs * mask)
    out_entropy = entropy.new_zeros(n, t).index_put((rows, cols), entropy * mask)
    top = None
    if batch.top_ids is not None:
        extra = batch.top_ids[rows, cols]                                                   # [M, K]
        values = chunked_logprobs_at(predictors.detach(), weight.detach(), None if bias is None else bias.detach(),
                                     extra, temperature=temperature, chunk_size=chunk_size, fp32_head=fp32_head,
                                     truncation=truncation)
        top = values.new_zeros(n, t, extra.shape[1]).index_put((rows, cols), values * mask.unsqueeze(1))
    return TokenStats(logprobs=out_logprobs, entropy=out_entropy, top_logprobs=top)


@torch.no_grad()
def chunked_logprobs_at(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, *,
                        temperature: float = 1.0, chunk_size: int = 1024, fp32_head: bool = True,
                        truncation: Truncation | None = None) -> torch.Tensor:
    """log softmax((hidden W^T + b) / temperature) at K ids per token, [M, K], without gradient (with
    `truncation`: renormalised over the sampler's kept tokens, -inf off them): hidden
    [M, H], ids [M, K] long. Chunked over tokens like `chunked_token_logprobs_and_entropy` (one [C, V]
    buffer at a time, never [M, V]); the same numbers as its log-probs at those ids. One more pass of
    the head over the tokens: DPPO's top-K divergence (arXiv 2602.04879) reads the learner's log-probs
    of the sampler's top-K ids, which only decide its mask, so they need no backward."""
    dtype = _compute_dtype(hidden.dtype, fp32_head)
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    out = hidden.new_empty(ids.shape, dtype=torch.promote_types(dtype, torch.float32))   # [M, K]
    for start in range(0, hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        logits = _chunk_logits(hidden[rows], w, b, temperature)                            # [C, V]
        if truncation is not None:
            logits = logits.masked_fill(~truncation.kept(logits), float("-inf"))
        out[rows] = logits.gather(1, ids[rows]) - torch.logsumexp(logits, dim=-1, keepdim=True)
    return out
