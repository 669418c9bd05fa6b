"""The whole configuration of a run: the task section and `Config`, which holds every section.

The sections that parts of the run take are declared in reinforge/settings/ (documented once,
there; the objective section is derived from ObjectiveSpec's fields, settings/objective.py); a
part below the jobs takes its own section, never the Config. Each section checks its own fields;
the rules across sections are in config/checks.py, and loading (presets, YAML, overrides) is
config/load.py.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from reinforge.config.input import _unknown_key_message
from reinforge.errors import ConfigError
from reinforge.settings import (
    AlertConfig,
    AnalyticsConfig,
    CheckpointConfig,
    CriticConfig,
    CurationConfig,
    DPOConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    ProcessRewardTrainingConfig,
    PromptConfig,
    RayConfig,
    RewardConfig,
    RewardModelTrainingConfig,
    RolloutConfig,
    Section,
    SFTConfig,
    TrainConfig,
)
from reinforge.settings.objective import ObjectiveConfig


class TaskConfig(Section):
    name: str = Field(
        "arithmetic",
        description=(
            "Task: arithmetic, chain_sum (a sum written as running partial sums, one per line: steps for process "
            "rewards), countdown, multiply_tool (multiplication with a calculator tool: multi-turn), or "
            "dataset (problems from a JSONL/Parquet/datasets file, options path and verifier; see "
            "reinforge.tasks.dataset), or mix (several of them as domains of one run, option domains; see "
            "reinforge.tasks.mix), or verifiers_taskset (the tasks of a verifiers taskset, option env: the default "
            "with task.agent=verifiers:ENV_ID)."
        ),
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword options of the task's constructor, e.g. digits=3 for arithmetic."
    )
    environment: str | None = Field(
        None,
        description=(
            "A multi-turn environment, 'module:Class' or 'path/to/file.py:Class': a class with reset(row) -> "
            "messages and step(text) -> (messages, reward, done), constructed with no arguments per trajectory "
            "(docs/agents.md). Its return is the reward. None: single-turn, or tools (rollout.tools). With "
            "task.name=dataset the verifier defaults to none: rows need no answer, nor a prompt."
        ),
    )

    agent: str | None = Field(
        None,
        description=(
            "An agent trained through the policy's OpenAI-compatible endpoint: a function 'module:function' or "
            "'path/to/file.py:function' called as agent(client, row) -> reward (or a dict with 'reward' and metrics), "
            "a TRL environment_factory class 'module:Class', or a verifiers environment 'verifiers:ENV_ID' (its "
            "taskset gives the rows when task.name is not set; its rubric the reward) (docs/agents.md). Its reward is "
            "the episode's reward; rollout.max_turns bounds its calls."
        ),
    )
    agent_timeout_s: float = Field(120.0, gt=0, description="task.agent: an episode that runs longer fails alone.")
    agent_concurrency: int | None = Field(None, ge=1, description="task.agent: episodes running at once; None: "
                                          "all of a batch's (the engine then decodes their calls together).")
    environment_reward: Literal["trajectory", "turn"] = Field(
        "trajectory",
        description=(
            "How an environment's rewards are credited: 'trajectory', their sum on the last model token (every "
            "recipe); 'turn', each turn's reward on that turn's last token, for GAE to credit turn by turn (a recipe "
            "with a critic: ppo, vapo)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _verifiers_rows(cls, data: Any) -> Any:
        """A verifiers environment brings its rows: its taskset's tasks, unless the run names a task of its own."""
        agent = data.get("agent") if isinstance(data, dict) else None
        if isinstance(agent, str) and agent.startswith("verifiers:") and "name" not in data:
            data = {**data, "name": "verifiers_taskset",
                    "options": {"env": agent.split(":", 1)[1], **(data.get("options") or {})}}
        return data

    @model_validator(mode="after")
    def _check_task(self) -> TaskConfig:
        from reinforge.tasks import TASKS, build_task

        if (self.environment or self.agent) is not None and self.name == "dataset" and "verifier" not in self.options:
            self.options = {**self.options, "verifier": "none"}      # the environment scores the rows

        if self.name not in TASKS:
            build_task(self.name)  # raises with a suggestion for an unknown name
        _check_task_options(self.name, self.options, "task", default_name="name" not in self.model_fields_set)
        try:
            domains = TASKS[self.name].domain_specs(self.options)
        except ValueError as err:       # the shape of a mix's domains
            raise ConfigError(str(err)) from None
        for spec in domains:            # each domain's options, as its own task's would be checked
            _check_task_options(spec.task, spec.options, spec.where, default_name=False)
        return self


