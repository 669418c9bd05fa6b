"""The native rollout engine: KV-cache decoding with continuous batching for
Llama-family decoders (Llama, Qwen2, Qwen3, Mistral). This module owns the
engine (`NativeEngine`) and its decoding session (`DecodeSession`, the rows it
returns, `rows_to_rollout`); the decoder forward is `models.decoder`, the
cache `rollout.kv_cache`, the sampling and its random streams `rollout.sampling`.

Why not `generate`: per decoding step it pays for generality (cache objects,
mask builders, logits processors, stopping criteria) and keeps finished rows
in the batch until the last one ends. On small models and CPUs that overhead
is most of the rollout time, and in RL the completion lengths of one batch
are long-tailed. This engine

- runs the decoder's own modules (`models.decoder`), so it shares the
  training weights: an optimizer step is visible at the next call with no
  weight sync, and numerics match the learner's forward;
- prefills each prompt once, however many samples it has (the G samples of a
  prompt copy its keys/values into their own cache slots);
- keeps a key/value cache per layer (doubled as rows grow, its memory kept between calls) and
  decodes only the live rows: a finished row's slot is refilled with a
  waiting row (continuous batching) or, when none waits, the live rows are
  packed to the front so the batch shrinks;
- samples with temperature / top-k / top-p, recording the log-prob of each
  token under the distribution it was drawn from (after temperature and
  filtering), which the TIS / MIS corrections need;
- draws each sample's uniforms from a counter-based stream keyed by its
  prompt (`rollout.sampling.keyed_uniforms`), so a prompt's samples do not depend on the rest
  of the batch, slot moves, the device or how learner ranks split a batch.

Greedy decoding gives the tokens `generate` gives; sampler log-probs equal
the learner's recomputed log-probs (fp32) within 1e-4 (tests/test_native_engine.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from reinforge.kernels import HEAD_DIMS, load_cpu_kernels, rms_norm
from reinforge.models import Policy
from reinforge.models.decoder import (
    DecoderWeights,
    additive_mask,
    attention,
    decoder_layers,
    decoder_shape,
    pass_geometry,
    rotary_factors,
    run_pass,
)
from reinforge.models.lora import base_model
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.kv_cache import KVCache
from reinforge.rollout.prompts import encode_prompts
from reinforge.rollout.sampling import draw_group_keys, keyed_uniforms, row_keys, sample_tokens
from reinforge.rollout.stopping import stop_string_end
from reinforge.rollout.trajectory import Segment, Trajectory, collate


class NativeEngine:
    """Batched KV-cache sampling with continuous batching (see the module docstring).

    `max_batch_rows` bounds the rows decoded at once (the cache's slots);
    None decodes all rows of a call at once. `prefill_tokens` bounds the
    prompt tokens of one prefill forward.
    """

    def __init__(self, policy: Policy, chat_template: str = "auto", max_batch_rows: int | None = None,
                 prefill_tokens: int = 16384, cpu_kernels: bool = True):
        self.policy = policy
        self.chat_template = chat_template
        self.max_batch_rows = max_batch_rows
        self.prefill_tokens = prefill_tokens
        # On CPU the cache's memory is kept for the next call: a fresh multi-MB cache per call went
        # back to the OS in between, and faulting it in again cost ~5% of a rollout here. (GPU
        # allocators keep freed blocks themselves, and the learner may need them.)
        self._spare: KVCache | None = None
        # Fail at construction, before any run starts: an unsupported shape or layer type raises here.
        self.shape = decoder_shape(policy.model)
        DecoderWeights.of(policy.model)
        # Decoding on CPU in fp32 with SwiGLU MLPs: the fused layer kernel where it builds, else None.
        model = base_model(policy.model)
        fusable = (cpu_kernels and model.device.type == "cpu" and model.dtype == torch.float32
                   and self.shape.head_dim in HEAD_DIMS
                   and getattr(model.config, "hidden_act", None) in ("silu", "swish"))
        self.kernels = load_cpu_kernels() if fusable else None

    @torch.no_grad()
    def generate(self, prompts: list[str], group_size: int, params: SamplingParams, policy_version: int = 0,
                 generator: torch.Generator | None = None, group_keys: torch.Tensor | None = None) -> Rollout:
        """`group_size` samples of each prompt. Each prompt's samples draw from a stream keyed by one
        int64 (`group_keys` [P], default one draw per prompt from `generator`, else torch's global
        generator): a prompt's samples depend on its key alone, not on the other prompts of the call."""
        tokenizer = self.policy.tokenizer
        prompt_ids = encode_prompts(tokenizer, prompts, self.chat_template)
        n_rows = len(prompts) * group_size
        session = self.session(params, slots=min(n_rows, self.max_batch_rows or n_rows), generator=generator,
                               version=policy_version)
        session.add(prompt_ids, group_size, tags=range(n_rows), group_keys=group_keys)
        rows: list[FinishedRow | None] = [None] * n_rows
        while session.busy:
            for row in session.step():
                rows[row.tag] = row
        self.release(session)
        return rows_to_rollout(rows, [ids for ids in prompt_ids for _ in range(group_size)], group_size,
                               tokenizer, policy_version)

    def release(self, session: DecodeSession) -> None:
        """A finished session's cache memory is kept for the next one (on CPU; see `_spare`)."""
        if self.policy.model.device.type == "cpu":
            self._spare = session.cache

    def session(self, params: SamplingParams, slots: int, generator: torch.Generator | None = None,
                version: int = 0, keep_context: bool = False) -> DecodeSession:
        """A decoding session over this engine's model with `slots` cache slots: prompts join it any
        time (`add`), each `step` decodes one token of every live row (the asynchronous loop's sampler).
        `keep_context`: every finished row carries its `RowContext`, so `extend` can continue it."""
        return DecodeSession(self, params, slots, generator, version, keep_context)

    def _stop_strings(self, tokens: torch.Tensor, generated: torch.Tensor, stop: tuple[str, ...]) -> torch.Tensor:
        """[live] bool: which rows' text so far (tokens [live, T], `generated` of them) contains a stop string."""
        hits = [stop_string_end(self.policy.tokenizer, row[: int(g)].tolist(), stop) is not None
                for row, g in zip(tokens, generated, strict=True)]
        return torch.tensor(hits, dtype=torch.bool, device=tokens.device)

    def _prefill(self, w: DecoderWeights, prompt_ids: list[list[int]], freqs: torch.Tensor):
        """Each prompt once: its keys/values per layer ([P, kv_heads, width, D], right-padded) and the
        fp32 logits of its next token [P, V]."""
        width = max(len(p) for p in prompt_ids)
        rows_per_pass = max(1, self.prefill_tokens // width)
        keys: list[list[torch.Tensor]] = [[] for _ in w.layers]
        values: list[list[torch.Tensor]] = [[] for _ in w.layers]
        logits = [
            self._prefill_chunk(w, prompt_ids[start : start + rows_per_pass], width, keys, values, freqs)
            for start in range(0, len(prompt_ids), rows_per_pass)
        ]
        return [torch.cat(k) for k in keys], [torch.cat(v) for v in values], torch.cat(logits)

    def _prefill_chunk(self, w: DecoderWeights, chunk: list[list[int]], width: int, keys: list[list[torch.Tensor]],
                       values: list[list[torch.Tensor]], freqs: torch.Tensor) -> torch.Tensor:
        """Prefill prompts right-padded to `width`, appending each layer's keys/values; next-token logits [B, V]."""
        device = w.head.device
        ids = torch.full((len(chunk), width), self.policy.tokenizer.pad_token_id or 0, dtype=torch.long, device=device)
        lengths = torch.tensor([len(p) for p in chunk], device=device)
        for i, p in enumerate(chunk):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        # Right padding: query i sees keys j <= i (within the sliding window, if any), of its own prompt
        # for every real token; padded queries are never read.
        geometry = pass_geometry(freqs, width, torch.zeros_like(lengths))
        hidden, k, v = run_pass(self.shape, w, ids, geometry, freqs, fused=self.kernels is not None)
        for layer in range(len(w.layers)):
            keys[layer].append(k[layer].transpose(1, 2))      # [B, kv, S, D]
            values[layer].append(v[layer].transpose(1, 2))
        last = hidden[torch.arange(len(chunk), device=device), lengths - 1]   # [B, E]
        return last.float() @ w.head.t()

    def _window(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Mistral's sliding window: a query sees only the last `sliding_window` positions."""
        if self.shape.sliding_window is None:
            return allowed
        return allowed & (query_pos - key_pos < self.shape.sliding_window)

    def _decode(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                freqs: torch.Tensor) -> torch.Tensor:
        """One token for each of the front slots: tokens [live] at positions [live] (their cache lengths).
        Writes their keys/values and returns fp32 next-token logits [live, V]."""
        live = tokens.shape[0]
        cache.reserve(int(positions.max()) + 1)
        if self.kernels is not None and cache.keys_last:
            return self._decode_fused(w, cache, tokens, positions, freqs)
        key_pos = torch.arange(cache.capacity, device=tokens.device)
        allowed = self._window(key_pos[None, :] <= positions[:, None], positions[:, None], key_pos[None, :])
        bias = additive_mask(allowed, cache.v[0].dtype)[:, None, None, :]   # [live, 1, 1, capacity]
        slots = torch.arange(live, device=tokens.device)

        def attend(layer: int, q, k, v):
            cache.write(layer, k[:, 0], v[:, 0], slots, positions)
            out = attention(q.transpose(1, 2), cache.k[layer][:live], cache.v[layer][:live], bias,
                            keys_last=cache.keys_last)   # [live, H, 1, D]
            return out.reshape(live, 1, -1)

        hidden = decoder_layers(
            self.shape, w, F.embedding(tokens[:, None], w.embed), freqs[positions][:, None, None, :], attend
        )
        return hidden[:, 0].float() @ w.head.t()

    def _decode_fused(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                      freqs: torch.Tensor) -> torch.Tensor:
        """`_decode` as one call of the fused CPU kernel per layer (csrc/decode.cpp: the same
        operations as `decoder_layers` and `attention`, each row attending to its keys up to its
        position; the projections against weights packed once per `DecoderWeights`)."""
        shape, x = self.shape, F.embedding(tokens, w.embed)     # x [live, E], updated in place by each layer
        rot = torch.view_as_real(freqs[positions])              # [live, D/2, 2]: each row's (cos, sin) per pair
        for index, (lw, packed) in enumerate(zip(w.layers, w.packed(self.kernels), strict=True)):
            self.kernels.decode_layer(x, lw.input_norm, packed.qkv, lw.qkv_bias, lw.q_norm, lw.k_norm, packed.o,
                                      lw.o_bias, lw.post_norm, packed.gate_up, packed.down, rot, cache.k[index],
                                      cache.v[index], positions, shape.num_heads, w.eps, shape.sliding_window or 0)
        return rms_norm(x, w.final_norm, w.eps).float() @ w.head.t()


@dataclass
class RowContext:
    """What a finished turn leaves for the row's next turn (`DecodeSession.extend`): a multi-turn
    trajectory (prompt, model turn, observation, model turn, ...) goes on without re-prefilling."""

    ids: list[int]                        # every token so far: prompt, all turns and observations, this turn's last
    keys: list[torch.Tensor] | None       # per layer [kv_heads, cached, head_dim] of ids[:cached] (None: not kept)
    values: list[torch.Tensor] | None     # per layer [kv_heads, cached, head_dim]
    cached: int                           # positions stored: len(ids) - 1 (the last sampled token is not cached yet)
    key: int                              # the row's sampling stream (`keyed_uniforms`)
    drawn: int                            # draws taken from it so far (all turns): the next turn's first counter
    version: int                          # the weight version that computed keys/values


@dataclass
class FinishedRow:
    """One completed sample of a `DecodeSession` (of an extended row: its latest turn only)."""

    tag: Any                    # the caller's label, given to `add` or `extend`
    tokens: torch.Tensor        # [L] long, eos (or the token completing a stop string) included
    logprobs: torch.Tensor      # [L] float, sampler log-prob of each token
    versions: torch.Tensor      # [L] long, the weight version that sampled each token
    truncated: bool             # no stop within max_new_tokens
    context: RowContext | None = None   # with `keep_context`: what `extend` continues from


@dataclass
class PromptBlock:
    """Prompts prefilled together: their keys/values per layer [P, kv_heads, width, D]."""

    prompt_ids: list[list[int]]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class WaitingRow:
    """A sample whose first token is drawn (from its prompt's prefill) and that waits for a cache slot."""

    tag: Any
    block: PromptBlock
    prompt: int                 # its prompt's index in the block
    token: int
    logprob: float
    version: int
    key: int                    # its sampling stream (`keyed_uniforms`)
    drawn: int = 0              # draws of that stream before this turn (earlier turns of an extended row)


class DecodeSession:
    """Rows decoding in `slots` cache slots; the live slots are always 0..live-1.

    `add` prefills prompts once each and draws every sample's first token; the
    samples wait for a slot. Each `step` admits waiting rows into free slots,
    retires rows that ended (their slots go to waiting rows: continuous
    batching; with nobody waiting the live slots are packed to the front, so
    the decoded batch shrinks) and decodes one token of every live row.
    `NativeEngine.generate` is one `add` and steps until the session is empty;
    the asynchronous loop keeps adding prompts while it steps.

    `reload` takes new weights mid-generation (AReaL's interruptible rollout,
    arXiv 2505.24298 sec. 4.1): the keys/values the old weights computed are
    recomputed with the new ones, and later tokens are sampled by the new
    weights; every token records the version that sampled it.

    Multi-turn rows: with `keep_context` each finished row carries its
    `RowContext` (its ids, the keys/values of its slot, its stream and draws),
    and `extend` continues it with observation tokens and a new model turn.
    The decoder runs only over the new tokens, attending to the stored
    keys/values (`continuation`); where those cannot be used (not kept,
    computed by older weights, a sliding window) or `continuation` is off,
    the whole sequence is prefilled again, with the same numbers.

    A session is not thread-safe: `add`, `extend`, `step` and `reload` are
    called from one thread (or under one lock).
    """

    def __init__(self, engine: NativeEngine, params: SamplingParams, slots: int,
                 generator: torch.Generator | None, version: int, keep_context: bool = False):
        self.engine, self.params, self.count, self.generator, self.version = engine, params, slots, generator, version
        self.keep_context = keep_context
        self.continuation = True    # False: `extend` prefills the whole sequence again (the baseline)
        self.model = base_model(engine.policy.model)
        self.device = self.model.device
        self.weights = DecoderWeights.of(self.model)
        self.eos = torch.tensor(engine.policy.eos_token_ids, device=self.device)
        self.waiting: deque[WaitingRow] = deque()
        self.cache: KVCache | None = None
        self.freqs: torch.Tensor | None = None
        self.live = 0
        max_new, d = params.max_new_tokens, self.device
        self.tokens = torch.zeros(slots, max_new, dtype=torch.long, device=d)       # each slot's tokens so far
        self.logprobs = torch.zeros(slots, max_new, dtype=torch.float32, device=d)
        self.versions = torch.zeros(slots, max_new, dtype=torch.long, device=d)
        self.keys = torch.zeros(slots, dtype=torch.long, device=d)       # its sampling stream
        self.last = torch.zeros(slots, dtype=torch.long, device=d)       # its newest token (not yet cached)
        self.length = torch.zeros(slots, dtype=torch.long, device=d)     # positions in its cache
        self.generated = torch.zeros(slots, dtype=torch.long, device=d)  # its tokens so far (the last not yet cached)
        self.drawn = torch.zeros(slots, dtype=torch.long, device=d)      # its stream's draws before this turn
        self.tags: list[Any] = [None] * slots
        self.prompts: list[list[int]] = [[] for _ in range(slots)]

    @property
    def busy(self) -> bool:
        return bool(self.live or self.waiting)

    @property
    def rows(self) -> int:
        """Samples in the session: decoding or waiting for a slot."""
        return self.live + len(self.waiting)

    @torch.no_grad()   # whichever thread calls it: grad mode is per thread
    def add(self, prompt_ids: list[list[int]], group_size: int, tags, group_keys: torch.Tensor | None = None) -> None:
        """`group_size` samples of each prompt; sample j of prompt i is labelled tags[i * group_size + j].
        `group_keys` [P]: each prompt's sampling key; default one draw per prompt, in order, from the
        session's generator (torch's global one when it has none)."""
        tags = list(tags)
        if group_keys is None:
            group_keys = draw_group_keys(len(prompt_ids), self.generator)
        keys = row_keys(group_keys.to(torch.long), group_size)
        self._make_room(max(len(p) for p in prompt_ids))
        block, logits = self._prefill(prompt_ids)
        first, first_lp = self._sample(logits.repeat_interleave(group_size, dim=0), keys, torch.zeros_like(keys))
        for r, (token, logprob, key) in enumerate(zip(first.tolist(), first_lp.tolist(), keys.tolist(), strict=True)):
            self.waiting.append(WaitingRow(tags[r], block, r // group_size, token, logprob, self.version, key))

    @torch.no_grad()   # whichever thread calls it: grad mode is per thread
    def step(self) -> list[FinishedRow]:
        """Admit, retire the rows that ended, decode one token of each live row; the rows that ended."""
        finished: list[FinishedRow] = []
        self._admit(torch.arange(self.live, min(self.count, self.live + len(self.waiting)), device=self.device))
        admitted = True
        while admitted and self.live:   # a newly admitted row may end on its first token
            live = self.live
            g = self.generated[:live]
            stopped = torch.isin(self.last[:live], self.eos)
            if self.params.stop:
                stopped |= self.engine._stop_strings(self.tokens[:live], g, self.params.stop)
            done = (stopped | (g >= self.params.max_new_tokens)).nonzero().squeeze(1)
            if not len(done):
                break
            # One gather per field (a copy: the slots are about to be reused), then views of its rows.
            tokens, logprobs, versions = (state[done].cpu() for state in (self.tokens, self.logprobs, self.versions))
            for i, (slot, n, stop) in enumerate(
                zip(done.tolist(), g[done].tolist(), stopped[done].tolist(), strict=True)
            ):
                context = self._context(slot, tokens[i, :n].tolist()) if self.keep_context else None
                finished.append(FinishedRow(self.tags[slot], tokens[i, :n], logprobs[i, :n], versions[i, :n],
                                            truncated=not stop, context=context))
            admitted = self._retire(done)
        if self.live:
            live = self.live
            g, pos = self.generated[:live], self.length[:live]
            logits = self.engine._decode(self.weights, self.cache, self.last[:live], pos, self.freqs)
            self.length[:live] += 1
            token, logprob = self._sample(logits, self.keys[:live], g + self.drawn[:live])
            rows = torch.arange(live, device=self.device)
            self.tokens[rows, g], self.logprobs[rows, g], self.versions[rows, g] = token, logprob, self.version
            self.last[:live] = token
            self.generated[:live] += 1
        return finished

    def _context(self, slot: int, tokens: list[int]) -> RowContext:
        """The row in `slot` that just ended its turn (`tokens`), for `extend`: its keys/values copied out
        of the cache before the slot is refilled or packed."""
        cached, cache, layers = int(self.length[slot]), self.cache, range(len(self.cache.v))
        # Copies (`contiguous()` of a slot that fills the cache would be a view of it).
        dense = torch.contiguous_format
        return RowContext(
            ids=self.prompts[slot] + tokens,
            keys=[cache.keys(layer)[slot, :, :cached].clone(memory_format=dense) for layer in layers],
            values=[cache.v[layer][slot, :, :cached].clone(memory_format=dense) for layer in layers],
            cached=cached, key=int(self.keys[slot]), drawn=int(self.drawn[slot]) + len(tokens), version=self.version,
        )

    @torch.no_grad()
    def extend(self, context: RowContext, tokens: list[int], tag) -> None:
        """Continue a finished row (its `context`) with `tokens` (an observation; may be empty) and a
        new model turn, labelled `tag`; the row waits for a slot like an added one. Its first
        token is drawn here, at draw `context.drawn` of its stream, so a turn never reuses the
        uniforms of an earlier one."""
        ids = context.ids + list(tokens)     # past `cached`: at least the last turn's last token
        self._make_room(len(ids))
        reuse = (self.continuation and context.keys is not None and context.version == self.version
                 and self.engine.shape.sliding_window is None)
        block, logits = self._continue(context, ids) if reuse else self._prefill([ids])
        key, drawn = torch.tensor([context.key]), torch.tensor([context.drawn])
        token, logprob = self._sample(logits, key.to(self.device), drawn.to(self.device))
        self.waiting.append(WaitingRow(tag, block, 0, int(token[0]), float(logprob[0]), self.version, context.key,
                                       context.drawn))

    def _continue(self, context: RowContext, ids: list[int]) -> tuple[PromptBlock, torch.Tensor]:
        """The decoder over ids[cached:] alone, attending to the stored keys/values as a prefix
        (`run_pass`'s shared-prompt geometry, pos0 = pre_len = cached): the block of the whole
        sequence's keys/values [1, kv, len(ids), D] and the next-token logits [1, V]."""
        engine, d, cached = self.engine, self.device, context.cached
        new = torch.tensor(ids[cached:], dtype=torch.long, device=d)[None]             # [1, S]
        # run_pass reads prefixes token-major, [P, Lp, kv, D]
        prefix = ([k.transpose(0, 1)[None].contiguous() for k in context.keys],
                  [v.transpose(0, 1)[None].contiguous() for v in context.values])
        at = torch.tensor([cached], device=d)
        geometry = pass_geometry(self.freqs, new.shape[1], at, torch.zeros_like(at), at)
        hidden, k, v = run_pass(engine.shape, self.weights, new, geometry, self.freqs, prefix,
                                fused=engine.kernels is not None)
        keys = [torch.cat([old[None], nk.transpose(1, 2)], dim=2) for old, nk in zip(context.keys, k, strict=True)]
        values = [torch.cat([old[None], nv.transpose(1, 2)], dim=2) for old, nv in zip(context.values, v, strict=True)]
        return PromptBlock([ids], keys, values), hidden[:, -1].float() @ self.weights.head.t()

    def _sample(
        self, logits: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and sampler log-probs of logits [B, V] at draw `counters` of streams `keys`:
        `sample_tokens` with `keyed_uniforms`, or the fused CPU op for unfiltered sampling."""
        params, kernels = self.params, self.engine.kernels
        if kernels is None or params.top_k or params.top_p < 1.0 or logits.device.type != "cpu":
            return sample_tokens(logits, params, uniforms=keyed_uniforms(keys, counters))
        tokens, logprobs = torch.empty(len(logits), dtype=torch.long), torch.empty(len(logits))
        kernels.sample(tokens, logprobs, logits.contiguous(), 0.0 if params.greedy else params.temperature,
                       keys.contiguous(), counters.contiguous())
        return tokens, logprobs

    @torch.no_grad()   # whichever thread calls it: grad mode is per thread
    def reload(self, version: int) -> None:
        """Continue with the model's current weights, labelled `version` (interrupt and recompute)."""
        self.weights, self.version = DecoderWeights.of(self.model), version
        for block in {id(w.block): w.block for w in self.waiting}.values():
            fresh, _ = self._prefill(block.prompt_ids)
            block.keys, block.values = fresh.keys, fresh.values
        if self.live:
            live = self.live
            # Each live row's prompt and tokens but the last (not yet cached), prefilled as one sequence.
            sequences = [self.prompts[s] + self.tokens[s, : int(self.generated[s]) - 1].tolist() for s in range(live)]
            self.cache.reserve(max(len(q) for q in sequences))
            block, _ = self._prefill(sequences)
            rows = torch.arange(live, device=self.device)
            self.cache.fill(rows, block.keys, block.values, rows)

    def _make_room(self, prompt_len: int) -> None:
        """The cache and rotary table for prompts of `prompt_len` tokens: made afresh when the session is
        empty (sized as for one `generate` call), raised otherwise."""
        longest = prompt_len + self.params.max_new_tokens
        if self.cache is None or not self.busy:
            spare = self.cache or self.engine._spare
            self.cache = KVCache(len(self.weights.layers), self.count, self.engine.shape, initial=prompt_len + 64,
                                 limit=longest, dtype=self.model.dtype, device=self.device, reuse=spare)
            self.freqs = rotary_factors(self.model, self.engine.shape, longest)
        elif longest > len(self.freqs):   # (the cache's limit may already be past it: its BLAS floor)
            self.cache.limit = max(self.cache.limit, longest)
            self.freqs = rotary_factors(self.model, self.engine.shape, longest)

    def _prefill(self, prompt_ids: list[list[int]]) -> tuple[PromptBlock, torch.Tensor]:
        keys, values, logits = self.engine._prefill(self.weights, prompt_ids, self.freqs)
        return PromptBlock(prompt_ids, keys, values), logits

    def _admit(self, into: torch.Tensor) -> None:
        """Start waiting rows in the free slots `into`."""
        if not len(into):
            return
        rows = [self.waiting.popleft() for _ in range(len(into))]
        # An extended row's context may be longer than the slots have room for yet.
        self.cache.reserve(max(w.block.values[0].shape[2] for w in rows))
        for block in {id(w.block): w.block for w in rows}.values():
            mine = [i for i, w in enumerate(rows) if w.block is block]
            prompts = torch.tensor([rows[i].prompt for i in mine], dtype=torch.long, device=self.device)
            self.cache.fill(into[mine], block.keys, block.values, prompts)
        for slot, w in zip(into.tolist(), rows, strict=True):
            self.tags[slot], self.prompts[slot] = w.tag, w.block.prompt_ids[w.prompt]
        d = self.device
        self.tokens[into, 0] = self.last[into] = torch.tensor([w.token for w in rows], device=d)
        self.logprobs[into, 0] = torch.tensor([w.logprob for w in rows], device=d)
        self.versions[into, 0] = torch.tensor([w.version for w in rows], device=d)
        self.keys[into] = torch.tensor([w.key for w in rows], dtype=torch.long, device=d)
        self.drawn[into] = torch.tensor([w.drawn for w in rows], dtype=torch.long, device=d)
        self.length[into] = torch.tensor([len(w.block.prompt_ids[w.prompt]) for w in rows], device=d)
        self.generated[into] = 1
        self.live = max(self.live, int(into.max()) + 1)

    def _retire(self, done: torch.Tensor) -> bool:
        """Free the live slots `done`: refill what the queue allows, pack the rest away.
        Returns whether rows were admitted (they may need checking before they decode)."""
        refill, rest = done[: len(self.waiting)], done[len(self.waiting):]
        if len(refill):
            self._admit(refill)
        if len(rest):
            keep = torch.ones(self.live, dtype=torch.bool, device=done.device)
            keep[rest] = False
            live = int(keep.sum())
            holes = (~keep[:live]).nonzero().squeeze(1)
            movers = keep[live:].nonzero().squeeze(1) + live
            if len(holes):
                self.cache.move(holes, movers)
                for state in (self.tokens, self.logprobs, self.versions, self.keys,
                              self.last, self.length, self.generated, self.drawn):
                    state[holes] = state[movers]
                for h, m in zip(holes.tolist(), movers.tolist(), strict=True):
                    self.tags[h], self.prompts[h] = self.tags[m], self.prompts[m]
            self.live = live
        return bool(len(refill))


def rows_to_rollout(rows: list[FinishedRow], prompt_ids: list[list[int]], group_size: int, tokenizer,
                    policy_version: int) -> Rollout:
    """Finished rows, in order (row r is sample r % G of prompt r // G): single-turn trajectories,
    collated into the right-padded batch view."""
    trajectories = [
        Trajectory(prompt_ids=tuple(ids), segments=(Segment.sampled(row.tokens, row.logprobs, row.versions),),
                   truncated=row.truncated, group=r // group_size)
        for r, (row, ids) in enumerate(zip(rows, prompt_ids, strict=True))
    ]
    return collate(trajectories, tokenizer.pad_token_id or 0, policy_version,
                   lambda ids: tokenizer.batch_decode(ids, skip_special_tokens=True))
