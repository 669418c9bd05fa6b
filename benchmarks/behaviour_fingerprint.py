"""The numbers six fixed micro runs produce, so that a refactor can show it changed no behaviour.

    python benchmarks/behaviour_fingerprint.py OUT.json            # run the six configs, write their metrics
    python benchmarks/behaviour_fingerprint.py OUT.json --compare BEFORE.json

The configs (grpo, ppo, dapo, areal async, grpo async at max_staleness 0, dpo) are the test suite's micro
size with a fixed seed; every line of metrics.jsonl (SFT, evaluations, RL steps) is kept but wall-clock figures.
Two checkouts on the same machine and torch give identical files; `--compare` prints the first difference
and exits 1 when there is one. The final line is JSON: {"configs": 6, "equal": true|false|null, ...}.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

MICRO = [
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
    "model.intermediate_size=64", "sft.steps=3", "sft.batch_size=8", "sft.num_examples=32", "train.steps=3",
    "train.prompts_per_step=4", "train.group_size=4", "train.micro_batch_size=8", "rollout.max_new_tokens=4",
    "eval.num_prompts=6", "eval.num_samples=4", "log.progress=false", "threads=1", "seed=3",
]
CONFIGS = {
    "grpo": ["recipe=grpo"],
    "ppo": ["recipe=ppo"],
    "dapo": ["recipe=dapo"],
    "areal_async": ["recipe=areal"],
    "grpo_async_eta0": ["recipe=grpo", "train.mode=async", "train.max_staleness=0"],
    "dpo": ["recipe=dpo"],
}
# Wall-clock figures differ between any two runs; everything else must not.
TIMES = ("seconds", "time", "_s", "per_s", "wall", "elapsed", "throughput", "tokens_per")


def _kept(key: str) -> bool:
    return not any(t in key for t in TIMES)


def _clean(value):
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in sorted(value.items()) if _kept(k)}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def run_one(name: str, extra: list[str], root: Path) -> dict:
    """One config through the command line (the interface a refactor must keep), its metrics.jsonl."""
    out = root / name
    subprocess.run([sys.executable, "-m", "reinforge.cli", "train", *MICRO, *extra, f"output_dir={out}"],
                   check=True, stdout=subprocess.DEVNULL)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"lines": _clean(lines)}


def first_difference(a, b, path: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'after' if k in b else 'before'}"
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} entries != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--compare", default=None, help="a file an earlier run wrote; exit 1 on any difference")
    ap.add_argument("--only", default=None, help="comma-separated config names")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        result = {name: run_one(name, CONFIGS[name], Path(tmp)) for name in names}
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))
    equal, diff = None, None
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        diff = first_difference({k: before[k] for k in names}, result)
        equal = diff is None
    print(json.dumps({"configs": len(names), "equal": equal, "first_difference": diff,
                      "lines": {k: len(v["lines"]) for k, v in result.items()}}))
    return 1 if equal is False else 0


if __name__ == "__main__":
    sys.exit(main())
