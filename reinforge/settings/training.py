"""The sections of what trains: the model, prompts, SFT, the rollout, the RL update, the critic,
curation and DPO."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, model_validator

from reinforge.errors import ConfigError
from reinforge.settings.base import Section

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """LoRA adapters (Hu et al., arXiv 2106.09685) through peft: h = W x + (alpha / r) B A x, W frozen."""

    r: int = Field(gt=0, description="Rank of the adapters; setting it (model.lora.r=8) turns LoRA on.")
    alpha: float = Field(
        16.0,
        gt=0,
        description=(
            "Scale numerator: the update is (alpha / r) B A. Kept fixed when r changes, as in the LoRA paper (sec. "
            "4.1: r can then vary without retuning the learning rate); alpha = 2 r is another common choice."
        ),
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description=(
            "Dropout on the adapters' input in training mode; > 0 needs train.shared_prefix=false (the shared-prompt "
            "forward runs merged weights)."
        ),
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description=(
            "Module names (suffixes) that get adapters; default the attention and MLP projections of Llama-family "
            "decoders. The native engine and shared-prompt forward also handle lm_head."
        ),
    )


class MoEConfig(Section):
    """The built-in model as a Mixture-of-Experts decoder (models/moe.py): each MLP becomes `experts`
    SwiGLU experts behind a top-k router, built with transformers' own class for `architecture`."""

    experts: int = Field(gt=1, description="Experts per layer; setting it (model.moe.experts=8) makes the model MoE.")
    architecture: Literal["qwen2_moe", "mixtral", "qwen3_moe"] = Field(
        "qwen2_moe",
        description=(
            "transformers architecture: qwen2_moe (with a sigmoid-gated shared expert), mixtral (always renormalises "
            "the top-k gates) or qwen3_moe (per-head q/k norm, no shared expert)."
        ),
    )
    top_k: int = Field(2, gt=0, description="Experts per token (num_experts_per_tok).")
    expert_size: int = Field(128, gt=0, description="Each expert's MLP width (moe_intermediate_size).")
    shared_expert_size: int = Field(256, gt=0, description="qwen2_moe only: the shared expert's MLP width.")
    norm_topk_prob: bool = Field(
        True,
        description="Renormalise the top-k router probabilities to sum to 1 (qwen2_moe, qwen3_moe; mixtral always)",
    )


class ModelConfig(Section):
    path: str = Field(
        "builtin", description="'builtin' for the tiny built-in Qwen2, or a local Hugging Face causal-LM directory."
    )
    hidden_size: int = Field(128, gt=0, description="Built-in model only: width.")
    num_layers: int = Field(4, gt=0, description="Built-in model only: decoder layers.")
    num_heads: int = Field(8, gt=0, description="Built-in model only: attention heads.")
    num_kv_heads: int = Field(
        8,
        gt=0,
        description=(
            "Built-in model only: key/value heads (GQA when fewer than num_heads; with 2 the default SFT stayed on "
            "its loss plateau for 2 of 3 seeds, with 8 it learned on all 4 seeds tried)."
        ),
    )
    intermediate_size: int = Field(512, gt=0, description="Built-in model only: MLP width.")
    max_positions: int = Field(64, gt=0, description="Built-in model only: context length.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype.")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description=(
            "Where the policy (and its reference and critic) live and run: auto (the first CUDA device when there is "
            "one, else the CPU), cpu, cuda or cuda:N. Rollouts, rewards and advantages stay on the CPU; each forward "
            "moves its batch to the model."
        ),
    )
    moe: MoEConfig | None = Field(
        None,
        description=(
            "Built-in model only: a Mixture-of-Experts decoder (model.moe.experts=8 turns it on); train.routing_replay "
            "replays the sampler's expert choices in the learner. None: dense MLPs."
        ),
    )
    lora: LoraConfig | None = Field(
        None,
        description=(
            "LoRA adapters on the model (model.lora.r=8 turns them on): only the adapters train; the KL reference "
            "runs the policy's own model with its own adapter weights or none (no copy, learner/reference.py); "
            "RUN_DIR/model and `reinforge export` hold the merged weights. None: full fine-tuning."
        ),
    )


