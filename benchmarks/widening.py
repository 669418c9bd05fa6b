r"""Does RL widen what the model can solve, or only sharpen it? pass@1 against pass@k (k = 1..64) after each recipe.

    .venv/bin/python benchmarks/widening.py [--tasks a,b] [--recipes grpo,passk] [--seeds 0,1,2] [--steps N] \
        [--eval-prompts N] [--samples 64] [--out DIR] [--doc docs/results.md] [key=value ...]

Per task: one cold start (SFT, `train.steps=0`, seed 0), evaluated on the held-out prompts with
`--samples` samples each (pass@k for k = 1, 2, 4, ..., 64 by the unbiased estimator, greedy accuracy); a
cold start evaluated at another size is evaluated again at this one, in OUT/TASK/cold_start-evalNxS;
then every recipe x seed runs RL from that same model (`train.seed` is the RL stage's seed: the prompts
and the held-out split stay those of seed 0, so no run trains on a held-out prompt) and is evaluated the
same way, under the same evaluation seed. Each run's directory is OUT/TASK/RECIPE-sSEED; a directory with
summary.json is read back, not run again, so re-running the command resumes or extends the sweep.

Per task and recipe it reports the mean over seeds of pass@k, greedy accuracy and their seed spread
(sample std), the crossover k (the smallest k at which the recipe's mean pass@k falls below the cold
start's by more than 0.0005; none when it stays above or level up to k = --samples), and the test of
widening: pass@1 up by >= 0.15 while pass@8 and greedy accuracy stay >= start - 0.005 (means over
seeds). Prints the markdown table and, last, one JSON line of every figure. key=value: settings of
every run (e.g. threads=1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import yaml

import reinforge

# Each task: the settings of its cold start and of its RL runs (task and model size; the cold start's
# SFT steps). The reasoning-gym datasets are configured small enough for the built-in tiny model.
TASKS: dict[str, dict] = {
    "arithmetic": {"task.name": "arithmetic", "sft.steps": 600, "sft.batch_size": 256},
    "countdown": {"task.name": "countdown", "sft.steps": 600, "rollout.max_new_tokens": 12},
    "spell_backward": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
                       "task.options.datasets": [{"name": "spell_backward",
                                                  "config": {"min_word_len": 3, "max_word_len": 6}}]},
    "chain_sum": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
                  "task.options.datasets": [{"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 3,
                                                                             "min_digits": 1, "max_digits": 2}}]},
    "count_bits": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
                   "task.options.datasets": [{"name": "count_bits", "config": {"min_n": 1, "max_n": 4095}}]},
    "gcd": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
            "task.options.datasets": [{"name": "gcd", "config": {"min_value": 1, "max_value": 60}}]},
    "letter_counting": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
                        "task.options.datasets": [{"name": "letter_counting", "config": {"min_words": 3,
                                                                                         "max_words": 5}}]},
    "basic_arithmetic": {"task.name": "reasoning_gym", "sft.steps": 1000, "sft.batch_size": 128,
                         "task.options.datasets": [{"name": "basic_arithmetic",
                                                    "config": {"min_terms": 2, "max_terms": 2, "min_digits": 2,
                                                               "max_digits": 2, "operators": ["+", "-"],
                                                               "allow_parentheses": False,
                                                               "allow_negation": False}}]},
    "word_sequence_reversal": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
                               "model.max_positions": 224,
                               "task.options.datasets": [{"name": "word_sequence_reversal",
                                                          "config": {"min_words": 2, "max_words": 3}}]},
    "number_filtering": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
                         "task.options.datasets": [{"name": "number_filtering",
                                                    "config": {"min_numbers": 3, "max_numbers": 4,
                                                               "min_decimals": 0, "max_decimals": 0,
                                                               "min_value": -20, "max_value": 50}}]},
    # sums and differences of complex numbers with integer parts in [-10, 10] ("(-8.0 - 2.0i) + (-7.0 + 5.0i)")
    "complex_arithmetic": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
                           "task.options.datasets": [{"name": "complex_arithmetic",
                                                      "config": {"operations": ["+", "-"],
                                                                 "operations_weights": [0.5, 0.5]}}]},
    # 2x2 and 3x3 digit matrices turned by 0, 90, 180 or 270 degrees; questions of up to 193 characters
    "rotate_matrix": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
                      "model.max_positions": 256, "rollout.max_new_tokens": 24,
                      "task.options.datasets": [{"name": "rotate_matrix",
                                                 "config": {"min_n": 2, "max_n": 3, "min_rotations": 0,
                                                            "max_rotations": 3}}]},
    # x + a = b, a - x = b and the like: one unknown, two terms of 1 to 50 ("Solve for m: 3 - m = -17")
    "simple_equations": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
                         "rollout.max_new_tokens": 8,
                         "task.options.datasets": [{"name": "simple_equations",
                                                    "config": {"min_terms": 2, "max_terms": 2, "max_value": 50,
                                                               "operators": ["+", "-"],
                                                               "operators_weights": [0.5, 0.5]}}]},
    # lcm of two numbers up to 20 has ~390 distinct questions: too few for a held-out split of 400
    "lcm": {"task.name": "reasoning_gym", "sft.steps": 300, "sft.batch_size": 128,
            "task.options.datasets": [{"name": "lcm", "config": {"min_value": 1, "max_value": 20}}]},
}
TOLERANCE = 0.005      # pass@8 and greedy accuracy may fall by at most this much
GAIN = 0.15            # pass@1 must rise by at least this much


def task_settings(task: str, extra: dict, steps: int) -> tuple[dict, int, int]:
    """`task`'s settings with the command line's `extra` over them, without the SFT steps and RL steps
    (`train.steps` from either, else `steps`), and those two."""
    rest = {**TASKS[task], **extra}
    return rest, int(rest.pop("sft.steps")), int(rest.pop("train.steps", steps))


def run_once(out: Path, read_only: bool = False, **settings) -> dict | None:
    """summary.json of the run in `out`, running it first when it has none (None instead with `read_only`)."""
    if not (out / "summary.json").exists():
        if read_only:
            return None
        start = time.time()
        reinforge.train(output_dir=str(out), overwrite=True, **settings)
        print(f"  {out}: {time.time() - start:.0f} s", flush=True)
    return json.loads((out / "summary.json").read_text())


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def crossover(start: dict[str, float], curve: dict[str, float], margin: float = 0.0005) -> int | None:
    """The smallest k at which `curve`'s pass@k is below `start`'s by more than `margin` (curves that both reach
    1.000 do not cross); None when it stays above or level up to the largest k."""
    for k in sorted(start, key=int):
        if curve[k] < start[k] - margin:
            return int(k)
    return None


def summarise(start: dict, finals: list[dict]) -> dict:
    """Means and seed spreads of one recipe's runs against the cold start, with the widening test."""
    ks = sorted(start["pass@k"], key=int)
    curve = {k: statistics.fmean(f["pass@k"][k] for f in finals) for k in ks}
    spread = {k: (statistics.stdev([f["pass@k"][k] for f in finals]) if len(finals) > 1 else 0.0) for k in ks}
    greedy, greedy_std = _mean_std([f["greedy_accuracy"] for f in finals])
    gain = curve["1"] - start["pass@k"]["1"]
    drop8 = start["pass@k"]["8"] - curve["8"] if "8" in curve else float("nan")
    drop_greedy = start["greedy_accuracy"] - greedy
    return {"seeds": len(finals), "pass@k": curve, "pass@k_std": spread, "greedy": greedy, "greedy_std": greedy_std,
            "crossover_k": crossover(start["pass@k"], curve), "pass@1_gain": gain, "pass@8_drop": drop8,
            "greedy_drop": drop_greedy,
            "widens": gain >= GAIN and drop8 <= TOLERANCE and drop_greedy <= TOLERANCE}


