"""The run directory: resolved config, metrics.jsonl, summary.json, checkpoint."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from reinforge.config import Config, config_to_yaml
from reinforge.models import Policy, save_policy


def default_output_dir(cfg: Config) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.recipe}"


class RunDir:
    def __init__(self, path: str | Path, cfg: Config):
        self.path = Path(path)
        if (self.path / "metrics.jsonl").exists():
            raise FileExistsError(f"output_dir '{self.path}' already holds a run; choose another output_dir")
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.yaml").write_text(config_to_yaml(cfg))
        self._metrics = (self.path / "metrics.jsonl").open("a")

    def log(self, record: dict) -> None:
        """One JSON line per step; non-finite floats are written as null (valid JSON)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._metrics.write(json.dumps(clean) + "\n")
        self._metrics.flush()

    def save_checkpoint(self, policy: Policy, optimizer: torch.optim.Optimizer | None, state: dict) -> Path:
        directory = self.path / "checkpoint"
        save_policy(policy, directory)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), directory / "optimizer.pt")
        (directory / "trainer_state.json").write_text(json.dumps(state, indent=2))
        return directory

    def write_summary(self, summary: dict) -> None:
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))

    def close(self) -> None:
        self._metrics.close()
