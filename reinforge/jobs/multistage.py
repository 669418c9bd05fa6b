"""Multi-stage pipelines: stages run one after another, each a `reinforge train`
run that starts from the model the previous stage ended with.

A pipeline is a YAML file (shipped ones: `reinforge/pipelines/*.yaml`):

    name: r1
    description: ...
    settings: {task.name: arithmetic}     # every stage's settings (dotted keys)
    stages:
      - name: cold_start
        settings: {train.steps: 0}        # what makes this stage what it is
      - name: reasoning_rl
        settings: {recipe: grpo, sft.enabled: false}

A stage may instead start from the pipeline's own model (`start: initial`: a fresh student
beside a teacher the earlier stages trained), and a string setting may name an earlier stage's
run directory as `{stage_name}`, e.g. `sft.teacher_path: "{teacher_rl}/model"` (r1_distill).

Precedence for a stage (later wins): the pipeline's `settings` < the user's
overrides for every stage (`seed=1`) < the stage's own `settings` < the
user's overrides for that stage only (`reasoning_rl:train.steps=50`) < the
model the previous stage ended with. The user cannot override which model a
later stage starts from, since that is what chains the stages (a `start: initial`
stage takes model.path as the first stage does).

Stage k writes its own run directory OUT/<k>-<name>; a stage starts from
OUT/<k-1>-<name>/model. The pipeline writes OUT/pipeline.json with every
stage's held-out evaluation. Running the same command again skips finished
stages and resumes an interrupted one from its checkpoint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from reinforge.config import Config, build_config, load_yaml, parse_overrides
from reinforge.errors import ConfigError

PIPELINES_DIR = Path(__file__).parent.parent / "pipelines"


STARTS = ("previous", "initial")      # a stage's model: the previous stage's, or the pipeline's own (model.path)


@dataclass(frozen=True)
class Stage:
    name: str
    settings: dict[str, Any]       # dotted keys -> values; "{name}" in a string: that earlier stage's run directory
    start: str = "previous"        # one of STARTS


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    description: str
    settings: dict[str, Any]
    stages: tuple[Stage, ...]

    @classmethod
    def load(cls, name_or_path: str) -> PipelineSpec:
        """A shipped pipeline by name (r1, r1_zero) or a YAML file."""
        path = Path(name_or_path)
        if not path.suffix:
            path = PIPELINES_DIR / f"{name_or_path}.yaml"
            if not path.is_file():
                shipped = sorted(p.stem for p in PIPELINES_DIR.glob("*.yaml"))
                raise ConfigError(
                    f"unknown pipeline '{name_or_path}' (shipped: {', '.join(shipped)}; or give a YAML file)"
                )
        data = load_yaml(path)
        unknown = set(data) - {"name", "description", "settings", "stages"}
        if unknown:
            raise ConfigError(f"{path}: unknown keys {sorted(unknown)} (valid: name, description, settings, stages)")
        stages = data.get("stages") or []
        if not stages:
            raise ConfigError(f"{path}: a pipeline needs a non-empty list of stages")
        parsed = []
        for i, stage in enumerate(stages):
            if not isinstance(stage, dict) or "name" not in stage or set(stage) - {"name", "settings", "start"}:
                raise ConfigError(f"{path}: stage {i + 1} must be a mapping with 'name' and optional 'settings' "
                                  "and 'start'")
            start = str(stage.get("start", "previous"))
            if start not in STARTS:
                raise ConfigError(f"{path}: stage {i + 1} has start '{start}'; valid: {', '.join(STARTS)}")
            parsed.append(Stage(str(stage["name"]), dict(stage.get("settings") or {}), start))
        names = [s.name for s in parsed]
        if len(set(names)) != len(names):
            raise ConfigError(f"{path}: stage names must be distinct, got {names}")
        return cls(str(data.get("name", path.stem)), str(data.get("description", "")), dict(data.get("settings") or {}),
                   tuple(parsed))


@dataclass
class StageResult:
    name: str
    run_dir: str
    recipe: str
    rl_steps: int
    start: dict | None       # held-out evaluation at the start of the stage's RL (after its SFT)
    final: dict | None       # ... and at its end


@dataclass
class PipelineResult:
    name: str
    output_dir: str
    stages: list[StageResult]


def stage_configs(spec: PipelineSpec, overrides: list[str], out_dir: Path) -> list[Config]:
    """Every stage's validated config, built before anything runs (bad input writes nothing).

    Stage k > 0 reads its model from stage k-1's run directory, which need not exist yet.
    """
    names = {s.name for s in spec.stages}
    common, per_stage = [], {name: [] for name in names}
    for item in overrides:
        key = item.partition("=")[0]
        if ":" not in key:
            common.append(item)
            continue
        stage, _, rest = item.partition(":")
        if stage not in names:
            raise ConfigError(f"override '{item}' names stage '{stage}', which pipeline {spec.name} does not have "
                              f"(stages: {', '.join(s.name for s in spec.stages)})")
        per_stage[stage].append(rest)
    configs, previous, earlier = [], None, {}
    for k, stage in enumerate(spec.stages):
        chain = [] if previous is None or stage.start == "initial" else [f"model.path={previous / 'model'}"]
        try:
            settings = {key: _stage_dirs(value, earlier, names) for key, value in stage.settings.items()}
            # A later stage's model is the first stage's architecture, trained: it decides the engine.
            cfg = build_config([*_as_overrides(spec.settings), *common, *_as_overrides(settings),
                                *per_stage[stage.name], *chain, f"output_dir={out_dir / f'{k + 1}-{stage.name}'}"],
                               architecture_of=configs[0].model.path if configs else None)
        except ConfigError as err:
            raise ConfigError(f"stage '{stage.name}': {err}") from None
        configs.append(cfg)
        previous = earlier[stage.name] = Path(cfg.output_dir)
    return configs


def _stage_dirs(value: Any, earlier: dict[str, Path], names: set[str]) -> Any:
    """`value` with each "{name}" of an earlier stage replaced by its run directory (strings only); a later
    stage's name is an error (its directory holds nothing yet), other braces are left as they are."""
    if not isinstance(value, str):
        return value

    def directory(match: re.Match) -> str:
        name = match.group(1)
        if name in earlier:
            return str(earlier[name])
        if name in names:
            raise ConfigError(f"'{value}' names stage '{name}', which has not run yet at this stage: name an "
                              "earlier one")
        return match.group(0)

    return re.sub(r"\{([^{}]+)\}", directory, value)


