"""Option names people bring from TRL's GRPOConfig, verl's trainer config and OpenRLHF's launcher
(openrlhf.cli.train_ppo_ray), mapped to the reinforge key that does the same job, in whatever
section it lives.

An unknown key that is one of these names is refused (exit 2) with a hint that names the full
reinforge key and, where the meaning differs (units, per-device vs global counts, a value that
picks a recipe or a part), how. Refusing teaches the real name once; silently accepting would
keep two spellings alive and hide the differences in meaning.

TRL and OpenRLHF names are matched by their last component (`learning_rate`, `train.learning_rate`);
verl names by their whole dotted path (`actor_rollout_ref.rollout.n`). OpenRLHF's table is in
synonyms_openrlhf.py, which builds on this module's `Synonym`; the lookup across the three tables
(`find_synonym`) is in config_input.py, above both. An OpenRLHF flag typed as argparse
(`--n_samples_per_prompt 8`) is refused with its `key=value` spelling (config_input.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TRL = "TRL's GRPOConfig name"
VERL = "verl's name"
TRL_MODEL = "TRL's ModelConfig name"
TRL_SCRIPT = "TRL's GRPOTrainer / script argument"
REWARD_FILE = "as reward.functions=[{name: path/to/file.py:function}], in TRL's, verl's or reinforge's form"


@dataclass(frozen=True)
class Synonym:
    """Where another framework's option lives in reinforge."""

    key: str | None                  # the full reinforge key; None: reinforge has no such setting
    source: str                      # TRL or VERL
    note: str = ""                   # how the meaning differs, or why there is no such setting
    values: dict[str, str] = field(default_factory=dict)   # their value -> our `key=value`, where it picks a part


_AGG = {
    "token-mean": "objective.aggregation=token_mean",
    "seq-mean-token-mean": "objective.aggregation=seq_mean_token_mean",
    "seq-mean-token-sum": "objective.aggregation=seq_mean_token_sum",
    "seq-mean-token-sum-norm": "objective.aggregation=seq_mean_token_sum_norm",
    "token-sum": "objective.aggregation=token_sum",
}
# verl clamps its k3 ("low_var_kl") at 10 and its "+" forms take k2's gradient (straight-through).
KL_EST = {"kl": "objective.kl_estimator=k1", "k1": "objective.kl_estimator=k1", "abs": "objective.kl_estimator=abs",
           "mse": "objective.kl_estimator=k2", "k2": "objective.kl_estimator=k2",
           "low_var_kl": "objective.kl_estimator=k3 objective.kl_clamp=10",
           "k3": "objective.kl_estimator=k3 objective.kl_clamp=10",
           "k1+": "objective.kl_estimator=k1_st", "kl+": "objective.kl_estimator=k1_st",
           "k3+": "objective.kl_estimator=k3_st objective.kl_clamp=10",
           "low_var_kl+": "objective.kl_estimator=k3_st objective.kl_clamp=10"}
_KL_EST_NOTE = ("kl: k1, mse: k2, abs: abs, low_var_kl: k3 clamped at 10 (objective.kl_clamp=10), k1+ / k3+: k1_st / "
                "k3_st (the value of k1 / k3 with k2's gradient)")
_SCALE = {"True": "objective.advantage=grpo", "group": "objective.advantage=grpo",
          "False": "objective.advantage=dr_grpo", "none": "objective.advantage=dr_grpo",
          "batch": "objective.advantage=lite_ppo"}
PROMPT_LENGTH = ("reinforge never truncates prompts: a prompt that does not fit the model's positions with "
                  "rollout.max_new_tokens is refused at start, naming its row")
VLLM = ("rollout.engine=vllm samples with vLLM in this process (`make vllm-env`, docs/engine.md); the default "
        "is reinforge's own engine (native, Llama-family), hf is transformers generate")
NO_VLLM_OPTION = ("reinforge runs one in-process vLLM engine with its own settings (rollout.engine=vllm, "
                  "rollout.vllm_gpu_memory_utilization); it has no other vLLM option")

