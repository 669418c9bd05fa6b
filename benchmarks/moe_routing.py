r"""GRPO vs GSPO on the built-in MoE model, with and without routing replay.

    .venv/bin/python benchmarks/moe_routing.py [--out DIR] [--plot PNG] [key=value ...]

One cold-start SFT of the built-in arithmetic task on a Qwen2-MoE built-in model (model.moe.*),
then four RL runs from its weights: recipe grpo / gspo x train.routing_replay false / true, one
at a time, threads=1. Every RL step logs moe/routing_mismatch: the fraction of tokens (prompt and
completion) whose top-k expert set in some MoE layer differs between the sampler (the native
engine, at rollout) and the learner's forward. With train.mini_batches=2 the second optimizer step
of a batch runs on weights one step newer than the sampler's, so routing drifts even in fp32.

Writes the plot (reward and routing mismatch per step, the four runs) and prints one JSON line
per run and, last, a JSON summary.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from reinforge.config import build_config
from reinforge.jobs.train import run

MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_size=128", "threads=1", "log.progress=false"]
RUNS = [("grpo", False), ("grpo", True), ("gspo", False), ("gspo", True)]


def _records(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("stage") == "rl"]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main(argv: list[str]) -> dict:
    out, plot, overrides = Path("runs/moe_routing"), Path("docs/img/moe_routing.png"), []
    args = iter(argv)
    for a in args:
        if a == "--out":
            out = Path(next(args))
        elif a == "--plot":
            plot = Path(next(args))
        else:
            overrides.append(a)
    t0 = time.perf_counter()
    sft_dir = out / "sft"
    sft = build_config([*MOE, "train.steps=0", "eval.num_prompts=8", *overrides, f"output_dir={sft_dir}"])
    rl_overrides = [o for o in overrides if not o.startswith(("sft.", "model."))]   # SFT and the model: stage 1
    run(sft, overwrite=True)
    results = []
    for recipe, replay in RUNS:
        name = f"{recipe}{'+replay' if replay else ''}"
        run_dir = out / name
        # The SFT model's folder: its config.json says qwen2_moe, so the native engine and the learner's
        # own forward run it; sft.steps=0 starts RL from those weights.
        cfg = build_config([*MOE[3:], "task.name=arithmetic", f"recipe={recipe}", f"model.path={sft_dir / 'model'}",
                            "sft.steps=0",
                            f"train.routing_replay={str(replay).lower()}", *rl_overrides, f"output_dir={run_dir}"])
        start = time.perf_counter()
        summary = run(cfg, overwrite=True).summary
        rl = _records(run_dir)
        mismatch = [r["moe/routing_mismatch"] for r in rl if "moe/routing_mismatch" in r]
        reward = [r["reward_mean"] for r in rl]
        tail = max(1, len(rl) // 4)
        row = {
            "run": name, "steps": len(rl), "seconds": round(time.perf_counter() - start, 1),
            "routing_mismatch_mean": _mean(mismatch), "reward_first_quarter": _mean(reward[:tail]),
            "reward_last_quarter": _mean(reward[-tail:]),
            "pass@1_start": summary["eval"]["start"]["pass@1"], "pass@1_final": summary["eval"]["final"]["pass@1"],
            "mismatch_abs_diff_mean": _mean([r.get("mismatch_abs_diff_mean", float("nan")) for r in rl]),
        }
        print(json.dumps(row), flush=True)
        results.append((row, rl))
    _plot(results, plot)
    summary = {"runs": [row for row, _ in results], "plot": str(plot),
               "wall_seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary))
    return summary


def _plot(results: list[tuple[dict, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for row, rl in results:
        steps = [r["step"] for r in rl]
        style = "-" if "replay" in row["run"] else "--"
        top.plot(steps, [r["reward_mean"] for r in rl], style, label=row["run"])
        bottom.plot(steps, [r.get("moe/routing_mismatch", float("nan")) for r in rl], style, label=row["run"])
    top.set_ylabel("reward_mean")
    bottom.set_ylabel("moe/routing_mismatch")
    bottom.set_xlabel("RL step")
    top.legend()
    top.set_title("Built-in MoE (Qwen2-MoE, 8 experts, top-2): routing replay")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
