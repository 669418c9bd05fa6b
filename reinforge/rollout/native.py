"""The native rollout engine: KV-cache decoding with continuous batching for
Llama-family decoders (Llama, Qwen2, Qwen3, Mistral). This module owns the
engine (`NativeEngine`: `generate`, its prefill and decode passes); the rows it
decodes are scheduled by its decoding session (`rollout.session.DecodeSession`),
the decoder forward is `models.decoder`, the cache `rollout.kv_cache`, the
sampling and its random streams `rollout.sampling`.

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
the learner's recomputed log-probs (fp32) within 1e-4 (tests/unit/rollout/test_native_engine.py).
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F

from reinforge.kernels import HEAD_DIMS, load_cpu_kernels, rms_norm
from reinforge.models import Policy
from reinforge.models.attention import additive_mask, attention
from reinforge.models.decoder import DecoderWeights, decoder_layers, decoder_shape, run_pass
from reinforge.models.lora import base_model
from reinforge.models.positions import pass_geometry
from reinforge.models.quantize import quantize_weights
from reinforge.models.replay import ActivationRecord, Lent, PromptRecord, RecordBuffer, RecordShape
from reinforge.rollout.base import Rollout, SamplingParams
from reinforge.rollout.kv_cache import KVCache
from reinforge.rollout.prompts import encode_prompts
from reinforge.rollout.rows import FinishedRow, LoopRows, rows_to_rollout
from reinforge.rollout.sampling import kernel_sampling
from reinforge.rollout.session import DecodeSession
from reinforge.rollout.stopping import stop_string_end

log = logging.getLogger(__name__)

# The most memory a generation's activation record may take (`keep_activations`): beyond it the learner runs its own
# forward. The built-in model's RL batches keep 30-60 MB.
RECORD_BYTES = 512 << 20


class NativeEngine:
    """Batched KV-cache sampling with continuous batching (see the module docstring).

    `max_batch_rows` bounds the rows decoded at once (the cache's slots);
    None decodes all rows of a call at once. `prefill_tokens` bounds the
    prompt tokens of one prefill forward.
    """

    def __init__(self, policy: Policy, chat_template: str = "auto", max_batch_rows: int | None = None,
                 prefill_tokens: int = 16384, cpu_kernels: bool = True, quantization: str = "none",
                 quantize_lm_head: bool = False, cuda_graphs: bool = True):
        self.policy = policy
        # The sampler's weight precision (rollout.quantization, models/quantize.py); the learner stays fp32.
        self.quantization, self.quantize_lm_head = quantization, quantize_lm_head
        self.chat_template = chat_template
        self.max_batch_rows = max_batch_rows
        self.prefill_tokens = prefill_tokens
        # On CPU the cache's memory is kept for the next call: a fresh multi-MB cache per call went
        # back to the OS in between, and faulting it in again cost ~5% of a rollout here. (GPU
        # allocators keep freed blocks themselves, and the learner may need them.)
        self._spare: KVCache | None = None
        # Likewise the packed panels and fused projections of a finished session's weights, which the next
        # session's weights are written into (`DecoderWeights.reusable`): a 0.5B model's are ~2.4 GB of fresh pages
        # at every call otherwise.
        self._spare_panels: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._lent: Lent | None = None   # the weights of the last activation record, lent to its learner
        # Set by the RL loop where its learner can use them: single-turn generations decoded in one call keep every
        # layer's activations of the tokens they read (models/replay.py), in one buffer reused from call to call.
        self.keep_activations = False
        self._records: RecordBuffer | None = None
        self._prompt_record: tuple[weakref.ref, PromptRecord] | None = None   # the last prefill's, and its weights
        # Fail at construction, before any run starts: an unsupported shape or layer type raises here.
        self.shape = decoder_shape(policy.model)
        weights = self.decoder_weights()
        # MoE layers: how many, and their experts per token (the routing record's shape, `routes`).
        self.moe_layers = sum(lw.moe is not None for lw in weights.layers)
        self.top_k = max((lw.moe.top_k for lw in weights.layers if lw.moe is not None), default=0)
        # Decoding on CPU in fp32 with SwiGLU MLPs: the fused layer kernel where it builds, else None.
        model = base_model(policy.model)
        fusable = (cpu_kernels and not self.moe_layers and model.device.type == "cpu" and model.dtype == torch.float32
                   and self.shape.head_dim in HEAD_DIMS
                   and getattr(model.config, "hidden_act", None) in ("silu", "swish"))
        self.kernels = load_cpu_kernels() if fusable else None
        # On CUDA the decode step replays CUDA graphs (rollout/graphs.py): "capture", or None (eager).
        # Tests set "eager" to run the graphs' bucketed step without capturing it (any device).
        self.graph_mode: str | None = (
            "capture" if cuda_graphs and model.device.type == "cuda" and not self.moe_layers
            and quantization == "none" else None)

    def disable_graphs(self, reason: str) -> None:
        """Decode eagerly from now on: a CUDA graph failed or disagreed with the eager step (`reason`)."""
        if self.graph_mode is not None:
            log.warning("native engine: CUDA graphs of the decode step are off, decoding eagerly: %s", reason)
        self.graph_mode = None

    @torch.no_grad()
    def generate(self, prompts: list[str], group_size: int, params: SamplingParams, policy_version: int = 0,
                 generator: torch.Generator | None = None, group_keys: torch.Tensor | None = None) -> Rollout:
        """`group_size` samples of each prompt. Each prompt's samples draw from a stream keyed by one
        int64 (`group_keys` [P], default one draw per prompt from `generator`, else torch's global
        generator): a prompt's samples depend on its key alone, not on the other prompts of the call."""
        prompt_ids = encode_prompts(self.policy.tokenizer, prompts, self.chat_template)
        return self.generate_ids(prompt_ids, group_size, params, policy_version, generator, group_keys)

    @torch.no_grad()
    def generate_ids(self, prompt_ids: list[list[int]], group_size: int, params: SamplingParams,
                     policy_version: int = 0, generator: torch.Generator | None = None,
                     group_keys: torch.Tensor | None = None) -> Rollout:
        """`generate` of prompts given as token ids (as HFEngine.generate_ids): a context that ends inside
        an answer, e.g. a solution's first steps to be continued (rewards/shepherd.py)."""
        tokenizer = self.policy.tokenizer
        n_rows = len(prompt_ids) * group_size
        session = self.session(params, slots=min(n_rows, self.max_batch_rows or n_rows), generator=generator,
                               version=policy_version)
        session.add(prompt_ids, group_size, tags=range(n_rows), group_keys=group_keys)
        rows: list[FinishedRow | None] = [None] * n_rows
        for row in session.run():
            rows[row.tag] = row
        self.release(session)
        return rows_to_rollout(rows, [ids for ids in prompt_ids for _ in range(group_size)], group_size,
                               tokenizer, policy_version, exact=self.exact_logprobs(params))

    def exact_logprobs(self, params: SamplingParams) -> bool:
        """Whether the log-probs this engine samples with under `params` are the learner's own to float rounding
        (`Rollout.logprobs_exact`): the live model's fp32 weights, unquantised, the whole tempered softmax (the
        learner's log-probs are of that, not of a top-k / top-p / min-p subset or the greedy argmax), and no MoE
        router, whose near-ties could send a token to other experts than the learner's forward does."""
        return (self.quantization == "none" and base_model(self.policy.model).dtype == torch.float32
                and not self.moe_layers and not params.greedy and not params.truncates)

    def _record_shape(self, w: DecoderWeights) -> RecordShape | None:
        """A record row of weights `w` where this engine keeps records (`keep_activations`, the CPU kernels), and
        the learner's fused passes run its layers (`kernels.fused_layer_ok`'s); else None."""
        if not (self.keep_activations and self.kernels is not None):
            return None
        if any(lw.q_norm is not None or lw.act is not None for lw in w.layers):
            return None
        return RecordShape(hidden=w.embed.shape[1], heads=self.shape.num_heads, kv_heads=self.shape.num_kv_heads,
                           head_dim=self.shape.head_dim, intermediate=w.layers[0].gate_up.shape[0] // 2)

    def activation_record(self, w: DecoderWeights, key: tuple, rows: int, params: SamplingParams
                          ) -> ActivationRecord | None:
        """The record a one-call decoding of `rows` fresh rows with weights `w` (the model's at `weights_key` `key`)
        keeps its activations in (`keep_activations`; its rows are slots 0..rows-1), the buffer's generation bumped
        (a record of the generation before no longer matches); None where the learner could not use them (no CPU
        kernels, log-probs not the learner's own, layers the learner's fused passes do not run, over RECORD_BYTES)."""
        shape = self._record_shape(w)
        if shape is None or not self.exact_logprobs(params):
            return None
        size = (len(w.layers), rows, max(params.max_new_tokens - 1, 1), shape.width)
        if size[0] * size[1] * size[2] * size[3] * 4 > RECORD_BYTES:
            return None
        if self._records is None or tuple(self._records.data.shape) != size:
            self._records = RecordBuffer(torch.empty(size))
        self._records.generation += 1
        made, prompts = self._prompt_record or (None, None)
        self._lent = Lent(w)
        return ActivationRecord(self._records, self._records.generation, torch.arange(rows), shape, key,
                                prompts if made is not None and made() is w else None, self._lent)

    def decoder_weights(self) -> DecoderWeights:
        """The weights this engine samples with: the live model's (`DecoderWeights.of`), quantised as
        `rollout.quantization` says, taken afresh by every session (each call sees the latest step)."""
        if self._lent is not None:   # the last record's weights are written over from here on
            self._lent.weights = None
            self._lent = None
        spare, self._spare_panels = self._spare_panels, {}
        weights = quantize_weights(DecoderWeights.of(self.policy.model, spare=spare), self.quantization,
                                   self.quantize_lm_head)
        weights.spare_panels = spare
        return weights

    def release(self, session: DecodeSession) -> None:
        """A finished session's cache memory and packed panels are kept for the next one (on CPU; see `_spare`).
        The session is not used after this."""
        if self.policy.model.device.type == "cpu":
            self._spare = session.cache
            self._spare_panels = session.weights.reusable()

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

    def _prefill(self, w: DecoderWeights, prompt_ids: list[list[int]], freqs: torch.Tensor,
                 routes: list[torch.Tensor] | None = None):
        """Each prompt once: its keys/values per layer ([P, kv_heads, width, D], right-padded) and the
        fp32 logits of its next token [P, V]. `routes`: gets each chunk's MoE experts [B, width, layers, k]."""
        width = max(len(p) for p in prompt_ids)
        rows_per_pass = max(1, self.prefill_tokens // width)
        keys: list[list[torch.Tensor]] = [[] for _ in w.layers]
        values: list[list[torch.Tensor]] = [[] for _ in w.layers]
        # Where the decoding may keep a record, the prefill keeps its pass (one chunk) for the learner's prompt pass
        # (models/replay.py, `PromptRecord`), until the next prefill.
        shape = self._record_shape(w)
        keep = [] if (shape is not None and len(prompt_ids) <= rows_per_pass
                      and len(w.layers) * len(prompt_ids) * width * shape.width * 4 <= RECORD_BYTES) else None
        self._prompt_record = None
        logits = [
            self._prefill_chunk(w, prompt_ids[start : start + rows_per_pass], width, keys, values, freqs, routes, keep)
            for start in range(0, len(prompt_ids), rows_per_pass)
        ]
        if keep and len(keep) == len(w.layers):
            self._prompt_record = (weakref.ref(w), PromptRecord(keep, {tuple(p): i for i, p in enumerate(prompt_ids)},
                                                                width))
        return [torch.cat(k) for k in keys], [torch.cat(v) for v in values], torch.cat(logits)

    def _prefill_chunk(self, w: DecoderWeights, chunk: list[list[int]], width: int, keys: list[list[torch.Tensor]],
                       values: list[list[torch.Tensor]], freqs: torch.Tensor,
                       routes: list[torch.Tensor] | None = None, keep: list | None = None) -> torch.Tensor:
        """Prefill prompts right-padded to `width`, appending each layer's keys/values; next-token logits [B, V].
        `keep`: gets each layer's activations (`run_pass`)."""
        device = w.head.device
        ids = torch.full((len(chunk), width), self.policy.tokenizer.pad_token_id or 0, dtype=torch.long, device=device)
        lengths = torch.tensor([len(p) for p in chunk], device=device)
        for i, p in enumerate(chunk):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        # Right padding: query i sees keys j <= i (within the sliding window, if any), of its own prompt
        # for every real token; padded queries are never read.
        geometry = pass_geometry(freqs, width, torch.zeros_like(lengths))
        layer_routes: list[torch.Tensor] | None = [] if routes is not None and self.moe_layers else None
        hidden, k, v = run_pass(self.shape, w, ids, geometry, freqs, fused=self.kernels is not None,
                                routes=layer_routes, use="engine", keep=keep)
        if layer_routes is not None:
            routes.append(torch.stack(layer_routes, dim=2))           # [B, width, layers, k]
        for layer in range(len(w.layers)):
            keys[layer].append(k[layer].transpose(1, 2))      # [B, kv, S, D]
            values[layer].append(v[layer].transpose(1, 2))
        last = hidden[torch.arange(len(chunk), device=device), lengths - 1]   # [B, E]
        return self.head_logits(w, last)

    def head_logits(self, w: DecoderWeights, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 next-token logits [R, V] of final hidden states [R, E]: through the CPU kernels' packed head
        when they are loaded (`DecoderWeights.packed_logits`), else `DecoderWeights.logits`."""
        return w.logits(hidden) if self.kernels is None else w.packed_logits(self.kernels, hidden)

    def _window(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Mistral's sliding window: a query sees only the last `sliding_window` positions."""
        if self.shape.sliding_window is None:
            return allowed
        return allowed & (query_pos - key_pos < self.shape.sliding_window)

    def _decode(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                freqs: torch.Tensor, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One token for each of the front slots: tokens [live] at positions [live] (their cache lengths).
        Writes their keys/values and returns fp32 next-token logits [live, V]. `routes`: each MoE layer
        appends the experts [live, 1, k] of these tokens."""
        cache.reserve(int(positions.max()) + 1)
        if self.kernels is not None and cache.keys_last:
            return self._decode_fused(w, cache, tokens, positions, freqs)
        return self._decode_rows(w, cache, tokens, positions, freqs[positions], routes)

    def _decode_rows(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                     rot: torch.Tensor, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`_decode` through `decoder_layers` with the cache already large enough and the rows' rotary
        factors `rot` [live, D/2]: no host synchronisation (a CUDA graph's body, rollout/graphs.py)."""
        live = tokens.shape[0]
        key_pos = torch.arange(cache.capacity, device=tokens.device)
        allowed = self._window(key_pos[None, :] <= positions[:, None], positions[:, None], key_pos[None, :])
        bias = additive_mask(allowed, cache.v[0].dtype)[:, None, None, :]   # [live, 1, 1, capacity]
        slots = torch.arange(live, device=tokens.device)

        def attend(layer: int, q, k, v):
            cache.write(layer, k[:, 0], v[:, 0], slots, positions)
            out = attention(q.transpose(1, 2), cache.k[layer][:live], cache.v[layer][:live], bias,
                            keys_last=cache.keys_last)   # [live, H, 1, D]
            return out.reshape(live, 1, -1)

        hidden = decoder_layers(self.shape, w, F.embedding(tokens[:, None], w.embed), rot[:, None, None, :], attend,
                                routes)
        return self.head_logits(w, hidden[:, 0])

    def _decode_fused(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                      freqs: torch.Tensor) -> torch.Tensor:
        """`_decode` as one call of the fused CPU kernel per layer (csrc/decode.cpp: the same
        operations as `decoder_layers` and `attention`, each row attending to its keys up to its
        position; the projections against weights packed once per `DecoderWeights`)."""
        shape, x = self.shape, F.embedding(tokens, w.embed)     # x [live, E], updated in place by each layer
        rot = torch.view_as_real(freqs[positions])              # [live, D/2, 2]: each row's (cos, sin) per pair
        for index, (lw, packed) in enumerate(zip(w.layers, w.packed(self.kernels, use="engine"), strict=True)):
            self.kernels.decode_layer(x, lw.input_norm, packed.qkv, lw.qkv_bias, lw.q_norm, lw.k_norm, packed.o,
                                      lw.o_bias, lw.post_norm, packed.gate_up, packed.down, rot, cache.k[index],
                                      cache.v[index], positions, shape.num_heads, w.eps, shape.sliding_window or 0)
        return self.head_logits(w, rms_norm(x, w.final_norm, w.eps))

    def _decode_sample(self, w: DecoderWeights, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
                       freqs: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor,
                       params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
        """`_decode_fused` and the session's sampling (the fused `sample`: no top-k / min-p) as one call of the CPU
        kernels (csrc/step.cpp, `decode_step`): the same tokens and log-probs [live], bit for bit, without the
        ~30 small torch ops and 6 kernel calls around them (~6% of the built-in model's 64-row generation).
        `keys`, `counters`: each row's stream and draw."""
        cache.reserve(int(positions.max()) + 1)
        token, logprob = torch.empty(len(tokens), dtype=torch.long), torch.empty(len(tokens))
        temperature, top_p = kernel_sampling(params)
        self.kernels.decode_step(token, logprob, tokens, positions, *self._step_model(w, cache, freqs),
                                 temperature, keys, counters, top_p)
        return token, logprob

    def _decode_loop(self, w: DecoderWeights, cache: KVCache, freqs: torch.Tensor, rows: LoopRows,
                     params: SamplingParams, record: torch.Tensor | None = None) -> int:
        """The session's live rows decoded to their ends in one call of the CPU kernels (csrc/step.cpp,
        `decode_loop`): what `_decode_sample` and the session's bookkeeping do step after step, bit for bit,
        with the records written into `rows`' tensors in place, and with `record` [layers, slots, T, width] every
        token's activations (models/replay.py). Returns the steps it ran."""
        live = rows.live
        cache.reserve(int((rows.length[:live] + params.max_new_tokens - rows.generated[:live]).max()))
        temperature, top_p = kernel_sampling(params)
        return self.kernels.decode_loop(rows.tokens, rows.logprobs, rows.last, rows.length, rows.generated, rows.drawn,
                                        rows.keys, rows.eos, params.max_new_tokens, live,
                                        *self._step_model(w, cache, freqs), temperature, top_p, record=record)

    def _step_model(self, w: DecoderWeights, cache: KVCache, freqs: torch.Tensor) -> tuple:
        """The decoder's arguments of the one-call ops (`decode_step`, `decode_loop`), embedding to sliding window."""
        weights = [t for lw, packed in zip(w.layers, w.packed(self.kernels, use="engine"), strict=True)
                   for t in (lw.input_norm, packed.qkv, lw.qkv_bias, lw.q_norm, lw.k_norm, packed.o, lw.o_bias,
                             lw.post_norm, packed.gate_up, packed.down)]
        return (w.embed, weights, cache.k, cache.v, torch.view_as_real(freqs), w.final_norm,
                w.packed_head(self.kernels), w.head.shape[0], self.shape.num_heads, w.eps,
                self.shape.sliding_window or 0)