TRL_NAMES: dict[str, Synonym] = {
    "max_steps": Synonym(
        "train.steps",
        TRL,
        "an RL step is one rollout batch, trained with train.ppo_epochs x train.mini_batches optimizer steps",
    ),
    "learning_rate": Synonym("train.lr", TRL, "the SFT stage has its own sft.lr"),
    "beta": Synonym(
        "objective.kl_coef",
        TRL,
        "objective.kl_estimator=none drops the reference model, as beta=0 does in TRL; the dpo recipe's beta is "
        "dpo.beta",
    ),
    "num_generations": Synonym("train.group_size", TRL),
    "max_completion_length": Synonym("rollout.max_new_tokens", TRL),
    "max_tool_calling_iterations": Synonym(
        "rollout.max_tool_calls",
        TRL,
        "reinforge counts tool calls per trajectory (a call past it ends the trajectory), and model turns with "
        "rollout.max_turns",
    ),
    "max_prompt_length": Synonym(None, TRL, PROMPT_LENGTH),
    "per_device_train_batch_size": Synonym(
        "train.micro_batch_size",
        TRL,
        "completions per forward/backward (memory only, never the gradient); the rollout batch is "
        "train.prompts_per_step x train.group_size completions",
    ),
    "gradient_accumulation_steps": Synonym(
        "train.micro_batch_size",
        TRL,
        "reinforge accumulates by itself: each mini-batch runs in forwards of at most train.micro_batch_size "
        "completions (and train.micro_batch_tokens tokens), with the same gradient",
    ),
    "steps_per_generation": Synonym("train.mini_batches", TRL, "optimizer steps per pass over a rollout batch"),
    "generation_batch_size": Synonym(
        "train.prompts_per_step",
        TRL,
        "reinforge counts prompts: a batch is train.prompts_per_step x train.group_size completions",
    ),
    "num_iterations": Synonym("train.ppo_epochs", TRL),
    "epsilon": Synonym(
        "objective.eps_low",
        TRL,
        "TRL's epsilon is both sides unless epsilon_high is set; here set objective.eps_high too",
    ),
    "epsilon_high": Synonym("objective.eps_high", TRL),
    "delta": Synonym(
        "objective.policy_loss",
        TRL,
        "INTELLECT-2's two-sided clip bounds the ratio of negative-advantage tokens: "
        "objective.policy_loss=dual_clip with objective.policy_params.clip_c=DELTA",
    ),
    "loss_type": Synonym(
        "objective.aggregation",
        TRL,
        "its values: grpo is seq_mean_token_mean, bnpo and dapo token_mean, dr_grpo recipe=dr_grpo",
        {
            "grpo": "objective.aggregation=seq_mean_token_mean",
            "bnpo": "objective.aggregation=token_mean",
            "dapo": "objective.aggregation=token_mean",
            "dr_grpo": "recipe=dr_grpo",
            "cispo": "recipe=cispo",
            "sapo": "recipe=sapo",
        },
    ),
    "scale_rewards": Synonym("objective.advantage", TRL, "group std: grpo, none: dr_grpo, batch std: lite_ppo", _SCALE),
    "importance_sampling_level": Synonym(
        "objective.policy_loss",
        TRL,
        "token: ppo_clip, sequence: recipe=gspo (or objective.policy_loss=gspo)",
        {"token": "objective.policy_loss=ppo_clip", "sequence": "recipe=gspo"},
    ),
    "mask_truncated_completions": Synonym("curation.overlong_filter", TRL),
    "top_entropy_quantile": Synonym(
        None,
        TRL,
        "reinforge has no high-entropy token mask (arXiv 2506.01939); a policy_loss of your own "
        "('module:function') can apply one",
    ),
    "temperature": Synonym("rollout.temperature", TRL),
    "top_p": Synonym("rollout.top_p", TRL),
    "top_k": Synonym("rollout.top_k", TRL),
    "use_vllm": Synonym("rollout.engine", TRL, VLLM),
    "vllm_gpu_memory_utilization": Synonym("rollout.vllm_gpu_memory_utilization", TRL),
    "vllm_mode": Synonym(None, TRL, NO_VLLM_OPTION),
    "logging_steps": Synonym(None, TRL, "every RL step is written to RUN_DIR/metrics.jsonl"),
    "save_steps": Synonym("checkpoint.every", TRL),
    "save_total_limit": Synonym("checkpoint.keep_last", TRL),
    "eval_steps": Synonym("eval.every", TRL),
    "warmup_ratio": Synonym("train.warmup_steps", TRL, "a number of optimizer steps, not a fraction of the run"),
    "weight_decay": Synonym("train.weight_decay", TRL),
    "max_grad_norm": Synonym("train.grad_clip", TRL),
    "lr_scheduler_type": Synonym(
        None, TRL, "RL's learning rate is constant after train.warmup_steps (SFT's decays on a cosine)"
    ),
    "report_to": Synonym("log.wandb", TRL, "log.wandb=true and log.tensorboard=true; metrics.jsonl is always written"),
    "num_train_epochs": Synonym(
        "train.steps", TRL, "reinforge counts RL steps; train.num_prompts prompts are reshuffled every epoch"
    ),
    "bf16": Synonym("model.dtype", TRL, "model.dtype=bfloat16", {"True": "model.dtype=bfloat16"}),
    "sync_ref_model": Synonym("objective.reference", TRL, "objective.reference=ema with objective.reference_ema"),
    "ref_model_mixup_alpha": Synonym(
        "objective.reference_ema", TRL, "the weight of the old reference: reference_ema = 1 - alpha"
    ),
    "reward_weights": Synonym(
        "reward.functions",
        TRL,
        "each function's weight sits next to its name: reward.functions=[{name: verifier, weight: 1.0}]",
    ),
    "model_name_or_path": Synonym("model.path", TRL, "a local folder; nothing is downloaded"),
    # What a TRL user passes next to GRPOConfig: the trainer's arguments and ModelConfig's LoRA fields.
    "reward_funcs": Synonym("reward.functions", TRL_SCRIPT, REWARD_FILE + "; a reward model folder is "
                            "reward.model.path"),
    "dataset_name": Synonym(
        "task.options.path",
        TRL_SCRIPT,
        "a local data file or save_to_disk folder, with task.name=dataset; nothing is downloaded",
    ),
    "train_dataset": Synonym(
        "task.options.path", TRL_SCRIPT, "a local data file or save_to_disk folder, with task.name=dataset"
    ),
    "eval_dataset": Synonym("task.options.eval_path", TRL_SCRIPT, "a local data file, with task.name=dataset"),
    "use_peft": Synonym("model.lora.r", TRL_MODEL, "setting model.lora.r turns LoRA on"),
    "lora_r": Synonym("model.lora.r", TRL_MODEL),
    "lora_alpha": Synonym("model.lora.alpha", TRL_MODEL),
    "lora_dropout": Synonym("model.lora.dropout", TRL_MODEL),
    "lora_target_modules": Synonym("model.lora.target_modules", TRL_MODEL),
    "torch_dtype": Synonym("model.dtype", TRL_MODEL),
    # reinforge.train's own argument and the short name people try first on the command line.
    "dataset": Synonym("task.options.path", "reinforge.train's argument name", "with task.name=dataset"),
    "data": Synonym("task.options.path", VERL, "its data section; with task.name=dataset"),
    "resume_from_checkpoint": Synonym(None, TRL_SCRIPT, "continue a run with `reinforge train --resume RUN_DIR`"),
}

