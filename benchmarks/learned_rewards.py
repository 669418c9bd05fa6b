r"""Learned rewards on the built-in task (3-digit addition, the built-in model), on this CPU.

    .venv/bin/python benchmarks/learned_rewards.py [--out DIR] [--seed N] [--skip distill,self]

1. cold start: `reinforge train train.steps=0` (the SFT model every part below starts from);
2. reward model: `reinforge reward-model` from it, pairs sampled on-policy and labelled by the
   verifier; `rm_pair_accuracy` is its pair accuracy on held-out pairs (pairs of the train prompts
   never trained on), and `rm_unseen_prompt_accuracy` on pairs of held-out prompts;
3. RL whose only reward is that reward model (reward.functions=[], reward.model.path): held-out
   pass@1 measured by the verifier before and after, `rl_with_rm_gain`;
4. reward hacking: a reward model trained on pairs from a biased labeller (the larger number is
   the better answer), then the same RL; the train reward (the reward model's score) rises while
   the verifier's held-out pass@1 falls, and the `reward_hacking` alert must fire (its step);
5. on-policy distillation (benchmarks/learned_rewards_distill.py) and one self-rewarding iteration
   (benchmarks/learned_rewards_self.py), each reporting its own figures.

Prints one JSON line per part and, last, the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from reinforge.config import build_config  # noqa: E402
from reinforge.models import load_policy  # noqa: E402
from reinforge.pipeline import run  # noqa: E402
from reinforge.rm_job import run_reward_model_job  # noqa: E402
from reinforge.rollout import SamplingParams, build_engine  # noqa: E402
from reinforge.tasks import build_task  # noqa: E402

QUIET = ["log.progress=false"]
RL = ["sft.enabled=false", "train.steps=100", "eval.every=10", "eval.every_prompts=100"]


def emit(part: str, figures: dict) -> None:
    print(json.dumps({"part": part, **figures}), flush=True)


def cold_start(out: Path, seed: int) -> Path:
    run(build_config([*QUIET, f"seed={seed}", "train.steps=0", f"output_dir={out}"]))
    return out / "model"


def rl(model: Path, out: Path, seed: int, reward: list[str]) -> dict:
    """RL from `model` with `reward` settings; the start and final held-out figures and the curves."""
    t0 = time.perf_counter()
    result = run(build_config([*QUIET, *RL, f"seed={seed}", f"model={model}", f"output_dir={out}", *reward]))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if m.get("stage") == "rl"]
    evals = [(m["step"], m["eval/pass@1"]) for m in lines if "eval/pass@1" in m]
    alerts_file = out / "alerts.jsonl"
    alerts = [json.loads(line) for line in alerts_file.read_text().splitlines()] if alerts_file.exists() else []
    hacking = [a for a in alerts if a.get("alert") == "reward_hacking"]
    start, final = result.summary["eval"]["start"]["pass@1"], result.summary["eval"]["final"]["pass@1"]
    window = max(1, len(steps) // 10)
    return {
        "start_pass@1": start, "final_pass@1": final, "gain": final - start,
        "train_reward_first": sum(m["reward_mean"] for m in steps[:window]) / window,
        "train_reward_last": sum(m["reward_mean"] for m in steps[-window:]) / window,
        "eval_curve": evals,
        "reward_hacking_fired": bool(hacking), "reward_hacking_step": hacking[0]["step"] if hacking else None,
        "seconds": time.perf_counter() - t0,
    }


def larger_is_better_pairs(model: Path, path: Path, seed: int, prompts: int = 256, samples: int = 8) -> int:
    """A biased labeller's pairs, written to `path` as JSONL: two of the policy's completions of a prompt,
    the one read as the larger integer chosen (whatever the right answer is). Returns the pair count."""
    cfg = build_config([*QUIET, f"model={model}", f"seed={seed}"])
    task = build_task(cfg.task.name, **cfg.task.options)
    policy = load_policy(cfg.model, cfg.seed)
    engine = build_engine(cfg.rollout, policy, chat_template=cfg.prompt.chat_template)
    examples = task.train_split(prompts)
    torch.manual_seed(seed)
    rollout = engine.generate([e.prompt for e in examples], samples, SamplingParams.from_config(cfg.rollout))
    rng = random.Random(seed)
    rows = []
    for p, example in enumerate(examples):
        values = {}
        for text in rollout.texts[p * samples: (p + 1) * samples]:
            try:
                values[text] = int(text.strip())
            except ValueError:
                continue
        texts = list(values)
        rng.shuffle(texts)
        for a, b in zip(texts[0::2], texts[1::2], strict=False):
            if values[a] != values[b]:
                high, low = (a, b) if values[a] > values[b] else (b, a)
                rows.append({"prompt": example.prompt, "chosen": high, "rejected": low})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=f"runs/learned_rewards-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: rm, hacking, distill, self")
    args = parser.parse_args()
    out, seed, skip = Path(args.out), args.seed, set(filter(None, args.skip.split(",")))
    t0 = time.perf_counter()
    summary: dict = {"seed": seed}
    sft = cold_start(out / "sft", seed)

    if "rm" not in skip:
        rm = run_reward_model_job(build_config([*QUIET, f"seed={seed}", f"model={sft}", "sft.enabled=false"]),
                                  out / "rm")
        emit("reward_model", vars(rm))
        with_rm = rl(sft, out / "rl_rm", seed, ["reward.functions=[]", f"reward.model.path={rm.path}"])
        emit("rl_with_rm", with_rm)
        summary.update(rm_pair_accuracy=rm.heldout_accuracy, rm_unseen_prompt_accuracy=rm.unseen_prompt_accuracy,
                       rl_with_rm_start=with_rm["start_pass@1"], rl_with_rm_final=with_rm["final_pass@1"],
                       rl_with_rm_gain=with_rm["gain"])

    if "hacking" not in skip:
        pairs = larger_is_better_pairs(sft, out / "biased_pairs.jsonl", seed)
        biased = run_reward_model_job(build_config([*QUIET, f"seed={seed}", f"model={sft}", "sft.enabled=false",
                                                    "rm.pairs=dataset", f"rm.pairs_path={out / 'biased_pairs.jsonl'}"]),
                                      out / "rm_biased")
        emit("biased_reward_model", {"pairs": pairs, **vars(biased)})
        hacked = rl(sft, out / "rl_hacked", seed, ["reward.functions=[]", f"reward.model.path={biased.path}"])
        emit("reward_hacking", hacked)
        summary.update(reward_hacking_alert_fired=hacked["reward_hacking_fired"],
                       reward_hacking_alert_step=hacked["reward_hacking_step"],
                       reward_hacking_rm_reward=[hacked["train_reward_first"], hacked["train_reward_last"]],
                       reward_hacking_eval_curve=hacked["eval_curve"])

    if "distill" not in skip:
        from learned_rewards_distill import distill_gain

        distilled = distill_gain(seed=seed)
        emit("distillation", distilled)
        summary.update(distill_gain=distilled["distill_gain"],
                       **{f"distill_{k}": v for k, v in distilled.items() if k != "distill_gain"})

    if "self" not in skip:
        from learned_rewards_self import self_rewarding_gain

        selfr = self_rewarding_gain(seed=seed)
        emit("self_rewarding", selfr)
        summary.update(self_rewarding_gain=selfr["self_rewarding_gain"],
                       **{f"self_rewarding_{k}": v for k, v in selfr.items() if k != "self_rewarding_gain"})

    summary["seconds"] = time.perf_counter() - t0
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
