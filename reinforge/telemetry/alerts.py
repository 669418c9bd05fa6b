"""Health alerts: warnings, while a run is still going, that it has stopped learning what it should.

`AlertMonitor.check` reads each RL step's metrics dict and returns the alerts
that became true at that step; `AlertLog` prints them and appends them to
RUN_DIR/alerts.jsonl. Thresholds are `reinforge.settings.AlertConfig`.

Why each signal:

- `entropy_collapse` (`entropy`): the policy stops exploring and every group
  sample agrees, so group-relative advantages vanish; DAPO (arXiv 2503.14476,
  sec. 3.1) sees this early in GRPO runs and counters it with clip-higher.
- `length_blowup` (`response_length_mean`, `truncation_rate`): per-sequence
  length normalisation rewards long wrong answers (Dr. GRPO, arXiv
  2503.20783, sec. 3.1), and truncated samples carry no answer at all.
- `reward_hacking` (`eval/pass@1`, `reward_mean`): train reward rising while
  held-out accuracy falls means the policy is exploiting the reward function
  rather than solving the task.
- `is_weight_explosion` (`is_weight_max`): large pi_learner / pi_sampler
  ratios mean the sampler's numbers no longer match the learner's (Yao et
  al. 2025, "Your efficient RL framework secretly brings you off-policy RL
  training", truncated importance sampling).
- `no_gradient` (`curation/prompts_kept`, `dpo/pairs`): `no_gradient_steps`
  steps in a row took no update because there was nothing to train on:
  curation's filters dropped every sampled group (the zero-variance filter
  on a model that gets every sample of every prompt wrong, or right), or no
  prompt gave DPO a correct and an incorrect sample. Such a run spends its
  whole budget sampling and its weights never move.

Invariants: a key that is missing, None or NaN on a step is skipped; every
signal but the per-step IS weight is a mean over `window` steps that have it,
so nothing fires before `window` such steps; an alert fires once when its
condition becomes true and again only after the condition was false on a
step that evaluated it; `state_dict` holds all of this, so a resumed run
raises exactly the alerts of an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from reinforge.records import Alert
from reinforge.settings import AlertConfig

# Metrics whose first `window` values form a baseline.
_BASELINE_KEYS = ("entropy", "response_length_mean", "reward_mean")
# Metrics whose last `window` values form the current value.
_RECENT_KEYS = ("entropy", "response_length_mean", "truncation_rate", "reward_mean")
# Float slack for "at least hacking_eval_drop below": 0.5 - 0.45 is 0.04999... in binary.
_EPS = 1e-9


def _number(value: object) -> float | None:
    """A metric value, or None where it is missing, None, NaN or not a number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        return None
    return float(value)


def _mean(values) -> float:
    return sum(values) / len(values)


