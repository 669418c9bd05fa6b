"""The engine behind the endpoint: requests from many HTTP threads sampled by the run's engine in one thread.

An agent's calls arrive one at a time from many threads, whenever each agent is ready. `Sampler` owns
the engine while episodes run: callers `sample(prompt_ids, n, key)` and block; one thread feeds the
requests to the engine and hands each its samples.

- native engine: one decoding session (continuous batching, reinforge/rollout/session.py): a request
  joins the live rows at the next step, so a slow agent never holds the others back;
- any engine with `generate_ids` (hf): the requests waiting at that moment are sampled together.

Each request's samples draw from the stream keyed by `key` (the native engine's keyed sampling), so an
episode's draws do not depend on which other requests share its batch. Every sample carries the
sampler's log-probs and the policy version of each token, as a single-turn rollout does.

Continuation (native engine): a request of an episode (`episode` given, one sample) whose prompt starts
with the whole context of that episode's earlier call continues that call's row (`DecodeSession.extend_many`,
with the other continuations that arrived together):
the decoder runs over the new tokens alone, attending to the keys/values the earlier call left, and the
row's sampling stream goes on. The tokens are the same as a fresh prefill would compute them
(tests/unit/rollout/test_native_continuation.py); only the time differs. `forget(episode)` drops what it left.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from reinforge.rollout.base import SamplingParams


@dataclass(frozen=True)
class Sample:
    """One sampled continuation of a request's prompt."""

    token_ids: torch.Tensor          # [L] long, L >= 1, the stop token (eos) included when it stopped
    sampler_logprobs: torch.Tensor   # [L] float, log-prob of each token under the distribution it was drawn from
    versions: torch.Tensor           # [L] long, the policy version that sampled each token
    truncated: bool                  # it reached the run's max_new_tokens without a stop


@dataclass
class _Request:
    prompt_ids: list[int]
    n: int
    key: int
    future: Future
    rows: list[Any]
    episode: str | None = None


class Sampler:
    """The run's engine sampling requests from any thread (see the module docstring). Use as a context
    manager, or `start` / `close`; `sample` raises RuntimeError once it is closed or its thread failed."""

    def __init__(self, engine: Any, params: SamplingParams, version: int = 0, slots: int = 16,
                 generator: torch.Generator | None = None):
        self.engine, self.params, self.version, self.slots, self.generator = engine, params, version, slots, generator
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.failure: BaseException | None = None
        self.busy_max = 0            # the most requests in flight at once (the endpoint's concurrency)
        self.continued = 0           # requests that continued an earlier call's row
        self._contexts: dict[str, Any] = {}     # episode -> the RowContext its last call left (native engine)
        self._lock = threading.Lock()

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="reinforge-endpoint-sampler", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sample(self, prompt_ids: list[int], n: int, key: int, episode: str | None = None) -> list[Sample]:
        """`n` samples of `prompt_ids` from the stream keyed by `key` (or, continuing `episode`'s last call, its
        row's stream); blocks until they are drawn."""
        if self._closed.is_set() or self.failure is not None:
            raise RuntimeError(f"the endpoint's sampler is closed{f' ({self.failure})' if self.failure else ''}")
        request = _Request([int(t) for t in prompt_ids], n, key, Future(), [None] * n, episode)
        self._queue.put(request)
        return request.future.result()

    # ---------------------------------------------------------------- the engine's thread

    def _run(self) -> None:
        pending: list[_Request] = []
        try:
            with torch.no_grad():
                if hasattr(self.engine, "session"):
                    self._continuous(pending)
                else:
                    self._batched(pending)
        except BaseException as err:  # the engine failed: every waiting caller gets the error, not a hang
            self.failure = err
            for request in pending + self._drain(block=False):
                if not request.future.done():
                    request.future.set_exception(RuntimeError(f"the endpoint's engine failed: "
                                                              f"{type(err).__name__}: {err}"))

    def _drain(self, block: bool) -> list[_Request]:
        """The requests queued now (waiting for the first when `block`); a None marks close."""
        out = []
        try:
            item = self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
            while True:
                if item is None:
                    self._closed.set()
                else:
                    out.append(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            return out

    def forget(self, episode: str) -> None:
        """Drop the row `episode`'s last call left (the episode has ended)."""
        with self._lock:
            self._contexts.pop(episode, None)

    def _continuous(self, pending: list[_Request]) -> None:
        session = self.engine.session(self.params, slots=self.slots, generator=self.generator, version=self.version,
                                      keep_context=True)
        while not (self._closed.is_set() and not pending):
            self._admit(session, self._drain(block=not session.busy), pending)
            self.busy_max = max(self.busy_max, len(pending))
            if not session.busy:
                continue
            for row in session.step():
                request, j = row.tag
                request.rows[j] = Sample(row.tokens, row.logprobs, row.versions, row.truncated)
                if request.episode is not None and request.n == 1 and row.context is not None:
                    with self._lock:
                        self._contexts[request.episode] = row.context
                if all(r is not None for r in request.rows):
                    pending.remove(request)
                    request.future.set_result(list(request.rows))
        self.engine.release(session)

    def _admit(self, session: Any, requests: list[_Request], pending: list[_Request]) -> None:
        """Start the requests that arrived together: the continuations in shared passes (`extend_many`), the
        new prompts in one prefill per sample count (`add`). Neither changes a number (each row attends to its
        own keys and draws from its own stream); one pass instead of one per request is what changes."""
        continuations, fresh = [], {}
        for request in requests:
            pending.append(request)
            with self._lock:
                context = self._contexts.pop(request.episode, None) if request.episode else None
            if context is not None and request.n == 1 and request.prompt_ids[: len(context.ids)] == context.ids:
                continuations.append((context, request.prompt_ids[len(context.ids):], (request, 0)))
            else:
                fresh.setdefault(request.n, []).append(request)
        if continuations:
            session.extend_many(continuations)
            self.continued += len(continuations)
        for n, group in fresh.items():
            session.add([r.prompt_ids for r in group], n, tags=[(r, j) for r in group for j in range(n)],
                        group_keys=torch.tensor([r.key for r in group]))

    def _batched(self, pending: list[_Request]) -> None:
        while not (self._closed.is_set() and not pending):
            pending.extend(self._drain(block=True))
            if not pending:
                continue
            self.busy_max = max(self.busy_max, len(pending))
            batch, pending[:] = list(pending), []
            prompts = [r.prompt_ids for r in batch for _ in range(r.n)]
            generator = torch.Generator().manual_seed(batch[0].key & (2**62 - 1))
            out = self.engine.generate_ids(prompts, 1, self.params, self.version, generator)
            lengths = out.completion_mask.sum(dim=1).long().tolist()
            at = 0
            for request in batch:
                samples = []
                for _ in range(request.n):
                    n = lengths[at]
                    samples.append(Sample(out.completion_ids[at, :n], out.sampler_logprobs[at, :n],
                                          torch.full((n,), self.version, dtype=torch.long), bool(out.truncated[at])))
                    at += 1
                request.future.set_result(samples)
