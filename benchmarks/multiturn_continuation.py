"""Multi-turn rollout model-tokens/s of the native engine: continuing each row from its stored
keys/values (`DecodeSession.extend`, continuation) against prefilling its whole sequence again for
every turn (continuation=False, what a driver without it does).

    .venv/bin/python benchmarks/multiturn_continuation.py [--rows 24] [--turns 5] [--rounds 3]
        [--prompt-tokens 200] [--turn-tokens 32] [--observation-tokens 48] [--hidden 384] [--threads 2]

An agentic trajectory: a prompt, a model turn, an observation (a tool result: fixed random ids,
not sampled), a model turn, ... The driver steps one `DecodeSession` and extends a row with its
observation as soon as its turn ends, until each row has done `--turns` turns (continuous batching:
the other rows keep decoding). A turn ends at <eos> or at max_new_tokens (`--turn-tokens`); the
random-init model samples <eos> now and then, so turns average a little under the limit. Model: a
random-init Qwen2-shaped decoder (hidden 384, 4 layers, 6 heads of 64, 2 key/value heads, MLP
1024), char vocabulary, fp32. Both modes run on the same model and keys, alternating
(continuation, re-prefill, ...), after one warm-up round; the figure per mode is the median over
rounds of sampled tokens / seconds. They sample the same tokens (`same_tokens`). The last line is
one JSON object. On a CPU shared with other work, `--threads 1` gives steadier figures: a busy core
stalls every parallel region of a 2-thread run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from reinforge.models import Policy, build_tiny_qwen2
from reinforge.rollout import NativeEngine, SamplingParams
from reinforge.settings import ModelConfig


def trajectories(engine: NativeEngine, prompts: list[list[int]], observations: list[list[list[int]]],
                 params: SamplingParams, continuation: bool) -> tuple[float, list[list[int]]]:
    """Seconds for every row's `len(observations[r]) + 1` turns, and each row's final sequence."""
    rows, turns = len(prompts), len(observations[0]) + 1
    session = engine.session(params, slots=rows, keep_context=True)
    session.continuation = continuation
    done = [0] * rows
    final: list[list[int]] = [[] for _ in range(rows)]
    start = time.perf_counter()
    session.add(prompts, 1, tags=range(rows), group_keys=torch.arange(rows))
    while session.busy:
        for row in session.step():
            done[row.tag] += 1
            if done[row.tag] < turns:
                session.extend(row.context, observations[row.tag][done[row.tag] - 1], tag=row.tag)
            else:
                final[row.tag] = row.context.ids
    return time.perf_counter() - start, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--observation-tokens", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    sizes = ModelConfig(hidden_size=args.hidden, num_layers=4, num_heads=args.hidden // 64, num_kv_heads=2,
                        intermediate_size=1024, max_positions=4096)
    policy: Policy = build_tiny_qwen2(sizes, seed=0)
    vocab = policy.model.config.vocab_size
    ids = torch.Generator().manual_seed(1)
    # Token ids past the special ones (pad 0, eos 1): prompts and observations are fixed random text.
    prompts = torch.randint(2, vocab, (args.rows, args.prompt_tokens), generator=ids).tolist()
    observations = torch.randint(2, vocab, (args.rows, args.turns - 1, args.observation_tokens), generator=ids).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=args.turn_tokens)
    engine = NativeEngine(policy)

    given = args.rows * (args.prompt_tokens + (args.turns - 1) * args.observation_tokens)   # not sampled
    modes = {"continuation": True, "reprefill": False}
    rates: dict[str, list[float]] = {name: [] for name in modes}
    sequences: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds + 1):       # round 0 warms up and is not counted
        for name, continuation in modes.items():
            seconds, sequences[name] = trajectories(engine, prompts, observations, params, continuation)
            if round_:
                rates[name].append((sum(map(len, sequences[name])) - given) / seconds)
    cont, full = statistics.median(rates["continuation"]), statistics.median(rates["reprefill"])
    print(json.dumps({
        "continuation_tokens_per_s": round(cont, 1),
        "reprefill_tokens_per_s": round(full, 1),
        "ratio": round(cont / full, 3),
        "same_tokens": sequences["continuation"] == sequences["reprefill"],
        "model_tokens": sum(map(len, sequences["continuation"])) - given,
        "mean_turn_tokens": round((sum(map(len, sequences["continuation"])) - given) / (args.rows * args.turns), 2),
        "final_length": max(len(seq) for seq in sequences["continuation"]),
        "continuation_runs": [round(r, 1) for r in rates["continuation"]],
        "reprefill_runs": [round(r, 1) for r in rates["reprefill"]],
        "rows": args.rows, "turns": args.turns, "prompt_tokens": args.prompt_tokens, "turn_tokens": args.turn_tokens,
        "observation_tokens": args.observation_tokens, "rounds": args.rounds, "threads": args.threads,
        "model": {"hidden": args.hidden, "layers": 4, "heads": args.hidden // 64, "kv_heads": 2, "mlp": 1024,
                  "vocab": vocab}, "dtype": "float32", "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
