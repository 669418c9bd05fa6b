"""`reinforge` command line: train, recipes (and, as they land, more commands)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from reinforge.errors import ConfigError, UserError
from reinforge.openmp import set_spin_count

# OpenMP's wait setting, before torch loads libgomp (not yet): reinforge/openmp.py says which and why.
set_spin_count()

# `reinforge --help` and `--version` must answer at once: torch and transformers (seconds to import) are
# imported inside the commands that need them, never at module level here.

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="RL post-training of language models with verifiable rewards."
)
console = Console()


# Errors go to stderr, so that a script reading the command's output never parses one.
error_console = Console(stderr=True)


def _error_line(message: str) -> None:
    """One red line on stderr: a message that spans lines is joined, so the line is all a log shows."""
    error_console.print(f"[bold red]error:[/] {escape(' '.join(message.split()))}", soft_wrap=True, highlight=False)


@contextmanager
def user_errors(*fixable: type[Exception]) -> Iterator[None]:
    """Errors the user can fix end with one red line on stderr, no traceback: exit 2 for a UserError
    (bad config or input, config.ConfigError among them) and the `fixable` ones (missing systems),
    exit 1 for the operating system's (disk full, permission denied). Anything else is a bug and
    keeps its traceback."""
    try:
        yield
    except (UserError, *fixable) as err:
        _error_line(str(err))
        raise typer.Exit(code=2) from None
    except OSError as err:
        from reinforge.telemetry.errors import os_error_message

        _error_line(os_error_message(err))
        raise typer.Exit(code=1) from None


def _print_version(value: bool) -> None:
    if value:
        from reinforge import __version__

        console.print(f"reinforge {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit")
    ] = False,
) -> None:
    """reinforge: RL post-training with verifiable rewards."""
    # transformers' per-file progress bars (loading and saving weights) would interleave with ours. Said
    # through huggingface_hub's variable (which transformers' bars follow), not by importing transformers
    # here: this callback runs before every command, `reinforge train --help` included.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:     # imported already (from Python): it read the variable then
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def build_config(overrides: list[str], config_file: str | None):
    """reinforge.config.build_config, imported on first use (it pulls in torch)."""
    from reinforge.config import build_config as build

    return build(overrides, config_file)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="key=value overrides, e.g. recipe=dr_grpo train.steps=20 model=/path/to/hf_model"),
    ] = None,
    config: Annotated[str | None, typer.Option("--config", "-c", help="YAML file of settings")] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            help="Continue the run in this directory from its newest checkpoint (its config.yaml; overrides are not "
                 "allowed)",
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a run already in output_dir")] = False,
) -> None:
    """Cold-start SFT, RL with the chosen recipe, and held-out evaluation.

    Every key=value setting, with its documentation and default: `reinforge config` (one section:
    `reinforge config rollout`; a recipe's resolved values: `reinforge config --recipe dapo`).
    """
    from reinforge.config.load import resume_config
    from reinforge.errors import RunInterrupted, RunStopped
    from reinforge.jobs.train import run
    from reinforge.telemetry.console import print_run_summary

    try:
        with user_errors(ConfigError, FileExistsError, NotImplementedError, RunStopped):
            if resume is not None:
                if overrides or config:
                    raise ConfigError(
                        "--resume continues a run with its own config.yaml; start a new run to change settings"
                    )
                cfg = resume_config(resume)
            else:
                cfg = build_config(overrides or [], config)
            result = run(cfg, resume=resume is not None, overwrite=overwrite)
    except KeyboardInterrupt as err:     # SIGINT / SIGTERM: where it stopped, what was saved; exit 128 + signal
        line = str(err) if isinstance(err, RunInterrupted) else "interrupted before training started"
        error_console.print(escape(line), soft_wrap=True, highlight=False)
        raise typer.Exit(code=128 + (err.signum if isinstance(err, RunInterrupted) else signal.SIGINT)) from None
    if os.environ.get("RANK", "0") == "0":      # under torchrun, every rank ran the job: rank 0 reports it
        print_run_summary(console, result.output_dir, result.summary)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def pipeline(
    name: Annotated[str, typer.Argument(help="A shipped pipeline (r1, r1_zero) or a pipeline YAML file")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="key=value for every stage, STAGE:key=value for one stage")
    ] = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="Folder of the stages' run directories; default runs/<time>-<name>. Re-running into it "
                            "skips finished stages and resumes an interrupted one")
    ] = None,
) -> None:
    """Multi-stage training: each stage a train run starting from the previous stage's model."""
    import time
    from pathlib import Path

    from reinforge.errors import RunInterrupted, RunStopped
    from reinforge.jobs.multistage import run_pipeline

    target = Path(out) if out else Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{Path(name).stem}"

    def announce(k: int, cfg) -> None:
        console.print(f"[bold]stage {k + 1}[/]: {escape(Path(cfg.output_dir).name)} (recipe {cfg.recipe}, "
                      f"sft {'on' if cfg.sft.enabled and cfg.sft.steps else 'off'}, {cfg.train.steps} RL steps)")

    try:
        with user_errors(ConfigError, FileExistsError, NotImplementedError, RunStopped):
            result = run_pipeline(name, overrides or [], target, on_stage=announce)
    except RunInterrupted as err:     # the stage saved its step: the same command goes on from there
        error_console.print(escape(f"{err.stopped} (stage {err.run_dir}); go on with the same command and "
                                   f"--out {target}"), soft_wrap=True, highlight=False)
        raise typer.Exit(code=128 + err.signum) from None
    table = Table(title=f"pipeline {result.name}: held-out evaluation after each stage")
    for column in ("stage", "recipe", "RL steps", "pass@1", "greedy accuracy"):
        table.add_column(column, justify="left" if column in ("stage", "recipe") else "right")
    for stage in result.stages:
        table.add_row(escape(stage.name), stage.recipe, str(stage.rl_steps), f"{stage.final['pass@1']:.3f}",
                      f"{stage.final['greedy_accuracy']:.3f}")
    console.print(table)
    console.print(f"pipeline directory: {escape(result.output_dir)} (pipeline.json)")


@app.command(name="reward-model", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def reward_model(
    out: Annotated[str, typer.Argument(help="Folder to write the reward model to (a Hugging Face folder)")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="key=value overrides: rm.* (pairs, steps, ...), model, task, sft, rollout, seed"),
    ] = None,
    config: Annotated[str | None, typer.Option("--config", "-c", help="YAML file of settings")] = None,
) -> None:
    """Train a Bradley-Terry reward model on preference pairs (on-policy from the verifier, or rm.pairs_path)
    and save it as an AutoModelForSequenceClassification folder; use it with reward.model.path=OUT."""
    import dataclasses
    import json

    from reinforge.jobs.reward_model import run_reward_model_job

    with user_errors(ConfigError, FileExistsError):
        result = run_reward_model_job(build_config(overrides or [], config), out)
    console.print(f"reward model: {escape(result.path)} ({result.train_pairs} training pairs, {result.heldout_pairs} "
                  f"held out: pair accuracy {result.heldout_accuracy:.3f})", highlight=False)
    console.print(json.dumps(dataclasses.asdict(result)), highlight=False, soft_wrap=True)


@app.command(name="process-reward-model", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def process_reward_model(
    out: Annotated[str, typer.Argument(help="Folder to write the process reward model to (a Hugging Face folder)")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="key=value overrides: prm.* (num_prompts, continuations, steps, ...), model, task, sft, "
                            "rollout, seed"),
    ] = None,
    config: Annotated[str | None, typer.Option("--config", "-c", help="YAML file of settings")] = None,
) -> None:
    """Label the policy's step-by-step solutions with Math-Shepherd's continuations, train a process reward model
    on them and save it as an AutoModelForTokenClassification folder; use it with reward.process.path=OUT."""
    import dataclasses
    import json

    from reinforge.jobs.process_reward_model import run_process_reward_model_job

    with user_errors(ConfigError, FileExistsError):
        result = run_process_reward_model_job(build_config(overrides or [], config), out)
    console.print(f"process reward model: {escape(result.path)} ({result.train_solutions} labelled solutions, "
                  f"{result.heldout_steps} held-out steps: step accuracy {result.heldout_accuracy:.3f})",
                  highlight=False)
    console.print(json.dumps(dataclasses.asdict(result)), highlight=False, soft_wrap=True)


@app.command(name="filter", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def filter_prompts(
    out: Annotated[
        str, typer.Argument(help="JSONL file to write the kept prompts to (read back with task.name=dataset)")
    ],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="key=value overrides: model=PATH, task.*, rollout.*, train.num_prompts")
    ] = None,
    config: Annotated[str | None, typer.Option("--config", "-c", help="YAML file of settings")] = None,
    k: Annotated[int, typer.Option(help="Samples per prompt")] = 8,
    lo: Annotated[float, typer.Option(help="Lowest pass rate kept")] = 0.1,
    hi: Annotated[float, typer.Option(help="Highest pass rate kept")] = 0.9,
) -> None:
    """Offline difficulty filter: keep the train prompts whose pass rate over k samples lies in \\[lo, hi]."""
    from reinforge.jobs.filter import run_filter

    with user_errors(ConfigError, ValueError, NotImplementedError):
        report = run_filter(build_config(overrides or [], config), out, k, lo, hi)
    console.print(f"kept {report.kept} of {len(report.pass_rates)} prompts (too easy: {report.too_easy}, "
                  f"too hard: {report.too_hard}) -> {out}")