def table(task: str, start: dict, rows: dict[str, dict]) -> str:
    ks = sorted(start["pass@k"], key=int)
    head = ("| recipe | " + " | ".join(f"pass@{k}" for k in ks) + " | greedy | crossover k | "
            "pass@1 gain | pass@8 drop | greedy drop | widens |")
    lines = [f"**{task}**", "", head, "|" + "---|" * (len(ks) + 7)]
    lines.append("| cold start | " + " | ".join(f"{start['pass@k'][k]:.3f}" for k in ks)
                 + f" | {start['greedy_accuracy']:.3f} | | | | | |")
    for recipe, r in rows.items():
        cells = [f"{r['pass@k'][k]:.3f} ± {r['pass@k_std'][k]:.3f}" for k in ks]
        cross = "none" if r["crossover_k"] is None else str(r["crossover_k"])
        lines.append(f"| {recipe} (n={r['seeds']}) | " + " | ".join(cells)
                     + f" | {r['greedy']:.3f} ± {r['greedy_std']:.3f} | {cross} | {r['pass@1_gain']:+.3f} | "
                     f"{r['pass@8_drop']:+.3f} | {r['greedy_drop']:+.3f} | "
                     f"{'yes' if r['widens'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", default="arithmetic,countdown,spell_backward,chain_sum")
    parser.add_argument("--recipes", default="grpo,passk")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--out", default="runs/widening")
    parser.add_argument("--cold-only", action="store_true", help="only the cold starts (to pick tasks)")
    parser.add_argument("--read-only", action="store_true", help="report the finished runs under --out, run nothing")
    parser.add_argument("overrides", nargs="*", help="key=value settings of every run")
    args = parser.parse_args()
    # values as the CLI reads them (YAML: 2 is an int, [a, b] a list)
    extra = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.overrides)}
    common = {"threads": 1, "log.progress": False, "seed": 0, "eval.every": 0,
              "eval.num_prompts": args.eval_prompts, "eval.num_samples": args.samples}
    report: dict[str, dict] = {}
    for task in args.tasks.split(","):
        settings, sft_steps, rl_steps = task_settings(task, extra, args.steps)
        settings = {**common, **settings}
        base = Path(args.out) / task
        cold = run_once(base / "cold_start", args.read_only, **settings,
                        **{"sft.steps": sft_steps, "train.steps": 0})
        if cold is None:
            continue
        start = cold["eval"]["final"]
        if (start["num_prompts"], start["num_samples"]) != (args.eval_prompts, args.samples):
            # a cold start evaluated at another size: evaluate its model at this one (no training)
            again = run_once(base / f"cold_start-eval{args.eval_prompts}x{args.samples}", args.read_only,
                             model=str(base / "cold_start" / "model"), **settings,
                             **{"sft.steps": 0, "train.steps": 0})
            if again is None:
                continue
            start = again["eval"]["final"]
        print(f"{task}: cold start pass@1 {start['pass@1']:.3f} pass@8 {start['pass@k'].get('8', float('nan')):.3f} "
              f"greedy {start['greedy_accuracy']:.3f}", flush=True)
        report[task] = {"start": {"pass@k": start["pass@k"], "greedy_accuracy": start["greedy_accuracy"]},
                        "recipes": {}, "seconds": {}}
        if args.cold_only:
            continue
        for recipe in args.recipes.split(","):
            finals, seconds = [], []
            for seed in args.seeds.split(","):
                summary = run_once(base / f"{recipe}-s{seed}", args.read_only,
                                   model=str(base / "cold_start" / "model"), recipe=recipe, **settings,
                                   **{"sft.steps": 0, "train.steps": rl_steps, "train.seed": int(seed)})
                if summary is None:
                    continue
                finals.append(summary["eval"]["final"])
                seconds.append(summary["wall_seconds"])
            if not finals:
                continue
            report[task]["recipes"][recipe] = summarise(report[task]["start"], finals)
            report[task]["seconds"][recipe] = max(seconds)
            r = report[task]["recipes"][recipe]
            print(f"  {recipe}: pass@1 {r['pass@k']['1']:.3f} pass@8 {r['pass@k'].get('8', float('nan')):.3f} "
                  f"greedy {r['greedy']:.3f} crossover {r['crossover_k']} widens {r['widens']}", flush=True)
        print(table(task, report[task]["start"], report[task]["recipes"]), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