class PromptConfig(Section):
    chat_template: Literal["auto", "always", "never"] = Field(
        "auto", description="Wrap prompts in the tokenizer's chat template: 'auto' uses it when the tokenizer has one."
    )
    system: str | None = Field(
        None,
        description=(
            "A system message before every prompt: a plain prompt becomes [system, user] for the chat template (the "
            "model's tokenizer must have one); a conversation from the data file (a list of messages) without a "
            "system message gets it, one with its own keeps that. None: no system message."
        ),
    )


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
        description="Teacher traces drawn from the train split (each drawn once by default: steps x batch_size; fresh "
                    "problems keep the model from memorising noisy answers).",
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


VLLM_INSTALL_HINT = "run `make vllm-env` and use .venv-vllm/bin/reinforge (docs/engine.md)"


class RolloutConfig(Section):
    engine: Literal["native", "hf", "vllm"] = Field(
        "native",
        description="Generation engine: 'native' is reinforge's KV-cache engine with continuous batching (Llama-family "
                    "decoders: Llama, Qwen2, Qwen3, Mistral), 'hf' is transformers generate, 'vllm' is vLLM in this "
                    "process over its own copy of the weights, synced after every update (its own environment: "
                    "`make vllm-env`, docs/engine.md).",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.1, gt=0, le=1, description="rollout.engine=vllm: the share of the device's memory vLLM reserves for its "
        "weights and KV cache (on a CPU, of the machine's memory).")
    max_batch_rows: int | None = Field(
        None,
        gt=0,
        description="Native engine: completions decoded at once; a finished row's slot is refilled with a waiting one "
                    "(continuous batching). None: all rows of a call at once.",
    )
    cpu_kernels: bool = Field(
        True,
        description=(
            "Native engine on CPU in fp32: each decoder layer's decoding step runs as one fused C++ op "
            "(reinforge/kernels/csrc/decode.cpp: the matmuls stay ATen's, the norms, rotary, cache write, attention "
            "and SwiGLU between them are fused), compiled with the machine's C++ compiler on first use (~10 s) and "
            "cached in ~/.cache/reinforge; where it cannot be built (no compiler) the engine warns once and uses its "
            "PyTorch path, which gives the same tokens and log-probs within 1e-5. false: always the PyTorch path "
            "(also REINFORGE_CPU_KERNELS=0)."
        ),
    )
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature for training rollouts and pass@k evaluation."
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold (1.0 = off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    record_top_k: int = Field(
        0, ge=0, description="Native engine: at each sampled position, record the K most likely token ids and their "
        "log-probs under the sampling distribution (DPPO's top-K divergence, policy_loss=dppo_topk_tv|kl); 0 = off.")
    min_p: float = Field(
        0.0, ge=0, le=1,
        description="Min-p sampling: keep the tokens whose probability is at least min_p times the most likely "
                    "token's, after temperature, as HF and vLLM define it (0.0 = off).",
    )
    quantization: Literal["none", "int8"] = Field(
        "none",
        description=(
            "Native engine: the sampler's weight precision. int8: every q/k/v/o and MLP projection rounded to int8 per "
            "output channel (fp32 scales) each time the engine takes the weights, dequantised in the matmul; the "
            "learner stays fp32, so the sampler-learner mismatch (mismatch_kl, is_weight_max) widens as with "
            "a quantised inference server (reinforge/models/quantize.py). none: the training weights as they are."
        ),
    )
    quantize_lm_head: bool = Field(
        False, description="rollout.quantization=int8: quantise the LM head too (false: it stays fp32)."
    )
    max_new_tokens: int = Field(8, gt=0, description="Completion length limit; longer completions are truncated.")
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings: a completion ends with the token that completes one (eos always ends it).",
    )
    tools: list[str] | None = Field(
        None,
        description=(
            "Tools the model may call, making each sample a multi-turn episode (docs/agents.md): 'python' (the code "
            "sandbox), 'module:function' or 'path/to/file.py:function' (a typed function with a docstring, the "
            "transformers chat-template convention). None: the task's own (multiply_tool: its calculator); []: none."
        ),
    )
    tool_parser: str = Field(
        "auto", description="How tool calls are read from the model's text: hermes, or auto (from the chat template)."
    )
    tool_timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of one tool call; a late call is stopped.")
    tool_max_chars: int = Field(4096, ge=100, description="A tool's result is cut to this many characters.")
    max_tool_calls: int = Field(4, ge=1, description="Tool calls per trajectory; a call past it ends the trajectory.")
    max_turns: int = Field(8, ge=1, description="Multi-turn: model turns per trajectory (each up to max_new_tokens).")
    max_model_tokens: int | None = Field(
        None, gt=0, description="Multi-turn: the model's tokens per trajectory, all turns (None: no limit)."
    )
    max_environment_tokens: int | None = Field(
        None, ge=0, description="Multi-turn: tool-result and reply tokens per trajectory (None: no limit)."
    )
    continuation: bool = Field(
        True,
        description=(
            "Multi-turn on the native engine: a trajectory goes on from its cached keys/values after a tool result "
            "or reply (the prompt and earlier turns are not recomputed). false: each turn re-prefills its context."
        ),
    )

    @model_validator(mode="after")
    def _check_quantization(self) -> RolloutConfig:
        if self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"rollout.engine=vllm needs vLLM, which is not installed here: {VLLM_INSTALL_HINT}")
        if self.quantization != "none" and self.engine != "native":
            raise ConfigError(f"rollout.quantization={self.quantization} is built for the native engine only: "
                              "set rollout.engine=native, or rollout.quantization=none")
        if self.quantize_lm_head and self.quantization == "none":
            raise ConfigError("rollout.quantize_lm_head needs a quantised sampler: set rollout.quantization=int8")
        return self


