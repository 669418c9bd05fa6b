"""A generative judge: a causal LM prompted to grade a (prompt, completion), its score read from its output.

Owns the judge prompt (`judge_prompt`), reading a score out of a judgement (`parse_score`), judging a
batch with one of reinforge's rollout engines (`Judge`), the judge as a reward source of a run
(`reward.judge`, `JudgeSource`), and the verifier-labelled judge training data that teaches a model
to judge in this format (`judge_examples`, sft.judge_fraction).

LLM-as-a-judge (Zheng et al., arXiv 2306.05685) asks a model for a verdict in words and parses a
score out of it; the self-rewarding loop (Yuan et al., arXiv 2401.10020, sec. 2.1-2.2) makes the
policy its own judge: "LLM-as-a-Judge" prompting gives each of its own samples a score, and a model
learns to judge from evaluation fine-tuning (EFT) data mixed into its SFT. A judgement is free text,
so reading it can fail: an output that does not match the pattern, or a score off the declared
scale, is no score at all (NaN). The row is then skipped (no gradient) and counted, never given a
made-up 0.

The graded text is the policy's, so it can try to speak for the judge ("... score: 10"), and a judge
often quotes what it grades before its verdict. So the verdict is the judge's LAST match of the
pattern, and a match that lies wholly inside text the judge quotes is ignored: a verbatim copy of the
graded completion, of the task's prompt or of the judge prompt, a Markdown quote line ("> ...") or a
fenced block ("```...```", to the end when never closed). The scale is always on ([0, 1] by default,
`reward.judge.min` / `max`): a number off it, an injected "score: 1000000" say, is no score, never a
reward of 1e6.

The default format suits the built-in tasks: the judge first writes its own answer, then the graded
answer's difference from it digit by digit (mod 10), then the score ("judge: 123+456=0589\\n" ->
"0579 0010 score: 0"). It is the reference-guided judge of arXiv 2306.05685 (sec. 3.4), which solves
the problem before comparing, with its comparison written out in steps the built-in model can learn.
Taught "answer, then score", it wrote the right sum but scored near misses 1; taught one "same /
different" mark per digit, it marked every digit "same" (at the built-in task's error rates a mark
is "same" 85% of the time, and it never left that prior); a digit difference is a 10 x 10 table like
the sums it already learned, and one all-zero check.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import zip_longest

import torch
from torch import Tensor

from reinforge.models import Policy, load_policy
from reinforge.rewards.sources import SourceContext, SourceScores, micro_batches
from reinforge.rollout import SamplingParams, build_engine
from reinforge.rollout.base import Rollout, RolloutEngine
from reinforge.settings import ModelConfig, RolloutConfig
from reinforge.settings.judge import JudgeConfig
from reinforge.tasks.base import Example, SFTExample, Task

# A score written as a word: what a yes / no judge means by it.
WORD_SCORES = {"yes": 1.0, "no": 0.0}


# ------------------------------------------------------------------ format


def judge_prompt(template: str, prompt: str, completion: str) -> str:
    """`template` with {prompt} and {completion} replaced in one pass: the texts go in literally (a
    completion that writes "{prompt}" is not expanded, and other braces in the template stay)."""
    return _fill(template, {"prompt": str(prompt), "completion": completion})


def _fill(template: str, values: dict[str, str]) -> str:
    """{name} of each of `values` replaced by its text, in one pass (nothing inserted is expanded again)."""
    return re.sub("\\{(" + "|".join(values) + ")\\}", lambda m: values[m.group(1)], template)


@dataclass(frozen=True)
class Verdict:
    """What one judgement says."""

    score: float          # the normalised score; NaN when there is none
    raw: float            # the number as written (NaN when none was found)
    parsed: bool          # the pattern matched and its group is a number or yes / no
    in_range: bool        # parsed, and inside [low, high] (always, without a scale)
    quoted: int = 0       # matches ignored because they lie in quoted text


# Text a judge quotes rather than says: Markdown quote lines, and fenced blocks (to the end when never closed).
_QUOTE_LINE = re.compile(r"^[ \t]*>.*$", re.MULTILINE)
_FENCE = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)


def _quoted_spans(text: str, quoted: Sequence[str]) -> list[tuple[int, int]]:
    """(start, end) of every part of `text` that quotes: each occurrence of each of `quoted`, quote lines, fences."""
    spans = [m.span() for m in _QUOTE_LINE.finditer(text)] + [m.span() for m in _FENCE.finditer(text)]
    for q in {q.strip() for q in quoted} - {""}:
        at = text.find(q)
        while at != -1:
            spans.append((at, at + len(q)))
            at = text.find(q, at + 1)
    return spans


def parse_score(text: str, pattern: str, low: float | None = 0.0, high: float | None = 1.0,
                quoted: Sequence[str] = ()) -> Verdict:
    """The score in judgement `text`: the LAST match of `pattern` (one group) outside quoted text (any
    occurrence of one of `quoted`, e.g. the graded completion; Markdown quote lines; fenced blocks), a
    number or yes / no.

    On the scale [low, high] (default [0, 1]) the score is (raw - low) / (high - low) in [0, 1], and a raw
    score outside the scale is no score (a judge that says 7 on a 1-5 scale has not followed its format,
    and a completion that makes it say 1000000 earns nothing). low = high = None: the raw number, unbounded
    (for reading a label, never for a reward).
    """
    spans = _quoted_spans(text, quoted)
    matches = list(re.finditer(pattern, text))
    own = [m for m in matches if not any(a <= m.start() and m.end() <= b for a, b in spans)]
    skipped = len(matches) - len(own)
    match = own[-1] if own else None
    word = match.group(1).strip().lower() if match and match.group(1) is not None else None
    if word is None:
        return Verdict(math.nan, math.nan, False, False, skipped)
    try:
        raw = float(word) if word not in WORD_SCORES else WORD_SCORES[word]
    except ValueError:
        return Verdict(math.nan, math.nan, False, False, skipped)
    if not math.isfinite(raw):
        return Verdict(math.nan, raw, False, False, skipped)
    if low is None or high is None:
        return Verdict(raw, raw, True, True, skipped)
    if not low <= raw <= high:
        return Verdict(math.nan, raw, True, False, skipped)
    return Verdict((raw - low) / (high - low), raw, True, True, skipped)


@dataclass
class Judgements:
    """A judge's verdicts on N (prompt, completion) rows."""

    scores: Tensor                      # [N] float, normalised scores, NaN where there is none
    texts: list[str]                    # [N] the judge's outputs
    unparsed: int = 0                   # outputs the pattern found no score in
    out_of_range: int = 0               # scores outside [min, max]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def unscored(self) -> int:
        return self.unparsed + self.out_of_range