def _check_task_options(name: str, options: dict[str, Any], where: str, *, default_name: bool) -> None:
    """ConfigError for an option the task `name` does not take, or a required one not given; `where` is
    the section's key ("task", or a mix's "task.options.domains[1]"), `default_name`: the name was not set."""
    from reinforge.tasks import TASKS

    signature = inspect.signature(TASKS[name].__init__)
    params = [p for p in signature.parameters if p != "self"]
    for key in options:
        if key not in params:
            others = [n for n, cls in TASKS.items() if n != name and key in inspect.signature(cls.__init__).parameters]
            if others:    # task.options.path without task.name=dataset: the option is right, the task is not
                raise ConfigError(
                    f"{where}.options.{key} is an option of task.name={' or '.join(others)}, not of the "
                    f"task '{name}'{' (the default)' if default_name else ''}: set {where}.name={others[0]}"
                )
            raise ConfigError(_unknown_key_message(f"{where}.options.{key}", key, params))
    # Options without a default (the dataset task's path) must be given.
    missing = [p for p in params if signature.parameters[p].default is inspect.Parameter.empty and p not in options]
    if missing:
        raise ConfigError(f"task '{name}' needs {where}.options.{missing[0]}")


class Config(Section):
    seed: int = Field(0, description="Seed of everything random in the run.")
    recipe: str = Field("grpo", description="Named method: its preset and objective (see `reinforge recipes`).")
    output_dir: str | None = Field(None, description="Run directory; default runs/<time>-<recipe>.")
    threads: int = Field(2, gt=0, description="torch CPU threads.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    curation: CurationConfig = Field(default_factory=CurationConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    rm: RewardModelTrainingConfig = Field(default_factory=RewardModelTrainingConfig)
    prm: ProcessRewardTrainingConfig = Field(default_factory=ProcessRewardTrainingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    analytics: AnalyticsConfig = Field(default_factory=AnalyticsConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    alerts: AlertConfig = Field(default_factory=AlertConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    backend: Literal["local", "ray"] = Field(
        "local",
        description="Where train.mode=async generates: local (a sampler thread of this process, no Ray needed) or ray "
                    "(rollout worker actors on a Ray cluster, section ray).",
    )
    ray: RayConfig = Field(default_factory=RayConfig)

    @property
    def rl_seed(self) -> int:
        """The seed of the training stage after SFT: train.seed, else seed."""
        return self.seed if self.train.seed is None else self.train.seed

    @model_validator(mode="before")
    @classmethod
    def _model_shorthand(cls, data: Any) -> Any:
        # `model=PATH` is the shorthand users expect for `model.path=PATH`.
        if isinstance(data, dict) and isinstance(data.get("model"), str):
            data = {**data, "model": {"path": data["model"]}}
        return data

    @field_validator("reward")
    @classmethod
    def _check_reward(cls, reward: RewardConfig, info: ValidationInfo) -> RewardConfig:
        # A check of the section, reported at key `reward`; here, as it needs reinforge.rewards (above settings/).
        from reinforge.rewards.functions import check_reward_section

        return check_reward_section(reward, resolve=(info.context or {}).get("resolve_rewards") is not False)

    @model_validator(mode="after")
    def _check_recipe(self) -> Config:
        from reinforge.objectives import RECIPES

        if self.recipe not in RECIPES:
            close = difflib.get_close_matches(self.recipe, sorted(RECIPES), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown recipe '{self.recipe}'{hint} (`reinforge recipes` lists them)")
        return self


