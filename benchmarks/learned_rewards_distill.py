r"""On-policy distillation against GRPO on the built-in task: how far, and how fast, each lifts a student.

    .venv/bin/python benchmarks/learned_rewards_distill.py [--seed 0] [--steps 40] [--threads 2] [key=value ...]

1. The teacher: the default job (`make run`): cold-start SFT, then 150 GRPO steps (held-out pass@1 ~0.92).
2. The student: a fresh cold start of its own (seed + 1, SFT only; pass@1 ~0.6), saved as a folder.
3. From that student, the same prompts, steps and learning rate, once with on-policy distillation alone
   (`reward.functions=[]`, `reward.teacher.path=TEACHER`: the teacher's per-token reverse KL is the whole
   advantage) and once with GRPO alone (the verifier's reward), evaluating the held-out prompts every
   `eval_every` steps.

Prints one JSON line: `distill_gain` (held-out pass@1 after distillation minus the student's),
`grpo_gain`, and the steps each took to reach min(distill_gain, 0.15) over the student (None: never within
`steps`), with the runs' wall-clock seconds. `distill_gain(seed)` returns the same dict. key=value
overrides apply to every run (a smaller model or shorter SFT for a quick check).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from reinforge.config import build_config
from reinforge.jobs.train import run

GAIN = 0.15     # the gain whose steps are counted (or the distillation's own, when it gains less)


def _run(args: list[str], out: Path, threads: int) -> dict:
    """One `reinforge train` run into `out`: its summary.json, with its RL metrics lines as "steps"."""
    run(build_config([*args, f"threads={threads}", "log.progress=false", "checkpoint.every=0",
                      "log.samples_every=0", f"output_dir={out}"]))
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary["steps"] = [x for x in lines if x.get("stage") == "rl"]
    return summary


def _curve(summary: dict) -> list[tuple[int, float]]:
    """(step, held-out pass@1) from the start of RL to its end, the evaluations between included."""
    evals = summary["eval"]
    middle = [(x["step"], x["eval/pass@1"]) for x in summary["steps"] if "eval/pass@1" in x]
    return [(0, evals["start"]["pass@1"]), *middle, (summary["rl_steps"], evals["final"]["pass@1"])]


def _steps_to(curve: list[tuple[int, float]], start: float, gain: float) -> int | None:
    """The first evaluated step whose pass@1 is at least start + gain; None when none is."""
    return next((step for step, value in curve if step > 0 and value - start >= gain - 1e-9), None)


def distill_gain(seed: int = 0, *, steps: int = 40, eval_every: int = 5, threads: int = 2,
                 overrides: list[str] | tuple[str, ...] = (), workdir: str | Path | None = None) -> dict:
    """Teacher, student, then distillation and GRPO from the student (see the module docstring)."""
    t0 = time.perf_counter()
    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="distill_"))
    common = [*overrides, f"seed={seed}"]
    teacher = _run([*common, "eval.every=0"], root / "teacher", threads)
    t_teacher = time.perf_counter()
    student = _run([*overrides, f"seed={seed + 1}", "train.steps=0"], root / "student", threads)
    t_student = time.perf_counter()
    start = student["eval"]["final"]["pass@1"]
    # The same prompts, steps, lr and evaluations for both; only the advantage differs. No KL to the
    # student's own start (objective.kl_coef=0) for either: it would hold the student back from the teacher.
    after = [*common, f"model.path={root / 'student' / 'model'}", "sft.enabled=false", f"train.steps={steps}",
             f"eval.every={eval_every}", "objective.kl_coef=0"]
    distill = _run([*after, "reward.functions=[]", f"reward.teacher.path={root / 'teacher' / 'model'}"],
                   root / "distill", threads)
    t_distill = time.perf_counter()
    grpo = _run(after, root / "grpo", threads)
    t_grpo = time.perf_counter()
    distill_final, grpo_final = distill["eval"]["final"]["pass@1"], grpo["eval"]["final"]["pass@1"]
    target = min(distill_final - start, GAIN)
    return {
        "teacher_pass@1": teacher["eval"]["final"]["pass@1"],
        "student_start_pass@1": start,
        "distill_pass@1": distill_final,
        "distill_gain": distill_final - start,
        "distill_steps_to_gain": _steps_to(_curve(distill), start, target),
        "grpo_pass@1": grpo_final,
        "grpo_gain": grpo_final - start,
        "grpo_steps_to_gain": _steps_to(_curve(grpo), start, target),
        "gain_counted": target,
        "distill_curve": _curve(distill),
        "grpo_curve": _curve(grpo),
        "distill_reverse_kl": [round(x["reward/teacher/reverse_kl"], 4) for x in distill["steps"]],
        "steps": steps,
        "teacher_seconds": t_teacher - t0,
        "student_seconds": t_student - t_teacher,
        "distill_seconds": t_distill - t_student,
        "grpo_seconds": t_grpo - t_distill,
        "seconds": time.perf_counter() - t0,
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    options = {name: int(value) for name, value in zip(args, args[1:], strict=False) if name.startswith("--")}
    rest = [a for a in args if "=" in a and not a.startswith("--")]
    print(json.dumps(distill_gain(options.get("--seed", 0), steps=options.get("--steps", 40),
                                  threads=options.get("--threads", 2), overrides=rest)))
