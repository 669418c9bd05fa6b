"""The generative judge's section (`reward.judge`): a causal LM prompted to grade a completion, whose
parsed score is a reward source (reinforge.rewards.judge), the signal of dpo.pairs=self_judged, and
the format that sft.judge_fraction teaches a model to judge in."""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import Field, model_validator

from reinforge.errors import ConfigError
from reinforge.settings.base import Section

# The built-in tasks' judge prompt and judgement. The judge solves the problem itself, writes the graded
# answer's difference from its own digit by digit, then scores (a reference-guided judge, arXiv 2306.05685
# sec. 3.4): "judge: 123+456=0589\n" -> "0579 0010 score: 0".
DEFAULT_TEMPLATE = "judge: {prompt}{completion}\n"
DEFAULT_PATTERN = r"score: ?(-?\d+(?:\.\d+)?)"
DEFAULT_LABEL = "{reference} {diff} score: {score}"


class JudgeConfig(Section):
    """A generative judge (LLM-as-a-judge, arXiv 2306.05685; the self-rewarding judge, arXiv 2401.10020 sec. 2)."""

    path: str | None = Field(
        None,
        description="The judge: a local Hugging Face causal-LM folder, or None / 'policy': the policy being trained "
                    "judges its own samples (self-rewarding).",
    )
    template: str = Field(
        DEFAULT_TEMPLATE,
        description="The judge's prompt; {prompt} and {completion} are replaced by the task's prompt and the "
                    "completion to grade (the default suits the built-in tasks and the built-in model's alphabet).",
    )
    pattern: str = Field(
        DEFAULT_PATTERN,
        description="A regular expression with one group, searched in the judge's output: the group is the score, a "
                    "number or yes / no (1 / 0). No match: the row gets no reward (skipped, counted as unscored).",
    )
    min: float = Field(
        0.0, description="The bottom of the judge's scale: scores are normalised to [0, 1] by (s - min) / (max - min), "
                         "and a score outside [min, max] is no score (the row is skipped and counted as out_of_range), "
                         "so a completion that makes the judge write 'score: 1000000' earns nothing. The default "
                         "[0, 1] fits the built-in judgement (score 1 or 0) and yes / no judges."
    )
    max: float = Field(1.0, description="The top of the judge's scale (with min).")
    max_new_tokens: int = Field(24, gt=0, description="Length limit of the judge's output in tokens.")
    greedy: bool = Field(True, description="Greedy judgements; false: sampled at judge.temperature.")
    temperature: float = Field(1.0, gt=0, description="greedy=false: the judge's sampling temperature.")
    engine: Literal["native", "hf"] = Field(
        "native", description="What generates the judgements: reinforge's native engine (Llama-family decoders) or "
                              "transformers generate (any causal LM)."
    )
    weight: float = Field(1.0, description="Weight of the judge's score in the summed reward.")
    device: str | None = Field(None, description="Where a judge loaded from path runs; None: model.device.")
    micro_batch_size: int = Field(64, gt=0, description="Judge prompts generated at once.")
    label: str = Field(
        DEFAULT_LABEL,
        description="sft.judge_fraction: how a judge training example's correct judgement is written ({reference}: "
                    "the task's teacher answer; {diff}: the graded completion minus the reference, digit by digit "
                    "mod 10 ('0' where they agree, 'x' where a non-digit differs or one text has ended); {score}: 1 "
                    "when the verifier accepts the completion, else 0); `pattern` must read 1 and 0 back from it.",
    )

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        if "{completion}" not in self.template:
            raise ConfigError("reward.judge.template must contain {completion} (the text the judge grades)")
        try:
            groups = re.compile(self.pattern).groups
        except re.error as err:
            raise ConfigError(f"reward.judge.pattern is not a regular expression: {err}") from None
        if groups != 1:
            raise ConfigError(f"reward.judge.pattern must have exactly one group (the score), it has {groups}")
        if not (math.isfinite(self.min) and math.isfinite(self.max)):
            raise ConfigError(f"reward.judge.min and max must be finite numbers, got [{self.min}, {self.max}]")
        if not self.min < self.max:
            raise ConfigError(f"reward.judge.min ({self.min}) must be below reward.judge.max ({self.max})")
        return self
