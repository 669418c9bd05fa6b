"""OpenRLHF's launcher flags (openrlhf/cli/train_ppo_ray.py), mapped to the reinforge key that does
the same job: the third table of reinforge/config/synonyms.py, matched by a key's last part as TRL's names
are. The flags OpenRLHF shares with TRL (temperature, top_p, save_steps, eval_steps, logging_steps,
bf16, lora_alpha, lora_dropout, eval_dataset) are in TRL's table.
"""

from __future__ import annotations

from reinforge.config.synonyms import KL_EST, NO_VLLM_OPTION, PROMPT_LENGTH, REWARD_FILE, Synonym

OPENRLHF = "OpenRLHF's name"
_NO_DEEPSPEED = "reinforge does not use DeepSpeed; to train on several GPUs run under torchrun --nproc-per-node N"
_PLACEMENT = ("reinforge places its models itself: one process, torchrun --nproc-per-node N for several learner "
              "ranks, or backend=ray with section ray")

OPENRLHF_NAMES: dict[str, Synonym] = {
    "pretrain": Synonym("model.path", OPENRLHF, "a local folder; nothing is downloaded"),
    "reward_pretrain": Synonym("reward.model.path", OPENRLHF, "a sequence-classification folder"),
    "critic_pretrain": Synonym(None, OPENRLHF, "the critic of recipe=ppo starts from the policy's weights"),
    "remote_rm_url": Synonym("reward.functions", OPENRLHF, "a local Python reward function, " + REWARD_FILE),
    "agent_func_path": Synonym("task.environment", OPENRLHF, "an environment class, 'path/to/file.py:Class' "
                               "(docs/agents.md)"),
    "normalize_reward": Synonym("reward.model.normalize", OPENRLHF),
    "prompt_data": Synonym("task.options.path", OPENRLHF, "a local data file or save_to_disk folder, with "
                           "task.name=dataset; nothing is downloaded"),
    "prompt_split": Synonym("task.options.path", OPENRLHF, "a split of a datasets folder is written folder::split"),
    "eval_split": Synonym("task.options.eval_path", OPENRLHF, "a split of a datasets folder is written folder::split"),
    "input_key": Synonym("task.options.fields", OPENRLHF, "task.options.fields.prompt=COLUMN, with task.name=dataset"),
    "label_key": Synonym("task.options.fields", OPENRLHF, "task.options.fields.answer=COLUMN, with task.name=dataset"),
    "input_template": Synonym("task.options.prompt_template", OPENRLHF, "with {prompt} where OpenRLHF writes {}"),
    "apply_chat_template": Synonym("prompt.chat_template", OPENRLHF, "prompt.chat_template=always (the default, "
                                   "auto, applies the model's template when it has one)",
                                   {"True": "prompt.chat_template=always", "False": "prompt.chat_template=never"}),
    "max_samples": Synonym("train.num_prompts", OPENRLHF, "the number of training prompts read"),
    "rollout_batch_size": Synonym("train.prompts_per_step", OPENRLHF, "prompts per RL step, each sampled "
                                  "train.group_size times"),
    "micro_rollout_batch_size": Synonym("rollout.max_batch_rows", OPENRLHF, "completions decoded at once (memory "
                                        "only)"),
    "vllm_generate_batch_size": Synonym("rollout.max_batch_rows", OPENRLHF, "completions decoded at once"),
    "train_batch_size": Synonym("train.mini_batches", OPENRLHF, "reinforge counts mini-batches: train.mini_batches = "
                                "rollout_batch_size x n_samples_per_prompt / train_batch_size"),
    "micro_train_batch_size": Synonym("train.micro_batch_size", OPENRLHF, "completions per forward/backward (memory "
                                      "only, never the gradient)"),
    "n_samples_per_prompt": Synonym("train.group_size", OPENRLHF),
    "max_epochs": Synonym("train.ppo_epochs", OPENRLHF, "passes over each rollout batch"),
    "num_episodes": Synonym("train.steps", OPENRLHF, "reinforge counts RL steps of train.prompts_per_step prompts; "
                            "train.num_prompts prompts are reshuffled every epoch"),
    "prompt_max_len": Synonym(None, OPENRLHF, PROMPT_LENGTH),
    "generate_max_len": Synonym("rollout.max_new_tokens", OPENRLHF),
    "max_len": Synonym("rollout.max_new_tokens", OPENRLHF, "a completion's tokens; " + PROMPT_LENGTH),
    "actor_learning_rate": Synonym("train.lr", OPENRLHF, "the SFT stage has its own sft.lr"),
    "critic_learning_rate": Synonym("critic.lr", OPENRLHF),
    "lr_warmup_ratio": Synonym("train.warmup_steps", OPENRLHF, "a number of optimizer steps, not a fraction"),
    "lr_scheduler": Synonym(None, OPENRLHF, "RL's learning rate is constant after train.warmup_steps"),
    "max_norm": Synonym("train.grad_clip", OPENRLHF),
    "l2": Synonym("train.weight_decay", OPENRLHF),
    "init_kl_coef": Synonym("objective.kl_coef", OPENRLHF, "where the KL goes is objective.kl_placement (in_reward, "
                            "as OpenRLHF's default, or in_loss as its --use_kl_loss)"),
    "kl_target": Synonym("train.kl_target", OPENRLHF, "setting it makes the coefficient adaptive"),
    "use_kl_loss": Synonym("objective.kl_placement", OPENRLHF, "objective.kl_placement=in_loss",
                           {"True": "objective.kl_placement=in_loss", "False": "objective.kl_placement=in_reward"}),
    "kl_estimator": Synonym("objective.kl_estimator", OPENRLHF,
                            "k1, k2, k3 (clamped at 10, objective.kl_clamp=10) as in OpenRLHF", KL_EST),
    "advantage_estimator": Synonym(
        "objective.advantage",
        OPENRLHF,
        "reinforce and reinforce_baseline are recipes (REINFORCE++), gae is recipe=ppo with whitened advantages",
        {
            "gae": "recipe=ppo objective.whiten_advantages=true",
            "reinforce": "recipe=reinforce_pp",
            "reinforce_baseline": "recipe=reinforce_pp_baseline",
            "rloo": "objective.advantage=rloo",
            "group_norm": "objective.advantage=grpo",
            "dr_grpo": "objective.advantage=dr_grpo",
        },
    ),
    "no_advantage_std_norm": Synonym("objective.advantage", OPENRLHF, "objective.advantage=dr_grpo (the group mean "
                                     "only)", {"True": "objective.advantage=dr_grpo"}),
    "policy_loss_type": Synonym("objective.policy_loss", OPENRLHF, "ppo: ppo_clip, gspo: recipe=gspo",
                                {"ppo": "objective.policy_loss=ppo_clip", "gspo": "recipe=gspo"}),
    "eps_clip": Synonym("objective.eps_low", OPENRLHF, "OpenRLHF's eps_clip is both sides: set objective.eps_high "
                        "too"),
    "eps_clip_low_high": Synonym("objective.eps_low", OPENRLHF, "objective.eps_low and objective.eps_high"),
    "dual_clip": Synonym("objective.policy_loss", OPENRLHF, "objective.policy_loss=dual_clip with "
                         "objective.policy_params.clip_c=VALUE"),
    "value_clip": Synonym("objective.value", OPENRLHF, "objective.value.value_clip (PPO-family recipes)"),
    "gamma": Synonym("objective.value", OPENRLHF, "objective.value.gamma (PPO-family recipes)"),
    "lambd": Synonym("objective.value", OPENRLHF, "objective.value.lam_actor and lam_critic (PPO-family recipes)"),
    "freezing_actor_steps": Synonym("objective.value", OPENRLHF, "objective.value.pretrain_steps: the critic trains "
                                    "alone first (PPO-family recipes)"),
    "entropy_loss_coef": Synonym("objective.entropy_coef", OPENRLHF),
    "dynamic_filtering": Synonym("curation.filters", OPENRLHF, "curation.filters=[zero_variance] with "
                                 "curation.refill=dynamic (or recipe=dapo)"),
    "overlong_buffer_len": Synonym("reward.overlong.cache", OPENRLHF, "with reward.overlong.max_length"),
    "overlong_penalty_factor": Synonym("reward.overlong.coef", OPENRLHF),
    "async_train": Synonym("train.mode", OPENRLHF, "train.mode=async", {"True": "train.mode=async"}),
    "use_dynamic_batch": Synonym("train.micro_batch_tokens", OPENRLHF, "token-budget micro-batches are on by default"),
    "train_max_tokens_per_gpu": Synonym("train.micro_batch_tokens", OPENRLHF),
    "packing_samples": Synonym(None, OPENRLHF, "micro-batches are already packed by tokens (train.micro_batch_tokens)"),
    "lora_rank": Synonym("model.lora.r", OPENRLHF, "setting model.lora.r turns LoRA on"),
    "target_modules": Synonym("model.lora.target_modules", OPENRLHF),
    "load_in_4bit": Synonym(None, OPENRLHF, "reinforge trains in model.dtype (float32, bfloat16, float16)"),
    "save_path": Synonym("output_dir", OPENRLHF, "the final model is OUTPUT_DIR/model, a Hugging Face folder"),
    "ckpt_path": Synonym("output_dir", OPENRLHF, "checkpoints are written to OUTPUT_DIR/checkpoints"),
    "save_hf_ckpt": Synonym(None, OPENRLHF, "the final model is a Hugging Face folder; a checkpoint is exported with "
                            "`reinforge export RUN_DIR --step N`"),
    "load_checkpoint": Synonym(None, OPENRLHF, "continue a run with `reinforge train --resume RUN_DIR`"),
    "max_ckpt_num": Synonym("checkpoint.keep_last", OPENRLHF),
    "eval_n_samples_per_prompt": Synonym("eval.num_samples", OPENRLHF),
    "use_wandb": Synonym("log.wandb", OPENRLHF, "log.wandb=true"),
    "wandb_project": Synonym("log.wandb_project", OPENRLHF),
    "use_tensorboard": Synonym("log.tensorboard", OPENRLHF, "log.tensorboard=true writes into the run directory"),
    "zero_stage": Synonym(None, OPENRLHF, _NO_DEEPSPEED),
    "adam_offload": Synonym(None, OPENRLHF, _NO_DEEPSPEED),
    "gradient_checkpointing": Synonym(None, OPENRLHF, "reinforge has no activation checkpointing; a lower "
                                      "train.micro_batch_tokens uses less memory"),
    "flash_attn": Synonym(None, OPENRLHF, "the attention kernel is chosen for the model and device"),
    "attn_implementation": Synonym(None, OPENRLHF, "the attention kernel is chosen for the model and device"),
}


def openrlhf_family(name: str) -> Synonym | None:
    """OpenRLHF's placement and engine flags, matched by their shape (vllm_*, actor_num_gpus_per_node, ...)."""
    if name.startswith("vllm_") or name in ("enable_prefix_caching", "enforce_eager"):
        return Synonym(None, OPENRLHF, NO_VLLM_OPTION)
    if name.endswith(("_num_nodes", "_num_gpus_per_node")) or name.startswith("colocate_"):
        return Synonym(None, OPENRLHF, _PLACEMENT)
    if name.startswith(("deepspeed_", "ds_")) or name in ("zpg", "overlap_comm", "grad_accum_dtype"):
        return Synonym(None, OPENRLHF, _NO_DEEPSPEED)
    return None