@app.command()
def report(
    run_dirs: Annotated[
        list[str], typer.Argument(help="Run directories (each holds metrics.jsonl)", show_default=False)
    ],
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            "-o",
            help="Folder for report.html and its PNGs; default: the run directory (one run), else ./report",
        ),
    ] = None,
) -> None:
    """One HTML page of one or several runs: the before/after table, plots of every run overlaid, and the alerts."""
    from pathlib import Path

    from reinforge.telemetry.report import write_report

    paths = [Path(p) for p in run_dirs]
    for path in paths:
        problem = ("does not exist" if not path.exists() else "is not a directory" if not path.is_dir()
                   else "has no metrics.jsonl (not a run directory, or its run has not started)"
                   if not (path / "metrics.jsonl").is_file() else None)
        if problem:
            _error_line(f"run directory '{path}' {problem}")
            raise typer.Exit(code=2)
    target = Path(out) if out else paths[0] if len(paths) == 1 else Path("report")
    with user_errors():
        html_path = write_report(paths, target)
    console.print(f"report: {escape(str(html_path))}", soft_wrap=True, highlight=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sweep(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="Axes key=a,b,c (the grid is their product) and plain key=value settings, e.g. recipe=grpo,dr_grpo "
                 "seed=0,1,2 train.steps=50"
        ),
    ] = None,
    config: Annotated[
        str | None, typer.Option("--config", "-c", help="YAML file of settings shared by every run")
    ] = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="Sweep folder; default sweeps/<time>. Re-running into the same folder skips finished runs")
    ] = None,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            "-j",
            min=1,
            help="Runs at a time (each a subprocess with cores/jobs torch threads unless threads is set)",
        ),
    ] = 1,
) -> None:
    """Run every combination of the values given, then compare the groups: mean ± std over seeds.

    Each combination is one `reinforge train` run.
    """
    import time
    from pathlib import Path

    from reinforge.jobs.sweep import print_result, run_sweep

    target = Path(out) if out else Path("sweeps") / time.strftime("%Y%m%d-%H%M%S")
    with user_errors(ConfigError):
        result = run_sweep(overrides or [], target, jobs=jobs, config_file=config,
                           on_event=lambda message: console.print(escape(message), soft_wrap=True, highlight=False))
    print_result(console, result, target)
    if result.failed:
        raise typer.Exit(code=1)


