r"""Self-rewarding on the built-in task: the model judges its own samples and learns from its own judgements.

    .venv/bin/python benchmarks/learned_rewards_self.py [--seed N] [--spin [--spin-data KEY=VALUE]] \
        [--sft-cache FILE] [key=value ...]

--sft-cache FILE: load the cold start's weights from FILE if it exists, else train and save them there.

`self_rewarding_gain(seed)` runs, with the built-in model on the built-in arithmetic task:

1. cold start: SFT on the task's noisy teacher traces with a fraction of judge training data
   (sft.judge_fraction: the judge prompt of a right or corrupted completion -> the verifier's
   judgement, the Self-Rewarding paper's EFT data, arXiv 2401.10020 sec. 2.2);
2. one self-rewarding iteration: DPO on pairs of the policy's own samples ranked by its own
   judgements (dpo.pairs=self_judged; the verifier is not used);

and returns held-out pass@1 (by the verifier) before and after the iteration, their difference
(`self_rewarding_gain`), and `judge_accuracy`: how often the cold-start model's judgement of its own
held-out samples (score 1: right, anything else, unparsed included: wrong) agrees with the verifier.

`spin_gain(seed)` runs the default cold start (no judge data) and one SPIN iteration
(dpo.pairs=spin: the SFT data as chosen, the policy's own samples as rejected), whose data are the
teacher's traces without corrupted ones, as in reinforge/pipelines/spin.yaml (`--spin-data
sft.corrupt_fraction=0.3`: the cold start's own noisy data).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from reinforge.config import Config, build_config
from reinforge.eval.evaluate import evaluate
from reinforge.jobs.rl import run_dpo, sft_examples
from reinforge.jobs.start import preference_spec, seed_everything
from reinforge.learner import ForwardPlan
from reinforge.loops.sft import run_sft
from reinforge.models import Policy, load_policy
from reinforge.rewards.judge import build_judge
from reinforge.rollout import SamplingParams, build_engine
from reinforge.rollout.base import RolloutEngine
from reinforge.settings.judge import JudgeConfig
from reinforge.tasks import Task, build_task

# The default job's cold start (600 SFT steps; with 400 the judge was right on 0.78 of its own samples,
# not 0.96, and the iteration lost 0.02 pass@1) with half of it judge data, and one iteration of 30 DPO
# steps as in reinforge/pipelines/self_rewarding.yaml. One torch thread: on the 2-core machine shared
# with other jobs, two threads took 1.29 s per SFT step and one 0.49 s.
SELF_REWARDING = [
    "recipe=dpo", "dpo.pairs=self_judged", "sft.steps=600", "sft.judge_fraction=0.5", "train.steps=30",
    "train.prompts_per_step=16", "train.group_size=8", "eval.num_prompts=200", "eval.num_samples=8",
    "log.progress=false", "threads=1",
]
SPIN = ["recipe=dpo", "dpo.pairs=spin", "sft.steps=600", "train.steps=30", "train.prompts_per_step=64",
        "eval.num_prompts=200", "eval.num_samples=8", "log.progress=false", "threads=1"]
# SPIN's data in reinforge/pipelines/spin.yaml: the teacher's traces without the cold start's corrupted ones.
SPIN_DATA = ["sft.corrupt_fraction=0"]


def cold_start(cfg: Config, cache: str | None = None) -> tuple[Task, Policy, RolloutEngine]:
    """The pipeline's cold start: the task, the policy after SFT on sft_examples, an engine over it.
    `cache`: a file of SFT weights, loaded when it exists, else written after SFT."""
    torch.set_num_threads(cfg.threads)
    seed_everything(cfg.seed)
    task = build_task(cfg.task.name, **cfg.task.options)
    policy = load_policy(cfg.model, cfg.seed)
    engine = build_engine(cfg.rollout, policy, chat_template=cfg.prompt.chat_template)
    if cache and Path(cache).is_file():
        policy.model.load_state_dict(torch.load(cache))
        return task, policy, engine
    data, _ = sft_examples(cfg, engine, task)
    run_sft(policy, data, cfg.sft, chat_template=cfg.prompt.chat_template, seed=cfg.seed,
            forward=ForwardPlan.from_config(cfg.train))
    if cache:
        torch.save(policy.model.state_dict(), cache)
    return task, policy, engine


def pass_at_1(cfg: Config, engine: RolloutEngine, task: Task) -> float:
    return evaluate(engine, task, task.eval_split(cfg.eval.num_prompts), num_samples=cfg.eval.num_samples,
                    sampling=SamplingParams.from_config(cfg.rollout), seed=cfg.eval.seed).pass_at_1


def judge_accuracy(cfg: Config, policy: Policy, engine: RolloutEngine, task: Task, samples: int = 4) -> dict:
    """The policy's judgements of its own samples of the held-out prompts against the verifier."""
    examples = task.eval_split(cfg.eval.num_prompts)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.eval.seed)
        rollout = engine.generate([e.prompt for e in examples], samples, SamplingParams.from_config(cfg.rollout))
        judged = build_judge(cfg.reward.judge or JudgeConfig(), policy, cfg.model.device,
                             cfg.prompt.chat_template).judge([e.prompt for e in examples for _ in range(samples)],
                                                             rollout.texts)
    right = torch.tensor([task.reward(examples[r // samples], t) >= 1.0 for r, t in enumerate(rollout.texts)])
    says_right = judged.scores == 1.0          # NaN (unparsed) is never 1: counted as a wrong judgement
    return {"judge_accuracy": float((says_right == right).float().mean()),
            "judge_unscored": judged.unscored / len(rollout.texts),
            "judge_false_positive": float((says_right & ~right).float().mean()),
            "judge_false_negative": float((~says_right & right).float().mean())}


def self_rewarding_gain(seed: int = 0, overrides: list[str] | None = None, sft_cache: str | None = None,
                        threads: int = 1) -> dict:
    """Cold start with judge data -> one self-rewarding DPO iteration; held-out pass@1 before and after.
    `threads`: torch threads (2 is faster on an idle 2-core machine, much slower on a busy one)."""
    t0 = time.perf_counter()
    cfg = build_config([*SELF_REWARDING, f"seed={seed}", f"threads={threads}", *(overrides or [])])
    task, policy, engine = cold_start(cfg, sft_cache)
    t_sft = time.perf_counter() - t0
    start = pass_at_1(cfg, engine, task)
    judging = judge_accuracy(cfg, policy, engine, task)
    print(json.dumps({"start_pass@1": start, **judging, "sft_seconds": t_sft}), file=sys.stderr)
    steps: list[dict] = []

    def on_step(record, state) -> None:
        steps.append(record.metrics)
        print(json.dumps({"step": record.step, **{k: round(v, 4) for k, v in record.metrics.items()
                                                  if k.startswith(("dpo/", "judge/", "reward_mean"))}}),
              file=sys.stderr)

    run_dpo(cfg, policy, engine, task, preference_spec(cfg), on_step)
    after = pass_at_1(cfg, engine, task)
    return {"start_pass@1": start, "after_pass@1": after, "self_rewarding_gain": after - start, **judging,
            "pairs_per_step": sum(s["dpo/pairs"] for s in steps) / len(steps),
            "chosen_correct": _nanmean([s["dpo/chosen_correct"] for s in steps]),
            "rejected_correct": _nanmean([s["dpo/rejected_correct"] for s in steps]),
            "sft_seconds": t_sft, "seconds": time.perf_counter() - t0}


def spin_gain(seed: int = 0, overrides: list[str] | None = None, sft_cache: str | None = None,
              data: list[str] | None = None) -> dict:
    """Cold start -> one SPIN iteration on the SFT data of `data` (default SPIN_DATA, as spin.yaml);
    held-out pass@1 before and after."""
    t0 = time.perf_counter()
    cfg = build_config([*SPIN, f"seed={seed}", *(overrides or [])])
    task, policy, engine = cold_start(cfg, sft_cache)
    start = pass_at_1(cfg, engine, task)
    spin = build_config([*SPIN, f"seed={seed}", *(overrides or []), *(SPIN_DATA if data is None else data)])
    run_dpo(spin, policy, engine, task, preference_spec(spin), lambda record, state: None)
    after = pass_at_1(cfg, engine, task)
    return {"start_pass@1": start, "after_pass@1": after, "spin_gain": after - start,
            "seconds": time.perf_counter() - t0}


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if v == v]
    return sum(kept) / len(kept) if kept else float("nan")


if __name__ == "__main__":
    args = sys.argv[1:]
    seed = int(args.pop(args.index("--seed") + 1)) if "--seed" in args else 0
    cache = args.pop(args.index("--sft-cache") + 1) if "--sft-cache" in args else None
    spin_data = [args.pop(args.index("--spin-data") + 1)] if "--spin-data" in args else None
    rest = [a for a in args if a not in ("--seed", "--spin", "--sft-cache", "--spin-data")]
    if "--spin" in args:
        print(json.dumps(spin_gain(seed, rest, cache, spin_data)))
    else:
        print(json.dumps(self_rewarding_gain(seed, rest, cache)))
