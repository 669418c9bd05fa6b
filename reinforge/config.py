"""Typed run configuration: defaults, recipe presets, YAML files and dotted
command-line overrides, validated before anything runs.

Precedence (later wins): field defaults < recipe preset
(`reinforge/recipes/<recipe>.yaml`) < user YAML file (`config=FILE`) <
`key=value` overrides. The sections that parts of the run take are declared
in reinforge/settings/ (documented once, there), the objective section is derived
from ObjectiveSpec's fields (objective_config.py), the task section and the
whole Config are here; this module is the edge where they meet: a part below
it takes its own section, never the Config. Unknown keys are errors that name
the closest valid key (the parsing of what users type, and those checks:
config_input.py).
"""

from __future__ import annotations

import copy
import difflib
import inspect
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from reinforge.config_input import (
    _unknown_key_message,
    check_keys,
    deep_merge,
    leaves,
    load_yaml,
    parse_overrides,
)
from reinforge.errors import ConfigError
from reinforge.objective_config import ObjectiveConfig
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

RECIPES_DIR = Path(__file__).parent / "recipes"


class TaskConfig(Section):
    name: str = Field(
        "arithmetic",
        description=(
            "Task: arithmetic, chain_sum (a sum written as running partial sums, one per line: steps for process "
            "rewards), countdown, multiply_tool (multiplication with a calculator tool: multi-turn), or "
            "dataset (problems from a JSONL/Parquet/datasets file, options path and verifier; see "
            "reinforge.tasks.dataset), or mix (several of them as domains of one run, option domains; see "
            "reinforge.tasks.mix)."
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

    environment_reward: Literal["trajectory", "turn"] = Field(
        "trajectory",
        description=(
            "How an environment's rewards are credited: 'trajectory', their sum on the last model token (every "
            "recipe); 'turn', each turn's reward on that turn's last token, for GAE to credit turn by turn (a recipe "
            "with a critic: ppo, vapo)."
        ),
    )

    @model_validator(mode="after")
    def _check_task(self) -> TaskConfig:
        from reinforge.tasks import TASKS, build_task

        if self.environment is not None and self.name == "dataset" and "verifier" not in self.options:
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
    def _check_reward_domains(self) -> Config:
        # Across two sections: reward.functions[].domains names the task's domains (a mix's).
        from reinforge.rewards.functions import check_reward_domains
        from reinforge.rewards.sources import configured_sources
        from reinforge.tasks import TASKS

        specs = TASKS[self.task.name].domain_specs(self.task.options)
        domains = [s.domain for s in specs] or [self.task.name]
        check_reward_domains(self.reward.functions, domains, has_source=bool(configured_sources(self.reward)))
        return self

    @model_validator(mode="after")
    def _check_self_play(self) -> Config:
        # Judge training data must be written in the format its judge reads (sft.judge_fraction); SPIN needs SFT data.
        if self.sft.judge_fraction > 0:
            from reinforge.rewards.judge import check_label
            from reinforge.settings.judge import JudgeConfig

            try:
                check_label(self.reward.judge or JudgeConfig())
            except ValueError as err:
                raise ConfigError(str(err)) from None
        if self.dpo.pairs == "spin" and self.sft.source == "rejection":
            raise ConfigError("dpo.pairs=spin pairs the SFT data with the policy's samples, and sft.source=rejection "
                              "has no SFT data before sampling: set sft.source=teacher or file")
        return self

    @model_validator(mode="after")
    def _check_top_k_recording(self) -> Config:
        # DPPO's top-K divergence reads the sampler's top-K, which only the native engine records.
        if self.rollout.record_top_k and self.rollout.engine != "native":
            raise ConfigError("rollout.record_top_k needs rollout.engine=native (the HF engine does not record the "
                              "sampler's top-K log-probs): set rollout.engine=native or rollout.record_top_k=0")
        if self.rollout.engine == "vllm" and self.train.mode == "async":
            raise ConfigError("train.mode=async samples with the native engine in its own thread, and rollout.engine="
                              "vllm samples in the loop: use train.mode=sync (a recipe that is not asynchronous) "
                              "with rollout.engine=vllm, or rollout.engine=native")
        if self.rollout.engine == "vllm" and self.model.lora is not None:
            raise ConfigError("rollout.engine=vllm does not sync LoRA adapters yet (vLLM's LoRA requests): remove "
                              "model.lora, or set rollout.engine=native")
        from reinforge.objectives import RECIPE_OBJECTIVES

        recipe = RECIPE_OBJECTIVES.get(self.recipe)
        loss = self.objective.policy_loss or (recipe.policy_loss if recipe is not None else None)
        if loss in ("dppo_topk_tv", "dppo_topk_kl") and not self.rollout.record_top_k:
            raise ConfigError(f"objective.policy_loss={loss} compares the sampler's top-K "
                              "log-probs with the learner's: set rollout.record_top_k (e.g. 20)")
        return self

    @model_validator(mode="after")
    def _check_token_budgets(self) -> Config:
        # Across two sections: a budget past the generation limit would measure nothing new.
        over = [b for b in self.eval.token_budgets if b > self.rollout.max_new_tokens]
        if over:
            raise ConfigError(f"eval.token_budgets has {over[0]} > rollout.max_new_tokens={self.rollout.max_new_tokens}"
                              f": lower it or raise rollout.max_new_tokens")
        if self.eval.token_budgets and (self.task.environment is not None or self.rollout.tools):
            raise ConfigError("eval.token_budgets cuts single-turn completions; an episode (task.environment, "
                              "rollout.tools) has turns of its own: set eval.token_budgets=[]")
        return self

    @model_validator(mode="after")
    def _check_recipe(self) -> Config:
        from reinforge.objectives import RECIPES

        if self.recipe not in RECIPES:
            close = difflib.get_close_matches(self.recipe, sorted(RECIPES), n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown recipe '{self.recipe}'{hint} (`reinforge recipes` lists them)")
        return self


def recipe_preset(name: str) -> dict[str, Any]:
    """The YAML preset of a named recipe (empty if the recipe has none)."""
    path = RECIPES_DIR / f"{name}.yaml"
    return load_yaml(path) if path.is_file() else {}


def task_preset(user: dict[str, Any]) -> dict[str, Any]:
    """The config values the named task runs best with (`Task.preset`): under the recipe's and the user's."""
    from reinforge.tasks import TASKS

    task = user.get("task") if isinstance(user.get("task"), dict) else {}
    name = task.get("name", TaskConfig.model_fields["name"].default)
    return copy.deepcopy(TASKS[name].preset) if name in TASKS else {}


def build_config(overrides: list[str] | None = None, config_file: str | None = None, *,
                 architecture_of: str | None = None) -> Config:
    """Resolve defaults, recipe preset, YAML file and overrides into one validated Config, fitted to
    its model folder's architecture (models/model_dir.py). `architecture_of`: where to read that
    architecture when model.path is written later (a pipeline stage's model, made by the stage before)."""
    user = load_yaml(config_file) if config_file else {}
    cli = parse_overrides(overrides or [])
    if isinstance(cli.get("model"), str):
        cli["model"] = {"path": cli["model"]}
    if isinstance(user.get("model"), str):
        user["model"] = {"path": user["model"]}
    merged_user = deep_merge(user, cli)
    check_keys(merged_user, Config)
    recipe = merged_user.get("recipe", Config.model_fields["recipe"].default)
    preset = recipe_preset(str(recipe))
    check_keys(preset, Config, prefix=f"recipes/{recipe}.yaml: ")
    try:
        cfg = Config.model_validate(deep_merge(deep_merge(task_preset(merged_user), preset), merged_user))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    given = {leaf for leaf, _ in leaves("", preset)} | {leaf for leaf, _ in leaves("", merged_user)}
    given = {leaf.lstrip(".") for leaf in given}
    cfg = _fit_sft_to_data(cfg, given)
    if (architecture_of or cfg.model.path) == "builtin":
        check_lengths(cfg, cfg.model.max_positions, "model.max_positions")
        return _fit_builtin_moe(cfg, given)
    # The model folder's architecture decides the engine and the learner forward, before anything loads.
    return fit_to_model_dir(cfg, given, architecture_of)


def _fit_sft_to_data(cfg: Config, given: set[str]) -> Config:
    """No cold-start SFT, said in one line, for a data file with no completion column when sft.enabled
    was left unset (a TRL user's first run: GRPO does no SFT); a file's SFT corrupts no completions unless
    sft.corrupt_fraction is set. Settings given explicitly are kept (pipeline.prepare checks the file)."""
    if cfg.task.name != "dataset" or not (cfg.sft.enabled and cfg.sft.steps > 0 and cfg.sft.source == "teacher"):
        return cfg
    sft: dict[str, Any] = {}
    if "sft.corrupt_fraction" not in given and cfg.sft.corrupt_fraction > 0:
        sft["corrupt_fraction"] = 0.0
    if "sft.enabled" not in given and "sft.source" not in given:
        from reinforge.tasks import build_task

        try:
            first = build_task(cfg.task.name, **cfg.task.options).train_split(1)
        except (ValueError, TypeError, OSError):     # the run's input check names what is wrong with the file
            first = []
        if first and "completion" not in first[0].meta:
            sft["enabled"] = False
            from rich.console import Console
            from rich.markup import escape

            Console(stderr=True).print(escape(
                f"sft: off: the data file '{cfg.task.options.get('path')}' has no 'completion' column to imitate "
                "before RL (RL starts from the model as it is, as TRL's GRPO does); map one with "
                "task.options.fields.completion=COLUMN, or set sft.enabled=false to say so"),
                soft_wrap=True, highlight=False)
    return cfg.model_copy(update={"sft": cfg.sft.model_copy(update=sft)}) if sft else cfg


def check_lengths(cfg: Config, positions: int | None, source: str) -> None:
    """ConfigError when rollout.max_new_tokens leaves no room for a prompt in the model's `positions`
    (`source`: where that number is read, for the message): every completion would run past what the
    model was built for. Each prompt's own length is checked once the tokenizer has loaded
    (rollout/prompts.py: check_context)."""
    if not isinstance(positions, int) or positions <= 0:
        return
    value = cfg.rollout.max_new_tokens
    if value >= positions:
        raise ConfigError(
            f"rollout.max_new_tokens={value} does not fit the model's {positions} positions ({source}) with any "
            f"prompt: set rollout.max_new_tokens below {positions} less the longest prompt's tokens (e.g. "
            f"rollout.max_new_tokens={max(1, positions // 2)})")


def _fit_builtin_moe(cfg: Config, given: set[str]) -> Config:
    """The built-in model as MoE (model.moe) runs the learner's own forward, where routing is counted and
    replayed (learner/routing.py), as for an MoE model folder; routing replay needs an MoE model."""
    if cfg.model.moe is None:
        if cfg.train.routing_replay:
            raise ConfigError("train.routing_replay=true needs a Mixture-of-Experts model: set model.moe.experts "
                              "(e.g. 8) or remove train.routing_replay")
        return cfg
    if cfg.train.routing_replay and cfg.rollout.engine != "native":
        raise ConfigError("train.routing_replay=true replays what the native engine records: set rollout.engine=native")
    if not cfg.train.shared_prefix:
        return cfg
    if "train.shared_prefix" in given:
        raise ConfigError("train.shared_prefix=true cannot run an MoE model (its routing is recorded and replayed on "
                          "the model's own forward): set train.shared_prefix=false")
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"shared_prefix": False})})


