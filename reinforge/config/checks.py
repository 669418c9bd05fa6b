"""Every rule that relates two parts of a run's configuration, in one place.

Sections check their own fields (reinforge/settings/, the task section in config/root.py); what
relates one section to another, or the config to what it names (the task's data, a model folder,
files), is checked here, before anything loads or is written:

- `check_config`: rules between sections, on the config alone (build_config runs it).
- `fit_sft_to_data`, `fit_builtin_moe`, `fit_to_model_dir`, `check_lengths`: the config against the
  model it trains and the data it reads; a default the model cannot run is changed (said in one
  line), an explicit setting it cannot run is refused (build_config runs them).
- `check_run`: the config against the built task and objective: engine and mode, data-parallel
  ranks, teachers, agents, reward inputs, the model folder, the output folder (the job bootstrap,
  jobs/start.py, runs it).

Every failure is a ConfigError whose message names the key to change.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from reinforge.agents.setup import check_agent
from reinforge.config.root import Config
from reinforge.distributed import torchrun_world_size
from reinforge.errors import ConfigError
from reinforge.loops.baselines import takes_baselines
from reinforge.loops.dpo import preference_pairs
from reinforge.models import resolve_device
from reinforge.models.decoder import check_native_model_type
from reinforge.models.factory import check_model_dir
from reinforge.objectives import RECIPES, ObjectiveSpec
from reinforge.objectives.spec import PreferenceSpec
from reinforge.rewards.compose import check_reward_inputs
from reinforge.serve.setup import check_agent_functions
from reinforge.tasks import Task
from reinforge.telemetry import default_output_dir
from reinforge.telemetry.run_dir import check_output_dir


def check_config(cfg: Config) -> None:
    """The rules between sections that need nothing but the config."""
    _reward_domains(cfg)
    _self_play(cfg)
    _vllm_engine(cfg)
    _top_k_recording(cfg)
    _token_budgets(cfg)


def _reward_domains(cfg: Config) -> None:
    # Across two sections: reward.functions[].domains names the task's domains (a mix's).
    from reinforge.rewards.functions import check_reward_domains
    from reinforge.rewards.source_builders import configured_sources
    from reinforge.tasks import TASKS

    specs = TASKS[cfg.task.name].domain_specs(cfg.task.options)
    domains = [s.domain for s in specs] or [cfg.task.name]
    check_reward_domains(cfg.reward.functions, domains, has_source=bool(configured_sources(cfg.reward)))


def _self_play(cfg: Config) -> None:
    # Judge training data must be written in the format its judge reads (sft.judge_fraction); SPIN needs SFT data.
    if cfg.sft.judge_fraction > 0:
        from reinforge.rewards.judge import check_label
        from reinforge.settings.judge import JudgeConfig

        try:
            check_label(cfg.reward.judge or JudgeConfig())
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if cfg.dpo.pairs == "spin" and cfg.sft.source == "rejection":
        raise ConfigError("dpo.pairs=spin pairs the SFT data with the policy's samples, and sft.source=rejection "
                          "has no SFT data before sampling: set sft.source=teacher or file")


def _vllm_engine(cfg: Config) -> None:
    # What the vLLM engine does not do yet (rollout/vllm_engine.py).
    if cfg.rollout.engine == "vllm" and cfg.train.mode == "async" and cfg.backend == "ray":
        raise ConfigError("train.mode=async with rollout.engine=vllm samples in a thread of this process over its "
                          "one vLLM engine, not in Ray actors: set backend=local, or rollout.engine=native")


def _top_k_recording(cfg: Config) -> None:
    # DPPO's top-K divergence reads the sampler's top-K, which only the native engine records.
    if cfg.rollout.record_top_k and cfg.rollout.engine != "native":
        raise ConfigError("rollout.record_top_k needs rollout.engine=native (the HF engine does not record the "
                          "sampler's top-K log-probs): set rollout.engine=native or rollout.record_top_k=0")
    from reinforge.objectives import RECIPE_OBJECTIVES

    recipe = RECIPE_OBJECTIVES.get(cfg.recipe)
    loss = cfg.objective.policy_loss or (recipe.policy_loss if recipe is not None else None)
    if loss in ("dppo_topk_tv", "dppo_topk_kl") and not cfg.rollout.record_top_k:
        raise ConfigError(f"objective.policy_loss={loss} compares the sampler's top-K "
                          "log-probs with the learner's: set rollout.record_top_k (e.g. 20)")


def _token_budgets(cfg: Config) -> None:
    # Across two sections: a budget past the generation limit would measure nothing new.
    over = [b for b in cfg.eval.token_budgets if b > cfg.rollout.max_new_tokens]
    if over:
        raise ConfigError(f"eval.token_budgets has {over[0]} > rollout.max_new_tokens={cfg.rollout.max_new_tokens}"
                          f": lower it or raise rollout.max_new_tokens")
    if cfg.eval.token_budgets and (cfg.task.environment or cfg.task.agent or cfg.rollout.tools):
        raise ConfigError("eval.token_budgets cuts single-turn completions; an episode (task.environment, "
                          "task.agent, rollout.tools) has turns of its own: set eval.token_budgets=[]")


def check_run(cfg: Config, task: Task, spec: ObjectiveSpec | PreferenceSpec) -> None:
    """The rules across the config, the task's data and the files it names (model folder, SFT traces,
    pairs, output folder), judged on the built task and objective before anything loads or is written."""
    resolve_device(cfg.model.device)       # a CUDA device this machine lacks
    check_mode(cfg, spec)
    if torchrun_world_size() > 1:
        check_data_parallel(cfg, spec, torchrun_world_size())
    if isinstance(spec, PreferenceSpec) and cfg.dpo.pairs == "dataset":
        preference_pairs(cfg.dpo.pairs_path, cfg.dpo.pairs_fields)   # DatasetError (a ConfigError) names a bad row
    if cfg.sft.enabled and cfg.sft.steps > 0 and cfg.sft.source == "file" and not Path(cfg.sft.data_path).exists():
        raise ConfigError(f"sft.data_path '{cfg.sft.data_path}' does not exist")
    # The first train example of each domain (one, unless the task is a mix): what the checks below judge.
    firsts = {task.domain_of(e): e for e in reversed(task.train_split(max(cfg.train.num_prompts, 1)))}
    if cfg.sft.enabled and cfg.sft.steps > 0 and cfg.sft.source == "teacher":
        # A task without traces (a dataset with no completions) says so here, before the run directory exists.
        rng = random.Random(cfg.seed)
        for first in firsts.values():
            task.teacher_completion(first, rng)
            if cfg.sft.corrupt_fraction > 0:
                task.corrupt_completion(first, rng)
    check_agent(cfg.rollout, cfg.task.environment, task)    # tools and environment class, before any load
    check_agent_functions(cfg.task.agent, cfg.task.environment, cfg.rollout, cfg.train.mode, cfg.backend)
    if (task.use_tools or cfg.task.environment) and cfg.sft.enabled and cfg.sft.steps > 0 \
            and cfg.sft.source == "rejection":
        raise ConfigError("sft.source=rejection keeps single completions, and this run's samples are multi-turn "
                          "episodes (tools or task.environment): rejection sampling of episodes is not built; use "
                          "sft.source=teacher or file, or sft.enabled=false")
    if cfg.task.environment_reward == "turn" and not (cfg.task.environment and spec.needs_critic):
        need = "a critic to credit turn by turn (recipe=ppo or vapo, or objective.advantage=gae)" \
            if cfg.task.environment else "task.environment (tools' episodes are scored once, on the answer)"
        raise ConfigError(f"task.environment_reward=turn needs {need}; a group advantage ({cfg.recipe}) reads one "
                          "reward per trajectory: task.environment_reward=trajectory")
    for domain, first in firsts.items():      # a required parameter nothing fills: before any load
        check_reward_inputs(cfg.reward, first, domain)
    check_teachers(cfg)
    if cfg.model.path != "builtin":
        path = check_model_dir(cfg.model.path)      # config.json, weights, a tokenizer that fits
        if cfg.rollout.engine == "native":
            check_native_model_type(path)
        if cfg.train.shared_prefix:
            check_native_model_type(path, "train.shared_prefix=true", "train.shared_prefix=false")
        if torchrun_world_size() > 1:     # shard_model shards the same Llama-family decoders
            check_native_model_type(path, "torchrun (FSDP learner ranks)", "one process")
    if cfg.model.lora is not None and cfg.model.lora.dropout > 0 and cfg.train.shared_prefix:
        raise ConfigError(
            "model.lora.dropout > 0 needs train.shared_prefix=false: the shared-prompt learner forward runs "
            "the merged LoRA weights, with no dropout on the adapters' input (or set model.lora.dropout=0)"
        )
    check_output_dir(cfg.output_dir or default_output_dir(cfg.recipe))


def check_teachers(cfg: Config) -> None:
    """The teachers of distillation exist; on-policy distillation's shares the policy's tokenizer."""
    if cfg.reward.teacher is not None:
        from reinforge.rewards.teacher import check_teacher

        check_teacher(cfg.reward.teacher.path, cfg.model.path, cfg.model.added_tokens)
    if cfg.sft.teacher_path is not None and cfg.sft.enabled and cfg.sft.steps > 0 and cfg.sft.source == "rejection":
        try:
            path = check_model_dir(cfg.sft.teacher_path)
            if cfg.rollout.engine == "native":
                check_native_model_type(path)
        except ConfigError as err:
            raise ConfigError(f"sft.teacher_path: {err}") from None


def check_mode(cfg: Config, spec: ObjectiveSpec | PreferenceSpec) -> None:
    """train.mode against what the recipe and engine can do."""
    if takes_baselines(spec) and (cfg.train.mode == "async" or cfg.backend == "ray"):
        raise ConfigError(
            f"objective.advantage={spec.advantage} needs a greedy completion of each prompt as its baseline, which "
            "only the synchronous loop in one process generates: set train.mode=sync and backend=local"
        )
    if "async" in RECIPES[cfg.recipe].requires and cfg.train.mode != "async":
        raise ConfigError(
            f"recipe {cfg.recipe!r} is asynchronous (train.mode=async in its preset); with train.mode="
            f"{cfg.train.mode} it would not be {cfg.recipe}: compose its objective under another recipe name instead"
        )
    if cfg.backend == "ray" and cfg.train.mode == "sync":
        if cfg.ray.learner_ranks < 2:
            raise ConfigError(
                "backend=ray runs rollout workers for train.mode=async, or data-parallel learner ranks for "
                "train.mode=sync (ray.learner_ranks >= 2): set one of them, or backend=local"
            )
        check_data_parallel(cfg.model_copy(update={"backend": "local"}), spec, cfg.ray.learner_ranks)
    if cfg.train.mode != "async":
        return
    if isinstance(spec, PreferenceSpec):
        raise ConfigError("train.mode=async is for RL recipes; DPO trains synchronously (train.mode=sync)")
    if cfg.rollout.engine not in ("native", "vllm"):
        raise ConfigError(f"train.mode=async samples with the native engine (interruptible decoding) or vLLM, not "
                          f"rollout.engine={cfg.rollout.engine}: set rollout.engine=native")


def check_data_parallel(cfg: Config, spec: ObjectiveSpec | PreferenceSpec, world_size: int) -> None:
    """Refuse, before anything is written, what data-parallel learner ranks do not support yet."""
    where = f"under torchrun (WORLD_SIZE={world_size}: data-parallel FSDP learner ranks)"
    if cfg.train.shared_prefix:
        raise ConfigError(
            f"train.shared_prefix=true is not supported {where}: the shared-prompt learner forward reads "
            "every layer's weights directly, past FSDP's per-layer all-gathers; set train.shared_prefix=false"
        )
    if cfg.model.lora is not None:
        raise ConfigError(
            f"model.lora is not supported {where} yet: train the full model (model.lora=null), or run one process"
        )
    if isinstance(spec, PreferenceSpec):
        raise ConfigError(f"recipe {cfg.recipe!r} (preference pairs) is not supported {where} yet: run one process")
    if spec.needs_critic:
        raise ConfigError(
            f"recipe {cfg.recipe!r} trains a critic, which is not supported {where} yet: run one process, "
            "or use a critic-free recipe (grpo, dr_grpo, ...)"
        )
    if takes_baselines(spec):
        raise ConfigError(f"objective.advantage={spec.advantage} (a greedy baseline rollout) is not supported {where} "
                          "yet: run one process")
    if cfg.backend != "local":
        raise ConfigError(f"backend={cfg.backend} is not supported {where}: set backend=local")


def fit_sft_to_data(cfg: Config, given: set[str]) -> Config:
    """No cold-start SFT, said in one line, for a data file with no completion column when sft.enabled
    was left unset (a TRL user's first run: GRPO does no SFT); a file's SFT corrupts no completions unless
    sft.corrupt_fraction is set. Settings given explicitly are kept (check_run checks the file)."""
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


def fit_builtin_moe(cfg: Config, given: set[str]) -> Config:
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
