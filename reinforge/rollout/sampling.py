"""Sampling for the native engine: logit filters (temperature, top-k, top-p, min-p), token draws with the
log-prob of each token under the distribution it was drawn from (after temperature and
filtering), which the TIS / MIS corrections need, and the counter-based random streams they draw
from.

Each sample's uniforms come from a splitmix64 stream keyed by its prompt (`keyed_uniforms`), so a
prompt's samples do not depend on the rest of the batch, slot moves, the device or how learner
ranks split a batch; whoever splits a call's prompts draws their keys as the engine would
(`draw_group_keys`). The fused CPU op (`kernels.sample`, csrc/decode.cpp) computes the same draws.
"""

from __future__ import annotations

from typing import Any

import torch

from reinforge.rollout.base import SamplingParams


def filter_logits(scores: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Top-k, then nucleus (top-p), then min-p filtering of [B, V] scores: removed tokens get -inf.

    Top-p keeps the smallest set of most likely tokens whose mass reaches p
    (Holtzman et al., arXiv 1904.09751); the most likely token always stays.
    Min-p keeps the tokens with p_k >= min_p * max_j p_j (Nguyen et al., arXiv 2407.01082; HF's
    MinPLogitsWarper and vLLM's min_p, both after temperature): in logits, z_k >= max_j z_j + log min_p.
    The ratio p_k / p_max does not change when top-k / top-p renormalise, so min-p after them keeps
    the intersection of the sets, as HF's order (top-k, top-p, min-p) does.
    """
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs      # mass of the strictly more likely tokens
        remove_sorted = mass_before >= top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    if min_p > 0.0:
        floor = scores.amax(dim=-1, keepdim=True) + torch.log(torch.tensor(min_p, dtype=scores.dtype))
        scores = scores.masked_fill(scores < floor, float("-inf"))
    return scores


def kernel_sampling(params: SamplingParams) -> tuple[float, float]:
    """(temperature, top_p) as the CPU kernels' sampler reads them (csrc/sampling.h): greedy is temperature 0,
    with no nucleus."""
    return (0.0, 1.0) if params.greedy else (params.temperature, params.top_p)


def keyed_sample(logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor, counters: torch.Tensor,
                 kernels: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and sampler log-probs [B] of logits [B, V] at draw `counters` of streams `keys`: `sample_tokens`
    with `keyed_uniforms`, or the fused CPU op of `kernels` (csrc/sampling.h) without top-k / min-p (with top-p
    it finds the nucleus by a radix select, where `filter_logits` sorts: the same set but for tokens tied at its
    edge, which the op all keeps)."""
    if kernels is None or params.top_k > 0 or params.min_p > 0.0 or logits.device.type != "cpu":
        return sample_tokens(logits, params, uniforms=keyed_uniforms(keys, counters))
    tokens, logprobs = torch.empty(len(logits), dtype=torch.long), torch.empty(len(logits))
    temperature, top_p = kernel_sampling(params)
    kernels.sample(tokens, logprobs, logits.contiguous(), temperature, keys.contiguous(), counters.contiguous(), top_p)
    return tokens, logprobs


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                  uniforms: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of fp32 logits [B, V], inverting each row's CDF at `uniforms` [B] when
    given, else at uniforms from `generator` (default torch's global one).

    Returns (tokens [B] long, log-probs [B] of the tokens under the distribution
    they were drawn from: softmax(filter(logits / T)); greedy: the untempered softmax).
    """
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        # x / 1 is x, bit for bit: no pass over the [B, V] logits for the usual temperature of 1.
        scores = logits if params.temperature == 1.0 else logits / params.temperature
        if scores.device.type == "cuda" and not params.truncates:
            return sample_blocked(scores, generator, uniforms)
        scores = filter_logits(scores, params.top_k, params.top_p, params.min_p)
        logprobs = torch.log_softmax(scores, dim=-1)
        tokens = _draw(logprobs.exp(), generator, uniforms)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


# Tokens per block of `sample_blocked`'s two-level CDF (Qwen's 151,936 tokens: 148 blocks and a tail).
SAMPLE_BLOCK = 1024


def sample_blocked(scores: torch.Tensor, generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None,
                   block: int = SAMPLE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` of unfiltered scores [B, V] (the tempered logits) by the same inverse CDF, in two
    levels: each row's softmax once (one fused kernel), the mass of each block of `block` tokens, the
    block holding the draw from the blocks' cumulative sums, then the cumulative sum inside that block
    only. The same distribution and the same draw (u x total mass, the first token whose CDF passes
    it), with the CDF summed in another order: a row departs from `_draw`'s token only where rounding
    moves a CDF boundary across its uniform. On a GPU this replaces a scan, a log-softmax and an exp
    over the whole [B, V] (0.5 ms of a 4 ms decode step at 256 rows of Qwen's vocabulary) with one
    softmax and one reduction. The log-prob is log p of the token (p > 0 for any token drawn), the
    log-softmax's number within float rounding. No host synchronisation (a CUDA graph's body)."""
    probs = torch.softmax(scores, dim=-1)                                         # [B, V]
    rows, v = probs.shape
    full = v // block * block
    sums = [probs[:, :full].view(rows, -1, block).sum(dim=-1)] if full else []
    if full < v:
        sums.append(probs[:, full:].sum(dim=-1, keepdim=True))
    mass = torch.cat(sums, dim=1) if len(sums) > 1 else sums[0]                    # [B, blocks]
    cdf = mass.cumsum(dim=-1)
    if uniforms is None:
        uniforms = torch.rand(rows, dtype=cdf.dtype, generator=generator)
    u = uniforms.to(device=probs.device, dtype=cdf.dtype)[:, None] * cdf[:, -1:]   # [B, 1]
    # [B, 1] the draw's block: the first whose CDF passes u (so it has mass), or, where rounding puts u at
    # the total, the last block with mass
    blocks = torch.arange(mass.shape[1], device=probs.device)[None, :]
    j = torch.minimum(torch.searchsorted(cdf, u, right=True),
                      torch.where(mass > 0, blocks, 0).amax(dim=-1, keepdim=True))
    u = (u - (cdf.gather(1, j) - mass.gather(1, j))).clamp_(min=0)               # the draw within its block
    at = j * block + torch.arange(block, device=probs.device)[None, :]             # [B, block] its token ids
    inside = at < v
    local = probs.gather(1, at.clamp(max=v - 1)) * inside                          # [B, block] (0 past the tail)
    # The last token with mass in the block: where rounding puts the draw past the block's own sum.
    last = torch.where(local > 0, torch.arange(block, device=probs.device)[None, :], 0).amax(dim=-1, keepdim=True)
    k = torch.minimum(torch.searchsorted(local.cumsum(dim=-1), u, right=True), last)
    tokens = (j * block + k).squeeze(1)
    return tokens, probs.gather(1, tokens.unsqueeze(1)).squeeze(1).log()


def _draw(
    probs: torch.Tensor, generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """One index per row of probs [B, V] by inverting the CDF at a uniform draw (torch.multinomial
    does the same job several times slower on CPU). The draw is scaled by each row's total, so
    rounding in the sum cannot step past the last token with mass. The uniforms are drawn on the CPU
    (`generator` is a CPU generator), so a seed gives the same draws on any device."""
    cdf = probs.cumsum(dim=-1)
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], dtype=cdf.dtype, generator=generator)
    u = uniforms.to(device=probs.device, dtype=cdf.dtype)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


# splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014):
# its state increment and finaliser constants, as int64 (two's complement; torch's int64 arithmetic wraps).
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed ints)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of int64 whose outputs for consecutive inputs look independent."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def draw_group_keys(n: int, generator: torch.Generator | None) -> torch.Tensor:
    """n prompts' sampling keys [n] int64, one draw each, in order, from `generator` (None: torch's
    global one). Whoever splits a call's prompts (learner ranks) draws them here, as the engine would."""
    return torch.cat([torch.randint(2**62, (1,), generator=generator) for _ in range(n)])


def row_keys(group_keys: torch.Tensor, group_size: int) -> torch.Tensor:
    """The key of sample j of each group [P] -> [P G]: a stream of its own per sample."""
    j = torch.arange(1, group_size + 1, device=group_keys.device).repeat(len(group_keys))
    return mix64(group_keys.repeat_interleave(group_size) + j * _GOLDEN)


def keyed_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) [n] of draw number `counters` [n] of the streams `keys` [n] (int64): the
    splitmix64 output at state key + (counter + 1) x increment, top 24 bits. A row's draws depend on
    its key alone: not on the rows beside it, the batch's order, slots, ranks or device."""
    z = mix64(keys + (counters + 1) * _GOLDEN)
    return _shr(z, 40).to(torch.float32) * 2.0**-24


def sampler_top_k(logits: torch.Tensor, params: SamplingParams, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K most likely token ids [B, K] of each row of fp32 logits [B, V] and their log-probs [B, K]
    under the distribution `sample_tokens` draws from (softmax(filter(logits / T)); greedy: the
    untempered softmax), most likely first. A filtered-out token has log-prob -inf. For DPPO's top-K
    divergence (arXiv 2602.04879), which compares these with the learner's at the same ids."""
    scores = (logits if params.greedy
              else filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p))
    top = torch.topk(torch.log_softmax(scores, dim=-1), k, dim=-1)
    return top.indices, top.values
