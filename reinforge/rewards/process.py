"""Process rewards: a completion's steps, and a process reward model's step scores as a reward.

Owns step segmentation (a completion's text cut at a marker, and the token of the rollout that
completes each step), the aggregation of step scores into a sequence reward (min, mean, last,
product: `AGGREGATES`), DeepSeekMath's process-supervision advantages (each token credited with the
group-normalised rewards of the steps ending at or after it), and the PRM as a reward source
(`reward.process`, `ProcessRewardSource`). The PRM itself (training, saving) is
rewards/process_model.py; its labels (Math-Shepherd) rewards/shepherd.py.

Why: an outcome verifier gives a group whose every sample is wrong no signal at all (GRPO's
advantages are all zero). A PRM scores each step, so a wrong solution whose first steps are right
is told from one that went wrong at once, in every group (Lightman et al., arXiv 2305.20050;
Math-Shepherd, arXiv 2312.08935; DeepSeekMath, arXiv 2402.03300, section 4.1.3).
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from reinforge.objectives.advantages import grpo
from reinforge.rewards.process_model import load_process_reward_model, step_probabilities
from reinforge.rewards.sources import SourceContext, SourceScores
from reinforge.rollout.base import Rollout
from reinforge.tasks.base import Example

# ------------------------------------------------------------------ segmentation


def split_steps(text: str, marker: str) -> list[str]:
    """The steps of `text`, in order; "".join(steps) == text.

    A marker of whitespace only ("\\n", "\\n\\n") ends a step and stays at the end of the step it ends:
    "12+34=46\\n46+7=53\\n" is ["12+34=46\\n", "46+7=53\\n"]. Any other marker ("Step") starts a step:
    "Step 1: a. Step 2: b." is ["Step 1: a. ", "Step 2: b."]. A piece of whitespace only is no step of
    its own: it joins the step before it (the one after it, at the start). Empty text has no steps.
    """
    if not marker:
        raise ValueError("the step marker is empty: give one, e.g. '\\n'")
    ends_step = not marker.strip()
    cuts = {m.end() if ends_step else m.start() for m in re.finditer(re.escape(marker), text)}
    bounds = sorted({0, len(text)} | cuts)
    steps: list[str] = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        piece = text[start:end]
        if steps and (not piece.strip() or not steps[-1].strip()):
            steps[-1] += piece
        else:
            steps.append(piece)
    return steps


@dataclass(frozen=True)
class Steps:
    """The steps of one completion, located on the tokens the policy sampled."""

    texts: tuple[str, ...]       # [S] the steps in order; their concatenation is the decoded completion
    token_ends: tuple[int, ...]  # [S] strictly increasing: completion index of the token that completes each step


def completion_steps(ids: Sequence[int], tokenizer: PreTrainedTokenizerBase, marker: str) -> Steps:
    """The steps of the completion `ids` (its tokens, eos included or not) and the token that ends each.

    The text is `ids` decoded (special tokens skipped, as rollouts decode it); a step ends at the first
    token t whose prefix ids[: t + 1] decodes to text that starts with the whole step (and everything
    before it). This is exact for any tokenizer, whatever tokens the policy sampled (which need not be
    the canonical encoding of the text, so re-encoding and its offsets cannot be used): a character
    split over several byte-level tokens ends at its last byte's token, and a token that holds the end
    of one step and the start of the next ends the first. Two steps completed by the same token become
    one (a token carries one score). Found by bisection: O(S log T) decodes.
    """
    ids = list(ids)
    text = decode_ids(tokenizer, ids)
    texts: list[str] = []
    ends: list[int] = []
    done, low = 0, 0
    for step in split_steps(text, marker):
        done += len(step)
        prefix = text[:done]
        end = low + bisect_left(range(low, len(ids)), True, key=lambda t: decode_ids(tokenizer, ids[: t + 1])
                                .startswith(prefix))
        if end >= len(ids):
            raise ValueError(f"no prefix of the tokens decodes to {prefix!r}: the tokenizer's decoding is not "
                             "prefix-stable")
        if ends and end == ends[-1]:
            texts[-1] += step
        else:
            texts.append(step)
            ends.append(end)
        low = end
    return Steps(texts=tuple(texts), token_ends=tuple(ends))


def decode_ids(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The text of `ids` as steps are found in it: special tokens skipped, no clean-up of spaces (which
    would make a prefix's text differ from the start of the whole text's)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def rollout_steps(rollout: Rollout, tokenizer: PreTrainedTokenizerBase, marker: str) -> list[Steps]:
    """[N] the steps of every row of a single-turn rollout, on its completion tokens."""
    if rollout.loss_mask is not None:
        raise NotImplementedError("process rewards split single-turn completions into steps; multi-turn episodes "
                                  "(tools, environments) are not segmented: remove reward.process for this run")
    present = rollout.completion_mask > 0
    return [completion_steps(rollout.completion_ids[r][present[r]].tolist(), tokenizer, marker)
            for r in range(rollout.num_rows)]


def padded_ends(steps: Sequence[Steps]) -> tuple[Tensor, Tensor]:
    """(step_ends [N, S] long, step_mask [N, S] bool) of the rows' steps, right-padded (S at least 1)."""
    width = max([len(s.token_ends) for s in steps] + [1])
    ends = torch.zeros(len(steps), width, dtype=torch.long)
    mask = torch.zeros(len(steps), width, dtype=torch.bool)
    for r, s in enumerate(steps):
        ends[r, : len(s.token_ends)] = torch.tensor(s.token_ends, dtype=torch.long)
        mask[r, : len(s.token_ends)] = True
    return ends, mask