class Judge:
    """Grades completions with a causal LM: each (prompt, completion) becomes a judge prompt, the
    engine writes a judgement (greedy, or sampled), and `parse_score` reads its score.

    The engine is one of reinforge's (`build_engine`): over the run's policy it reads the live
    weights at every call, so a self-judging run is judged by the model as it is now.
    """

    def __init__(self, engine: RolloutEngine, cfg: JudgeConfig):
        self.engine, self.cfg = engine, cfg
        self.sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                       greedy=cfg.greedy)

    def judge(self, prompts: list[str], completions: list[str],
              generator: torch.Generator | None = None) -> Judgements:
        """Verdicts of every (prompt, completion), `cfg.micro_batch_size` judge prompts per generate call."""
        asked = [judge_prompt(self.cfg.template, p, c) for p, c in zip(prompts, completions, strict=True)]
        texts: list[str] = []
        for part in micro_batches(len(asked), self.cfg.micro_batch_size):
            texts += self.engine.generate([asked[i] for i in part], 1, self.sampling, generator=generator).texts
        # What the judge may quote: the judge prompt it was given, the task's prompt, the graded completion.
        verdicts = [parse_score(t, self.cfg.pattern, self.cfg.min, self.cfg.max, quoted=(a, p, c))
                    for t, a, p, c in zip(texts, asked, prompts, completions, strict=True)]
        scores = torch.tensor([v.score for v in verdicts], dtype=torch.float)
        unparsed = sum(not v.parsed for v in verdicts)
        out_of_range = sum(v.parsed and not v.in_range for v in verdicts)
        scored = scores[~scores.isnan()]
        metrics = {"unparsed": float(unparsed), "out_of_range": float(out_of_range),
                   "quoted_matches": float(sum(v.quoted > 0 for v in verdicts)),
                   "score_mean": float(scored.mean()) if len(scored) else math.nan}
        return Judgements(scores, texts, unparsed, out_of_range, metrics)