@app.command()
def recipes(
    name: Annotated[
        str | None, typer.Argument(help="A recipe: print its preset (its full composition) instead of the table")
    ] = None,
) -> None:
    """The catalogue of methods, generated from the registry: advantage, objective, aggregation, KL, extras."""
    from dataclasses import fields

    from reinforge.objectives import RECIPES
    from reinforge.objectives.catalogue import RecipeRow, preset_yaml, recipe_rows
    from reinforge.objectives.common import lookup

    if name is not None:
        try:
            recipe = lookup(RECIPES, name, "recipe")
        except ValueError as err:
            _error_line(str(err))
            raise typer.Exit(code=2) from None
        console.print(escape(preset_yaml(recipe)), soft_wrap=True, highlight=False)
        return
    table = Table(title="reinforge recipes (reinforge recipes NAME prints one preset)")
    for field in fields(RecipeRow):
        table.add_column(field.name, overflow="fold", no_wrap=field.name == "method")
    for row in recipe_rows():
        table.add_row(*(escape(getattr(row, field.name)) for field in fields(RecipeRow)))
    console.print(table)


@app.command(name="config")
def config_command(
    section: Annotated[
        str | None, typer.Argument(help="A section (rollout, train, ...) or top-level key (seed); default every key")
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option("--recipe", "-r", help="Show the values this recipe resolves to (its preset over the defaults)"),
    ] = None,
) -> None:
    """Every config key with its type, default (or a recipe's value) and documentation: what key=value accepts."""
    from reinforge.config.keys import config_keys, format_keys

    with user_errors(ConfigError):
        keys = config_keys(section, recipe)
    console.print(escape(format_keys(keys, width=console.width, recipe=recipe)), soft_wrap=True, highlight=False)