VERL_NAMES: dict[str, Synonym] = {
    "data.train_batch_size": Synonym("train.prompts_per_step", VERL),
    "data.max_prompt_length": Synonym(None, VERL, PROMPT_LENGTH),
    "data.max_response_length": Synonym("rollout.max_new_tokens", VERL),
    "data.train_files": Synonym("task.options.path", VERL, "with task.name=dataset"),
    "data.val_files": Synonym("task.options.eval_path", VERL, "with task.name=dataset"),
    "data.prompt_key": Synonym("task.options.fields", VERL, "task.options.fields.prompt=COLUMN"),
    "custom_reward_function.path": Synonym("reward.functions", VERL, REWARD_FILE),
    "reward_model.enable": Synonym("reward.model.path", VERL, "setting reward.model.path turns the reward model on"),
    "reward_model.model.path": Synonym("reward.model.path", VERL, "a sequence-classification folder"),
    "reward_model.micro_batch_size_per_gpu": Synonym("reward.model.micro_batch_size", VERL),
    "reward_model.micro_batch_size": Synonym("reward.model.micro_batch_size", VERL),
    "custom_reward_function.name": Synonym("reward.functions", VERL, REWARD_FILE),
    "actor_rollout_ref.model.path": Synonym("model.path", VERL),
    "actor_rollout_ref.model.lora_rank": Synonym("model.lora.r", VERL),
    "actor_rollout_ref.model.lora_alpha": Synonym("model.lora.alpha", VERL),
    "actor_rollout_ref.model.target_modules": Synonym("model.lora.target_modules", VERL),
    "actor_rollout_ref.rollout.n": Synonym("train.group_size", VERL),
    "actor_rollout_ref.rollout.temperature": Synonym("rollout.temperature", VERL),
    "actor_rollout_ref.rollout.top_p": Synonym("rollout.top_p", VERL),
    "actor_rollout_ref.rollout.top_k": Synonym("rollout.top_k", VERL, "verl's -1 (off) is 0 here"),
    "actor_rollout_ref.rollout.response_length": Synonym("rollout.max_new_tokens", VERL),
    "actor_rollout_ref.rollout.name": Synonym("rollout.engine", VERL, VLLM),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": Synonym("rollout.max_turns", VERL),
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": Synonym(
        "rollout.max_tool_calls", VERL, "tool calls per trajectory; an environment's replies are bounded by "
        "rollout.max_turns"),
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": Synonym(
        "rollout.tool_max_chars", VERL, "in characters, not tokens"),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": Synonym(
        "rollout.tools", VERL, "tools are typed Python functions named in a list (rollout.tools=[module:function]), "
        "not a YAML of tool classes; an environment class is task.environment"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": Synonym("rollout.vllm_gpu_memory_utilization", VERL),
    "actor_rollout_ref.actor.optim.lr": Synonym("train.lr", VERL),
    "actor_rollout_ref.actor.optim.weight_decay": Synonym("train.weight_decay", VERL),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": Synonym("train.warmup_steps", VERL),
    "actor_rollout_ref.actor.ppo_epochs": Synonym("train.ppo_epochs", VERL),
    "actor_rollout_ref.actor.use_rollout_log_probs": Synonym(
        "train.old_logprobs", VERL, "train.old_logprobs=rollout takes pi_old from the sampler's log-probs",
        {"True": "train.old_logprobs=rollout", "False": "train.old_logprobs=recompute"}),
    "actor_rollout_ref.rollout.calculate_log_probs": Synonym(
        None, VERL, "reinforge's engines always return the sampler's log-probs (train.old_logprobs=rollout uses "
        "them as pi_old; objective.correction corrects with them)"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": Synonym(
        "train.mini_batches",
        VERL,
        "reinforge counts mini-batches: train.mini_batches = data.train_batch_size / ppo_mini_batch_size",
    ),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": Synonym("train.micro_batch_size", VERL),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": Synonym("train.micro_batch_tokens", VERL),
    "actor_rollout_ref.actor.use_dynamic_bsz": Synonym(
        "train.micro_batch_tokens",
        VERL,
        "token-budget micro-batches are on by default (train.micro_batch_tokens=null turns them off)",
    ),
    "actor_rollout_ref.actor.clip_ratio": Synonym(
        "objective.eps_low", VERL, "set objective.eps_high too for the upper side"
    ),
    "actor_rollout_ref.actor.clip_ratio_low": Synonym("objective.eps_low", VERL),
    "actor_rollout_ref.actor.clip_ratio_high": Synonym("objective.eps_high", VERL),
    "actor_rollout_ref.actor.clip_ratio_c": Synonym(
        "objective.policy_params", VERL, "verl's vanilla loss always applies it (3 by default): "
        "objective.policy_loss=dual_clip with objective.policy_params.clip_c; in its dppo losses it caps the ratio: "
        "objective.policy_params.ratio_cap"
    ),
    "actor_rollout_ref.actor.loss_agg_mode": Synonym(
        "objective.aggregation", VERL, "the same modes, with underscores", _AGG
    ),
    "actor_rollout_ref.actor.policy_loss.loss_mode": Synonym(
        "objective.policy_loss", VERL,
        "vanilla is PPO clip with dual-clip c = clip_ratio_c (3): dual_clip; verl's dppo losses cap the ratio at "
        "clip_ratio_c (3) and use clip_ratio (0.2) as the divergence bound, objective.policy_params.delta",
        {"vanilla": "objective.policy_loss=dual_clip objective.policy_params.clip_c=3",
         "dppo_tv": "objective.policy_loss=dppo_tv objective.policy_params.ratio_cap=3",
         "dppo_kl": "objective.policy_loss=dppo_kl objective.policy_params.ratio_cap=3",
         "gspo": "recipe=gspo", "geo_mean": "recipe=gmpo", "cispo": "recipe=cispo"}
    ),
    "actor_rollout_ref.actor.use_kl_loss": Synonym("objective.kl_placement", VERL, "objective.kl_placement=in_loss"),
    "actor_rollout_ref.actor.kl_loss_coef": Synonym("objective.kl_coef", VERL, "with objective.kl_placement=in_loss"),
    "actor_rollout_ref.actor.kl_loss_type": Synonym(
        "objective.kl_estimator", VERL, _KL_EST_NOTE, KL_EST
    ),
    "actor_rollout_ref.actor.entropy_coeff": Synonym("objective.entropy_coef", VERL),
    "actor_rollout_ref.actor.grad_clip": Synonym("train.grad_clip", VERL),
    "actor_rollout_ref.actor.optim.clip_grad": Synonym("train.grad_clip", VERL),
    "algorithm.adv_estimator": Synonym(
        "objective.advantage",
        VERL,
        "gae is recipe=ppo (a critic) with objective.whiten_advantages=true; REINFORCE++, its baseline variant, "
        "ReMax and OPO are recipes; grpo_passk is max_loo (the best sample's margin, not recipe=passk); gpg is "
        "recipe=gpg, whose alpha is the paper's B / (B - M), M the samples of all-equal groups, not verl's "
        "B / (samples with a non-zero reward)",
        {
            "gae": "recipe=ppo objective.whiten_advantages=true",
            "reinforce_plus_plus": "recipe=reinforce_pp",
            "reinforce_plus_plus_baseline": "recipe=reinforce_pp_baseline",
            "remax": "recipe=remax",
            "grpo": "objective.advantage=grpo",
            "rloo": "objective.advantage=rloo",
            "grpo_passk": "objective.advantage=max_loo",     # verl's: best-of-group margin, not Chen et al.'s
            "opo": "recipe=opo",
        },
    ),
    "algorithm.norm_adv_by_std_in_grpo": Synonym(
        "objective.advantage",
        VERL,
        "true: grpo, false: dr_grpo",
        {"True": "objective.advantage=grpo", "False": "objective.advantage=dr_grpo"},
    ),
    "algorithm.use_kl_in_reward": Synonym("objective.kl_placement", VERL, "objective.kl_placement=in_reward"),
    "algorithm.kl_ctrl.kl_coef": Synonym("objective.kl_coef", VERL, "with objective.kl_placement=in_reward"),
    "algorithm.kl_ctrl.target_kl": Synonym(
        "train.kl_target", VERL, "not the same quantity: verl's target is the batch mean of each sequence's mean "
        "per-token KL, train.kl_target the mean of each sequence's summed KL; set train.kl_target to about "
        "target_kl x the mean completion length in tokens (the rl log's completion length)"),
    "algorithm.kl_penalty": Synonym(
        "objective.kl_estimator", VERL, "with objective.kl_placement=in_reward; " + _KL_EST_NOTE, KL_EST),
    "algorithm.kl_ctrl.type": Synonym("train.kl_target", VERL, "adaptive: set train.kl_target; fixed: leave it null"),
    "algorithm.gamma": Synonym("objective.value", VERL, "objective.value.gamma (PPO-family recipes)"),
    "algorithm.lam": Synonym("objective.value", VERL, "objective.value.lam_actor and lam_critic (PPO-family recipes)"),
    "critic.optim.lr": Synonym("critic.lr", VERL),
    "trainer.total_training_steps": Synonym("train.steps", VERL),
    "trainer.total_epochs": Synonym("train.steps", VERL, "reinforge counts RL steps"),
    "trainer.save_freq": Synonym("checkpoint.every", VERL),
    "trainer.test_freq": Synonym("eval.every", VERL),
    "trainer.default_local_dir": Synonym("output_dir", VERL),
    "trainer.resume_mode": Synonym(None, VERL, "continue a run with `reinforge train --resume RUN_DIR`"),
    "trainer.val_before_train": Synonym(None, VERL, "reinforge always evaluates the model RL starts from (the 'start "
                                        "of RL' column); eval.num_prompts and eval.num_samples make it cheaper"),
    "trainer.experiment_name": Synonym("output_dir", VERL, "the run directory's name"),
    "trainer.nnodes": Synonym(None, VERL, "to train on several GPUs run under torchrun --nproc-per-node N"),
    "data.filter_overlong_prompts": Synonym(None, VERL, PROMPT_LENGTH),
    "data.truncation": Synonym(None, VERL, PROMPT_LENGTH),
    "data.shuffle": Synonym(None, VERL, "train.num_prompts prompts are reshuffled every epoch (seed)"),
    "data.reward_fn_key": Synonym("reward.functions", VERL, "reward.functions[].domains names the domains a function "
                                  "scores (task.name=mix)"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": Synonym(
        None, VERL, "reinforge has no activation checkpointing; a lower train.micro_batch_tokens uses less memory"),
    "actor_rollout_ref.rollout.val_kwargs.n": Synonym("eval.num_samples", VERL),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": Synonym("train.micro_batch_size", VERL),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": Synonym("train.micro_batch_size", VERL),
    "actor_rollout_ref.actor.entropy_coef": Synonym("objective.entropy_coef", VERL),
    "critic.model.path": Synonym(None, VERL, "the critic of recipe=ppo starts from the policy's weights"),
    "critic.ppo_micro_batch_size_per_gpu": Synonym("train.micro_batch_size", VERL),
    "trainer.project_name": Synonym("log.wandb_project", VERL),
    "trainer.logger": Synonym(
        "log.wandb", VERL, "log.wandb=true and log.tensorboard=true; metrics.jsonl is always written"
    ),
    "trainer.n_gpus_per_node": Synonym("ray.learner_ranks", VERL, "or run under torchrun --nproc-per-node N"),
}


def synonym_message(path: str, value: Any, synonym: Synonym) -> str:
    """The one-line refusal of `path` (=`value`), naming where reinforge has it."""
    where = f"{synonym.source}" + (f"; {synonym.note}" if synonym.note else "")
    if synonym.key is None:
        return f"unknown config key '{path}' ({where}); remove it"
    choice = synonym.values.get(str(value)) if not isinstance(value, (dict, list)) else None
    if choice is not None:     # the value picks a recipe or a part: name that setting, and the key
        return (f"unknown config key '{path}'; did you mean '{choice}'? ({synonym.source} for {synonym.key}; "
                f"{path.rpartition('.')[2]}={value} is {choice} here)")
    return f"unknown config key '{path}'; did you mean '{synonym.key}'? ({where})"
