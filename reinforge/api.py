"""The Python API: `reinforge.train(...)`, for notebooks and scripts, as `reinforge train` is for the shell.

It is the command line, called from Python: the arguments become `key=value`
overrides that go through the same `build_config` (defaults < recipe preset <
config file < overrides, unknown keys named with the closest valid one) and
the same `pipeline.run` (the checks before anything is written, the run
directory, checkpoints, the exported model). What the CLI prints as its one
red line, this raises as an exception with that same message: `ConfigError`
(a `ValueError`) for bad input, `FileExistsError` for a run already in
output_dir, `NotImplementedError` for a recipe whose systems are missing,
`RunStopped` when a guard stopped the run, and an `OSError` whose message is
the CLI's for a full disk or a denied permission. Ctrl-C (or SIGTERM) during
RL saves the step and raises `RunInterrupted` (a KeyboardInterrupt).

Arguments TRL users know:

    model         a local Hugging Face model folder; None: the built-in tiny model
    dataset       a data file (JSONL, Parquet, a datasets folder), a list of dicts, a
                  `datasets.Dataset` or a pandas DataFrame: task.name=dataset with task.options.path;
                  None: the config's task
    reward_funcs  callables, 'module:function' paths or built-in names (verifier, format, ...), or
                  dicts {name, weight, params, domains} whose name is one of those; callables without an
                  import path (a notebook's) are registered in-process (reinforge/rewards/user.py)
    recipe        a named method (grpo, dapo, ...)
    config        settings as a dict, nested ({"train": {"steps": 2}}) or dotted ({"train.steps": 2})
    **overrides   the same as keyword arguments: seed=1, train={"steps": 2}, **{"rollout.temperature": 0.7}
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from reinforge.config import Config, build_config
from reinforge.rewards.user import register
from reinforge.telemetry.errors import os_error_message


@dataclass(frozen=True)
class RunResult:
    """What a finished run left behind, read from its run directory."""

    run_dir: Path                 # the run directory (config.yaml, metrics.jsonl, samples.jsonl, summary.json, ...)
    metrics: dict[str, Any]       # the last RL step's metrics.jsonl line, with its "step"; {} when RL ran no step
    eval: dict[str, dict]         # held-out evaluation at the start and end of RL: {"start": {...}, "final": {...}}
    model_dir: Path               # the exported model: a Hugging Face folder (from_pretrained loads it)
    summary: dict                 # summary.json
    config: Config                # the resolved config the run used


def train(
    model: str | os.PathLike | None = None,
    dataset: str | os.PathLike | Sequence[Mapping[str, Any]] | Any | None = None,
    reward_funcs: Sequence[Callable | str | Mapping[str, Any]] | Callable | str | None = None,
    recipe: str | None = None,
    *,
    config: Mapping[str, Any] | None = None,
    config_file: str | os.PathLike | None = None,
    overwrite: bool = False,
    **overrides: Any,
) -> RunResult:
    """Cold-start SFT, RL with `recipe` and held-out evaluation, as `reinforge train` runs them
    (see the module docstring for the arguments); the run's `RunResult`."""
    from transformers.utils import logging as hf_logging

    from reinforge.jobs.train import run

    if "train_dataset" in overrides:      # GRPOTrainer's name: as a key it would get the CLI's hint, not this argument
        raise TypeError("reinforge.train takes the data as dataset=..., not train_dataset=...")
    hf_logging.disable_progress_bar()     # as the CLI: transformers' per-file bars would cut through ours
    cfg = build_config(train_overrides(model, dataset, reward_funcs, recipe, {**(config or {}), **overrides}),
                       str(config_file) if config_file is not None else None)
    try:
        result = run(cfg, overwrite=overwrite)
    except FileExistsError:
        raise
    except OSError as err:      # the CLI's line for a full disk or a denied permission, as the message
        raise OSError(os_error_message(err)) from err
    return load_result(Path(result.output_dir), cfg.model_copy(update={"output_dir": result.output_dir}))


