"""The endpoint's sampler starts the requests that arrive together in shared passes (new prompts in one
prefill per sample count, continuations in one `extend_many`): every request's samples are those it gets
when it arrives alone, token for token and log-prob for log-prob."""

from __future__ import annotations

import threading
import time

import torch
from unit.rollout.test_native_continuation import encode, qwen2

from reinforge.rollout import NativeEngine, SamplingParams
from reinforge.serve.sampler import Sampler

PARAMS = SamplingParams(temperature=0.9, max_new_tokens=7)
# (prompt, samples, key, episode): the episodes of one sample continue in a second turn
REQUESTS = [("12+30=", 1, 11, "a"), ("7*6=", 2, 12, None), ("99-9=", 1, 13, "b"), ("5+5+5=", 2, 14, None),
            ("8*8=", 1, 15, "c")]


def submit_together(sampler: Sampler, calls: list[tuple[list[int], int, int, str | None]]) -> list:
    """Each call from its own thread, all queued before the sampler's thread reads the queue: that thread is
    held on the sampler's lock (taken for each request's episode), or not yet started."""
    out: list = [None] * len(calls)
    queued = sampler._queue.unfinished_tasks + len(calls)     # every put counts (no task_done is called)

    def call(i: int) -> None:
        out[i] = sampler.sample(*calls[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while sampler._queue.unfinished_tasks < queued and time.monotonic() < deadline:
        time.sleep(0.001)
    return [threads, out]


def samples_key(samples) -> list[tuple]:
    return [(s.token_ids.tolist(), s.sampler_logprobs, s.versions.tolist(), s.truncated) for s in samples]


def test_requests_arriving_together_get_the_samples_they_get_alone() -> None:
    policy = qwen2()
    first = [(encode(policy, p), n, key, episode) for p, n, key, episode in REQUESTS]

    def second(turns) -> list[tuple]:
        """Each one-sample episode's next call: its whole context, an observation, a new turn."""
        return [(ids + samples[0].token_ids.tolist() + encode(policy, " obs: 4\n"), 1, key, episode)
                for (ids, n, key, episode), samples in zip(first, turns, strict=True) if episode is not None]

    with Sampler(NativeEngine(policy), PARAMS, slots=8) as alone:
        alone_first = [alone.sample(*call) for call in first]
        alone_second = [alone.sample(*call) for call in second(alone_first)]
        assert alone.continued == 3

    together = Sampler(NativeEngine(policy), PARAMS, slots=8)
    threads, together_first = submit_together(together, first)     # queued before the thread starts
    together.start()
    for t in threads:
        t.join()
    with together._lock:                 # the thread cannot admit anything until every second call is queued
        threads, together_second = submit_together(together, second(together_first))
    for t in threads:
        t.join()
    together.close()
    assert together.continued == 3

    for got, want in zip(together_first + together_second, alone_first + alone_second, strict=True):
        for (ids, logprobs, versions, truncated), (ids0, logprobs0, versions0, truncated0) in zip(
                samples_key(got), samples_key(want), strict=True):
            assert (ids, versions, truncated) == (ids0, versions0, truncated0)
            torch.testing.assert_close(logprobs, logprobs0, rtol=0, atol=1e-6)
    # Turns of different lengths and both sample counts: the batching had something to mix.
    assert len({len(s.token_ids) for samples in together_first for s in samples}) > 1