# ------------------------------------------------------------------ aggregation


def _none_without_steps(values: Tensor, step_mask: Tensor) -> Tensor:
    """NaN (no score: the row is skipped) where a row has no step."""
    return values.masked_fill(~step_mask.any(dim=1), math.nan)


def aggregate_min(step_scores: Tensor, step_mask: Tensor) -> Tensor:
    """[N] the weakest step: a solution is as good as its worst step (Lightman et al., arXiv 2305.20050,
    section 5; Math-Shepherd's verification uses the minimum, arXiv 2312.08935, section 3.4)."""
    return _none_without_steps(step_scores.masked_fill(~step_mask, math.inf).amin(dim=1), step_mask)


def aggregate_mean(step_scores: Tensor, step_mask: Tensor) -> Tensor:
    """[N] the mean over the row's steps."""
    mask = step_mask.to(step_scores.dtype)
    return _none_without_steps((step_scores * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1), step_mask)


def aggregate_last(step_scores: Tensor, step_mask: Tensor) -> Tensor:
    """[N] the last step's score: the PRM's judgement of the whole solution (its final answer included)."""
    last = (step_mask.sum(dim=1) - 1).clamp(min=0)
    return _none_without_steps(step_scores.gather(1, last[:, None]).squeeze(1), step_mask)


def aggregate_product(step_scores: Tensor, step_mask: Tensor) -> Tensor:
    """[N] the product of the step scores: the probability that every step is right, were the steps
    independent (Lightman et al., arXiv 2305.20050, section 5)."""
    return _none_without_steps(step_scores.masked_fill(~step_mask, 1.0).prod(dim=1), step_mask)


# aggregate name -> f(step_scores [N, S], step_mask [N, S] bool) -> [N] sequence reward (NaN: no steps)
AGGREGATES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "min": aggregate_min, "mean": aggregate_mean, "last": aggregate_last, "product": aggregate_product,
}


def process_token_advantages(step_rewards: Tensor, step_mask: Tensor, step_ends: Tensor, group_ids: Tensor,
                             width: int) -> Tensor:
    """DeepSeekMath's process supervision (arXiv 2402.03300, section 4.1.3): [N, width] token advantages.

    Every step reward r_k of every row of a group is normalised by the mean and std of all step rewards
    of that group, r~ = (r - mean(R)) / std(R) (reinforge's GRPO estimator applied to the steps as
    samples: Bessel's std, + 1e-6), and a token's advantage is the sum of the normalised rewards of the
    row's steps that end at or after it:

        A_t = sum_{k : end_k >= t} r~_k

    so a step's reward credits every token before its end, a later step's only the tokens that led to
    it. Tokens after the row's last step end (its eos) get 0, as padding does.
    step_rewards [N, S] float, step_mask [N, S] bool, step_ends [N, S] long, group_ids [N] long.
    """
    rows, cols = step_mask.nonzero(as_tuple=True)
    normalised = grpo(step_rewards[rows, cols].float(), group_ids[rows])       # [steps]
    placed = torch.zeros(step_rewards.shape[0], width)
    placed.index_put_((rows, step_ends[rows, cols]), normalised, accumulate=True)
    return placed.flip(1).cumsum(dim=1).flip(1)                                 # [N, width]


