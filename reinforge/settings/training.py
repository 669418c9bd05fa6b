"""The sections of what trains: cold-start SFT, the RL update, the critic and curation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reinforge.errors import ConfigError
from reinforge.settings.base import Section
from reinforge.settings.rollout import WatchdogConfig, WeightSyncConfig


class SFTConfig(Section):
    enabled: bool = Field(True, description="Run the cold-start SFT stage before RL.")
    steps: int = Field(600, ge=0, description="Optimizer steps.")
    batch_size: int = Field(256, gt=0, description="Sequences per optimizer step.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (linear warm-up, cosine decay).")
    warmup_steps: int = Field(30, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    num_examples: int = Field(
        150000,
        gt=0,
        description="Teacher traces made from the train split: the pool each step draws its batch_size rows from, "
                    "at random with replacement (a pool of steps x batch_size traces is used about once each on "
                    "average; fresh problems keep the model from memorising noisy answers).",
    )
    corrupt_fraction: float = Field(
        0.3, ge=0, le=1, description="Fraction of teacher traces with a wrong answer (noisy cold start)."
    )
    judge_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description=(
            "Fraction of the SFT data that is judge training data (the Self-Rewarding paper's EFT data, arXiv "
            "2401.10020 sec. 2.2): the judge prompt (reward.judge.template) of a right or a corrupted completion of a "
            "train problem, and the judgement the task's verifier gives it (reward.judge.label), so that the model "
            "learns to judge its own samples (dpo.pairs=self_judged). 0: none."
        ),
    )
    source: Literal["teacher", "rejection", "file"] = Field(
        "teacher",
        description=(
            "What SFT trains on: the task's (noisy) teacher traces; 'rejection': the model's own verified-correct "
            "samples (rejection-sampling SFT, DeepSeek-R1 stage 3, arXiv 2501.12948 sec. 2.3.3); 'file': teacher "
            "traces from sft.data_path (distillation)."
        ),
    )
    data_path: str | None = Field(
        None, description="source=file: a JSONL / Parquet / datasets folder of prompt and completion fields."
    )
    rejection_prompts: int = Field(512, gt=0, description="source=rejection: train prompts sampled.")
    rejection_samples: int = Field(
        8, gt=0, description="source=rejection: samples per prompt (at the rollout temperature)."
    )
    rejection_max_per_prompt: int = Field(
        2,
        gt=0,
        description=(
            "source=rejection: distinct correct samples kept per prompt at most, so easy prompts do not crowd out "
            "hard ones."
        ),
    )
    teacher_path: str | None = Field(
        None,
        description=(
            "source=rejection: sample from this causal-LM folder (a teacher) instead of the model being trained: "
            "offline distillation, SFT on a teacher's verified samples (DeepSeek-R1-Distill, arXiv 2501.12948 sec. "
            "2.4). Its text is re-encoded by the student's tokenizer, so the two need not share one. None: the model "
            "itself."
        ),
    )

    @model_validator(mode="after")
    def _check_source(self) -> SFTConfig:
        if self.source == "file" and not self.data_path:
            raise ConfigError("sft.source=file needs sft.data_path (a JSONL / Parquet file of prompt and completion)")
        if self.teacher_path is not None and self.source != "rejection":
            raise ConfigError(f"sft.teacher_path is read by sft.source=rejection (the teacher's verified samples), "
                              f"and sft.source is {self.source}: set sft.source=rejection, or drop sft.teacher_path")
        return self


class TrainConfig(Section):
    steps: int = Field(150, ge=0, description="RL steps (one rollout batch each).")
    seed: int | None = Field(
        None,
        description=(
            "Seed of the stage after SFT (RL or DPO): its sampling, prompt order and mini-batch order. None: the "
            "run's seed. With seed fixed and train.seed swept (seed=0 train.seed=0,1,2) every run starts RL from the "
            "same SFT model, so a comparison of methods measures RL's variance, not SFT's."
        ),
    )
    prompts_per_step: int = Field(32, gt=0, description="Prompts per rollout batch.")
    num_prompts: int = Field(
        1000, gt=0, description="Train-split prompts that RL samples from, reshuffled every epoch."
    )
    group_size: int = Field(8, gt=1, description="Completions per prompt (G).")
    ppo_epochs: int = Field(1, gt=0, description="Passes over each rollout batch.")
    mini_batches: int = Field(
        2, gt=0, description="Optimizer steps per pass: the rollout batch is split into this many mini-batches."
    )
    old_logprobs: Literal["auto", "recompute", "rollout"] = Field(
        "auto",
        description=(
            "pi_old, the policy each PPO-style ratio and clip are taken against. recompute: the learner's own "
            "log-probs of the batch at the weights that sampled it (from the update's first forward, or a no-grad "
            "forward before it where a later mini-batch or a KL in the reward needs them). rollout: the sampling "
            "engine's log-probs of its own tokens, with no forward (verl's actor.use_rollout_log_probs, slime's "
            "--use-rollout-logprobs): the ratio is then to the policy that sampled, so an importance correction "
            "(objective.correction) sees a ratio of 1 and the sampler-learner mismatch metrics read 0 (the weight-sync "
            "probe, train.weight_sync.verify, still compares them), and an engine whose numbers are not the learner's "
            "(bf16 kernels, int8 weights, an older policy) moves the ratio off 1 before any update. auto: rollout "
            "for a batch whose sampler log-probs are the learner's own to float rounding (the native engine in this "
            "process on the learner's fp32 weights, unquantised, sampling the whole tempered softmax: no top-k / "
            "top-p / min-p, no MoE router; no update since: not an asynchronous batch's stale rows), else recompute. "
            "It saves the no-grad forward that would only repeat them."
        ),
    )
    micro_batch_size: int = Field(
        256,
        gt=0,
        description=(
            "Completions per forward/backward at most (gradient accumulation); never changes the gradient. With "
            "micro_batch_tokens, whichever limit comes first."
        ),
    )
    logprob_chunk_size: int = Field(
        1024,
        ge=0,
        description=(
            "Tokens per chunk through the LM head for log-probs and entropy (fp32 head, recomputed in backward; "
            "never holds [tokens x vocab] logits); 0: the plain full-logits path."
        ),
    )
    truncated_logprobs: bool = Field(
        True,
        description=(
            "With rollout.top_k / top_p / min_p: the learner's log-probs are of the same truncated distribution the "
            "sampler drew from (renormalised over the tokens its own temperature-scaled logits keep), so the PPO / "
            "TIS ratio is 1 on-policy. false: the full softmax, whose ratio to the sampler's is Z_kept < 1 "
            "(reinforge/learner/truncation.py). No effect without truncation."
        ),
    )
    shared_prefix: bool = Field(
        True,
        description=(
            "Learner forward runs each prompt once for its group's completions (GRPO-style groups share a prompt): "
            "fewer FLOPs, same numbers. Llama-family decoders (Llama, Qwen2, Qwen3, Mistral without sliding window); "
            "false: the plain forward."
        ),
    )
    compile: bool = Field(
        False,
        description=(
            "On a CUDA device, the shared-prompt learner forward (shared_prefix) runs each decoder layer's work "
            "around the attention (norms, rotary, SwiGLU, residual adds) through torch.compile: a few fused kernels "
            "instead of one launch per small op, forward and backward. Compiled once per process, with dynamic "
            "shapes (the first update pays seconds of compiling); the same numbers within the dtype's rounding. "
            "If compiling fails, the layers run eagerly with a logged warning. No effect on a CPU or with "
            "shared_prefix=false. Measured slower than eager on an H200 for a 0.5B model (docs/gpu.md)."
        ),
    )
    reuse_activations: bool = Field(
        True,
        description=(
            "The first mini-batch's backward takes its completion tokens' activations from the native engine's "
            "decoding instead of running the learner's forward over them: where the sampled log-probs are the "
            "learner's own (see old_logprobs=auto) and no optimizer step has come since, both ran the same layers at "
            "the same weights, equal to float rounding. The engine keeps them in one-call single-turn generations on "
            "CPU in fp32 with the shared-prompt learner (shared_prefix); elsewhere, and for later mini-batches, the "
            "forward runs as before. false: always run it."
        ),
    )
    routing_replay: bool = Field(
        False,
        description=(
            "MoE models: the learner's routers take the experts the sampler chose for each token (recorded by the "
            "native engine; routing replay, arXiv 2507.18071 sec. 4), with gates from the learner's own router "
            "probabilities of those experts, renormalised as the architecture does. moe/routing_mismatch is logged "
            "either way. Needs rollout.engine=native."
        ),
    )
    micro_batch_tokens: int | None = Field(
        16384,
        gt=0,
        description=(
            "Token budget of a micro-batch (rows x longest row, rows sorted by length), as verl's "
            "ppo_max_token_len_per_gpu (also 16384 there): short rows share few large forwards (on the built-in task "
            "one forward per mini-batch, 10-20% faster RL steps than 64 rows at a time on 2 CPU cores), long rows "
            "get few enough for memory. On a GPU with shared_prefix: the positions that forward runs (each prompt "
            "once, completions unpadded). None: micro_batch_size rows only. Never changes the gradient."
        ),
    )
    lr: float = Field(
        5e-5,
        gt=0,
        description=(
            "Learning rate (constant after warm-up). On the built-in task 2e-4 already raised pass@1 but cost greedy "
            "accuracy (the carry circuit drifts)."
        ),
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up in optimizer steps.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    kl_target: float | None = Field(
        None,
        gt=0,
        description=(
            "Adaptive KL coefficient for a KL placed in the reward (objective.kl_placement=in_reward, ppo): after "
            "each step beta <- beta (1 + 0.1 clip(KL / kl_target - 1, -0.2, 0.2)) with KL the mean per-sequence KL "
            "(Ziegler et al. 2019); objective.kl_coef is the starting beta. None: fixed beta."
        ),
    )
    mode: Literal["sync", "async"] = Field(
        "sync",
        description=(
            "sync: generate a batch, then train on it. async: rollout workers keep generating while the learner "
            "trains (AReaL, arXiv 2505.24298), at most train.max_staleness learner steps ahead; needs "
            "rollout.engine=native. Recipes areal and scalerl are async."
        ),
    )
    max_staleness: int = Field(
        4,
        ge=0,
        description=(
            "async: eta, the most learner steps between the weights that sampled a token and the step that trains on "
            "it (0 is exactly the synchronous loop). A new prompt group starts only while floor(N / B) <= eta + v (N "
            "groups requested, B = prompts_per_step, v the learner's version)."
        ),
    )
    in_flight: Literal["interrupt", "finish"] = Field(
        "interrupt",
        description=(
            "async: what samples in flight do when new weights arrive: interrupt (AReaL: their keys/values are "
            "recomputed and they continue with the new weights, each token recording its version) or finish (they "
            "complete with the weights they started with; new prompts wait)."
        ),
    )
    max_nonfinite_steps: int = Field(
        3,
        gt=0,
        description=(
            "Guard: an optimizer step whose loss or gradient is NaN/inf is skipped (weights and optimizer state "
            "untouched) and counted (guard/skipped_steps); after this many RL steps in a row with a skipped step the "
            "run stops, with a checkpoint of the last good weights."
        ),
    )
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig,
                                          description="Weight-sync verification (docs/observability.md).")
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig,
                                     description="Hang watchdog (docs/observability.md).")


class CriticConfig(Section):
    """The value model of PPO-family recipes (advantage gae: ppo, vapo); see reinforge.learner.critic."""

    lr: float = Field(
        1e-3,
        gt=0,
        description=(
            "Critic learning rate (its own AdamW; the head starts at V = 0, so it learns faster than the policy "
            "moves)."
        ),
    )
    weight_decay: float = Field(0.0, ge=0, description="Critic AdamW weight decay.")
    shared_body: bool = Field(
        False,
        description=(
            "A value head on the policy's own body instead of a separate value model: one body in memory; the value "
            "loss trains the head only (the policy's features are read, not changed)."
        ),
    )
    pretrain_patience: int = Field(
        5,
        gt=0,
        description=(
            "Value pre-training stops before objective.value.pretrain_steps once the explained variance (after each "
            "step) has not risen by pretrain_tolerance over this many steps: it has converged (VC-PPO pre-trains "
            "until it does)."
        ),
    )
    pretrain_tolerance: float = Field(0.01, ge=0, description="See pretrain_patience.")


class CurationConfig(Section):
    filters: list[Literal["zero_variance"]] = Field(
        default_factory=list,
        description=(
            "Group filters between reward and advantage: zero_variance drops prompts whose rewards are all equal "
            "(their advantage is zero)."
        ),
    )
    refill: Literal["none", "dynamic", "active"] = Field(
        "none",
        description=(
            "When filters leave the batch short: none trains on what is left (ScaleRL); dynamic samples another full "
            "batch of prompts per round (DAPO dynamic sampling); active samples just the missing prompts (Olmo 3 "
            "active refill)."
        ),
    )
    max_rounds: int = Field(
        3,
        gt=0,
        description="Generation rounds per step when refilling; a batch still short then is trained on as it is "
                    "(curation/short = 1).",
    )
    overlong_filter: bool = Field(
        False,
        description=(
            "Mask truncated completions out of the loss (DAPO overlong filtering); they still count in their group's "
            "advantage."
        ),
    )
    retire_pass_rate: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Prompts whose group pass rate reaches this leave the pool for later epochs (ScaleRL "
                    "no-positive-resampling: 0.9). None: never.",
    )


