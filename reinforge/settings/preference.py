"""The sections of the preference and learned-reward jobs: DPO pairs, reward-model and process-reward-model
training."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reinforge.errors import ConfigError
from reinforge.settings.base import Section


class DPOConfig(Section):
    """The preference loop (recipe dpo, reinforge.loops.dpo). It reuses train.steps (one optimizer step each),
    train.lr, train.warmup_steps, train.grad_clip, train.prompts_per_step, train.group_size, train.num_prompts and
    the forward settings; train.ppo_epochs and train.mini_batches do not apply."""

    pairs: Literal["on_policy", "dataset", "self_judged", "spin"] = Field(
        "on_policy",
        description=(
            "Where pairs come from: on_policy samples train.group_size completions of train.prompts_per_step prompts "
            "from the current policy each step and pairs a verified-correct one (chosen) with an incorrect one "
            "(rejected) of the same prompt; dataset draws train.prompts_per_step pairs per step from dpo.pairs_path; "
            "self_judged samples as on_policy and pairs the completions that the policy itself judges best and worst "
            "(reward.judge, default: the policy with the built-in judge prompt; self-rewarding, arXiv 2401.10020); "
            "spin pairs train.prompts_per_step SFT examples (sft.source=teacher or file) as chosen with the "
            "policy's own sample of each prompt as rejected (SPIN, arXiv 2401.01335)."
        ),
    )
    pairs_path: str | None = Field(
        None,
        description="pairs=dataset: a JSONL / Parquet / datasets folder with prompt, chosen and rejected text fields.",
    )
    pairs_fields: dict[str, str] = Field(
        default_factory=dict,
        description="pairs=dataset: our field name -> the file's column, e.g. {chosen: response_a}.",
    )
    pairs_per_prompt: int = Field(
        2,
        gt=0,
        description=(
            "pairs=on_policy: pairs formed per prompt at most; pair k takes correct sample k mod c and incorrect "
            "sample k mod i (c, i their counts), k < max(c, i)."
        ),
    )
    beta: float | None = Field(
        None,
        gt=0,
        description="Override of the recipe's beta (the implicit reward's scale); None keeps the recipe's (dpo: 0.1).",
    )
    loss_type: str | None = Field(
        None, description="Override of the recipe's preference loss: sigmoid (DPO), ipo, or 'module:function'."
    )
    label_smoothing: float | None = Field(
        None, ge=0, le=0.5, description="Override of the recipe's label smoothing s (cDPO; sigmoid only)."
    )

    @model_validator(mode="after")
    def _check_pairs(self) -> DPOConfig:
        if self.pairs == "dataset" and not self.pairs_path:
            raise ConfigError(
                "dpo.pairs=dataset needs dpo.pairs_path (a JSONL / Parquet file of prompt, chosen and rejected)"
            )
        if self.pairs != "dataset" and (self.pairs_path or self.pairs_fields):
            raise ConfigError("dpo.pairs_path and dpo.pairs_fields are read only with dpo.pairs=dataset")
        return self


class RewardModelTrainingConfig(Section):
    """`reinforge reward-model`: the preference pairs and the training of a Bradley-Terry reward model
    (reinforge.jobs.reward_model). It starts from model.path after the sft section's cold start, as a run does."""

    pairs: Literal["on_policy", "dataset"] = Field(
        "on_policy",
        description="on_policy: sample the policy on rm.num_prompts train prompts and pair a verified-correct "
                    "completion (chosen) with an incorrect one (rejected); dataset: read rm.pairs_path.",
    )
    pairs_path: str | None = Field(
        None, description="pairs=dataset: a JSONL / Parquet / datasets folder with prompt, chosen and rejected fields."
    )
    pairs_fields: dict[str, str] = Field(
        default_factory=dict, description="pairs=dataset: our field name -> the file's column, e.g. {chosen: good}."
    )
    num_prompts: int = Field(512, gt=0, description="pairs=on_policy: train prompts sampled.")
    samples_per_prompt: int = Field(8, gt=1, description="pairs=on_policy: completions sampled per prompt.")
    pairs_per_prompt: int = Field(4, gt=0, description="pairs=on_policy: pairs formed per prompt at most.")
    unseen_prompts: int = Field(
        128, ge=0, description="pairs=on_policy: held-out (eval split) prompts whose pairs are also measured; 0: none."
    )
    heldout_fraction: float = Field(0.2, ge=0, lt=1, description="Pairs held out of training for the accuracy.")
    steps: int = Field(1500, gt=0, description="AdamW steps on the Bradley-Terry loss.")
    batch_size: int = Field(32, gt=0, description="Pairs per step.")
    lr: float = Field(1e-3, gt=0, description="Learning rate.")

    @model_validator(mode="after")
    def _check_pairs(self) -> RewardModelTrainingConfig:
        if self.pairs == "dataset" and not self.pairs_path:
            raise ConfigError("rm.pairs=dataset needs rm.pairs_path: a file of prompt / chosen / rejected pairs")
        return self


class ProcessRewardTrainingConfig(Section):
    """`reinforge process-reward-model`: Math-Shepherd step labels from the policy and the training of a
    process reward model on them (reinforge.jobs.process_reward_model). It starts from model.path after the
    sft section's cold start, as a run does."""

    num_prompts: int = Field(512, gt=0, description="Train prompts whose sampled solutions are labelled.")
    samples_per_prompt: int = Field(4, gt=0, description="Solutions sampled per prompt (Math-Shepherd: 15).")
    continuations: int = Field(
        8, gt=0, description="Continuations sampled from each step prefix (Math-Shepherd's N) to label the step."
    )
    marker: str = Field("\n", description="What splits a solution into steps (see reward.process.marker).")
    heldout_prompts: int = Field(
        128, ge=0, description="Held-out (eval split) prompts labelled the same way: the PRM's held-out step accuracy."
    )
    target: Literal["hard", "soft"] = Field(
        "hard",
        description="Labels trained on: hard, 1 if some continuation reached the answer; soft, the fraction that did.",
    )
    steps: int = Field(1200, gt=0, description="AdamW steps on the step-level binary cross-entropy.")
    batch_size: int = Field(32, gt=0, description="Solutions per step.")
    # On 4-term chain sums with the built-in model, 1e-3 left the held-out step accuracy at 0.84 (overfitting,
    # train loss 0.24); 3e-4 reached 0.96.
    lr: float = Field(3e-4, gt=0, description="Learning rate.")
