"""CUDA graphs of the native engine's decode step (`DecodeGraphs`), for GPUs, where the eager step
is hundreds of small kernel launches and their Python: one token costs as much at 1 row as at 256.

A graph replays one step's kernels (embedding, every layer with its cache writes and attention,
the LM head, the sampling) for a fixed number of rows and fixed buffers. So that a session's
changing set of live rows can use it:

- rows are padded to a bucket (the next power of two, at most the cache's slots); padded rows decode
  token 0 at position 0 of a free slot (slots past the live ones hold nothing a row needs, and a
  slot's position 0 is rewritten when a row is admitted to it), and their outputs are dropped;
- the inputs (tokens, positions, rotary factors, sampling keys and counters) are copied into static
  buffers each step; the cache's tensors and the weights are the ones captured, which a graph
  checks by identity before every replay (a cache that grew, or new weights, make a new set);
- a bucket is captured once it has been asked for `CAPTURE_AFTER` times in the session (a capture
  costs a few eager steps; short bursts of a bucket stay eager); the buckets share one memory pool.

Every capture is checked once against the same step run eagerly (the warm-up capture needs anyway):
the same tokens and the same logits within float rounding, else the graphs are turned off. Any
failure turns them off for the engine with a logged reason and the step runs eagerly: graphs change
the speed, never the tokens. The step body (`step_body`) has no host synchronisation; run eagerly on
padded rows (`capture=False`, what the CPU tests check) it gives the eager path's numbers.
"""

from __future__ import annotations

from collections import Counter

import torch

from reinforge.models.decoder import DecoderWeights
from reinforge.rollout.base import SamplingParams
from reinforge.rollout.kv_cache import KVCache
from reinforge.rollout.passes import DecodePasses
from reinforge.rollout.sampling import keyed_uniforms, sample_tokens

# Asks of a bucket, in a session, before it is captured: a capture costs a few eager steps (a warm-up, the
# capture, the check), so buckets that live a handful of steps stay eager.
CAPTURE_AFTER = 8
# The capture's check against the eager step: logits of the same kernels on the same inputs agree to
# float rounding; a graph reading stale buffers would be off by far more.
CHECK_RTOL = CHECK_ATOL = 1e-3


class GraphCheckFailed(RuntimeError):
    """A captured decode step disagreed with the same step run eagerly."""


def bucket_of(live: int, slots: int) -> int:
    """The rows a step of `live` rows runs as: the next power of two, at most `slots`."""
    return min(slots, 1 << max(0, live - 1).bit_length())


def step_body(engine: DecodePasses, w: DecoderWeights, cache: KVCache, params: SamplingParams, tokens: torch.Tensor,
              positions: torch.Tensor, rot: torch.Tensor, keys: torch.Tensor,
              counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step of the front slots without host synchronisation: `engine._decode_rows` (the
    eager step's decoder) then `sample_tokens` at the keyed uniforms. (logits [B, V], tokens [B],
    log-probs [B])."""
    logits = engine._decode_rows(w, cache, tokens, positions, rot)
    token, logprob = sample_tokens(logits, params, uniforms=keyed_uniforms(keys, counters))
    return logits, token, logprob


class _Bucket:
    """Static inputs and outputs of one bucket's graph (graph None: run eagerly on them)."""

    def __init__(self, rows: int, half_dim: int, device: torch.device):
        self.rows = rows
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.rot = torch.zeros(rows, half_dim, dtype=torch.complex64, device=device)
        self.keys = torch.zeros(rows, dtype=torch.long, device=device)
        self.counters = torch.zeros(rows, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def load(self, tokens, positions, rot, keys, counters) -> None:
        live = len(tokens)
        for static, value in ((self.tokens, tokens), (self.positions, positions), (self.rot, rot),
                              (self.keys, keys), (self.counters, counters)):
            static[:live].copy_(value)
            static[live:].zero_()     # padded rows: token 0 at position 0, key 0, counter 0


class DecodeGraphs:
    """The decode graphs of one session's weights and cache (see the module docstring).
    `capture=False` runs the same bucketed step on the static buffers eagerly (no CUDA needed)."""

    def __init__(self, engine: DecodePasses, weights: DecoderWeights, cache: KVCache, params: SamplingParams,
                 capture: bool = True):
        self.engine, self.weights, self.cache, self.params, self.capture = engine, weights, cache, params, capture
        self.buffers = (list(cache.k), list(cache.v))     # held: their identity is what the graphs read
        self.buckets: dict[int, _Bucket] = {}
        self.asked: Counter[int] = Counter()
        self.pool = None

    def serves(self, weights: DecoderWeights, cache: KVCache, params: SamplingParams) -> bool:
        """Whether these graphs read exactly `weights`, `cache`'s current tensors and `params`."""
        k, v = self.buffers
        return (weights is self.weights and params is self.params and cache is self.cache
                and len(k) == len(cache.k) and all(a is b for a, b in zip(k, cache.k, strict=True))
                and all(a is b for a, b in zip(v, cache.v, strict=True)))

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, rot: torch.Tensor, keys: torch.Tensor,
             counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(logits [live, V], tokens [live], log-probs [live]) of the live rows' step, or None when their
        bucket is not captured yet (the caller runs the eager step). The outputs are views of static
        buffers, valid until the next step."""
        live = len(tokens)
        rows = bucket_of(live, len(self.cache.v[0]))
        self.asked[rows] += 1
        bucket = self.buckets.get(rows)
        if bucket is None:
            if self.capture and self.asked[rows] < CAPTURE_AFTER:
                return None
            bucket = self.buckets[rows] = _Bucket(rows, rot.shape[-1], tokens.device)
            bucket.load(tokens, positions, rot, keys, counters)
            if self.capture:
                self._capture(bucket)           # its checked replay is this step
            else:
                bucket.out = self._body(bucket)
        else:
            bucket.load(tokens, positions, rot, keys, counters)
            if bucket.graph is not None:
                bucket.graph.replay()
            else:
                bucket.out = self._body(bucket)
        logits, token, logprob = bucket.out
        return logits[:live], token[:live], logprob[:live]

    def _body(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return step_body(self.engine, self.weights, self.cache, self.params, b.tokens, b.positions, b.rot, b.keys,
                         b.counters)

    def _capture(self, bucket: _Bucket) -> None:
        """Capture `bucket`'s step with its inputs loaded; check one replay against the eager step.
        The eager warm-up and the replay write the same keys/values at the same positions."""
        with torch.cuda.device(bucket.tokens.device):
            self._capture_here(bucket)

    def _capture_here(self, bucket: _Bucket) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            reference = [t.clone() for t in self._body(bucket)]
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a learner in another thread (the asynchronous loop) may use the device meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            bucket.out = self._body(bucket)
        self.pool = graph.pool()
        graph.replay()
        logits, token, _ = bucket.out
        if not torch.equal(token, reference[1]) or not torch.allclose(logits, reference[0], rtol=CHECK_RTOL,
                                                                       atol=CHECK_ATOL):
            diff = float((logits - reference[0]).abs().max())
            raise GraphCheckFailed(f"the captured step of {bucket.rows} rows disagrees with the eager step "
                                   f"(logits differ by up to {diff:.3g})")
        bucket.graph = graph

