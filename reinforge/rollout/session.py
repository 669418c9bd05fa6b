"""The decoding session of the native engine (`DecodeSession`): rows sampled in the slots of one key/value
cache, with continuous batching, multi-turn continuation and interruptible weight updates, and the records
it hands back (`FinishedRow`, rollout/rows.py).

The prefill and decode passes themselves are the engine's (`rollout.native.NativeEngine`), which a
session reads through the interface `rollout.passes.DecodePasses`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from reinforge.models.lora import base_model
from reinforge.models.positions import rotary_factors
from reinforge.models.replay import ActivationRecord, weights_key
from reinforge.rollout.base import SamplingParams
from reinforge.rollout.continuation import continue_rows
from reinforge.rollout.graphs import DecodeGraphs
from reinforge.rollout.kv_cache import KVCache
from reinforge.rollout.passes import DecodePasses
from reinforge.rollout.rows import FinishedRow, LoopRows, PromptBlock, RowContext, WaitingRow, slot_context
from reinforge.rollout.sampling import draw_group_keys, keyed_sample, row_keys, sampler_top_k
from reinforge.rollout.stop_flags import StopFlags


class DecodeSession:
    """Rows decoding in `slots` cache slots; the live slots are always 0..live-1.

    `add` prefills prompts once each and draws every sample's first token; the samples wait for a slot. Each
    `step` admits waiting rows into free slots, retires rows that ended (their slots go to waiting rows:
    continuous batching; with nobody waiting the live slots are packed to the front, so the decoded batch
    shrinks) and decodes one token of every live row. `NativeEngine.generate` is one `add` and one `run` (steps
    until the session is empty); the asynchronous loop keeps adding prompts while it steps.

    `reload` takes new weights mid-generation (AReaL's interruptible rollout, arXiv 2505.24298 sec. 4.1): the
    keys/values the old weights computed are recomputed with the new ones, and later tokens are sampled by the
    new weights; every token records the version that sampled it.

    Multi-turn rows: with `keep_context` each finished row carries its `RowContext` (its ids, the keys/values
    of its slot, its stream and draws), and `extend` continues it with observation tokens and a new model turn.
    The decoder runs only over the new tokens, attending to the stored keys/values (`continuation`); where
    those cannot be used (not kept, computed by older weights, a sliding window) or `continuation` is off, the
    whole sequence is prefilled again, with the same numbers.

    A session is not thread-safe: `add`, `extend`, `step`, `run` and `reload` are called from one thread (or
    under one lock).
    """

    def __init__(self, engine: DecodePasses, params: SamplingParams, slots: int,
                 generator: torch.Generator | None, version: int, keep_context: bool = False):
        self.engine, self.params, self.count, self.generator, self.version = engine, params, slots, generator, version
        self.keep_context = keep_context
        self.continuation = True    # False: `extend` prefills the whole sequence again (the baseline)
        self.model = base_model(engine.policy.model)
        self.device = self.model.device
        self.weights = engine.decoder_weights()
        self.weights_key = weights_key(engine.policy.model)   # the parameters (and versions) `weights` were taken at
        self.eos = torch.tensor(engine.policy.eos_token_ids, dtype=torch.long, device=self.device)
        self.waiting: deque[WaitingRow] = deque()
        self.cache: KVCache | None = None
        self.graphs: DecodeGraphs | None = None    # the decode graphs of this session's weights and cache
        self.freqs: torch.Tensor | None = None
        self.live = 0
        max_new, d = params.max_new_tokens, self.device
        # Each slot's tokens so far; one column more than max_new_tokens, which a row's step past its end
        # writes when its stop is seen a step late (`_step_ahead`).
        self.tokens = torch.zeros(slots, max_new + 1, dtype=torch.long, device=d)
        self.logprobs = torch.zeros(slots, max_new + 1, dtype=torch.float32, device=d)
        self.versions = torch.zeros(slots, max_new + 1, dtype=torch.long, device=d)
        # With params.record_top_k = K: each position's K most likely ids and log-probs (sampling.sampler_top_k)
        k = params.record_top_k
        self.top_ids = torch.zeros(slots, max_new, k, dtype=torch.long, device=d) if k else None
        self.top_logprobs = torch.zeros(slots, max_new, k, dtype=torch.float32, device=d) if k else None
        self.keys = torch.zeros(slots, dtype=torch.long, device=d)       # its sampling stream
        self.last = torch.zeros(slots, dtype=torch.long, device=d)       # its newest token (not yet cached)
        self.length = torch.zeros(slots, dtype=torch.long, device=d)     # positions in its cache
        self.generated = torch.zeros(slots, dtype=torch.long, device=d)  # its tokens so far (the last not yet cached)
        self.drawn = torch.zeros(slots, dtype=torch.long, device=d)      # its stream's draws before this turn
        self.tags: list[Any] = [None] * slots
        self.prompts: list[list[int]] = [[] for _ in range(slots)]
        # MoE routing record (routing replay): each slot's generated tokens' experts [slots, max_new, layers, k]
        # (-1 until the token is decoded) and its prompt's [P, layers, k]; None for a dense model.
        moe = (engine.moe_layers, engine.top_k) if getattr(engine, "moe_layers", 0) else None
        self.routes = None if moe is None else torch.full((slots, max_new, *moe), -1, dtype=torch.long, device=d)
        self.prompt_routes: list[torch.Tensor | None] = [None] * slots
        self._ahead: StopFlags | None = None   # with decode graphs: the last step's stop flags (`_step_ahead`)
        self._kept: ActivationRecord | None = None   # `_finish_live`'s record (by slot) while its rows retire
        self._pinned: list[torch.Tensor] = []

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
        top = self._top(logits)
        for r, (token, logprob, key) in enumerate(zip(first.tolist(), first_lp.tolist(), keys.tolist(), strict=True)):
            mine = None if top is None else (top[0][r // group_size], top[1][r // group_size])
            self.waiting.append(WaitingRow(tags[r], block, r // group_size, token, logprob, self.version, key,
                                           top=mine))

    @torch.no_grad()   # whichever thread calls it: grad mode is per thread
    def run(self) -> list[FinishedRow]:
        """`step` until the session is empty: every row that ended. Once no row waits for a slot, where the step
        is one call of the CPU kernels (`_one_call`) and rows end on tokens alone (no stop strings), the live
        rows are decoded to their ends in one call (`_decode_loop`, csrc/step.cpp): the same records, bit for
        bit, without the session's work in Python between steps (~0.45 ms a step of the built-in model)."""
        finished: list[FinishedRow] = []
        while self.busy:
            if self._loops():
                self._admit(torch.arange(self.live, self.live + len(self.waiting), device=self.device))
                finished += self._finish_live()
            else:
                finished += self.step()
        return finished

    def _loops(self) -> bool:
        """Whether `run` decodes the rows to their ends in one call (see there)."""
        return (self.live + len(self.waiting) <= self.count and self._ahead is None and not self.params.stop
                and getattr(self.engine, "graph_mode", None) is None and self.cache is not None and self._one_call())

    def _finish_live(self) -> list[FinishedRow]:
        """Every live row decoded to its end in one call (`_decode_loop`); the `step` after it retires them all.
        The rows of a fresh single-turn call carry the activations it kept, where the engine keeps them
        (models/replay.py)."""
        live, start = self.live, self.generated[: self.live].clone()
        rows = LoopRows(self.tokens, self.logprobs, self.last, self.length, self.generated, self.drawn, self.keys,
                        self.eos, live)
        fresh = getattr(self.engine, "keep_activations", False) and not self.keep_context and bool((start == 1).all())
        self._kept = self.engine.activation_record(self.weights, self.weights_key, live, self.params) if fresh else None
        self.engine._decode_loop(self.weights, self.cache, self.freqs, rows, self.params,
                                 None if self._kept is None else self._kept.buffer.data)
        column = torch.arange(self.versions.shape[1], device=self.device)
        self.versions[:live][(column >= start[:, None]) & (column < self.generated[:live, None])] = self.version
        finished, self._kept = self.step(), None
        return finished

    @torch.no_grad()   # whichever thread calls it: grad mode is per thread
    def step(self) -> list[FinishedRow]:
        """Admit, retire the rows that ended, decode one token of each live row; the rows that ended."""
        finished: list[FinishedRow] = []
        into = torch.arange(self.live, min(self.count, self.live + len(self.waiting)), device=self.device)
        ahead, self._ahead = self._ahead, None
        if (ahead is not None and not len(into) and self.live == ahead.slots
                and self.cache.capacity >= self.cache.limit):
            return self._step_ahead(ahead)
        self._admit(into)
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
            finished += self._finished_rows(done, g[done].tolist(), stopped[done].tolist())
            admitted = self._retire(done)
        if self.live:
            self._decode_live()
            if self._looks_ahead():
                self._ahead = self._flags()
        return finished

    def _decode_live(self) -> None:
        """One token of every live row, sampled and recorded (no host synchronisation through the graphs)."""
        live = self.live
        g, pos = self.generated[:live], self.length[:live]
        step_routes: list[torch.Tensor] | None = None if self.routes is None else []
        out = self._graph_step(live, g, pos) if getattr(self.engine, "graph_mode", None) else None
        if out is None and self._one_call():
            logits, (token, logprob) = None, self.engine._decode_sample(
                self.weights, self.cache, self.last[:live], pos, self.freqs, self.keys[:live], g + self.drawn[:live],
                self.params)
        elif out is None:
            logits = self.engine._decode(self.weights, self.cache, self.last[:live], pos, self.freqs, step_routes)
            token, logprob = self._sample(logits, self.keys[:live], g + self.drawn[:live])
        else:
            logits, token, logprob = out
        self.length[:live] += 1
        rows = torch.arange(live, device=self.device)
        if step_routes is not None:   # the experts of the token just read, the slot's token g - 1
            self.routes[rows, g - 1] = torch.stack(step_routes, dim=2)[:, 0]
        self.tokens[rows, g], self.logprobs[rows, g], self.versions[rows, g] = token, logprob, self.version
        top = self._top(logits)
        if top is not None:
            self.top_ids[rows, g], self.top_logprobs[rows, g] = top
        self.last[:live] = token
        self.generated[:live] += 1

    def _one_call(self) -> bool:
        """Whether the step decodes and samples in one call of the CPU kernels (`_decode_sample`): the fused
        decoding step and sampler, a dense model, no logits kept (top-K records) and no top-k / min-p filter."""
        params = self.params
        return (self.engine.kernels is not None and self.cache.keys_last and self.routes is None
                and not params.record_top_k and params.top_k == 0 and params.min_p == 0.0)

    def _finished_rows(self, done: torch.Tensor, lengths: list[int], stops: list[bool]) -> list[FinishedRow]:
        """The records of the rows in slots `done` (device), of `lengths` tokens, ended by a stop (`stops`)
        or by max_new_tokens: copies, read before the slots are reused."""
        # One gather per field (a copy: the slots are about to be reused), then each row's tokens as views of
        # its kept positions, split in one op (a slice per row and field was most of this at 256 rows)
        width = max(lengths, default=0)
        kept = (torch.arange(width) < torch.tensor(lengths, dtype=torch.long)[:, None]).flatten()
        tokens, logprobs, versions = (state[done, :width].cpu().flatten()[kept].split(lengths)
                                      for state in (self.tokens, self.logprobs, self.versions))
        top_ids, top_lps = ((None, None) if self.top_ids is None
                            else (self.top_ids[done].cpu(), self.top_logprobs[done].cpu()))
        routes = None if self.routes is None else self.routes[done].cpu()
        finished = []
        for i, (slot, n, stop) in enumerate(zip(done.tolist(), lengths, stops, strict=True)):
            context = self._context(slot, tokens[i].tolist()) if self.keep_context else None
            prompt_routes = self.prompt_routes[slot]
            row_routes = (None if routes is None or prompt_routes is None
                          else torch.cat([prompt_routes.cpu(), routes[i, :n]]))
            finished.append(FinishedRow(self.tags[slot], tokens[i], logprobs[i], versions[i],
                                        truncated=not stop, context=context, routes=row_routes,
                                        top_ids=None if top_ids is None else top_ids[i, :n],
                                        top_logprobs=None if top_lps is None else top_lps[i, :n],
                                        record=self._kept, record_row=slot))
        return finished

    def _looks_ahead(self) -> bool:
        """Whether the next step may decode before it knows which rows this step ended (`_step_ahead`):
        with decode graphs, for rows whose end is a token (no stop strings, which need the text), whose
        records are tokens, log-probs and versions only (no context kept, no top-K, no MoE routes)."""
        return (getattr(self.engine, "graph_mode", None) is not None and not self.params.stop
                and not self.keep_context and not self.params.record_top_k and self.routes is None)

    def _flags(self) -> StopFlags:
        """The live rows' stop flags after the step just queued, on their way to the host."""
        live = self.live
        return StopFlags.send(self.generated[:live], self.last[:live], self.eos, self._pinned, self.count)

    def _step_ahead(self, ahead: StopFlags) -> list[FinishedRow]:
        """A step that decodes first and then reads the previous step's stop flags (`ahead`, rollout/
        stop_flags.py), which the device sent while this step's work was queued: the host never waits
        for the step it just launched, so the device runs steps back to back. A row that had ended is
        thereby decoded one step past its end; that token (in the spare column, `tokens[:, max_new_tokens]`
        at most) and its key/value (at a position its slot's next row rewrites before reading it) are
        never read: each row draws from its own stream, so no other row's tokens change. The rows that
        ended are retired here; when waiting rows take their slots, the next step checks synchronously."""
        self._decode_live()
        flags = self._flags()
        counts, stopped = ahead.read()      # the previous step's flags only: this step keeps the device busy
        done = (stopped | (counts >= self.params.max_new_tokens)).nonzero().squeeze(1)
        if not len(done):
            self._ahead = flags
            return []
        finished = self._finished_rows(done.to(self.device), counts[done].tolist(), stopped[done].tolist())
        if not self._retire(done.to(self.device)):
            self._ahead = flags.packed(done)    # no row waited: the live rows were packed, and their flags
        return finished

    def _graph_step(self, live: int, g: torch.Tensor, pos: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The live rows' decode step and sampling through the engine's decode graphs (rollout/graphs.py):
        (logits, tokens, log-probs), or None for the eager step (bucket not captured yet, or graphs off
        after a failure, which the engine logs; the eager step then rewrites this step's keys/values)."""
        engine, cache = self.engine, self.cache
        try:
            if cache.capacity < cache.limit:      # (grown: new tensors, graphs captured again)
                cache.reserve(int(pos.max()) + 1)
            if self.graphs is None or not self.graphs.serves(self.weights, cache, self.params):
                self.graphs = DecodeGraphs(engine, self.weights, cache, self.params,
                                           capture=engine.graph_mode == "capture")
            return self.graphs.step(self.last[:live], pos, self.freqs[pos], self.keys[:live],
                                    g + self.drawn[:live])
        except Exception as err:   # noqa: BLE001 - any failure of the fast path falls back, logged
            engine.disable_graphs(f"{type(err).__name__}: {err}")
            self.graphs = None
            return None

    def _context(self, slot: int, tokens: list[int]) -> RowContext:
        """The row in `slot` that just ended its turn (`tokens`), for `extend` (`slot_context`)."""
        return slot_context(self.cache, slot, self.prompts[slot] + tokens, int(self.length[slot]),
                            int(self.keys[slot]), int(self.drawn[slot]) + len(tokens), self.version)

    def extend(self, context: RowContext, tokens: list[int], tag) -> None:
        """Continue a finished row (its `context`) with `tokens` (an observation; may be empty) and a
        new model turn, labelled `tag`: `extend_many` of one row."""
        self.extend_many([(context, tokens, tag)])

    @torch.no_grad()   # whichever thread calls it: grad mode is per thread
    def extend_many(self, items: list[tuple[RowContext, list[int], Any]]) -> None:
        """Continue finished rows, each (its `context`, observation `tokens` (may be empty), `tag` of its new
        turn); they wait for slots like added rows. Each row's first token is drawn here, at draw
        `context.drawn` of its stream, so a turn never reuses the uniforms of an earlier one. The rows whose
        keys/values can be reused run over their new tokens in shared passes (rollout/continuation.py); the others are
        prefilled again, each alone. Which rows share a pass changes no number: every row attends to its
        own keys only, and the products sum each output in one fixed order."""
        if not items:
            return
        rows = [(context, context.ids + list(tokens), tag) for context, tokens, tag in items]
        self._make_room(max(len(ids) for _, ids, _ in rows))
        reuse: list[tuple[RowContext, list[int], Any]] = []
        again: list[tuple[RowContext, list[int], Any]] = []
        for row in rows:
            (reuse if self._reusable(row[0]) else again).append(row)
        blocks: list[PromptBlock] = []
        logits: list[torch.Tensor] = []
        if reuse:
            blocks, continued = continue_rows(self.engine, self.weights, self.freqs, reuse, self.device)
            logits.append(continued)
        for _, ids, _ in again:
            block, row_logits = self._prefill([ids])
            blocks.append(block)
            logits.append(row_logits)
        ordered, next_logits = reuse + again, torch.cat(logits)
        key = torch.tensor([context.key for context, _, _ in ordered], device=self.device)
        drawn = torch.tensor([context.drawn for context, _, _ in ordered], device=self.device)
        token, logprob = self._sample(next_logits, key, drawn)
        top = self._top(next_logits)
        for r, ((context, _, tag), block) in enumerate(zip(ordered, blocks, strict=True)):
            self.waiting.append(WaitingRow(tag, block, 0, int(token[r]), float(logprob[r]), self.version, context.key,
                                           context.drawn, top=None if top is None else (top[0][r], top[1][r])))

    def _reusable(self, context: RowContext) -> bool:
        """Whether a row's stored keys/values can be continued from (else its sequence is prefilled again)."""
        return (self.continuation and context.keys is not None and context.version == self.version
                and self.engine.shape.sliding_window is None)

    def _sample(self, logits: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and sampler log-probs of logits [B, V] at draw `counters` of streams `keys` (`keyed_sample`)."""
        return keyed_sample(logits, self.params, keys, counters, self.engine.kernels)

    def _top(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The top-K ids and log-probs [B, K] of logits [B, V] under the sampling distribution, when recorded."""
        k = self.params.record_top_k
        return sampler_top_k(logits, self.params, k) if k else None

    @torch.no_grad()   # whichever thread calls it: grad mode is per thread
    def reload(self, version: int) -> None:
        """Continue with the model's current weights, labelled `version` (interrupt and recompute)."""
        self.weights, self.weights_key = self.engine.decoder_weights(), weights_key(self.engine.policy.model)
        self.version = version
        for block in {id(w.block): w.block for w in self.waiting}.values():
            fresh, _ = self._prefill(block.prompt_ids)
            block.keys, block.values, block.routes = fresh.keys, fresh.values, fresh.routes
        if self.live:
            live = self.live
            # Each live row's prompt and tokens but the last (not yet cached), prefilled as one sequence.
            sequences = [self.prompts[s] + self.tokens[s, : int(self.generated[s]) - 1].tolist() for s in range(live)]
            self.cache.reserve(max(len(q) for q in sequences))
            block, _ = self._prefill(sequences)
            rows = torch.arange(live, device=self.device)
            self.cache.fill(rows, block.keys, block.values, rows)
            if block.routes is not None:   # the new weights' experts for every token they recomputed
                for s, q in enumerate(sequences):
                    p = len(self.prompts[s])
                    self.prompt_routes[s] = block.routes[s, :p]
                    self.routes[s, : len(q) - p] = block.routes[s, p : len(q)]

    def _make_room(self, prompt_len: int) -> None:
        """The cache and rotary table for prompts of `prompt_len` tokens: made afresh when the session is
        empty (sized as for one `generate` call), raised otherwise."""
        longest = prompt_len + self.params.max_new_tokens
        if self.cache is None or not self.busy:
            spare = self.cache or self.engine._spare
            # Decode graphs read fixed cache tensors, captured again when the cache grows: with them it starts
            # twice as large (attention reads every position of the capacity, so not at its limit).
            initial = prompt_len + 64
            if getattr(self.engine, "graph_mode", None):
                initial = min(longest, 2 * initial)
            self.cache = KVCache(len(self.weights.layers), self.count, self.engine.shape, initial=initial,
                                 limit=longest, dtype=self.model.dtype, device=self.device, reuse=spare)
            self.freqs = rotary_factors(self.model, self.engine.shape.head_dim, longest)
        elif longest > len(self.freqs):   # (the cache's limit may already be past it: its BLAS floor)
            self.cache.limit = max(self.cache.limit, longest)
            self.freqs = rotary_factors(self.model, self.engine.shape.head_dim, longest)

    def _prefill(self, prompt_ids: list[list[int]]) -> tuple[PromptBlock, torch.Tensor]:
        routes: list[torch.Tensor] | None = None if self.routes is None else []
        keys, values, logits = self.engine._prefill(self.weights, prompt_ids, self.freqs, routes)
        return PromptBlock(prompt_ids, keys, values, None if routes is None else torch.cat(routes)), logits

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
            self.prompt_routes[slot] = (None if w.block.routes is None
                                        else w.block.routes[w.prompt, : len(self.prompts[slot])])
        if self.routes is not None:
            self.routes[into] = -1
        d = self.device
        self.tokens[into, 0] = self.last[into] = torch.tensor([w.token for w in rows], device=d)
        self.logprobs[into, 0] = torch.tensor([w.logprob for w in rows], device=d)
        self.versions[into, 0] = torch.tensor([w.version for w in rows], device=d)
        if self.top_ids is not None:
            self.top_ids[into, 0] = torch.stack([w.top[0] for w in rows]).to(d)
            self.top_logprobs[into, 0] = torch.stack([w.top[1] for w in rows]).to(d)
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
                              self.last, self.length, self.generated, self.drawn, self.routes, self.top_ids,
                              self.top_logprobs):
                    if state is not None:
                        state[holes] = state[movers]
                for h, m in zip(holes.tolist(), movers.tolist(), strict=True):
                    self.tags[h], self.prompts[h] = self.tags[m], self.prompts[m]
                    self.prompt_routes[h] = self.prompt_routes[m]
            self.live = live
        return bool(len(refill))
