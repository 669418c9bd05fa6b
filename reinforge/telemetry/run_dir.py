"""The run directory: resolved config, metrics.jsonl, summary.json, the final model.

    RUN_DIR/config.yaml          the resolved config (what --resume reads back)
    RUN_DIR/metrics.jsonl        one JSON line per SFT run, evaluation and RL step
    RUN_DIR/alerts.jsonl         health alerts (telemetry/alerts.py)
    RUN_DIR/checkpoints/step-N/  resumable checkpoints (telemetry/checkpoint.py)
    RUN_DIR/model/               the final model and tokenizer, a Hugging Face folder (LoRA merged)
    RUN_DIR/summary.json         evaluation of the start and final model

A directory that already holds a run is never overwritten by accident: a new
run there needs `overwrite=True` (`--overwrite`), a continued one `resume=True`.
One exception: a run that failed to start (stopped before its first RL step,
with nothing to resume and nothing but what a run writes) does not block the
retry: a new run there replaces it, and one line says so.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from reinforge.errors import ConfigError
from reinforge.models import Policy, save_policy
from reinforge.settings import RolloutConfig


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_output_dir(recipe: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{recipe}"


def check_output_dir(path: str | Path) -> None:
    """ConfigError, before anything is written, for an output_dir that is not a folder or cannot be
    created: an existing file, a file on its way, or a nearest existing folder that is not writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir '{path}' is a file, not a folder: choose another output_dir")
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ConfigError(
            f"output_dir '{path}' cannot be created: '{existing}' is a file, not a folder; choose another output_dir"
        )
    target = path if path.exists() else existing
    if not os.access(target, os.W_OK | os.X_OK):
        raise ConfigError(f"output_dir '{path}' cannot be {'written' if target == path else 'created'}: no permission "
                          f"to write in '{target}'; choose an output_dir you can write to")


def holds_run(path: Path) -> bool:
    return (path / "config.yaml").exists() or (path / "metrics.jsonl").exists()


# What a run writes before its first RL step (besides an empty checkpoints/ or one a crash left half-written).
_START_FILES = {"config.yaml", "metrics.jsonl", "alerts.jsonl", "error.log", "step.json", "tensorboard", "wandb"}


def failed_start(path: Path) -> bool:
    """Whether `path` holds only a run that stopped before its first RL step: no checkpoint, no RL step
    in metrics.jsonl, no summary or model, and no file a run does not write (so nothing of the user's)."""
    for entry in path.iterdir():
        if entry.name == "checkpoints":
            if any(not p.name.startswith(".tmp-") for p in entry.iterdir()):
                return False
        elif entry.name not in _START_FILES and not (entry.name.startswith("hang-") and entry.suffix == ".txt"):
            return False
    metrics = path / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                if json.loads(line).get("stage") == "rl":
                    return False
            except (json.JSONDecodeError, AttributeError):
                return False       # not a file a run wrote
    return True


class RunDir:
    def __init__(self, path: str | Path, config_yaml: str, sampling: RolloutConfig, *, resume: bool = False,
                 overwrite: bool = False, report: Callable[[str], None] = _stderr_line):
        """`config_yaml`: the resolved config, written as RUN_DIR/config.yaml (a new run only);
        `sampling`: the run's rollout settings, the exported model's generation defaults; `report`: where
        the line about replacing a failed start goes."""
        self.path = Path(path)
        self.sampling = sampling
        if resume:
            if not (self.path / "config.yaml").is_file():
                raise ConfigError(f"--resume: '{self.path}' holds no run (no config.yaml)")
        elif holds_run(self.path):
            if overwrite:
                shutil.rmtree(self.path)
            elif failed_start(self.path):     # the retry of a start that failed: nothing in it to keep
                report(f"output_dir '{self.path}' holds a run that stopped before its first RL step (nothing to "
                       "resume): replacing it")
                shutil.rmtree(self.path)
            else:
                raise FileExistsError(f"output_dir '{self.path}' already holds a run: continue it with "
                                      f"`reinforge train --resume {self.path}`, replace it with --overwrite, "
                                      "or choose another output_dir")
        self.path.mkdir(parents=True, exist_ok=True)
        if not resume:
            (self.path / "config.yaml").write_text(config_yaml)
        self._metrics = (self.path / "metrics.jsonl").open("a")

    def log(self, record: dict) -> None:
        """One JSON line per record; non-finite floats are written as null (valid JSON)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()

    def metrics_position(self) -> int:
        """Bytes of metrics.jsonl written so far (a checkpoint records it)."""
        return self._metrics.tell()

    def truncate_metrics(self, position: int) -> None:
        """Drop the lines written after `position`: a resumed run rewrites them."""
        size = os.path.getsize(self._metrics.name)
        if size < position:
            raise ConfigError(f"{self._metrics.name} has {size} bytes, fewer than the {position} its checkpoint "
                              "recorded: the file was changed after the run; it cannot be resumed exactly")
        self._metrics.truncate(position)
        self._metrics.seek(position)

    def sync(self) -> None:
        """Everything logged so far is on disk (called before a checkpoint records the position)."""
        self._metrics.flush()
        os.fsync(self._metrics.fileno())

    def export_model(self, policy: Policy) -> Path:
        """The final model and tokenizer as a plain Hugging Face folder (load it with from_pretrained):
        LoRA adapters merged into the weights, the run's sampling settings as generation defaults."""
        directory = self.path / "model"
        save_policy(policy, directory, self.sampling)
        return directory

    def write_step_parts(self, parts: dict) -> None:
        """step.json: what the RL step is made of (jobs/rl.py: RLStep.describe)."""
        (self.path / "step.json").write_text(json.dumps(parts, indent=2, default=str) + "\n")

    def write_summary(self, summary: dict) -> None:
        tmp = self.path / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(self.path / "summary.json")

    def close(self) -> None:
        self._metrics.close()