def train_overrides(model: Any, dataset: Any, reward_funcs: Any, recipe: str | None,
                    settings: Mapping[str, Any]) -> list[str]:
    """The `key=value` overrides `reinforge train` would be given for these arguments."""
    tree: dict[str, Any] = {}
    if model is not None:
        tree["model"] = {"path": str(model)}
    if recipe is not None:
        tree["recipe"] = recipe
    if dataset is not None:
        tree["task"] = {"name": "dataset", "options": {"path": dataset_path(dataset)}}
    if reward_funcs is not None:
        funcs = (
            [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str | Mapping) else list(reward_funcs)
        )
        tree["reward"] = {"functions": [reward_entry(f, i) for i, f in enumerate(funcs)]}
    pairs = _leaves("", tree) if tree else []
    for key, value in settings.items():   # the user's settings last: they win over what the arguments implied
        pairs += _leaves(key, value)
    return [f"{key}={_yaml(value)}" for key, value in pairs]


def _leaves(prefix: str, value: Any) -> list[tuple[str, Any]]:
    """Dotted keys of every leaf: ("train", {"steps": 2}) -> [("train.steps", 2)] (lists are leaves)."""
    if isinstance(value, Mapping) and value:
        return [pair for key, sub in value.items() for pair in _leaves(f"{prefix}.{key}" if prefix else str(key), sub)]
    return [(prefix, value)]


def _yaml(value: Any) -> str:
    """`value` as the text after `key=`, which the CLI parses back as YAML to the same value."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    try:
        # JSON is YAML's flow style, and its strings are double-quoted YAML scalars: a string stays a
        # string ("123", "a: b"), on one line whatever it holds.
        return json.dumps(value)
    except TypeError:                     # not JSON (a date): YAML's own flow style
        return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).removesuffix("\n...\n").strip()


def reward_entry(fn: Callable | str | Mapping[str, Any], position: int | None = None) -> dict[str, Any]:
    """One entry of reward.functions: {name, weight, params, domains}; `position`: its index in reward_funcs."""
    if isinstance(fn, Mapping):
        entry = dict(fn)
        if "name" not in entry:
            raise TypeError(
                f"a reward function given as a dict needs a 'name' (a callable or a string), got {sorted(entry)}"
            )
        entry["name"] = reward_name(entry["name"], position)
        return entry
    return {"name": reward_name(fn, position)}


def reward_name(fn: Callable | str, position: int | None = None) -> str:
    """A reward function's name in the config: a string as given; a callable by its import path when
    it has one (so config.yaml works in any process), else registered in-process."""
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise TypeError(f"reward_funcs entries must be callables or strings, got {type(fn).__name__}")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and qualname.isidentifier():
        try:
            if getattr(importlib.import_module(module), qualname) is fn:
                return f"{module}:{qualname}"
        except (ImportError, AttributeError):
            pass
    return register(fn, position=position)


def dataset_path(dataset: Any) -> str:
    """A file path as given; rows (a list of dicts, a `datasets.Dataset`) written once to a JSONL file
    named by their content under $REINFORGE_CACHE/datasets (default ~/.cache/reinforge), so the same
    rows always give the same path and config.yaml can be resumed."""
    if isinstance(dataset, str | os.PathLike):
        return os.fspath(dataset)
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):      # a datasets.Dataset
        dataset = dataset.to_list()
    elif hasattr(dataset, "to_json") and hasattr(dataset, "columns"):  # a pandas DataFrame (verl's parquet, read)
        # Through pandas' own JSON: a Parquet list column arrives as a numpy array, which json.dumps refuses.
        dataset = json.loads(dataset.to_json(orient="records"))
    if (
        isinstance(dataset, Mapping)
        or not isinstance(dataset, Sequence)
        or not all(isinstance(r, Mapping) for r in dataset)
    ):
        raise TypeError("dataset must be a file path, a list of dicts, a datasets.Dataset (a DatasetDict: pick "
                        f"a split, dataset['train']) or a pandas DataFrame, got {type(dataset).__name__}")
    text = "".join(json.dumps(dict(row), sort_keys=True) + "\n" for row in dataset)
    root = Path(os.environ.get("REINFORGE_CACHE", Path.home() / ".cache" / "reinforge")) / "datasets"
    path = root / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.jsonl"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return str(path)


def load_result(run_dir: Path, cfg: Config) -> RunResult:
    summary = json.loads((run_dir / "summary.json").read_text())
    last: dict[str, Any] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("stage") == "rl":
            last = {k: v for k, v in record.items() if k != "stage"}
    return RunResult(run_dir=run_dir, metrics=last, eval=summary["eval"], model_dir=run_dir / "model",
                     summary=summary, config=cfg)
