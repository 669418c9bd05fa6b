r"""GRPO with an int8 sampler and an fp32 learner, without and with a mismatch correction, against an fp32 sampler.

    .venv/bin/python benchmarks/quantized_rollouts.py [--model DIR] [--steps N] [--out DIR] [--plot PNG] \
        [--variants a,b] [--sft-steps N] [key=value ...]

--model DIR: a cold-started model folder (e.g. the `model/` of a run with train.steps=0); without it,
the default cold start (--sft-steps, 600) runs first, once, under --out. key=value: overrides of every run.

Each variant runs GRPO on the built-in arithmetic task from the same cold-started weights, seed and
prompts, with one torch thread:

- fp32: the engine samples with the training weights (rollout.quantization=none);
- int8: rollout.quantization=int8 (q/k/v/o and MLP projections per-channel int8, LM head fp32);
- int8_head: also the LM head in int8 (rollout.quantize_lm_head=true);
- int8_head+tis / int8_head+mis: the same sampler, and the token-level TIS (cap 2) / MIS ([0.5, 2])
  correction on the learner's loss (objective.correction);
- int8_head+decoupled: the same sampler, and AReaL's decoupled PPO (objective.policy_loss=decoupled_ppo):
  PPO's clip around the learner's pi_old, the sampler entering through the weight pi_old / mu only.

Per step it records reward, response length, entropy (the learner's, of the full distribution) and
the sampler-learner mismatch at pi_old (mismatch_kl, is_weight_max, mismatch_abs_diff_max; the
learner's own forward, reinforge/objectives/corrections.py). Prints one line per variant and, last,
one JSON line: per variant the mean of each figure over the run and over its last 10 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import reinforge

BASE = {"train.prompts_per_step": 16, "train.group_size": 8, "threads": 1, "log.progress": False, "seed": 0,
        "sft.steps": 0, "eval.num_prompts": 100, "eval.num_samples": 4}
VARIANTS = {
    "fp32": {},
    "int8": {"rollout.quantization": "int8"},
    "int8_head": {"rollout.quantization": "int8", "rollout.quantize_lm_head": True},
    "int8_head+tis": {"rollout.quantization": "int8", "rollout.quantize_lm_head": True, "objective.correction": "tis"},
    "int8_head+mis": {"rollout.quantization": "int8", "rollout.quantize_lm_head": True, "objective.correction": "mis"},
    # AReaL's decoupled PPO in the synchronous loop: the clip around the learner's pi_old (the proximal
    # policy) and the int8 sampler entering only through the detached weight pi_old / mu (cap 5)
    "int8_head+decoupled": {"rollout.quantization": "int8", "rollout.quantize_lm_head": True,
                            "objective.policy_loss": "decoupled_ppo",
                            "objective.policy_params": {"eps": 0.2, "w_max": 5.0}},
}
FIGURES = ["reward_mean", "response_length_mean", "entropy", "mismatch_kl", "is_weight_max", "mismatch_abs_diff_max"]


def curves(run_dir: Path) -> dict[str, list[float]]:
    """Each figure's per-step values from a run's metrics.jsonl (NaN where a step did not log it)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward_mean" in r]
    return {f: [float(r.get(f, math.nan)) for r in rows] for f in FIGURES}


def mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, figure in zip(axes.flat, FIGURES, strict=True):
        for name, result in results.items():
            ax.plot(result["curves"][figure], label=name, lw=1.2)
        ax.set_title(figure)
        ax.set_xlabel("step")
        if figure in ("mismatch_kl", "mismatch_abs_diff_max"):
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("GRPO, arithmetic: int8 sampler / fp32 learner, with and without correction")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default="runs/quantized_rollouts")
    parser.add_argument("--plot", default="docs/img/quantized_rollouts.png")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("overrides", nargs="*", help="key=value settings of every run")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.overrides)
    out = Path(args.out)
    model = args.model
    if model is None:
        cold = reinforge.train(output_dir=str(out / "cold_start"), **{**BASE, **extra, "sft.steps": args.sft_steps,
                                                                           "train.steps": 0})
        model = str(cold.model_dir)
    results = {}
    for name in args.variants.split(","):
        start = time.time()
        run = reinforge.train(model=model, output_dir=str(out / name.replace("+", "_")),
                              **{**BASE, **extra, "train.steps": args.steps, **VARIANTS[name]})
        c = curves(run.run_dir)
        results[name] = {
            "curves": c,
            "mean": {f: mean(v) for f, v in c.items()},
            "last10": {f: mean(v[-10:]) for f, v in c.items()},
            "pass@1_final": run.eval.get("final", {}).get("pass@1"),
            "pass@1_start": run.eval.get("start", {}).get("pass@1"),
            "seconds": round(time.time() - start, 1),
        }
        r = results[name]
        print(f"{name:14s} reward(last10) {r['last10']['reward_mean']:.3f} mismatch_kl {r['mean']['mismatch_kl']:.2e}  "
              f"is_weight_max {r['mean']['is_weight_max']:.4f}  pass@1 {r['pass@1_start']} -> {r['pass@1_final']}  "
              f"{r['seconds']} s", flush=True)
    plot(results, Path(args.plot))
    print(json.dumps({name: {k: v for k, v in r.items() if k != "curves"} for name, r in results.items()}))


if __name__ == "__main__":
    main()
