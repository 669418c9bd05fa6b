r"""Held-out effect of on-policy DPO on the built-in task: cold-start SFT, then DPO, pass@1 before and after.

    .venv/bin/python benchmarks/dpo_heldout.py [--sft-cache FILE] \
        [key=value ...]   # defaults: sft.steps=150 train.steps=30

--sft-cache FILE: load the SFT weights from FILE if it exists, else train and save them there
(to compare DPO settings from one SFT model).

Prints one JSON line per DPO step (dpo/* and reward figures) and a final JSON summary with the
held-out evaluation (eval.num_prompts x eval.num_samples, at the rollout temperature) before and after DPO.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from reinforge.config import build_config
from reinforge.eval.evaluate import evaluate
from reinforge.jobs.rl import run_dpo
from reinforge.jobs.start import preference_spec, seed_everything
from reinforge.loops.sft import run_sft
from reinforge.models import load_policy
from reinforge.rollout import SamplingParams, build_engine
from reinforge.tasks import build_task

KEYS = ("dpo/loss", "dpo/reward_accuracy", "dpo/margin", "dpo/pairs", "reward_mean", "grad_norm", "step_seconds")


def main(overrides: list[str], sft_cache: str | None = None) -> dict:
    cfg = build_config(["recipe=dpo", "sft.steps=150", "train.steps=30", "log.progress=false", *overrides])
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    t0 = time.perf_counter()
    task = build_task(cfg.task.name, **cfg.task.options)
    policy = load_policy(cfg.model, cfg.seed)
    if sft_cache and Path(sft_cache).is_file():
        policy.model.load_state_dict(torch.load(sft_cache))
        sft_loss = None
    else:
        # as the pipeline's cold start
        data = task.sft_examples(cfg.sft.num_examples, cfg.sft.corrupt_fraction, seed=cfg.seed)
        sft_loss = run_sft(policy, data, cfg.sft, chat_template=cfg.prompt.chat_template, seed=cfg.seed).final_loss
        if sft_cache:
            torch.save(policy.model.state_dict(), sft_cache)
    t_sft = time.perf_counter() - t0
    engine = build_engine(cfg.rollout, policy, chat_template=cfg.prompt.chat_template)
    held_out = task.eval_split(cfg.eval.num_prompts)

    def held_out_eval() -> dict:
        result = evaluate(engine, task, held_out, num_samples=cfg.eval.num_samples,
                          sampling=SamplingParams.from_config(cfg.rollout), seed=cfg.eval.seed)
        return {
            "pass@1": result.pass_at_1,
            "greedy_accuracy": result.greedy_accuracy,
            "pass@8": result.pass_at_k.get("8"),
        }

    start = held_out_eval()
    t1 = time.perf_counter()
    run_dpo(
        cfg,
        policy,
        engine,
        task,
        preference_spec(cfg),
        lambda record, state: print(
            json.dumps({"step": record.step, **{k: round(record.metrics[k], 4) for k in KEYS if k in record.metrics}})
        ),
    )
    t_dpo = time.perf_counter() - t1
    final = held_out_eval()
    summary = {"overrides": overrides, "sft_final_loss": sft_loss, "sft_seconds": t_sft, "dpo_seconds": t_dpo,
               "start": start, "final": final}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    args = sys.argv[1:]
    cache = args.pop(args.index("--sft-cache") + 1) if "--sft-cache" in args else None
    main([a for a in args if a != "--sft-cache"], cache)