def _as_overrides(settings: dict[str, Any]) -> list[str]:
    """{"train.steps": 0, "objective": {...}} -> ["train.steps=0", "objective={...}"] (values as YAML)."""
    out = []
    for key, value in settings.items():
        text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
        text = text.removesuffix("\n...").removesuffix("...").strip()
        out.append(f"{key}={text}")
    parse_overrides(out)   # fails here, naming the key, rather than inside a stage
    return out


def run_pipeline(name_or_path: str, overrides: list[str], out_dir: Path,
                 on_stage: Callable[[int, Config], None] | None = None) -> PipelineResult:
    """Run the stages in order (see the module docstring); returns each stage's evaluation."""
    from reinforge.jobs.start import prepare
    from reinforge.jobs.train import run

    spec = PipelineSpec.load(name_or_path)
    out_dir = Path(out_dir)
    configs = stage_configs(spec, overrides, out_dir)
    for cfg in configs[:1]:
        prepare(cfg)        # the first stage's model and task exist; later stages' models are made by this run
    results = []
    for k, cfg in enumerate(configs):
        run_dir = Path(cfg.output_dir)
        if on_stage is not None:
            on_stage(k, cfg)
        started = (run_dir / "config.yaml").is_file()
        if started and yaml.safe_load((run_dir / "config.yaml").read_text()) != cfg.model_dump(mode="json"):
            raise ConfigError(f"stage '{spec.stages[k].name}' in {run_dir} was run with other settings: "
                              "choose another output folder (--out) to run these")
        if not (run_dir / "summary.json").is_file():
            run(cfg, resume=started)
        summary = json.loads((run_dir / "summary.json").read_text())
        results.append(StageResult(spec.stages[k].name, str(run_dir), cfg.recipe, summary["rl_steps"],
                                   summary["eval"]["start"], summary["eval"]["final"]))
    result = PipelineResult(spec.name, str(out_dir), results)
    (out_dir / "pipeline.json").write_text(json.dumps(asdict(result), indent=2))
    return result
