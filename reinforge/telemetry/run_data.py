"""What `reinforge report` and `reinforge sweep` read from a run directory: config.yaml,
metrics.jsonl, summary.json, alerts.jsonl and the last samples of samples.jsonl, as one RunData
per run, each with a label unique among the runs read together.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from reinforge.telemetry.samples import SAMPLES_FILE


def finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class RunData:
    """What the report reads from one run directory."""

    path: Path
    label: str                      # unique among the runs of one report
    recipe: str | None
    seed: int | None
    config: dict                    # config.yaml, {} when absent
    records: list[dict]             # metrics.jsonl lines (a torn last line is dropped)
    summary: dict | None            # summary.json; None while the run is going or after it failed
    alerts: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)   # samples.jsonl lines of the last step that logged some

    @property
    def rl_steps(self) -> int:
        if self.summary is not None:
            return int(self.summary.get("rl_steps", 0))
        return max((r["step"] for r in self.records if r.get("stage") == "rl" and "step" in r), default=0)

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of `key` over the RL and eval lines, in step order; nulls skipped.

        Held-out keys (eval/...) fall back to the summary's start (step 0) and
        final (last step) evaluation when no line carries them.
        """
        by_step: dict[int, float] = {}
        for stage in ("rl", "eval"):          # an eval line wins over an RL line of the same step
            for r in self.records:
                if r.get("stage") == stage and "step" in r and finite(r.get(key)):
                    by_step[int(r["step"])] = float(r[key])
        if not by_step and key.startswith("eval/") and self.summary is not None:
            name = key.removeprefix("eval/")
            ends = self.summary.get("eval", {})
            for step, stage in ((0, "start"), (self.rl_steps, "final")):
                if finite(ends.get(stage, {}).get(name)):
                    by_step[step] = float(ends[stage][name])
        return sorted(by_step.items())


def load_runs(run_dirs: Iterable[Path]) -> list[RunData]:
    runs = [_load_run(Path(p)) for p in run_dirs]
    _unique_labels(runs)
    return runs


def _load_run(path: Path) -> RunData:
    config_path = path / "config.yaml"
    config = (yaml.safe_load(config_path.read_text()) or {}) if config_path.is_file() else {}
    summary_path = path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    recipe = config.get("recipe", (summary or {}).get("recipe"))
    seed = config.get("seed", (summary or {}).get("seed"))
    label = f"{recipe} seed {seed}" if recipe is not None and seed is not None else path.name
    samples = _read_jsonl(path / SAMPLES_FILE)
    last = max((s.get("step", 0) for s in samples), default=None)
    return RunData(path=path, label=label, recipe=recipe, seed=seed, config=config,
                   records=_read_jsonl(path / "metrics.jsonl"), summary=summary,
                   alerts=_read_jsonl(path / "alerts.jsonl"), samples=[s for s in samples if s.get("step") == last])


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:   # the line a live run is writing right now
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def _unique_labels(runs: list[RunData]) -> None:
    """`<recipe> seed <seed>` where that names one run; else the folder name (then its parent, then a number)."""
    def clashing() -> set[str]:
        labels = [r.label for r in runs]
        return {x for x in labels if labels.count(x) > 1}

    for rename in (lambda r: r.path.name, lambda r: f"{r.path.parent.name}/{r.path.name}"):
        same = clashing()
        for r in runs:
            if r.label in same:
                r.label = rename(r)
    same = clashing()
    for i, r in enumerate(runs):
        if r.label in same:
            r.label = f"{r.label} #{i + 1}"
