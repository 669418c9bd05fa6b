"""Option names from TRL's GRPOConfig and verl are refused with the full reinforge key (issue 21.3),
and `model=PATH` composes with the other model.* keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.config import Config, build_config
from reinforge.config.input import optional_section
from reinforge.config.synonyms import TRL_NAMES, VERL_NAMES
from reinforge.config.synonyms_openrlhf import OPENRLHF_NAMES
from reinforge.errors import ConfigError

runner = CliRunner()


@pytest.mark.parametrize(("override", "key"), [
    ("max_steps=100", "train.steps"),
    ("learning_rate=1e-6", "train.lr"),
    ("beta=0.04", "objective.kl_coef"),
    ("num_generations=8", "train.group_size"),
    ("max_completion_length=256", "rollout.max_new_tokens"),
    ("per_device_train_batch_size=4", "train.micro_batch_size"),
    ("gradient_accumulation_steps=4", "train.micro_batch_size"),
    ("num_iterations=2", "train.ppo_epochs"),
    ("epsilon=0.2", "objective.eps_low"),
    ("epsilon_high=0.28", "objective.eps_high"),
    ("loss_type=something", "objective.aggregation"),
    ("scale_rewards=sometimes", "objective.advantage"),
    ("temperature=0.7", "rollout.temperature"),
    ("data.train_batch_size=32", "train.prompts_per_step"),
    ("actor_rollout_ref.rollout.n=8", "train.group_size"),
    ("algorithm.adv_estimator=something", "objective.advantage"),
    ("actor_rollout_ref.actor.clip_ratio_high=0.28", "objective.eps_high"),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "train.lr"),
    ("actor_rollout_ref.rollout.temperature=0.7", "rollout.temperature"),
    ("data.max_response_length=512", "rollout.max_new_tokens"),
    ("trainer.total_training_steps=100", "train.steps"),
    ("algorithm.kl_ctrl.kl_coef=0.001", "objective.kl_coef"),
    ("actor_rollout_ref.actor.kl_loss_coef=0.001", "objective.kl_coef"),
    ("actor_rollout_ref.actor.clip_ratio_low=0.2", "objective.eps_low"),
    ("actor_rollout_ref.actor.loss_agg_mode=something", "objective.aggregation"),
    ("top_p=0.9", "rollout.top_p"),
    ("top_k=20", "rollout.top_k"),
    ("save_steps=50", "checkpoint.every"),
    ("eval_steps=50", "eval.every"),
    ("warmup_ratio=0.1", "train.warmup_steps"),
    ("weight_decay=0.01", "train.weight_decay"),
    ("max_grad_norm=1.0", "train.grad_clip"),
    ("report_to=wandb", "log.wandb"),
    ("use_vllm=true", "rollout.engine"),
    ("vllm_gpu_memory_utilization=0.5", "rollout.vllm_gpu_memory_utilization"),
    ("mask_truncated_completions=true", "curation.overlong_filter"),
    ("importance_sampling_level=something", "objective.policy_loss"),
    ("delta=4.0", "objective.policy_loss"),
    ("train.learning_rate=1e-6", "train.lr"),          # a TRL name in a reinforge section
    ("rollout.num_generations=8", "train.group_size"),  # ... and in the wrong one
])
def test_other_frameworks_names_give_the_full_key(override: str, key: str) -> None:
    name = override.partition("=")[0]
    source = (
        "verl's name"
        if name.split(".")[0] in ("data", "actor_rollout_ref", "algorithm", "trainer")
        else "TRL's GRPOConfig name"
    )
    with pytest.raises(ConfigError) as err:
        build_config([override])
    assert str(err.value).startswith(f"unknown config key '{name}'; did you mean '{key}'? ({source}")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "loss_type=dr_grpo",
            "unknown config key 'loss_type'; did you mean 'recipe=dr_grpo'? "
            "(TRL's GRPOConfig name for objective.aggregation; loss_type=dr_grpo is recipe=dr_grpo here)",
        ),
        ("loss_type=bnpo", "did you mean 'objective.aggregation=token_mean'?"),
        ("scale_rewards=false", "did you mean 'objective.advantage=dr_grpo'?"),
        ("scale_rewards=batch", "did you mean 'objective.advantage=lite_ppo'?"),
        ("importance_sampling_level=sequence", "did you mean 'recipe=gspo'?"),
        (
            "algorithm.adv_estimator=gae",
            "did you mean 'recipe=ppo objective.whiten_advantages=true'? (verl's name for objective.advantage",
        ),
        (
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
            "did you mean 'objective.aggregation=seq_mean_token_sum_norm'?",
        ),
        ("actor_rollout_ref.actor.kl_loss_type=low_var_kl",
         "did you mean 'objective.kl_estimator=k3 objective.kl_clamp=10'?"),
        ("actor_rollout_ref.actor.use_rollout_log_probs=True", "did you mean 'train.old_logprobs=rollout'?"),
    ],
)
def test_a_value_that_picks_a_part_names_the_setting(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as err:
        build_config([override])
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "max_prompt_length=512",
            "unknown config key 'max_prompt_length' (TRL's GRPOConfig name; reinforge never truncates prompts: a "
            "prompt that does not fit the model's positions with rollout.max_new_tokens is refused at start, naming "
            "its row); remove it",
        ),
        (
            "logging_steps=10",
            "unknown config key 'logging_steps' (TRL's GRPOConfig name; every RL step is written to "
            "RUN_DIR/metrics.jsonl); remove it",
        ),
        ("per_device_train_batch_size=4", "the rollout batch is train.prompts_per_step x train.group_size completions"),
        (
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "train.mini_batches = data.train_batch_size / ppo_mini_batch_size",
        ),
        ("warmup_ratio=0.1", "a number of optimizer steps, not a fraction of the run"),
        ("actor_rollout_ref.rollout.calculate_log_probs=True",
         "reinforge's engines always return the sampler's log-probs"),
    ],
)
def test_no_equivalent_and_different_meaning_say_so(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config([override])
    assert message in str(err.value)


def _is_key(dotted: str) -> bool:
    """Whether `dotted` is a key of Config (a dict-valued field, like task.options, takes any key below it)."""
    model: type[BaseModel] = Config
    for part in dotted.split("."):
        if part not in model.model_fields:
            return False
        annotation = optional_section(model.model_fields[part].annotation)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return True
        model = annotation
    return True


def test_every_hint_is_a_real_key_and_every_suggested_setting_builds() -> None:
    names = {**TRL_NAMES, **VERL_NAMES, **OPENRLHF_NAMES}
    assert [name for name, s in names.items() if s.key is not None and not _is_key(s.key)] == []
    for synonym in names.values():
        for setting in synonym.values.values():
            build_config(setting.split())    # raises if the hint would not run (some hints set two keys)


def test_verl_names_in_a_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump({"actor_rollout_ref": {"actor": {"optim": {"lr": 1e-6}}}}))
    with pytest.raises(ConfigError) as err:
        build_config([], str(path))
    assert (
        str(err.value)
        == "unknown config key 'actor_rollout_ref.actor.optim.lr'; did you mean 'train.lr'? (verl's name)"
    )


def test_a_section_key_at_the_top_names_its_sections() -> None:
    with pytest.raises(ConfigError) as err:
        build_config(["lr=1e-4"])
    assert str(err.value) == ("unknown config key 'lr'; did you mean 'sft.lr' or 'train.lr' or 'critic.lr' or 'rm.lr' "
                              "or 'prm.lr'?")


@pytest.mark.parametrize("order", ["path_first", "lora_first"])
def test_model_path_composes_with_model_keys(tmp_path: Path, micro_overrides, tiny_model_dir: str, order: str) -> None:
    model = [f"model={tiny_model_dir}", "model.lora.r=8"]
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, *(model if order == "path_first" else model[::-1]),
                                 "train.lr=1e-3", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert saved["path"] == tiny_model_dir and saved["lora"]["r"] == 8
    assert json.loads((out / "summary.json").read_text())["rl_steps"] == 3


def test_builtin_sizes_with_a_model_folder_must_be_its_own(micro_overrides, tiny_model_dir: str) -> None:
    # micro_overrides size the built-in model as tiny_model_dir was saved: they agree, so they are accepted.
    assert build_config([*micro_overrides, f"model={tiny_model_dir}"]).model.hidden_size == 32
    with pytest.raises(ConfigError) as err:
        build_config([f"model={tiny_model_dir}", "model.hidden_size=64"])
    assert str(err.value) == (f"model.hidden_size=64 sizes the built-in model only, and model.path '{tiny_model_dir}' "
                              "has hidden_size=32 (its config.json): remove model.hidden_size")


def test_the_command_line_refuses_a_synonym_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", "max_completion_length=64", f"output_dir={out}"])
    assert result.exit_code == 2 and not out.exists()
    assert result.stderr == (
        "error: unknown config key 'max_completion_length'; did you mean 'rollout.max_new_tokens'? "
        "(TRL's GRPOConfig name)\n"
    )


# OpenRLHF's launcher flags (openrlhf/cli/train_ppo_ray.py) and the reinforge key that does their job.
@pytest.mark.parametrize(("override", "key"), [
    ("pretrain=/models/qwen", "model.path"),
    ("reward_pretrain=/models/rm", "reward.model.path"),
    ("rollout_batch_size=128", "train.prompts_per_step"),
    ("micro_rollout_batch_size=16", "rollout.max_batch_rows"),
    ("train_batch_size=128", "train.mini_batches"),
    ("micro_train_batch_size=8", "train.micro_batch_size"),
    ("n_samples_per_prompt=8", "train.group_size"),
    ("init_kl_coef=0.001", "objective.kl_coef"),
    ("kl_target=0.1", "train.kl_target"),
    ("actor_learning_rate=5e-7", "train.lr"),
    ("critic_learning_rate=9e-6", "critic.lr"),
    ("generate_max_len=1024", "rollout.max_new_tokens"),
    ("max_len=2048", "rollout.max_new_tokens"),
    ("input_key=question", "task.options.fields"),
    ("label_key=answer", "task.options.fields"),
    ("max_epochs=2", "train.ppo_epochs"),
    ("num_episodes=3", "train.steps"),
    ("eps_clip=0.2", "objective.eps_low"),
    ("value_clip=0.5", "objective.value"),
    ("gamma=1.0", "objective.value"),
    ("lambd=0.95", "objective.value"),
    ("lora_rank=16", "model.lora.r"),
    ("target_modules=[q_proj]", "model.lora.target_modules"),
    ("save_path=/tmp/out", "output_dir"),
    ("ckpt_path=/tmp/ckpt", "output_dir"),
    ("max_ckpt_num=3", "checkpoint.keep_last"),
    ("entropy_loss_coef=0.01", "objective.entropy_coef"),
    ("prompt_data=/data/train.jsonl", "task.options.path"),
    ("normalize_reward=true", "reward.model.normalize"),
    ("temperature=0.7", "rollout.temperature"),
    ("top_p=0.9", "rollout.top_p"),
    ("save_steps=20", "checkpoint.every"),
    ("eval_steps=20", "eval.every"),
    ("lora_alpha=32", "model.lora.alpha"),
])
def test_openrlhf_names_give_the_full_key(override: str, key: str) -> None:
    name = override.partition("=")[0]
    with pytest.raises(ConfigError) as err:
        build_config([override])
    assert str(err.value).startswith(f"unknown config key '{name}'; did you mean '{key}'? (")


@pytest.mark.parametrize(("override", "setting"), [
    ("advantage_estimator=reinforce", "recipe=reinforce_pp"),
    ("advantage_estimator=reinforce_baseline", "recipe=reinforce_pp_baseline"),
    ("advantage_estimator=rloo", "objective.advantage=rloo"),
    ("advantage_estimator=group_norm", "objective.advantage=grpo"),
    ("advantage_estimator=gae", "recipe=ppo objective.whiten_advantages=true"),
    ("use_kl_loss=true", "objective.kl_placement=in_loss"),
    ("kl_estimator=k3", "objective.kl_estimator=k3 objective.kl_clamp=10"),
    ("apply_chat_template=true", "prompt.chat_template=always"),
    ("bf16=true", "model.dtype=bfloat16"),
])
def test_openrlhf_values_that_pick_a_part_name_the_setting(override: str, setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config([override])
    assert f"did you mean '{setting}'?" in str(err.value)


@pytest.mark.parametrize(("override", "message"), [
    ("prompt_max_len=1024", "(OpenRLHF's name; reinforge never truncates prompts"),
    ("data.max_prompt_length=1024", "(verl's name; reinforge never truncates prompts"),
    ("zero_stage=3", "(OpenRLHF's name; reinforge does not use DeepSpeed"),
    ("gradient_checkpointing=true", "(OpenRLHF's name; reinforge has no activation checkpointing"),
    ("packing_samples=true", "(OpenRLHF's name; micro-batches are already packed by tokens"),
    ("load_checkpoint=true", "`reinforge train --resume RUN_DIR`"),
    ("vllm_num_engines=2", "it has no other vLLM option); remove it"),
    ("actor_num_gpus_per_node=8", "reinforge places its models itself"),
    ("trainer.val_before_train=false", "(verl's name; reinforge always evaluates the model RL starts from"),
])
def test_openrlhf_and_verl_names_without_an_equivalent_say_why(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config([override])
    assert message in str(err.value)


@pytest.mark.parametrize("override", ["pretrain=/models/qwen", "rollout_batch_size=8", "trainer.val_before_train=1",
                                      "trainer.some_new_flag=1", "rollouts=8"])
def test_a_peer_name_never_points_at_a_section_with_another_job(override: str) -> None:
    # difflib alone would say pretrain -> train, rollout_batch_size -> rollout, trainer -> train.
    with pytest.raises(ConfigError) as err:
        build_config([override])
    assert "did you mean 'train'" not in str(err.value) and "did you mean 'rollout'" not in str(err.value)


@pytest.mark.parametrize(("args", "line"), [
    (["--advantage_estimator", "reinforce"],
     "error: '--advantage_estimator reinforce': settings are key=value, write advantage_estimator=reinforce; and "
     "advantage_estimator is not a reinforge key; did you mean 'recipe=reinforce_pp'? (OpenRLHF's name for "
     "objective.advantage; advantage_estimator=reinforce is recipe=reinforce_pp here)"),
    (["--n_samples_per_prompt", "8"],
     "error: '--n_samples_per_prompt 8': settings are key=value, write n_samples_per_prompt=8; and "
     "n_samples_per_prompt is not a reinforge key; did you mean 'train.group_size'? (OpenRLHF's name)"),
    (["--seed", "3"], "error: '--seed 3': settings are key=value, write seed=3"),
    (["--bf16", "train.steps=2"], "error: '--bf16': settings are key=value, write bf16=true; and bf16 is not a "
                                  "reinforge key; did you mean 'model.dtype=bfloat16'? (TRL's GRPOConfig name for "
                                  "model.dtype; bf16=True is model.dtype=bfloat16 here)"),
    (["--train.steps=5"], "error: '--train.steps=5': settings are key=value, write train.steps=5"),
    (["--objective.entropy_coef", "-0.01"],
     "error: '--objective.entropy_coef -0.01': settings are key=value, write objective.entropy_coef=-0.01"),
])
def test_argparse_style_options_get_their_key_value_spelling(tmp_path: Path, args: list[str], line: str) -> None:
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *args, f"output_dir={out}"], env={"COLUMNS": "1000"})
    assert result.exit_code == 2 and not out.exists()
    assert result.stderr == line + "\n"


def test_a_sweep_axis_typed_as_argparse_gets_the_same_hint() -> None:
    from reinforge.jobs.sweep import grid_axes

    with pytest.raises(ConfigError) as err:
        grid_axes(["--n_samples_per_prompt", "4,8"])
    assert str(err.value) == ("'--n_samples_per_prompt 4,8': settings are key=value, write n_samples_per_prompt=4,8; "
                              "and n_samples_per_prompt is not a reinforge key; did you mean 'train.group_size'? "
                              "(OpenRLHF's name)")