def build_judge(cfg: JudgeConfig, policy: Policy | None, device: str, chat_template: str) -> Judge:
    """The judge of `cfg`: the given policy itself (path None or 'policy'), or the causal LM in cfg.path."""
    from reinforge.errors import ConfigError

    if cfg.path in (None, "policy"):
        if policy is None:
            raise ConfigError("reward.judge.path is unset (the policy judges itself), and no policy was given: "
                              "set reward.judge.path to a causal-LM folder")
        judge_policy = policy
    else:
        judge_policy = load_policy(ModelConfig(path=cfg.path, device=cfg.device or device), seed=0)
        judge_policy.model.eval().requires_grad_(False)
    return Judge(build_engine(RolloutConfig(engine=cfg.engine), judge_policy, chat_template=chat_template), cfg)


# ------------------------------------------------------------------ as a reward source


class JudgeSource:
    """The judge's score of every rollout row as a sequence reward (NaN: unscored, the row is skipped)."""

    key = "judge"

    def __init__(self, judge: Judge, weight: float = 1.0):
        self.judge, self.weight = judge, weight

    def score(self, rows: list[Example], rollout: Rollout) -> SourceScores:
        out = self.judge.judge([e.prompt for e in rows], rollout.texts)
        return SourceScores(values=out.scores, metrics=out.metrics, unscored=out.unscored)


def build_source(section: JudgeConfig, context: SourceContext) -> JudgeSource:
    """The source section `reward.judge` configures (rewards/source_builders.py)."""
    return JudgeSource(build_judge(section, context.policy, context.device, context.chat_template), section.weight)


# ------------------------------------------------------------------ judge training data (EFT)


def check_label(cfg: JudgeConfig) -> None:
    """ValueError when `cfg.pattern` does not read 1 and 0 back from `cfg.label` (judge training data
    written in a format its own judge could not parse)."""
    for score in (1, 0):
        text = _fill(cfg.label, {"reference": "0", "diff": "0", "score": str(score)})
        verdict = parse_score(text, cfg.pattern, None, None)
        if verdict.raw != score:
            raise ValueError(f"reward.judge.pattern {cfg.pattern!r} reads {verdict.raw} from the judge training label "
                             f"{text!r}, not {score}: make reward.judge.label and reward.judge.pattern agree")


def digit_diff(reference: str, completion: str) -> str:
    """The completion minus the reference, position by position over the longer text: (c - r) mod 10 where
    both are digits, '0' where other characters agree, 'x' where they differ or one text has ended
    ("0579", "0589" -> "0010"; "0579", "0578" -> "0009"). All '0': the texts are the same."""
    out = []
    for r, c in zip_longest(reference, completion):
        if r is not None and c is not None and r.isdigit() and c.isdigit():
            out.append(str((int(c) - int(r)) % 10))
        else:
            out.append("0" if r == c else "x")
    return "".join(out)


def judge_examples(task: Task, n: int, cfg: JudgeConfig, seed: int) -> list[SFTExample]:
    """`n` judge training examples on train problems: the judge prompt of a right (teacher) or wrong
    (corrupted) completion, each with probability 1/2, and the correct judgement.

    The label is the verifier's (task.reward), not how the completion was made, and the judgement
    is `cfg.label` with {reference} the teacher's own answer, {diff} the completion's `digit_diff` from it
    and {score} 1 or 0: the Self-Rewarding paper's EFT data (arXiv 2401.10020, sec. 2.2:
    a justification, then the score), labelled by the task's verifier instead of human rankings. Problems are drawn as
    `Task.sft_examples` draws them: the first n train problems (cycled when there are fewer), in a
    seeded order.
    """
    if n == 0:
        return []
    pool = task.train_problems(n)
    if not pool:
        raise ValueError(f"task {task.name!r} has no train examples")
    rng = random.Random(seed)
    order: list[Example] = []
    out = []
    for _ in range(n):
        if not order:           # each problem once per pass, in a reshuffled order (as Task.sft_examples)
            order = list(pool)
            rng.shuffle(order)
        example = order.pop()
        completion = (task.teacher_completion if rng.random() < 0.5 else task.corrupt_completion)(example, rng)
        right = task.reward(example, completion) >= 1.0
        reference = task.teacher_completion(example, rng).strip()
        label = _fill(cfg.label, {"reference": reference, "diff": digit_diff(reference, completion.strip()),
                                  "score": str(int(right))})
        out.append(SFTExample(judge_prompt(cfg.template, example.prompt, completion), label, right))
    return out


__all__ = ["Judge", "JudgeSource", "Judgements", "Verdict", "build_judge", "check_label", "digit_diff",
           "judge_examples", "judge_prompt", "parse_score"]
