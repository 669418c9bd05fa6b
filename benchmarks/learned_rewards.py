r"""Learned rewards on the built-in task (3-digit addition, the built-in model), on this CPU.

    .venv/bin/python benchmarks/learned_rewards.py [--out DIR] [--seed N] [--skip distill,self]

1. cold start: `reinforge train train.steps=0` (the SFT model every part below starts from);
2. reward model: `reinforge reward-model` from it, pairs sampled on-policy and labelled by the
   verifier; `rm_pair_accuracy` is its pair accuracy on held-out pairs (pairs of the train prompts
   never trained on), and `rm_unseen_prompt_accuracy` on pairs of held-out prompts;
3. RL whose only reward is that reward model (reward.functions=[], reward.model.path): held-out
   pass@1 measured by the verifier before and after, `rl_with_rm_gain`;
4. reward hacking: a reward model trained on few pairs (those of 64 prompts), then longer RL; the
   train reward (that reward model's score) rises while the verifier's held-out pass@1 falls, and
   the `reward_hacking` alert must fire (its step);
5. on-policy distillation (benchmarks/learned_rewards_distill.py) and one self-rewarding iteration
   (benchmarks/learned_rewards_self.py), each reporting its own figures.

Prints one JSON line per part and, last, the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from reinforge.config import build_config  # noqa: E402
from reinforge.jobs.reward_model import run_reward_model_job  # noqa: E402
from reinforge.jobs.train import run  # noqa: E402

QUIET = ["log.progress=false", "threads=1"]
RL = ["sft.enabled=false", "eval.every=10", "eval.every_prompts=100"]
# The reward model: pairs of every RL train prompt (train.num_prompts, 1000), a gentle lr for a pretrained backbone.
RM = ["rm.num_prompts=1000", "rm.samples_per_prompt=16", "rm.pairs_per_prompt=8", "rm.steps=4000", "rm.lr=1e-4"]
RM_RL = ["train.steps=50"]
# The hackable one: the pairs of 64 prompts only, and RL twice as long.
FEW_PAIRS = ["rm.num_prompts=64", "rm.steps=1500", "rm.lr=3e-4"]
HACKING_RL = ["train.steps=100"]


def emit(part: str, figures: dict) -> None:
    print(json.dumps({"part": part, **figures}), flush=True)


def cold_start(out: Path, seed: int) -> Path:
    """The SFT model every part starts from; an earlier invocation's, when --out already holds it."""
    if not (out / "summary.json").exists():
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


def part_rm(out: Path, seed: int, sft: Path) -> dict:
    rm = run_reward_model_job(build_config([*QUIET, f"seed={seed}", f"model={sft}", "sft.enabled=false", *RM]),
                              out / "rm")
    emit("reward_model", vars(rm))
    with_rm = rl(sft, out / "rl_rm", seed, ["reward.functions=[]", f"reward.model.path={rm.path}", *RM_RL])
    emit("rl_with_rm", with_rm)
    return {"rm_pair_accuracy": rm.heldout_accuracy, "rm_heldout_pairs": rm.heldout_pairs,
            "rm_unseen_prompt_accuracy": rm.unseen_prompt_accuracy, "rl_with_rm_start": with_rm["start_pass@1"],
            "rl_with_rm_final": with_rm["final_pass@1"], "rl_with_rm_gain": with_rm["gain"],
            "rl_with_rm_eval_curve": with_rm["eval_curve"]}


def part_hacking(out: Path, seed: int, sft: Path) -> dict:
    few = run_reward_model_job(build_config([*QUIET, f"seed={seed}", f"model={sft}", "sft.enabled=false",
                                             *FEW_PAIRS]), out / "rm_few")
    emit("few_pairs_reward_model", vars(few))
    hacked = rl(sft, out / "rl_hacked", seed, ["reward.functions=[]", f"reward.model.path={few.path}", *HACKING_RL])
    emit("reward_hacking", hacked)
    return {"reward_hacking_rm_pair_accuracy": few.heldout_accuracy,
            "reward_hacking_alert_fired": hacked["reward_hacking_fired"],
            "reward_hacking_alert_step": hacked["reward_hacking_step"],
            "reward_hacking_rm_reward": [hacked["train_reward_first"], hacked["train_reward_last"]],
            "reward_hacking_eval_curve": hacked["eval_curve"]}


def part_distill(out: Path, seed: int, sft: Path) -> dict:
    from learned_rewards_distill import distill_gain

    distilled = distill_gain(seed=seed, threads=1, workdir=out / "distill")
    emit("distillation", distilled)
    return {"distill_gain": distilled["distill_gain"], "distillation": distilled}


def part_self(out: Path, seed: int, sft: Path) -> dict:
    from learned_rewards_self import self_rewarding_gain

    selfr = self_rewarding_gain(seed=seed)
    emit("self_rewarding", selfr)
    return {"self_rewarding_gain": selfr["self_rewarding_gain"], "self_rewarding": selfr}


PARTS = {"rm": part_rm, "hacking": part_hacking, "distill": part_distill, "self": part_self}


def main() -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=f"runs/learned_rewards-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: rm, hacking, distill, self")
    parser.add_argument("--workers", type=int, default=2, help="parts run at once (one torch thread each)")
    args = parser.parse_args()
    out, seed, skip = Path(args.out), args.seed, set(filter(None, args.skip.split(",")))
    t0 = time.perf_counter()
    sft = cold_start(out / "sft", seed)
    summary: dict = {"seed": seed, "cpu": cpu_model()}
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {name: pool.submit(part, out, seed, sft) for name, part in PARTS.items() if name not in skip}
        for future in futures.values():
            summary.update(future.result())
    summary["seconds"] = time.perf_counter() - t0
    print(json.dumps(summary), flush=True)
    return summary


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