class WeightSyncConfig(Section):
    verify: bool = Field(
        True,
        description=(
            "After every weight publication the sampler (the rollout engine, the async sampler thread, each Ray "
            "worker, each learner rank's plain copy) scores a fixed probe sequence with the weights it samples "
            "with; its next-token distributions must equal the learner's forward within `tolerance` (total "
            "variation), and an async worker must hold the version just published. Else an alert (weight_sync) "
            "and the run stops. Metric sync/probe_tv."
        ),
    )
    tolerance: float | None = Field(
        None,
        gt=0,
        description="Largest total variation between the sampler's and the learner's next-token distributions on the "
        "probe that passes. None: 1e-3 for fp32 models (rounding gives ~1e-6), 5e-2 for bf16/fp16 and for fp32 on a "
        "GPU with TF32 matmuls (the engine and the learner round differently).",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long an async worker may take to apply published weights before it counts as stale "
        "(train.in_flight=finish applies them only once the samples in flight end).",
    )


class WatchdogConfig(Section):
    enabled: bool = Field(
        True,
        description=(
            "Hang watchdog: when no RL step ends for max(factor x median step time so far, min_seconds) "
            "(first_step_seconds before the first one), every thread's stack and every child process's are "
            "written to RUN_DIR/hang-<step>.txt and an alert (hang) names where each thread waits."
        ),
    )
    factor: float = Field(10.0, gt=0, description="Hang limit as a multiple of the median step time so far.")
    min_seconds: float = Field(300.0, gt=0, description="The hang limit is never below this many seconds.")
    first_step_seconds: float = Field(
        1800.0, gt=0, description="Hang limit before the first step has ended (no step time to scale yet)."
    )
    stop_after: int = Field(
        0,
        ge=0,
        description=(
            "0: after a dump keep waiting (dumping again each further limit without progress). N > 0: stop the "
            "run after N dumps of one hang (the main thread is interrupted; a thread stuck in C code may not stop)."
        ),
    )


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
            "get few enough for memory. None: micro_batch_size rows only. Never changes the gradient."
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
    (reinforge.rm_job). It starts from model.path after the sft section's cold start, as a run does."""

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
    process reward model on them (reinforge.prm_job). It starts from model.path after the sft section's
    cold start, as a run does."""

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