# ------------------------------------------------------------------ as a reward source


class ProcessRewardSource:
    """A saved PRM scoring rollouts: each completion split into steps at `marker` on the policy's tokens,
    each step scored by the PRM (the probability that the solution so far is on a right track), then

    - aggregate min | mean | last | product: one sequence reward per row (`values`), added to the
      verifier's with `weight`, so the group estimator sees rewards that differ within all-wrong groups;
    - aggregate token: DeepSeekMath's step-end credit (`process_token_advantages`, normalised within each
      group of `rollout.group_ids`) as `token_values`, added to each token's advantage after the
      estimator, on top of the verifier's outcome advantage.
    """

    key = "process"

    def __init__(self, path: str | Path, tokenizer: PreTrainedTokenizerBase, *, marker: str | None = None,
                 aggregate: str = "min", weight: float = 1.0, device: str = "cpu", micro_batch_size: int = 32,
                 chat_template: str = "auto"):
        from reinforge.errors import ConfigError
        from reinforge.models.factory import resolve_device

        if aggregate != "token" and aggregate not in AGGREGATES:
            raise ConfigError(f"reward.process.aggregate={aggregate!r}: choose one of "
                              f"{', '.join([*AGGREGATES, 'token'])}")
        prm = load_process_reward_model(path, resolve_device(device))
        self.model, self.prm_tokenizer, self.tokenizer = prm.model, prm.tokenizer, tokenizer
        # The marker the PRM learnt its steps by, unless the config says otherwise.
        self.marker = marker if marker is not None else getattr(prm.model.config, "step_marker", "\n")
        self.aggregate, self.weight, self.micro_batch_size = aggregate, weight, micro_batch_size
        self.chat_template = chat_template

    @torch.no_grad()
    def score(self, rows: list[Example], rollout: Rollout) -> SourceScores:
        steps = rollout_steps(rollout, self.tokenizer, self.marker)
        probs, mask = step_probabilities(self.model, self.prm_tokenizer, [e.prompt for e in rows],
                                         [s.texts for s in steps], self.chat_template, self.micro_batch_size)
        no_steps = int((~mask.any(dim=1)).sum())
        metrics = {"step_score_mean": float(probs[mask].mean()) if mask.any() else math.nan,
                   "steps_mean": float(mask.sum(dim=1).float().mean())}
        if self.aggregate == "token":
            ends, _ = padded_ends(steps)
            tokens = process_token_advantages(probs, mask, ends[:, : mask.shape[1]], rollout.group_ids,
                                              rollout.completion_ids.shape[1])
            # A row without steps has no process credit (its outcome advantage stands); it is not skipped.
            return SourceScores(values=None, token_values=tokens, metrics=metrics)
        values = AGGREGATES[self.aggregate](probs, mask)
        return SourceScores(values=values, metrics=metrics, unscored=no_steps)


def build_source(section, context: SourceContext) -> ProcessRewardSource:
    """The source section `reward.process` configures (rewards/source_builders.py)."""
    from reinforge.errors import ConfigError

    if context.policy is None:
        raise ConfigError("reward.process needs the run's policy tokenizer to find the steps on its tokens")
    return ProcessRewardSource(section.path, context.policy.tokenizer, marker=section.marker,
                               aggregate=section.aggregate, weight=section.weight,
                               device=section.device or context.device, micro_batch_size=section.micro_batch_size,
                               chat_template=context.chat_template)


__all__ = ["AGGREGATES", "ProcessRewardSource", "Steps", "aggregate_last", "aggregate_mean", "aggregate_min",
           "aggregate_product", "completion_steps", "decode_ids", "padded_ends", "process_token_advantages",
           "rollout_steps", "split_steps"]
