"""The sections of what surrounds training: rewards, evaluation, checkpoints, logging, alerts and Ray."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from reinforge.errors import ConfigError
from reinforge.settings.base import Section
from reinforge.settings.judge import JudgeConfig


class EvalConfig(Section):
    num_prompts: int = Field(200, gt=0, description="Held-out prompts evaluated at the start and end of RL.")
    num_samples: int = Field(
        8, gt=0, description="Samples per prompt for pass@1 and pass@k (at the rollout temperature)."
    )
    seed: int = Field(1234, description="Sampling seed of evaluation, the same for the start and final model.")
    every: int = Field(
        25,
        ge=0,
        description=(
            "Held-out evaluation during RL every this many steps (metrics eval/pass@1, eval/greedy_accuracy; what "
            "the reward-hacking alert compares with the train reward); 0: only at the start and end. It runs under "
            "its own seed and never changes the training numbers."
        ),
    )
    every_prompts: int | None = Field(
        None,
        gt=0,
        description="Held-out prompts of the evaluations during RL (the first ones of the held-out set); None: "
                    "eval.num_prompts.",
    )
    token_budgets: list[int] = Field(
        default_factory=list,
        description=(
            "Test-time scaling: held-out pass@1 when generation is cut at each of these numbers of new tokens "
            "(metrics eval/pass@1@budget_B; the answer must be complete within B tokens). Computed from the "
            "evaluation's own samples, each cut at B tokens: no extra generation (reinforge.eval.budget). Each "
            "at most rollout.max_new_tokens; single-turn tasks only. []: off."
        ),
    )

    @field_validator("token_budgets")
    @classmethod
    def _check_budgets(cls, budgets: list[int]) -> list[int]:
        if any(b <= 0 for b in budgets):
            raise ConfigError(f"eval.token_budgets={budgets}: every budget must be a positive number of tokens")
        return sorted(set(budgets))


def word_key(word: str) -> str:
    """A reflection word's metric key: lower case, runs of non-alphanumerics as '_' ("double-check" -> double_check).
    Here, under the section that checks the keys are distinct; telemetry/reflection.py names its metrics with it."""
    return re.sub(r"[^0-9a-z]+", "_", word.strip().lower()).strip("_")


class AnalyticsConfig(Section):
    """What the run measures of its samples beyond rewards (reinforge.telemetry.reflection)."""

    reflection_words: list[str] = Field(
        default_factory=lambda: ["wait", "let me check", "verify", "double-check", "re-examine", "hmm"],
        description=(
            "Words and phrases counted in each RL step's samples, case-insensitive and as whole words ('waiting' "
            "is not 'wait'), split by whether the verifier accepted the sample: metrics "
            "reasoning/reflection_rate/{correct,incorrect}, reasoning/reflections_per_1k_tokens/..., "
            "reasoning/reflection_words/<word> (docs/observability.md). []: off."
        ),
    )

    @model_validator(mode="after")
    def _check_words(self) -> AnalyticsConfig:
        keys: dict[str, str] = {}
        for word in self.reflection_words:
            key = word_key(word)
            if not key:
                raise ConfigError(f"analytics.reflection_words has {word!r}: each entry needs a letter or digit")
            if key in keys:
                raise ConfigError(f"analytics.reflection_words has {keys[key]!r} and {word!r}, which share the metric "
                                  f"key reasoning/reflection_words/{key}: keep one")
            keys[key] = word
        return self


class CheckpointConfig(Section):
    every: int = Field(
        25,
        ge=0,
        description=(
            "Write a resumable checkpoint (weights, optimizer, scheduler, RNG, data and curation state, metrics "
            "position) every this many RL steps, and always at the end of RL; 0: only at the end. `reinforge train "
            "--resume RUN_DIR` continues from the newest."
        ),
    )
    keep_last: int = Field(
        2, gt=0, description="Resumable checkpoints kept; older ones are deleted once a newer one is complete."
    )


class LogConfig(Section):
    progress: bool = Field(True, description="Show a progress bar.")
    samples_every: int = Field(
        10,
        ge=0,
        description=(
            "Every this many RL steps, and at the last step, write a few of the step's samples (prompt, completion, "
            "each reward function's value, total reward, advantage) to RUN_DIR/samples.jsonl, TensorBoard (text) and "
            "W&B (a table); the report shows the last ones. 0: never. RL recipes only (DPO steps have pairs, not "
            "scored samples)."
        ),
    )
    samples_per_step: int = Field(
        4,
        gt=0,
        description=(
            "Samples written per logged step, spread over the batch "
            "(from different prompts when there are enough)."
        ),
    )
    tensorboard: bool = Field(
        False, description="Also write the metrics as TensorBoard scalars to RUN_DIR/tensorboard."
    )
    wandb: bool = Field(False, description="Also log the metrics to Weights & Biases.")
    wandb_project: str = Field("reinforge", description="W&B project name.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="W&B mode: offline writes RUN_DIR/wandb without network (`wandb sync` uploads it later)."
    )


class AlertConfig(Section):
    """Thresholds of the health alerts (console and RUN_DIR/alerts.jsonl); see reinforge.telemetry.alerts."""

    enabled: bool = Field(True, description="Check the health alerts every step.")
    window: int = Field(
        5, gt=0, description="Steps averaged for the baseline (the first `window` RL steps) and for the current value."
    )
    entropy_collapse_ratio: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="Entropy collapse: the current mean token entropy falls below this fraction of its baseline.",
    )
    length_blowup_ratio: float = Field(
        3.0, gt=1, description="Length blow-up: the current mean response length exceeds this multiple of its baseline."
    )
    truncation_rate_max: float = Field(
        0.5, gt=0, le=1, description="Length blow-up: the current truncation rate exceeds this fraction."
    )
    hacking_eval_drop: float = Field(
        0.05,
        gt=0,
        description=(
            "Reward hacking: held-out pass@1 has fallen by at least this much from its best while the train reward "
            "rose over the same steps."
        ),
    )
    is_weight_max: float = Field(
        10.0,
        gt=1,
        description="Exploding IS weights: the largest per-token ratio pi_learner / pi_sampler of a step exceeds this.",
    )
    no_gradient_steps: int = Field(
        5,
        gt=0,
        description=(
            "Training on nothing: this many steps in a row took no update because curation dropped every sampled "
            "group (RL) or no preference pair formed (DPO)."
        ),
    )


class CodeSandboxConfig(Section):
    """The code sandbox of the `code` verifier and the `python` tool (reinforge.verifiers.code, docs/security.md)."""

    allow_weak_sandbox: bool = Field(
        False,
        description="Run candidate programs even where a required sandbox layer is missing (seccomp, no_new_privs, "
                    "read-only mounts or Landlock, and a PID namespace, a uid of their own or Landlock with "
                    "seccomp: `reinforge doctor` lists them). False: such a machine refuses to run candidate "
                    "code, naming the missing layer. Even when true, a candidate that could write to the "
                    "interpreter's directories never runs.",
    )


class RewardFunctionConfig(Section):
    name: str = Field(
        description=(
            "Reward function: verifier (the task's own), format, think_answer, length_penalty, or 'module:function' "
            "(see reinforge.rewards.compose)."
        )
    )
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword parameters of the function, e.g. {pattern: 'answer: \\d+', mode: search} for format.",
    )
    domains: list[str] | None = Field(
        None,
        description="The domains of a mix (task.name=mix) it scores, e.g. [countdown]; on rows of other domains it "
                    "is not applicable: not called, left out of the sum (the row is not skipped). None: every row.",
    )


class OverlongConfig(Section):
    max_length: int | None = Field(None, gt=0, description="L_max in completion tokens; None: rollout.max_new_tokens.")
    cache: int | None = Field(
        None,
        gt=0,
        description=(
            "L_cache: the window before L_max over which the penalty ramps from 0 to -1; None: L_max // 5 (DAPO: "
            "4096 of 20480)."
        ),
    )
    coef: float = Field(1.0, ge=0, description="Weight of the shaping term in the reward.")

    @model_validator(mode="after")
    def _check_window(self) -> OverlongConfig:
        if self.max_length is not None and self.cache is not None and self.cache > self.max_length:
            raise ConfigError(f"reward.overlong.cache ({self.cache}) must be <= max_length ({self.max_length})")
        return self


class RewardModelConfig(Section):
    """A learned reward model as a reward source (InstructGPT's fourth model): a Hugging Face
    sequence-classification folder with one label, as `reinforge reward-model` writes it."""

    path: str = Field(description="The reward model's folder (AutoModelForSequenceClassification, num_labels=1).")
    weight: float = Field(1.0, description="Weight of its score in the summed reward.")
    device: str | None = Field(None, description="Where it runs; None: model.device.")
    micro_batch_size: int = Field(32, gt=0, description="Rows per forward of the reward model.")
    normalize: bool = Field(
        False,
        description="Subtract the mean and divide by the std of its scores on its training pairs (saved in its "
                    "config.json as reward_mean / reward_std by `reinforge reward-model`).",
    )
    clip: float | None = Field(None, gt=0, description="Clip the (normalized) score to [-clip, clip]; None: off.")


class TeacherConfig(Section):
    """On-policy distillation (Thinking Machines 2025; Qwen3, arXiv 2505.09388; GKD, arXiv 2306.13649): a
    teacher scores every token the policy sampled, and each token's advantage gains -weight * k_t with
    k_t = log pi_student(y_t) - log pi_teacher(y_t) (reinforge/rewards/teacher.py)."""

    path: str = Field(description="The teacher: a local causal-LM folder with the policy's tokenizer (one vocabulary).")
    weight: float = Field(1.0, description="The coefficient of the per-token reverse KL in the advantage.")
    device: str | None = Field(None, description="Where the teacher runs; None: model.device.")
    micro_batch_size: int = Field(64, gt=0, description="Rows per forward of the teacher.")
    temperature: float | None = Field(
        None, gt=0, description="Temperature of the teacher's log-probs; None: rollout.temperature (the sampler's)."
    )


class ProcessRewardConfig(Section):
    """A process reward model as a reward source: step scores of each completion, aggregated into a
    sequence reward or placed on the step ends as token advantages (docs/process-rewards.md)."""

    path: str = Field(description="The PRM's folder (AutoModelForTokenClassification, num_labels=1), as "
                                  "reinforge.rewards.process_model.save_process_reward_model writes it.")
    marker: str | None = Field(
        None,
        description="What splits a completion into steps: a whitespace marker ('\\n', '\\n\\n') ends a step, any "
                    "other ('Step') starts one; None: the marker the PRM was trained with (its step_marker).",
    )
    aggregate: Literal["min", "mean", "last", "product", "token"] = Field(
        "min",
        description="min, mean, last or product: the step scores as one reward per completion; token: each step's "
                    "score normalised within its group and summed onto the tokens up to its end (DeepSeekMath "
                    "process supervision), added to the advantage.",
    )
    weight: float = Field(1.0, description="Weight of its reward (or token advantages) next to the reward functions'.")
    device: str | None = Field(None, description="Where it runs; None: model.device.")
    micro_batch_size: int = Field(32, gt=0, description="Rows per forward of the PRM.")


class RewardConfig(Section):
    functions: list[RewardFunctionConfig] = Field(
        default_factory=lambda: [RewardFunctionConfig(name="verifier")],
        description="Reward functions, summed with their weights; a sample on which any raises or returns None gets no "
                    "gradient. A bare name is {name: NAME} with weight 1: [file.py:f, format]. Empty ([]) only "
                    "with a reward source (reward.model, ...), which is then the whole reward.",
    )
    model: RewardModelConfig | None = Field(
        None, description="A learned reward model whose score is added to the reward; None: none."
    )
    teacher: TeacherConfig | None = Field(
        None, description="On-policy distillation: a teacher's per-token reverse KL in the advantage; None: none."
    )
    process: ProcessRewardConfig | None = Field(None, description="A process reward model's step scores; None: none.")
    code: CodeSandboxConfig = Field(default_factory=CodeSandboxConfig,
                                    description="The sandbox that runs candidate programs.")
    judge: JudgeConfig | None = Field(
        None, description="A generative judge (an LM that grades each completion) whose score is added to the reward."
    )
    overlong: OverlongConfig | None = Field(
        None,
        description=(
            "DAPO overlong shaping added to the reward (0 up to L_max - L_cache, linear to -1 at L_max, -1 beyond); "
            "None: off."
        ),
    )
    max_error_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description=(
            "Largest fraction of a batch's samples on which reward functions may raise; above it the run stops with "
            "the first traceback."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _names_alone(cls, data: Any) -> Any:
        # `reward.functions=[a.py:f, format]` (or one name) is the shorthand people type first: each a {name: ...}.
        if isinstance(data, dict):
            functions = data.get("functions")
            if isinstance(functions, str):
                functions = [functions]
            if isinstance(functions, list):
                data = {**data, "functions": [{"name": f} if isinstance(f, str) else f for f in functions]}
        return data
    # That each function resolves and that something scores is checked where the Config is assembled
    # (config.py, Config._check_reward): resolving a function needs reinforge.rewards, above these sections.


class RayConfig(Section):
    """backend=ray: where the rollout workers of train.mode=async run."""

    address: str | None = Field(
        None,
        description="None: start a Ray instance on this machine; 'auto' or 'ray://HOST:PORT': join an existing cluster "
                    "(ray.init(address=...)).",
    )
    num_workers: int = Field(2, gt=0, description="Rollout worker actors; the groups of a step are spread over them.")
    num_cpus_per_worker: float = Field(1.0, gt=0, description="CPUs each rollout worker reserves.")
    num_gpus_per_worker: float = Field(
        0.0, ge=0, description="GPUs each rollout worker reserves (placed by a placement group); 0: CPU workers."
    )
    max_restarts: int = Field(
        3, ge=0, description="Times a rollout worker that dies is restarted; its requests in flight are sent again."
    )
    learner_ranks: int = Field(
        1,
        gt=0,
        description=(
            "train.mode=sync: data-parallel FSDP2 learner ranks that Ray launches as actors (one bundle of "
            "num_cpus/num_gpus_per_worker each), as torchrun would; each runs the job under torch.distributed and "
            "rank 0 writes the run."
        ),
    )