class AlertMonitor:
    def __init__(self, cfg: AlertConfig):
        self.cfg = cfg
        self._first: dict[str, list[float]] = {k: [] for k in _BASELINE_KEYS}
        self._last: dict[str, deque[float]] = {k: deque(maxlen=cfg.window) for k in _RECENT_KEYS}
        self._best_eval: dict | None = None     # {"step", "pass@1", "reward_mean"} of the best held-out eval so far
        self._active: set[str] = set()          # alerts whose condition held when last evaluated
        self._empty_streak = 0                  # steps in a row, up to the last, that took no update for lack of data
        # name -> (metrics that re-evaluate it, rule returning the alert while its condition holds)
        self._rules: dict[str, tuple[tuple[str, ...], Callable[[int, dict[str, float]], Alert | None]]] = {
            "entropy_collapse": (("entropy",), self._entropy_collapse),
            "length_blowup": (("response_length_mean", "truncation_rate"), self._length_blowup),
            "reward_hacking": (("eval/pass@1",), self._reward_hacking),
            "is_weight_explosion": (("is_weight_max",), self._is_weight_explosion),
            "no_gradient": (("curation/prompts_kept", "dpo/pairs"), self._no_gradient),
        }

    def check(self, step: int, metrics: dict[str, float | None]) -> list[Alert]:
        """Record one step's metrics; return the alerts that became true at this step."""
        if not self.cfg.enabled:
            return []
        fresh = {k: v for k in metrics if (v := _number(metrics[k])) is not None}
        for key in _BASELINE_KEYS:
            if key in fresh and len(self._first[key]) < self.cfg.window:
                self._first[key].append(fresh[key])
        for key in _RECENT_KEYS:
            if key in fresh:
                self._last[key].append(fresh[key])
        fired = []
        for name, (keys, rule) in self._rules.items():
            if not any(k in fresh for k in keys):
                continue                        # nothing new: the condition is as it was
            alert = rule(step, fresh)
            if alert is None:
                self._active.discard(name)      # re-arm
            elif name not in self._active:
                self._active.add(name)
                fired.append(alert)
        return fired

    def _baseline(self, key: str) -> float | None:
        first = self._first[key]
        return _mean(first) if len(first) == self.cfg.window else None

    def _current(self, key: str) -> float | None:
        last = self._last[key]
        return _mean(last) if len(last) == self.cfg.window else None

    def _entropy_collapse(self, step: int, fresh: dict[str, float]) -> Alert | None:
        ratio, baseline, current = self.cfg.entropy_collapse_ratio, self._baseline("entropy"), self._current("entropy")
        if baseline is None or current is None or current >= ratio * baseline:
            return None
        return Alert(
            step,
            "entropy_collapse",
            f"step {step}: entropy {current:.4g} is below {ratio:g} x its baseline {baseline:.4g} "
            "(entropy collapse: the policy has stopped exploring; consider clip-higher, an entropy bonus or a "
            "lower lr)",
            {"entropy": current, "baseline": baseline, "ratio": ratio},
        )

    def _length_blowup(self, step: int, fresh: dict[str, float]) -> Alert | None:
        ratio, trunc_max = self.cfg.length_blowup_ratio, self.cfg.truncation_rate_max
        baseline, length = self._baseline("response_length_mean"), self._current("response_length_mean")
        truncation = self._current("truncation_rate")
        reasons, values = [], {}
        if baseline is not None and length is not None:
            values.update(response_length_mean=length, baseline=baseline, ratio=ratio)
            if length > ratio * baseline:
                reasons.append(f"mean response length {length:.4g} is above {ratio:g} x its baseline {baseline:.4g}")
        if truncation is not None:
            values.update(truncation_rate=truncation, truncation_rate_max=trunc_max)
            if truncation > trunc_max:
                reasons.append(f"truncation rate {truncation:.3g} is above {trunc_max:g}")
        if not reasons:
            return None
        return Alert(step, "length_blowup",
                     f"step {step}: {' and '.join(reasons)} (length blow-up: responses grow without getting better; "
                     "consider token-level loss aggregation, overlong shaping or a larger max_new_tokens)",
                     values)

    def _reward_hacking(self, step: int, fresh: dict[str, float]) -> Alert | None:
        pass_at_1 = fresh["eval/pass@1"]
        recent = self._last["reward_mean"]
        reward = _mean(recent) if recent else None   # the `window` train rewards up to this eval, or fewer
        best, alert = self._best_eval, None
        if best is not None:
            # An eval before the first train step is compared with the first `window` train rewards.
            first = self._first["reward_mean"]
            best_reward = best["reward_mean"] if best["reward_mean"] is not None else (_mean(first) if first else None)
            drop = best["pass@1"] - pass_at_1
            if (
                drop >= self.cfg.hacking_eval_drop - _EPS
                and reward is not None
                and best_reward is not None
                and reward > best_reward
            ):
                alert = Alert(
                    step,
                    "reward_hacking",
                    f"step {step}: held-out pass@1 fell from {best['pass@1']:.4g} (step {best['step']}) to "
                    f"{pass_at_1:.4g} "
                    f"while the mean train reward rose from {best_reward:.4g} to {reward:.4g} "
                    "(reward hacking: the policy exploits the reward rather than solving the task; "
                    "inspect samples and check the reward functions)",
                    {
                        "eval/pass@1": pass_at_1,
                        "best_eval/pass@1": best["pass@1"],
                        "best_eval_step": float(best["step"]),
                        "reward_mean": reward,
                        "best_eval_reward_mean": best_reward,
                    },
                )
        # Ties move the best to the latest step: the divergence is measured from the last time held-out was at its best.
        if best is None or pass_at_1 >= best["pass@1"]:
            self._best_eval = {"step": step, "pass@1": pass_at_1, "reward_mean": reward}
        return alert

    def _is_weight_explosion(self, step: int, fresh: dict[str, float]) -> Alert | None:
        weight, limit = fresh["is_weight_max"], self.cfg.is_weight_max
        if not weight > limit:
            return None
        return Alert(
            step,
            "is_weight_explosion",
            f"step {step}: largest IS weight pi_learner/pi_sampler {weight:.4g} is above {limit:g} "
            "(exploding importance weights: sampler and learner disagree; with train.mode=async stale samples do this "
            "(see async/staleness_*; decoupled PPO masks w > w_max); else check the weight sync and dtypes, "
            "or truncate the IS weights)",
            {"is_weight_max": weight, "threshold": limit},
        )

    def _no_gradient(self, step: int, fresh: dict[str, float]) -> Alert | None:
        # Called once per step that reports either count: an RL step with no group left after curation,
        # or a DPO step without a pair, took no update (loops/rl.py Learner.step, loops/dpo.py).
        empty = fresh.get("curation/prompts_kept") == 0 or fresh.get("dpo/pairs") == 0
        self._empty_streak = self._empty_streak + 1 if empty else 0
        limit = self.cfg.no_gradient_steps
        if self._empty_streak < limit:
            return None
        reward = fresh.get("reward_mean", math.nan)
        # Identical rewards everywhere: all wrong (too hard for the model) or all right (too easy).
        difficulty = ("an easier task (task.options) or an SFT stage first (sft.enabled=true)" if not reward > 0.5
                      else "a harder task (task.options)")
        if "dpo/pairs" in fresh:
            what = ("no prompt gave a preference pair (each prompt's train.group_size samples were all correct "
                    f"or all wrong; mean reward {reward:.3g})")
            fixes = f"{difficulty}, a larger train.group_size, or pairs from a file (dpo.pairs=dataset)"
        else:
            dropped = [
                k.removeprefix("curation/dropped_")
                for k, v in fresh.items()
                if k.startswith("curation/dropped_") and v > 0
            ]
            why = (
                ": each group's samples had identical rewards, so zero advantage" if "zero_variance" in dropped else ""
            )
            what = f"curation dropped every sampled group (filter {', '.join(dropped)}{why}; mean reward {reward:.3g})"
            fixes = (f"{difficulty}, a larger train.group_size, more refill rounds (curation.refill=dynamic or active, "
                     "curation.max_rounds), or no filter (remove zero_variance from curation.filters)")
        return Alert(step, "no_gradient",
                     f"step {step}: {self._empty_streak} steps in a row took no update: {what} "
                     f"(training on nothing: consider {fixes})",
                     {"steps": float(self._empty_streak), "no_gradient_steps": float(limit), "reward_mean": reward})

    def state_dict(self) -> dict:
        """Everything `check` remembers, JSON-serialisable (infinite values as JSON's Infinity)."""
        return {
            "first": {k: list(v) for k, v in self._first.items()},
            "last": {k: list(v) for k, v in self._last.items()},
            "best_eval": None if self._best_eval is None else dict(self._best_eval),
            "active": sorted(self._active),
            "empty_streak": self._empty_streak,
        }

    def load_state_dict(self, state: dict) -> None:
        self._first = {k: [float(x) for x in state["first"].get(k, [])][: self.cfg.window] for k in _BASELINE_KEYS}
        self._last = {k: deque(map(float, state["last"].get(k, [])), maxlen=self.cfg.window) for k in _RECENT_KEYS}
        self._best_eval = None if state["best_eval"] is None else dict(state["best_eval"])
        self._active = set(state["active"])
        self._empty_streak = int(state.get("empty_streak", 0))   # checkpoints from before this alert have none


