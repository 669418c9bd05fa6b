"""Learner forward+backward time on a long-tailed batch: the shared-prompt forward with its completion
passes bucketed by length (the default) against one pass padded to the longest row.

    .venv/bin/python benchmarks/learner_padding.py [--repeats 7] [--threads 2] [--cap 40]

The batch is what RLVR rollouts look like after a little training: 32 arithmetic prompts x 8
samples, completion lengths 6 + k with P(k >= x) = 1 / (x + 1), k capped at `--cap` (the
long-tailed teacher of `task.options.trailing_max`), so most rows are short and each batch has a
few long ones. Token values do not change the work; they are drawn at random. The model is the
built-in tiny Qwen2, fp32. Each variant's figure is the median of `--repeats` timed forward +
backward passes (log-probs and entropy of every completion token), after one warm-up pass; the
variants alternate. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from reinforge.learner import build_sequences, completion_token_stats
from reinforge.learner import shared_prefix as sp
from reinforge.models import build_tiny_qwen2
from reinforge.rollout import encode_prompts
from reinforge.settings import ModelConfig
from reinforge.tasks import build_task

PROMPTS, GROUP_SIZE, BASE_LENGTH = 32, 8, 6


def long_tailed_batch(tokenizer, vocab: int, cap: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = encode_prompts(tokenizer, [e.prompt for e in build_task("arithmetic").train_split(PROMPTS)], "never")
    rows = [p for p in prompts for _ in range(GROUP_SIZE)]
    u = torch.rand(len(rows), generator=g)
    k = (1.0 / u - 1.0).floor().clamp(max=cap).long()          # P(k >= x) = 1 / (x + 1)
    lengths = BASE_LENGTH + k
    width = int(lengths.max())
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    ids = torch.randint(3, vocab, (len(rows), width), generator=g).masked_fill(mask == 0, tokenizer.pad_token_id)
    group_ids = torch.arange(PROMPTS).repeat_interleave(GROUP_SIZE)
    return build_sequences(rows, ids, mask, tokenizer.pad_token_id, group_ids=group_ids), lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cap", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    policy = build_tiny_qwen2(ModelConfig(max_positions=128), seed=0)
    model = policy.model
    batch, lengths = long_tailed_batch(policy.tokenizer, model.config.vocab_size, args.cap, args.seed)
    need = (lengths - 1).clamp(min=0)
    # The two shared-prompt variants differ only in the pass cost set before each call: the default
    # buckets by length, an unreachable cost merges every row into one padded pass.
    variants = {
        "bucketed": lambda: sp.completion_token_stats_shared(model, batch, batch.group_ids),
        "one_pass": lambda: sp.completion_token_stats_shared(model, batch, batch.group_ids),
        "plain_hf": lambda: completion_token_stats(model, batch),
    }
    costs = {"bucketed": sp.PASS_COST_POSITIONS, "one_pass": 10**12, "plain_hf": sp.PASS_COST_POSITIONS}
    times: dict[str, list[float]] = {name: [] for name in variants}
    results = {}
    default = sp.PASS_COST_POSITIONS
    try:
        for repeat in range(args.repeats + 1):
            for name, run in variants.items():
                sp.PASS_COST_POSITIONS = costs[name]
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                stats = run()
                (stats.logprobs.sum() + stats.entropy.sum()).backward()
                seconds = time.perf_counter() - start
                if repeat:
                    times[name].append(seconds)
                else:
                    results[name] = stats.logprobs.detach()
    finally:
        sp.PASS_COST_POSITIONS = default
    buckets = sp.length_buckets(need, default)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "bucketed_ms": round(1000 * median["bucketed"], 1),
        "one_pass_ms": round(1000 * median["one_pass"], 1),
        "plain_hf_ms": round(1000 * median["plain_hf"], 1),
        "ratio": round(median["bucketed"] / median["one_pass"], 3),
        "max_abs_diff": float((results["bucketed"] - results["one_pass"]).abs().max()),
        "rows": len(lengths), "mean_length": round(float(lengths.float().mean()), 2), "max_length": int(lengths.max()),
        "tokens": int(lengths.sum()), "one_pass_positions": int(len(lengths) * need.max()),
        "bucketed_positions": int(sum(len(b) * int(need[b].max()) for b in buckets)), "passes": len(buckets),
        "pass_cost_positions": default, "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
