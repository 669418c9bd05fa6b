"""Where a run's numbers go: metrics.jsonl (always), TensorBoard and W&B
(`log.tensorboard`, `log.wandb`), health alerts (console and alerts.jsonl),
samples of what the model writes (samples.jsonl, telemetry/samples.py), the
SFT loss curve and the progress bar.

A checkpoint stores `state_dict()`: how far metrics.jsonl and alerts.jsonl
had been written, the alert monitor's windows and the W&B run id. A resumed
run cuts both files back to those positions (and samples.jsonl back to the
checkpoint's step) and rewrites what follows, so its files end up equal to an
uninterrupted run's.

Console output (alerts, the SFT summary) goes through `bar_safe_console`, so
it prints above the progress bars instead of through them.
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console
from tqdm import tqdm

from reinforge.eval.evaluate import EvalResult
from reinforge.settings import AlertConfig, LogConfig
from reinforge.telemetry.alerts import Alert, AlertLog, AlertMonitor
from reinforge.telemetry.console import bar_safe_console
from reinforge.telemetry.run_dir import RunDir
from reinforge.telemetry.samples import (
    SAMPLES_FILE,
    SampleLog,
    StepSamples,
    pick_samples,
    truncate_samples,
)
from reinforge.telemetry.sinks import WandbSink, build_sinks

# Wall-clock figures: the only metrics a resumed run does not reproduce.
TIMING_KEYS = frozenset({"tokens_per_s", "generation_seconds", "step_seconds"})


def eval_metrics(result: EvalResult) -> dict[str, float]:
    """A held-out evaluation as flat metrics (eval/pass@1, eval/greedy_accuracy, eval/pass@K, ...; for
    a mix, eval/<domain>/pass@1 and eval/<domain>/greedy_accuracy; with eval.token_budgets, eval/pass@1@budget_B)."""
    return {
        "eval/pass@1": result.pass_at_1,
        "eval/greedy_accuracy": result.greedy_accuracy,
        "eval/mean_length": result.mean_length,
        **{f"eval/pass@{k}": v for k, v in result.pass_at_k.items() if k != "1"},
        **{f"eval/{d}/{name}": figures[name] for d, figures in result.domains.items()
           for name in ("pass@1", "greedy_accuracy")},
        **{f"eval/pass@1@budget_{b}": v for b, v in result.pass_at_budget.items()},
    }


class Recorder:
    def __init__(self, run_dir: RunDir, log: LogConfig, alerts: AlertConfig, *, recipe: str, rl_steps: int,
                 resolved: dict, saved: Mapping | None = None, console: Console | None = None):
        """`recipe` and `rl_steps` label the RL progress bar; `resolved`: the run's config as a dict,
        for the sinks that keep it (W&B); `saved`: the `state_dict()` of a checkpoint being resumed
        (None: a new run)."""
        self.run_dir, self.log_cfg, self.recipe, self.rl_steps = run_dir, log, recipe, rl_steps
        self.start_step = saved["step"] if saved else 0
        run_dir.truncate_metrics(saved["metrics_position"] if saved else 0)
        self.monitor = AlertMonitor(alerts)
        if saved:
            self.monitor.load_state_dict(saved["alerts"])
        self.console = console or bar_safe_console()
        self.alert_log = AlertLog(run_dir.path / "alerts.jsonl", self.console,
                                  truncate_to=saved["alerts_position"] if saved else 0)
        truncate_samples(run_dir.path / SAMPLES_FILE, self.start_step)
        self.samples = SampleLog(run_dir.path / SAMPLES_FILE)
        self.sinks = build_sinks(log, run_dir.path, resolved, self.start_step,
                                 saved.get("wandb_id") if saved else None)
        self._bar: tqdm | None = None
        self._last_eval: str | None = None

    def log(self, record: dict) -> None:
        """A line that is not an RL step (the SFT stage, an evaluation); sinks get it when it has a step."""
        self.run_dir.log(record)
        if "step" in record:
            for sink in self.sinks:
                sink.log(record["step"], record)

    def alert(self, alerts: list[Alert]) -> None:
        """Alerts raised outside the per-step monitor (weight sync, the hang watchdog): console and alerts.jsonl."""
        self.alert_log.write(alerts)

    def log_eval(self, step: int, result: EvalResult) -> None:
        """The start (step 0) and final evaluation; the alerts see them too (the reward-hacking
        check compares held-out accuracy from the start of RL on)."""
        metrics = eval_metrics(result)
        self.alert_log.write(self.monitor.check(step, metrics))
        self.log({"stage": "eval", "step": step, **metrics})

    def log_sft_step(self, step: int, loss: float) -> None:
        """SFT step `step` (from 0): a metrics.jsonl line of its own stage ("sft_step", its own step
        key, so it never reads as RL step k) and the sinks' "sft/loss" on the SFT step axis."""
        self.run_dir.log({"stage": "sft_step", "sft_step": step, "loss": loss})
        for sink in self.sinks:
            sink.log_sft(step, {"sft/loss": loss})

    def sft_done(self, summary: dict, seconds: float) -> None:
        """The SFT stage's metrics.jsonl line and its one-line console summary (the time only there:
        metrics.jsonl holds what the seed reproduces, wall-clock figures aside)."""
        self.log({"stage": "sft", **summary})
        self.console.print(f"sft: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> "
                           f"{summary['final_loss']:.3f} (mean of the last 10%), {seconds:.1f} s")

    def start_rl(self, step: int) -> None:
        """Draw the RL bar at `step` (0, or the checkpoint's step on resume) before the first RL
        step runs, so its first rate covers a whole step."""
        if self._bar is None:
            self._bar = tqdm(total=self.rl_steps, initial=step, desc=f"rl:{self.recipe}",
                             disable=not self.log_cfg.progress, dynamic_ncols=True)

    def step(self, step: int, metrics: dict[str, float], samples: StepSamples | None = None) -> None:
        """One RL step: alerts first (so they print above the bar), then every sink, then the bar.
        `samples`: the step's batch; every log.samples_every steps, and at the last step (so that a run
        shorter than log.samples_every has some too), a few rows go to samples.jsonl."""
        self.alert_log.write(self.monitor.check(step, metrics))
        self.run_dir.log({"stage": "rl", "step": step, **metrics})
        for sink in self.sinks:
            sink.log(step, metrics)
        every = self.log_cfg.samples_every
        if samples is not None and every and (step % every == 0 or step == self.rl_steps):
            records = pick_samples(step, samples, self.log_cfg.samples_per_step)
            self.samples.write(records)
            for sink in self.sinks:
                sink.log_samples(step, records)
        self.start_rl(step - 1)     # a caller that did not draw it first (tests driving the recorder)
        self._bar.update(1)
        live = {"reward": ("reward_mean", ".3f"), "len": ("response_length_mean", ".1f"), "H": ("entropy", ".3f"),
                "kl": ("kl", ".2g"), "eval": ("eval/pass@1", ".3f")}
        shown = {name: format(metrics[key], fmt) for name, (key, fmt) in live.items() if key in metrics}
        if "eval/pass@1" in metrics:
            self._last_eval = shown["eval"]
        elif self._last_eval is not None:
            shown["eval"] = self._last_eval       # the latest held-out figure stays on the bar
        self._bar.set_postfix(shown)

    def state_dict(self) -> dict:
        """What a checkpoint taken now records (after `sync`)."""
        wandb = next((s for s in self.sinks if isinstance(s, WandbSink)), None)
        return {
            "metrics_position": self.run_dir.metrics_position(),
            "alerts_position": self.alert_log.position(),
            "alerts": self.monitor.state_dict(),
            "wandb_id": wandb.id if wandb is not None else None,
        }

    def sync(self) -> None:
        """metrics.jsonl and alerts.jsonl are on disk up to the positions `state_dict` reports."""
        self.run_dir.sync()
        self.alert_log.sync()
        self.samples.sync()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        for sink in self.sinks:
            sink.close()
        self.alert_log.close()
        self.samples.close()