class AlertLog:
    """Alerts as JSON lines (flushed one by one) and as yellow console lines.

    `truncate_to` (a byte position from `position()`) cuts the file first: a
    resumed run drops the alerts written after its checkpoint.
    """

    def __init__(self, path: str | Path, console: Console | None = None, truncate_to: int | None = None):
        self.path, self.console = Path(path), console
        if truncate_to is not None and self.path.exists():
            with self.path.open("r+b") as f:
                f.truncate(truncate_to)
        self._file = self.path.open("a")
        self._lock = threading.Lock()      # the hang watchdog writes from its own thread

    def write(self, alerts: list[Alert]) -> None:
        with self._lock:
            self._write(alerts)

    def _write(self, alerts: list[Alert]) -> None:
        for alert in alerts:
            record = alert.to_json()
            # Non-finite numbers as null keep every line valid JSON.
            record["values"] = {k: (v if math.isfinite(v) else None) for k, v in record["values"].items()}
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self.console is not None:
                self.console.print(escape(alert.message), style="yellow")

    def position(self) -> int:
        """The file's size in bytes: where a checkpoint taken now would truncate it on resume."""
        self._file.flush()
        return self.path.stat().st_size

    def sync(self) -> None:
        """Written alerts are on disk (before a checkpoint records `position()`)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()
