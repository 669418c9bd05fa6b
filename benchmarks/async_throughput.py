"""Synchronous vs asynchronous RL (train.mode) on the built-in task with long-tailed completion lengths.

    .venv/bin/python benchmarks/async_throughput.py [--sft-cache FILE] [key=value ...]

The task's teacher ends each answer with k spaces, P(k >= x) = (x + 1)^-1 up to 40
(task.options.trailing_max): after SFT the model's completions are mostly short with a
tail near the cap, as reasoning traces are. The synchronous loop waits for the longest
completion of every batch and the learner waits for the sampler; the asynchronous loop
keeps decoding (new prompts fill finished rows' slots) while the learner trains, at most
train.max_staleness steps ahead (AReaL, arXiv 2505.24298).

Both runs start from the same SFT weights, use the same objective (decoupled PPO, grpo
advantages, token mean, no KL: recipe areal's loss, which is PPO-clip when nothing is stale)
and train on the same number of samples (train.steps x prompts_per_step x group_size).
samples_per_s = those samples / RL wall-clock seconds (the loop, from the first request to
the last update; no evaluation inside it). pass@1: held-out, eval.num_prompts x
eval.num_samples at the rollout temperature, after RL.

--sft-cache FILE: load the SFT weights from FILE if it exists, else train and save them there.
Prints one JSON line per run and a final JSON line: sync_samples_per_s, async_samples_per_s,
ratio, sync_pass@1, async_pass@1 (and the start pass@1).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from reinforge.config import build_config
from reinforge.eval.evaluate import evaluate
from reinforge.jobs.rl import run_rl
from reinforge.jobs.start import objective_spec, seed_everything
from reinforge.loops.sft import run_sft
from reinforge.models import load_policy
from reinforge.rollout import SamplingParams, build_engine
from reinforge.tasks import build_task

DEFAULTS = [
    "task.options={trailing_max: 40}", "rollout.max_new_tokens=48",
    "recipe=grpo", "objective.policy_loss=decoupled_ppo", "objective.aggregation=token_mean",
    "objective.kl_estimator=none", "objective.kl_coef=0",
    "train.steps=40", "train.max_staleness=2", "eval.num_prompts=200", "log.progress=false",
]


def sft_weights(cfg, cache: str | None) -> dict:
    policy = load_policy(cfg.model, cfg.seed)
    if cache and Path(cache).is_file():
        return torch.load(cache)
    task = build_task(cfg.task.name, **cfg.task.options)
    # as the pipeline's cold start
    data = task.sft_examples(cfg.sft.num_examples, cfg.sft.corrupt_fraction, seed=cfg.seed)
    run_sft(policy, data, cfg.sft, chat_template=cfg.prompt.chat_template, seed=cfg.seed)
    state = policy.model.state_dict()
    if cache:
        torch.save(state, cache)
    return state


def held_out(cfg, policy, task) -> dict:
    engine = build_engine(cfg.rollout, policy, chat_template=cfg.prompt.chat_template)
    result = evaluate(engine, task, task.eval_split(cfg.eval.num_prompts), num_samples=cfg.eval.num_samples,
                      sampling=SamplingParams.from_config(cfg.rollout), seed=cfg.eval.seed)
    return {"pass@1": result.pass_at_1, "greedy_accuracy": result.greedy_accuracy, "mean_length": result.mean_length}


def run(mode: str, overrides: list[str], weights: dict) -> dict:
    cfg = build_config([*DEFAULTS, *overrides, f"train.mode={mode}"])
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    task = build_task(cfg.task.name, **cfg.task.options)
    policy = load_policy(cfg.model, cfg.seed)
    policy.model.load_state_dict(weights)
    engine = build_engine(cfg.rollout, policy, chat_template=cfg.prompt.chat_template)
    lengths: list[float] = []
    t0 = time.perf_counter()
    run_rl(cfg, policy, engine, task, objective_spec(cfg),
            lambda record, state: lengths.append(record.metrics.get("response_length_mean", float("nan"))))
    seconds = time.perf_counter() - t0
    samples = cfg.train.steps * cfg.train.prompts_per_step * cfg.train.group_size
    out = {"mode": mode, "samples": samples, "rl_seconds": round(seconds, 2), "samples_per_s": samples / seconds,
           "mean_response_length": sum(lengths) / len(lengths), **held_out(cfg, policy, task)}
    print(json.dumps(out), flush=True)
    return out


def main(overrides: list[str], sft_cache: str | None = None) -> dict:
    cfg = build_config([*DEFAULTS, *overrides])
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    weights = sft_weights(cfg, sft_cache)
    policy = load_policy(cfg.model, cfg.seed)
    policy.model.load_state_dict(weights)
    start = held_out(cfg, policy, build_task(cfg.task.name, **cfg.task.options))
    sync, asynchronous = run("sync", overrides, weights), run("async", overrides, weights)
    summary = {
        "sync_samples_per_s": round(sync["samples_per_s"], 2),
        "async_samples_per_s": round(asynchronous["samples_per_s"], 2),
        "ratio": round(asynchronous["samples_per_s"] / sync["samples_per_s"], 3),
        "start_pass@1": round(start["pass@1"], 4),
        "sync_pass@1": round(sync["pass@1"], 4),
        "async_pass@1": round(asynchronous["pass@1"], 4),
        "samples": sync["samples"],
        "max_staleness": cfg.train.max_staleness,
        "start_mean_length": round(start["mean_length"], 2),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    args = sys.argv[1:]
    cache = None
    if "--sft-cache" in args:
        i = args.index("--sft-cache")
        cache = args[i + 1]
        del args[i : i + 2]
    main(args, cache)
