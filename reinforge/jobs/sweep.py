"""`reinforge sweep`: a grid of runs over override values, and a table that
compares the groups honestly: mean ± sample std over seeds, never one seed's
number.

    reinforge sweep recipe=grpo,dr_grpo seed=0,1,2 train.steps=50

Each `key=a,b,c` is an axis and the grid is their Cartesian product (first
axis slowest). Every combination is validated before anything runs. Each runs
into OUT/<name>: with jobs=1 one after the other in this process (an exception
fails that run only), with jobs>1 as that many `reinforge train` subprocesses
at a time (a crash of any kind stays in its run). A combination whose
directory already has summary.json, with the same settings, is not run again,
so re-running the command resumes an interrupted sweep; a directory without
summary.json (a run that stopped) is renamed <name>.incomplete-N and redone.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from reinforge.config import build_config, load_yaml, parse_overrides
from reinforge.errors import ConfigError
from reinforge.jobs.sweep_table import SweepRow, SweepRun, csv_text, separation_note, summarise, table

_OPENERS, _CLOSERS = "[{(", "]})"


# ---------------------------------------------------------------------------
# The grid


def split_values(raw: str) -> list[str]:
    """Split `a,b,c` on its top-level commas; commas inside [], {}, () or quotes stay."""
    values, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(raw):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _OPENERS:
            depth += 1
        elif ch in _CLOSERS:
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            values.append(raw[start:i])
            start = i + 1
    values.append(raw[start:])
    return values


def grid_axes(overrides: list[str]) -> list[tuple[str, list[str]]]:
    """(key, values) of each override in the order given; a key given twice is a ConfigError."""
    axes: list[tuple[str, list[str]]] = []
    for item in overrides:
        if item.startswith("-"):      # `--key value` as argparse takes it: its key=value spelling, as train says
            parse_overrides(overrides)
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value (a sweep axis is key=a,b,c)")
        if any(key == k for k, _ in axes):
            raise ConfigError(f"'{key}' is given twice; give all its values in one override: {key}=a,b")
        values = split_values(raw)
        if len(values) > 1 and any(v.strip() == "" for v in values):
            raise ConfigError(f"override '{item}' has an empty value between its commas")
        axes.append((key, values))
    return axes


def expand_grid(overrides: list[str]) -> list[list[str]]:
    """Every combination of the axes as a list of key=value overrides; the first axis varies slowest."""
    axes = grid_axes(overrides)
    return [[f"{key}={value}" for (key, _), value in zip(axes, combo, strict=True)]
            for combo in itertools.product(*(values for _, values in axes))]


def run_names(combos: list[list[str]], swept: list[str]) -> list[str]:
    """Folder name of each combination: its swept values joined, `recipe-grpo_seed-0` (filesystem-safe).

    A name that sanitising made ambiguous, or that is too long, ends with a
    hash of the combination, so the same grid always gives the same names.
    """
    def sanitise(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-") or "x"

    names = []
    for combo in combos:
        parts = [item.partition("=") for item in combo]
        names.append("_".join(f"{sanitise(k)}-{sanitise(v)}" for k, _, v in parts if k in swept) or "run")
    return [f"{name[:120]}-{hashlib.sha1(' '.join(combo).encode()).hexdigest()[:8]}"
            if names.count(name) > 1 or len(name) > 120 else name
            for name, combo in zip(names, combos, strict=True)]


# ---------------------------------------------------------------------------
# Results


@dataclass
class SweepResult:
    out_dir: Path
    axes: list[str]                      # keys with more than one value
    runs: list[SweepRun]
    rows: list[SweepRow]
    note: str
    markdown: Path
    json: Path
    csv: Path
    report: Path | None                  # None when no run wrote any metrics

    @property
    def failed(self) -> list[SweepRun]:
        return [r for r in self.runs if r.status == "failed"]


# ---------------------------------------------------------------------------
# Running


def run_sweep(overrides: list[str], out_dir: Path, jobs: int = 1, config_file: str | None = None,
              on_event: Callable[[str], None] | None = None) -> SweepResult:
    """Validate the whole grid, run what is not finished (`jobs` at a time), then tabulate and report.

    Raises ConfigError before anything is written when any combination is invalid.
    """
    from reinforge.jobs.start import prepare

    say = on_event or (lambda _: None)
    if jobs < 1:
        raise ConfigError(f"jobs must be at least 1, got {jobs}")
    axes = grid_axes(overrides)
    if any(key == "output_dir" for key, _ in axes):
        raise ConfigError("a sweep names each run's output_dir itself (OUT/<name>); choose OUT with --out")
    swept = [key for key, values in axes if len(values) > 1]
    extra = _sweep_settings([key for key, _ in axes], jobs, config_file)
    combos = expand_grid(overrides)
    out_dir = Path(out_dir)
    runs = []
    for combo, name in zip(combos, run_names(combos, swept), strict=True):
        run = SweepRun(name=name, path=out_dir / name, overrides=[*combo, *extra],
                       axes={k: v for k, _, v in (item.partition("=") for item in combo) if k in swept})
        try:
            cfg = build_config([*run.overrides, f"output_dir={run.path}"], config_file)
            prepare(cfg)
        except (ConfigError, NotImplementedError) as err:
            raise ConfigError(f"{name}: {err}") from None
        if (run.path / "summary.json").is_file():
            _check_same_settings(run, cfg.model_dump(mode="json"))
            run.status = "skipped"
        runs.append(run)

    out_dir.mkdir(parents=True, exist_ok=True)
    todo = []
    for run in runs:
        if run.status != "skipped":
            _set_aside_incomplete(run.path)
            todo.append(run)
    say(f"{len(runs)} runs in {out_dir}: {len(runs) - len(todo)} finished before, {len(todo)} to run, {jobs} at a time")
    if jobs == 1:
        for run in todo:   # in the main thread: the pipeline may install signal handlers
            _execute(run, out_dir, config_file, True, say)
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(lambda run: _execute(run, out_dir, config_file, False, say), todo))
    for run in runs:
        if run.status != "failed":
            run.summary = json.loads((run.path / "summary.json").read_text())
    return _write_results(out_dir, swept, runs)


def _sweep_settings(keys: list[str], jobs: int, config_file: str | None) -> list[str]:
    """Settings parallel runs get unless the user set them: no progress bars in their logs, and
    torch threads split over the cores instead of oversubscribing them."""
    user = set(keys) | set(_flat_keys(load_yaml(config_file))) if config_file else set(keys)
    if jobs == 1:
        return []      # in this process, as `reinforge train` would run
    extra = [] if "log.progress" in user else ["log.progress=false"]
    if "threads" not in user:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        extra.append(f"threads={max(1, cores // jobs)}")
    return extra


def _check_same_settings(run: SweepRun, wanted: dict) -> None:
    """A finished run is reused only if it ran with the settings asked for now (else the table would lie)."""
    from reinforge.telemetry.report import flatten

    stored = flatten(yaml.safe_load((run.path / "config.yaml").read_text()) or {})
    # Settings that do not change what a run computes; keys a newer version added are not in old runs.
    differ = [f"{key}: {stored[key]!r} there, {value!r} now" for key, value in flatten(wanted).items()
              if key in stored and stored[key] != value and key not in _BOOKKEEPING]
    if differ:
        raise ConfigError(f"{run.path} holds a finished run with other settings ({'; '.join(differ[:3])}): "
                          "choose another --out, or remove that run to redo it")


_BOOKKEEPING = {"output_dir", "threads", "log.progress"}


def _flat_keys(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        out.append(f"{prefix}{key}")
        if isinstance(value, dict):
            out += _flat_keys(value, f"{prefix}{key}.")
    return out


def _set_aside_incomplete(path: Path) -> None:
    """A run that stopped before summary.json starts again; its directory is kept, renamed, for inspection."""
    if not path.exists():
        return
    for i in itertools.count(1):
        target = path.with_name(f"{path.name}.incomplete-{i}")
        if not target.exists():
            path.rename(target)
            return


def _execute(
    run: SweepRun, out_dir: Path, config_file: str | None, in_process: bool, say: Callable[[str], None]
) -> None:
    log_path = out_dir / "logs" / f"{run.name}.log"
    log_path.parent.mkdir(exist_ok=True)
    say(f"{run.name}: running" + ("" if in_process else f" (log: {log_path})"))
    start = time.perf_counter()
    if in_process:
        code = _run_in_process(run, config_file, log_path)
    else:
        command = [sys.executable, "-m", "reinforge.cli", "train", *(["--config", config_file] if config_file else []),
                   *run.overrides, f"output_dir={run.path}"]
        with log_path.open("w") as log:
            # Plain Python tracebacks in the log (typer's boxed ones make an unreadable tail).
            env = {**os.environ, "_TYPER_STANDARD_TRACEBACK": "1"}
            code = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            ).returncode
    run.seconds = time.perf_counter() - start
    if code == 0 and (run.path / "summary.json").is_file():
        say(f"{run.name}: done in {run.seconds:.0f} s")
        return
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    run.status = "failed"
    run.error = "\n".join(lines[-10:])[-1500:] or f"exit code {code}, no output"
    say(f"{run.name}: FAILED (exit code {code}): {lines[-1] if lines else 'no output'}")


def _run_in_process(run: SweepRun, config_file: str | None, log_path: Path) -> int:
    """One run in this process (no interpreter start-up per run); its exception, if any, goes to the log."""
    from reinforge.jobs.train import run as run_pipeline

    try:
        run_pipeline(build_config([*run.overrides, f"output_dir={run.path}"], config_file))
    except Exception:   # one run's crash is reported in the table; the sweep goes on
        log_path.write_text(traceback.format_exc())
        return 1
    log_path.write_text("")
    return 0


# ---------------------------------------------------------------------------
# The table


def _write_results(out_dir: Path, swept: list[str], runs: list[SweepRun]) -> SweepResult:
    from reinforge.telemetry.report import write_report

    rows = summarise(runs, swept)
    note = separation_note(rows)
    header, cells = table(rows, swept)
    md = ["# reinforge sweep", "", f"Axes: {', '.join(swept) or '(none)'}. Held-out numbers after RL, "
          "mean ± sample std (ddof=1) over the seeds of each group; n/a: fewer than two seeds.", "",
          "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
    if note:
        md += ["", note]
    failed = [r for r in runs if r.status == "failed"]
    if failed:
        md += ["", "## Failed runs", ""]
        md += [f"- `{r.name}` (log: logs/{r.name}.log):\n\n```\n{r.error}\n```" for r in failed]
    md += ["", "Plots of every run: [report.html](report.html)", ""]
    paths = {"markdown": out_dir / "sweep.md", "json": out_dir / "sweep.json", "csv": out_dir / "sweep.csv"}
    paths["markdown"].write_text("\n".join(md))
    paths["json"].write_text(json.dumps({
        "axes": swept, "note": note, "rows": [asdict(r) for r in rows],
        "runs": [{**{k: v for k, v in asdict(r).items() if k != "summary"}, "path": str(r.path)} for r in runs],
    }, indent=2))
    paths["csv"].write_text(csv_text(rows, swept))
    with_metrics = [r.path for r in runs if (r.path / "metrics.jsonl").is_file()]
    report = write_report(with_metrics, out_dir) if with_metrics else None
    return SweepResult(out_dir=out_dir, axes=swept, runs=runs, rows=rows, note=note, report=report, **paths)


def print_result(console: Console, result: SweepResult, target: Path) -> None:
    """The end of `reinforge sweep`: the table of every group (unwrapped when not a terminal), the failed
    runs with their logs, and where the table and report were written."""
    header, cells = table(result.rows, result.axes)
    grid = Table(title="held-out evaluation after RL: mean ± sample std over seeds")
    labels = max(1, len([axis for axis in result.axes if axis != "seed"]))   # the group's columns, then numbers
    for i, name in enumerate(header):
        grid.add_column(name, justify="left" if i < labels else "right")
    for row in cells:
        grid.add_row(*(escape(c) for c in row))
    if console.is_terminal:
        console.print(grid)
    else:   # a log file or pipe: the whole table unwrapped, not squeezed into rich's default 80 columns
        from rich.measure import Measurement

        width = Measurement.get(console, console.options.update_width(10_000), grid).maximum
        Console(file=console.file, width=max(console.width, width)).print(grid)
    if result.note:
        console.print(escape(result.note), soft_wrap=True, highlight=False)
    for run in result.failed:
        last = (run.error or "").splitlines()[-1:] or ["no output"]
        console.print(
            f"[bold red]failed:[/] {escape(run.name)}: {escape(last[0])} "
            f"(log: {escape(str(target / 'logs' / run.name))}.log)",
            soft_wrap=True,
        )
    console.print(
        f"table: {escape(str(result.markdown))} (also {result.json.name}, {result.csv.name})",
        soft_wrap=True,
        highlight=False,
    )
    if result.report is not None:
        console.print(f"report: {escape(str(result.report))}", soft_wrap=True, highlight=False)
