"""The built-in tool task trained through the endpoint (an agent function) against the in-process tool rollout.

    .venv/bin/python benchmarks/tool_agent_vs_inprocess.py --out DIR [--threads 1] [--mode concurrent] [key=value ...]

The two runs:
- in_process: `reinforge train task.name=multiply_tool` (the native engine plays the calculator episodes,
  reinforge/agents/rollout.py);
- agent: `reinforge train task.name=multiply_tool task.agent=examples/multiply_agent.py:solve` (the same
  episodes played by an agent function through the OpenAI-compatible endpoint, reinforge/serve/).

Both run the task's preset unchanged (400 SFT steps, 150 RL steps of 16 prompts x 8, held-out evaluation of
100 prompts x 8 samples before and after RL), each in its own process with `--threads` torch threads
(`threads=N`). `--mode concurrent` (default) starts both at once, so that a machine shared with other work
loads both alike; `--mode alternate` runs one after the other. Load is sampled with os.getloadavg every
15 s while they run. key=value: config overrides for both runs (e.g. train.steps=20 for a quick check).

Read from each run's directory: summary.json's eval.start / eval.final pass@1 (held-out) and wall_seconds,
and metrics.jsonl's RL steps (step_seconds, generation_seconds). The last line of stdout is one JSON
object: per run pass@1 before/after and its gain, wall seconds (the process's and the run's own), RL
seconds, generation seconds; agent_over_in_process_wall (the ratio of the runs' wall_seconds) and
agent_over_in_process_rl; the load averages sampled (mean and max of the 1-minute figure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = {
    "in_process": ["task.name=multiply_tool"],
    "agent": ["task.name=multiply_tool", f"task.agent={REPO / 'examples' / 'multiply_agent.py'}:solve"],
}


def start(name: str, out: Path, threads: int, extra: list[str]) -> tuple[subprocess.Popen, float, object]:
    log = open(out / f"{name}.log", "w")  # noqa: SIM115 - closed when the run ends
    cmd = [sys.executable, "-m", "reinforge.cli", "train", *RUNS[name], f"threads={threads}",
           f"output_dir={out / name}", *extra]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), time.perf_counter(), log


def figures(run_dir: Path, seconds: float) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"stage": "rl"' in line]
    before, after = summary["eval"]["start"]["pass@1"], summary["eval"]["final"]["pass@1"]
    return {"pass1_before": before, "pass1_after": after, "gain": after - before,
            "greedy_after": summary["eval"]["final"]["greedy_accuracy"],
            "process_seconds": seconds, "wall_seconds": summary["wall_seconds"],
            "rl_steps": len(steps), "rl_seconds": sum(s["step_seconds"] for s in steps),
            "generation_seconds": sum(s["generation_seconds"] for s in steps),
            "episode_errors": sum(s.get("env/error_rate", 0.0) for s in steps) / max(len(steps), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--mode", choices=["concurrent", "alternate"], default="concurrent")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    loads: list[float] = []
    done = threading.Event()

    def sample_load() -> None:
        while not done.is_set():
            loads.append(os.getloadavg()[0])
            done.wait(15)

    threading.Thread(target=sample_load, daemon=True).start()
    seconds: dict[str, float] = {}
    names = list(RUNS)
    batches = [names] if args.mode == "concurrent" else [[n] for n in names]
    for batch in batches:
        running = {name: start(name, args.out, args.threads, args.overrides) for name in batch}
        for name, (proc, started, log) in running.items():
            if proc.wait() != 0:
                raise SystemExit(f"{name} failed (exit {proc.returncode}): see {args.out / f'{name}.log'}")
            seconds[name] = time.perf_counter() - started
            log.close()
    done.set()
    out = {name: figures(args.out / name, seconds[name]) for name in names}
    out["agent_over_in_process_wall"] = out["agent"]["wall_seconds"] / out["in_process"]["wall_seconds"]
    out["agent_over_in_process_rl"] = out["agent"]["rl_seconds"] / out["in_process"]["rl_seconds"]
    out["agent_minus_in_process_pass1_after"] = out["agent"]["pass1_after"] - out["in_process"]["pass1_after"]
    out["load_1min"] = {"mean": sum(loads) / len(loads), "max": max(loads), "samples": len(loads)}
    out["mode"], out["threads"], out["cpus"] = args.mode, args.threads, os.cpu_count()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
