"""Metric sinks besides RUN_DIR/metrics.jsonl: TensorBoard and Weights & Biases.

A sink receives each step's metrics dict and writes its finite numbers as
scalars named by their keys ("eval/pass@1" groups under "eval"); strings,
None, booleans and non-finite numbers are left to metrics.jsonl. Both sinks
can continue a resumed run: TensorBoard discards the events the interrupted
run logged after the checkpoint, W&B reuses the run id.

Besides scalars: the samples of an RL step (telemetry/samples.py) as text in
TensorBoard and as a table in W&B, and the SFT loss curve (`log_sft`, its own
step axis: SFT step k is not RL step k).
"""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from typing import Literal, Protocol

from reinforge.settings import LogConfig


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, object]) -> None: ...

    def log_samples(self, step: int, records: list[dict]) -> None:
        """The samples.jsonl records of RL step `step`."""
        ...

    def log_sft(self, step: int, metrics: dict[str, object]) -> None:
        """One SFT step's scalars (keys "sft/..."), on the SFT step axis."""
        ...

    def close(self) -> None: ...


def scalars(metrics: dict[str, object]) -> dict[str, float]:
    """The finite real numbers of a metrics dict (bools are not numbers here)."""
    return {
        k: float(v) for k, v in metrics.items()
        if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoardSink:
    """Scalars as TensorBoard events in `log_dir`.

    `purge_step`: on resume, the first step the resumed run logs; events the
    interrupted run wrote at this step or later are discarded by readers.
    """

    def __init__(self, log_dir: Path, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("log.tensorboard=true needs TensorBoard: pip install tensorboard") from e
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, object]) -> None:
        for tag, value in scalars(metrics).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def log_samples(self, step: int, records: list[dict]) -> None:
        from reinforge.telemetry.samples import samples_markdown

        self._writer.add_text("samples", samples_markdown(records), global_step=step)

    def log_sft(self, step: int, metrics: dict[str, object]) -> None:
        # TensorBoard keeps one step axis per tag, so "sft/loss" at step k never meets RL step k.
        self.log(step, metrics)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars logged to a Weights & Biases run whose files live in RUN_DIR/wandb.

    Offline mode needs no network or account; `wandb sync RUN_DIR/wandb/offline-run-*`
    uploads it later. `resume_id` continues the run with that id (`id` of the
    interrupted run's sink).
    """

    def __init__(self, project: str, run_dir: Path, mode: Literal["offline", "online"], run_name: str,
                 config: dict, resume_id: str | None = None):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("log.wandb=true needs Weights & Biases: pip install wandb") from e
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        # silent: no banner or links; console="off": leave stdout alone (the progress bar owns it).
        settings = wandb.Settings(silent=True, console="off", disable_git=True, save_code=False)
        self._run = wandb.init(
            project=project, dir=str(run_dir), mode=mode, name=run_name, config=config,
            id=resume_id, resume="allow" if resume_id is not None else None, settings=settings,
        )

    @property
    def id(self) -> str:
        return self._run.id

    def log(self, step: int, metrics: dict[str, object]) -> None:
        self._run.log(scalars(metrics), step=step)

    def log_samples(self, step: int, records: list[dict]) -> None:
        import wandb

        columns = ["step", "prompt", "completion", "rewards", "reward", "advantage", "trained"]
        rows = [[r["step"], r["prompt"], r["completion"], json.dumps(r["rewards"]), r["reward"], r["advantage"],
                 r["trained"]] for r in records]
        self._run.log({"samples": wandb.Table(columns=columns, data=rows)}, step=step)

    def log_sft(self, step: int, metrics: dict[str, object]) -> None:
        """Nothing: a W&B run has one step axis, which RL steps own (SFT steps logged on it would
        push it past RL step 1 and W&B would drop the RL steps); the SFT curve is in
        metrics.jsonl, TensorBoard and the report."""

    def close(self) -> None:
        self._run.finish()


def build_sinks(log_cfg: LogConfig, run_dir: Path, cfg_dict: dict, start_step: int, wandb_id: str | None) -> list[Sink]:
    """The sinks `log_cfg` turns on, writing under `run_dir`.

    `start_step`: the step of the checkpoint a resumed run continues from (0
    for a new run); TensorBoard events after it are discarded. `wandb_id`: the
    W&B run id to continue (None: a new W&B run).
    """
    run_dir = Path(run_dir)
    sinks: list[Sink] = []
    if log_cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard", purge_step=start_step + 1 if start_step > 0 else None))
    if log_cfg.wandb:
        sinks.append(WandbSink(project=log_cfg.wandb_project, run_dir=run_dir, mode=log_cfg.wandb_mode,
                               run_name=run_dir.name, config=cfg_dict, resume_id=wandb_id))
    return sinks