# Built-in-model sizes (model.*) and the names a config.json gives them.
_BUILTIN_SIZES = {"hidden_size": ("hidden_size", "n_embd", "d_model"), "num_layers": ("num_hidden_layers", "n_layer"),
                  "num_heads": ("num_attention_heads", "n_head"), "num_kv_heads": ("num_key_value_heads",),
                  "intermediate_size": ("intermediate_size", "n_inner"),
                  "max_positions": ("max_position_embeddings", "n_positions")}


def _check_builtin_sizes(cfg: Config, given: set[str], config: dict[str, Any]) -> None:
    """Sizes of the built-in model set together with a model folder must be the folder's own
    (a sweep or pipeline may pass them to every run); any other value would be silently ignored."""
    for name, aliases in _BUILTIN_SIZES.items():
        if f"model.{name}" not in given:
            continue
        value = getattr(cfg.model, name)
        theirs = next((config[a] for a in aliases if config.get(a) is not None), None)
        if theirs != value:
            has = f"has {aliases[0]}={theirs}" if theirs is not None else f"has no {aliases[0]}"
            raise ConfigError(f"model.{name}={value} sizes the built-in model only, and model.path '{cfg.model.path}' "
                              f"{has} (its config.json): remove model.{name}")


def fit_to_model_dir(cfg: Config, given: set[str], architecture_of: str | None = None) -> Config:
    """`cfg` with the rollout engine, the learner forward and the LoRA targets its model folder's
    architecture needs, decided from config.json before anything loads. `given`: the dotted keys the
    user (or the recipe preset) set; a setting given explicitly that the model cannot run is a
    ConfigError, a default is changed (and the run says so in one line, see ArchitecturePlan.note).
    `architecture_of`: a folder of the same architecture to read instead, for a model.path that a
    pipeline's earlier stage has yet to write. A folder whose config.json cannot be read is returned
    unchanged: the run's input check says why."""
    from reinforge.models.model_dir import MOE_MODEL_TYPES, lora_targets, plan_for, read_model_config

    try:
        config = read_model_config(architecture_of or cfg.model.path)
    except ConfigError:
        return cfg
    _check_builtin_sizes(cfg, given, config)
    positions_key = next((k for k in ("max_position_embeddings", "n_positions") if isinstance(config.get(k), int)),
                         None)
    if positions_key is not None:
        check_lengths(cfg, config[positions_key], f"{positions_key} in its config.json")
    plan = plan_for(config)
    path = cfg.model.path
    if cfg.model.moe is not None:
        raise ConfigError(f"model.moe builds the built-in model as MoE, and model.path is '{path}': remove model.moe")
    if cfg.train.routing_replay and plan.model_type not in MOE_MODEL_TYPES:
        raise ConfigError(f"train.routing_replay=true needs a Mixture-of-Experts model ({', '.join(MOE_MODEL_TYPES)}), "
                          f"and '{path}' is {plan.model_type}: remove train.routing_replay")
    if cfg.train.routing_replay and (cfg.rollout.engine != "native" or plan.native_reason is not None):
        raise ConfigError("train.routing_replay=true replays what the native engine records: set rollout.engine=native")
    rollout, train, model = {}, {}, {}
    if plan.native_reason is not None:
        if cfg.train.mode == "async":
            raise ConfigError(f"train.mode=async samples with the native engine, which cannot run '{path}': "
                              f"{plan.native_reason}; use train.mode=sync and a recipe that is not asynchronous")
        if cfg.rollout.engine == "native":
            if "rollout.engine" in given:
                raise ConfigError(
                    f"rollout.engine=native cannot run '{path}': {plan.native_reason}; remove "
                    "rollout.engine=native (the transformers engine is chosen for this model) or set rollout.engine=hf"
                )
            rollout["engine"] = "hf"
    if plan.shared_prefix_reason is not None and cfg.train.shared_prefix:
        if "train.shared_prefix" in given:
            raise ConfigError(
                f"train.shared_prefix=true cannot run '{path}': {plan.shared_prefix_reason}; "
                "remove it (the model's own forward is chosen for this model) or set train.shared_prefix=false"
            )
        train["shared_prefix"] = False
    if plan.head_reason is not None and cfg.train.logprob_chunk_size > 0:
        if "train.logprob_chunk_size" in given:
            raise ConfigError(f"train.logprob_chunk_size={cfg.train.logprob_chunk_size} cannot run '{path}': "
                              f"{plan.head_reason}; remove it (full logits are chosen for this model) or set it to 0")
        train["logprob_chunk_size"] = 0
    if cfg.model.lora is not None and plan.native_reason is not None and "model.lora.target_modules" not in given:
        model["lora"] = cfg.model.lora.model_copy(update={"target_modules": lora_targets(plan.model_type, path)})
    return cfg.model_copy(update={
        "rollout": cfg.rollout.model_copy(update=rollout), "train": cfg.train.model_copy(update=train),
        "model": cfg.model.model_copy(update=model)})


def format_validation_error(err: ValidationError) -> str:
    lines, located = [], False
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)
        located = located or bool(loc)
    # A message of a whole-config check (unknown recipe) names its key itself.
    return ("invalid configuration: " if located else "") + "; ".join(lines)


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