@app.command(name="export")
def export_run(
    run_dir: Annotated[
        str,
        typer.Argument(
            help="Run directory of `reinforge train` (holds config.yaml and checkpoints/)", show_default=False
        ),
    ],
    out: Annotated[
        str | None,
        typer.Option(
            "--out", "-o", help="Folder to write the model to (must not exist, or be empty); default RUN_DIR/export"
        ),
    ] = None,
    step: Annotated[
        int | None,
        typer.Option("--step", help="Checkpoint step to export; default the newest checkpoint, else RUN_DIR/model"),
    ] = None,
) -> None:
    """A run's model as a plain Hugging Face folder, LoRA adapters merged.

    The run's sampling settings become the folder's generation defaults.
    """
    from pathlib import Path

    from reinforge.jobs.export import export_model

    with user_errors(ConfigError):
        path = export_model(Path(run_dir), Path(out) if out else Path(run_dir) / "export", step)
    console.print(f"model: {escape(str(path))}", soft_wrap=True, highlight=False)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    run_dir: Annotated[str, typer.Argument(help="Run directory of `reinforge train`", show_default=False)],
) -> None:
    """A run's policy as an OpenAI-compatible endpoint on 127.0.0.1, no training: port=N (default a free
    port, printed), step=N (a checkpoint; default the newest). Ctrl-C stops it."""
    from pathlib import Path

    from reinforge.jobs.export import run_policy
    from reinforge.serve.run import serve_options, serve_policy

    try:
        with user_errors(ConfigError):
            options = serve_options(ctx.args)
            cfg, policy = run_policy(Path(run_dir), options["step"])
            serve_policy(policy, cfg.rollout, cfg.prompt.chat_template, options["port"],
                         lambda line: console.print(escape(line), soft_wrap=True, highlight=False))
    except KeyboardInterrupt:
        raise typer.Exit(code=0) from None


@app.command()
def doctor(
    namespaces: Annotated[bool, typer.Option(help="Probe with the namespace layers (--no-namespaces: without)")] = True,
) -> None:
    """Which layers of the code sandbox this machine gives; exit 1 if a required one is missing."""
    from reinforge.verifiers.code_doctor import doctor_lines

    lines, ok = doctor_lines(namespaces)
    for line in lines:
        console.print(escape(line), soft_wrap=True, highlight=False)
    if not ok:
        raise typer.Exit(code=1)


def main() -> None:
    app(args=sys.argv[1:])


if __name__ == "__main__":
    main()
