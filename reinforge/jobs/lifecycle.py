"""How a train run says what it will do and how it ends when it does not run to the end.

Nothing about a run is silent:

- `check_can_train`: a run whose RL could not train a single step (fewer train prompts than one
  step draws) is refused when the data is known, before the model loads or the start evaluation
  runs, with the key that decides it.
- `split_notes`: a data file split automatically into train and held-out prompts says so once,
  with the share and the key that controls it.
- `Interrupts`: SIGINT (Ctrl-C) and SIGTERM during RL let the step in progress finish, save a
  checkpoint of it and stop with one line naming the step, what was saved and the resume command
  (`RunInterrupted`; the command line exits with 128 + the signal: 130, 143). A second signal, a
  signal before RL (nothing resumable yet) or the hang watchdog's stop ends the run at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reinforge.errors import ConfigError, RunInterrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def check_can_train(train_prompts: int, num_prompts: int, prompts_per_step: int, data: str | None = None) -> None:
    """ConfigError when RL could not train one step: each step draws `prompts_per_step` distinct prompts
    from the `train_prompts` of the train split (train.num_prompts of them at most: fewer means `data`,
    the task's data file, ran out), so the run would evaluate, export the model it started from and
    look finished."""
    if train_prompts >= prompts_per_step:
        return
    if train_prompts < num_prompts:     # the data ran out before train.num_prompts
        where = f"the train split of {data}" if data else "the task's train split"
        raise ConfigError(
            f"{where} has {train_prompts} prompt(s), fewer than train.prompts_per_step={prompts_per_step} (the "
            f"distinct prompts each RL step draws): RL would train 0 steps; set train.prompts_per_step="
            f"{train_prompts} or less, or give it more data")
    raise ConfigError(
        f"train.num_prompts={num_prompts} is fewer than train.prompts_per_step={prompts_per_step} (the distinct "
        f"prompts each RL step draws): RL would train 0 steps; set train.prompts_per_step={num_prompts} or less, "
        "or raise train.num_prompts")


def data_description(task) -> str | None:
    """A task's data file as `check_can_train` names it, with the rows the hash split held out: 'FILE' (K of
    its N rows held out for evaluation: task.options.eval_fraction); None for a generated task."""
    path, sizes = getattr(task, "path", None), getattr(task, "split_sizes", None)
    if path is None or sizes is None:
        return None
    if getattr(task, "eval_path", None) is not None:
        return f"'{path}'"
    return (f"'{path}' ({sizes['eval']} of its {sizes['train'] + sizes['eval']} rows held out for evaluation: "
            "task.options.eval_fraction)")


def split_notes(task) -> list[str]:
    """The automatic train / held-out split of each data file the task reads (a mix: each domain's)."""
    tasks = list(getattr(task, "tasks", {}).values()) or [task]
    return [note for t in tasks if (note := getattr(t, "split_note", lambda: None)()) is not None]


@dataclass
class Progress:
    """How far a run has come, for the line an interrupt ends it with."""

    run_dir: Path
    phase: str = "start"            # "start" (SFT, the start evaluation), "rl", "final" (the final evaluation)
    step: int = 0                   # the last RL step completed
    saved: int | None = None        # the step of the newest checkpoint written (or resumed from)


class Interrupts:
    """SIGINT and SIGTERM while a run goes (see the module docstring), a context around the run after its
    run directory exists. Installed in the main thread of a single process only (`enabled`): learner ranks
    must all stop at the same step, and signal handlers exist only in the main thread. A signal the shell
    set to be ignored (a background job) stays ignored.

    The pipeline tells it where the run is (`rl_started`, `step_done`, `saved`, `final`); a
    KeyboardInterrupt that leaves the context is logged (`log`, an "interrupted" line of metrics.jsonl)
    and becomes RunInterrupted, whose message says where it stopped, what was saved and how to resume."""

    def __init__(self, run_dir: str | Path, saved: int | None, notify: Callable[[str], None],
                 log: Callable[[dict], None], *, enabled: bool = True):
        self.progress = Progress(Path(run_dir), "start" if saved is None else "rl", saved or 0, saved)
        self.notify, self.log = notify, log
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None     # the first signal
        self.deferring = False               # during RL: the first signal waits for the end of the step
        self.force: Callable[[], bool] = lambda: False    # the hang watchdog sent the SIGINT: stop at once
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Interrupts:
        if self.enabled:
            for signum in SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, kind, err, traceback) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            stop = err if isinstance(err, RunInterrupted) else self.stop()
            self.log({"stage": "interrupted", "step": self.progress.step, "reason": str(stop)})  # the report shows it
            raise stop from None

    def _handle(self, signum: int, frame) -> None:
        if self.force():
            raise KeyboardInterrupt        # the watchdog's stop: the pipeline turns it into RunStopped
        if self.received is None:
            self.received = signum
            if self.deferring:
                self.notify(f"{signal.Signals(signum).name}: finishing step {self.progress.step + 1}, then saving "
                            "it and stopping (send it again to stop at once, unsaved)")
                return
        raise KeyboardInterrupt

    def rl_started(self, force: Callable[[], bool]) -> None:
        self.progress.phase, self.deferring, self.force = "rl", True, force

    def saved(self, step: int) -> None:
        """A checkpoint of `step` is written."""
        self.progress.saved = step

    def step_done(self, step: int, save: Callable[[], None]) -> None:
        """RL step `step` ended (logged, evaluated, checkpointed if due): after a signal, `save` it unless
        saved already, and stop."""
        self.progress.step = step
        if self.received is not None:
            if self.progress.saved != step:
                save()
            raise self.stop()

    def final(self) -> None:
        """RL is over (its last step saved): a signal now stops at once, and one that came late stops here."""
        self.deferring = False
        if self.received is not None:
            raise self.stop()
        self.progress.phase = "final"

    def stop(self) -> RunInterrupted:
        """The exception that ends the run now, its message the one line to print."""
        p = self.progress
        signum = self.received or signal.SIGINT      # a KeyboardInterrupt of no handler of ours: Ctrl-C
        where = {"start": "before RL step 1 (in SFT or the start evaluation)",
                 "final": f"in the final evaluation after step {p.step}"}.get(p.phase, f"at step {p.step}")
        if p.phase == "rl" and p.saved != p.step:
            where = f"in step {p.step + 1} (stopped at once, the step unfinished)"
        saved = f"saved step {p.saved}" if p.saved is not None else "nothing saved (checkpoints start with RL)"
        return RunInterrupted(f"interrupted {where}; {saved}", str(p.run_dir), signum)


def resume_line(step: int | None, steps: int, checkpoint: Path | None, run_dir: Path) -> str:
    """What `--resume` starts from: a checkpoint's step, or (none yet) the start of the run."""
    if step is None:
        return f"resume: no checkpoint in {run_dir} yet (checkpoints start with RL): starting the run over"
    return f"resuming from step {step} of {steps} ({checkpoint})"
