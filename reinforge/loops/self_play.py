"""DPO pairs that the model makes itself: self-rewarding (dpo.pairs=self_judged) and SPIN (dpo.pairs=spin).

Both are pair sources of the DPO loop (loops/dpo.py, `PairSource`), so each iteration of either
method is one DPO stage whose reference is the model the stage starts from (the previous iterate),
and a multi-stage pipeline chains the iterations (reinforge/pipelines/self_rewarding.yaml, spin.yaml).

- Self-rewarding language models (Yuan et al., arXiv 2401.10020, sec. 2.3, "AI Feedback Training"):
  the policy samples G completions of a prompt, judges each itself with the judge prompt
  (rewards/judge.py), and the highest- and the lowest-judged completion of the prompt form a pair;
  a prompt whose judged scores all tie gives none ("we discard the pair if the scores are equal").
  Samples whose judgement cannot be read take no part. The verifier is never used for the pairs;
  its verdicts are only reported (how often the chosen and the rejected sample are right).
- Self-play fine-tuning (SPIN, Chen et al., arXiv 2401.01335, sec. 4, eq. 4.7): the SFT data's
  completion is chosen, the model's own sample for the same prompt is rejected, and the loss is
  DPO's logistic loss against the previous iterate, which is what the DPO stage's reference is.

Both depart from the papers in one way: each step's pairs come from the current policy (as
dpo.pairs=on_policy does), while the papers build an iteration's pairs once, from the model as the
iteration starts. The first step's pairs are the papers'; later ones come from a policy that has
moved a few DPO steps away from it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from reinforge.curation.batches import Groups, PromptStream, rollout_metrics
from reinforge.loops.dpo import Pairs, PairSource, pair_sequences, rollout_pairs
from reinforge.loops.loop import Timed
from reinforge.loops.sft import tokenize_pairs
from reinforge.models import Policy
from reinforge.rewards.judge import Judge
from reinforge.rollout import RolloutEngine, SamplingParams
from reinforge.tasks import SFTExample, Task

# ------------------------------------------------------------------ self-rewarding


def judged_pairs(scores: Tensor) -> list[tuple[int, int]]:
    """(chosen row, rejected row) of each prompt, for a rollout whose row r is sample r % G of prompt r // G.

    scores [P, G] float: the judge's score of each sample, NaN where the judgement gave none. Per prompt,
    among its scored samples: chosen is the highest-scored, rejected the lowest-scored (the first in
    sample order among equals); no pair when fewer than two samples are scored or all scores are equal.
    """
    group = scores.shape[1]
    pairs = []
    for p, row in enumerate(scores.tolist()):
        scored = [(s, g) for g, s in enumerate(row) if not math.isnan(s)]
        if len(scored) < 2:
            continue
        best = max(scored, key=lambda sg: (sg[0], -sg[1]))       # highest score, first sample among ties
        worst = min(scored, key=lambda sg: (sg[0], sg[1]))       # lowest score, first sample among ties
        if best[0] > worst[0]:
            pairs.append((p * group + best[1], p * group + worst[1]))
    return pairs


class SelfJudgedPairs(PairSource):
    """Pairs from the policy's samples ranked by its own judgements (dpo.pairs=self_judged)."""

    def __init__(self, pool: PromptStream, engine: RolloutEngine, judge: Judge, task: Task, sampling: SamplingParams,
                 prompts_per_step: int, group_size: int, pad_id: int):
        self.clock = Timed()
        self.pool, self.engine, self.judge, self.task, self.sampling = pool, engine, judge, task, sampling
        self.prompts, self.group, self.pad_id = prompts_per_step, group_size, pad_id

    def draw(self, version: int) -> Pairs:
        examples = self.pool.next(self.prompts)
        prompts = [e.prompt for e in examples]
        rollout = self.engine.generate(prompts, self.group, self.sampling, policy_version=version)
        judged = self.judge.judge([p for p in prompts for _ in range(self.group)], rollout.texts)
        shape = (len(examples), self.group)
        pairs = judged_pairs(judged.scores.view(shape))
        # The verifier only reports (reward_mean, the pairs' correctness): the judge alone makes the pairs.
        rewards = torch.tensor([self.task.reward(examples[r // self.group], t) for r, t in enumerate(rollout.texts)])
        correct = rewards >= 1.0
        groups = Groups(rewards=rewards.view(shape), valid=torch.ones(shape, dtype=torch.bool),
                        correct=correct.view(shape), truncated=rollout.truncated.view(shape))
        scored = ~judged.scores.isnan()
        metrics = {
            **rollout_metrics(rollout, groups),
            "dpo/pairs": float(len(pairs)),
            "judge/unscored": float(judged.unscored),
            "judge/unparsed": float(judged.unparsed),
            "judge/out_of_range": float(judged.out_of_range),
            "judge/score_mean": judged.metrics["score_mean"],
            # prompts with two or more scored samples whose scores all tie: no pair (arXiv 2401.10020, sec. 2.3)
            "judge/tied_prompts": float((scored.view(shape).sum(dim=1) >= 2).sum()) - len(pairs),
            "dpo/chosen_correct": _mean([bool(correct[c]) for c, _ in pairs]),
            "dpo/rejected_correct": _mean([bool(correct[r]) for _, r in pairs]),
        }
        return Pairs(rollout_pairs(rollout, pairs, self.pad_id) if pairs else None, metrics,
                     int(rollout.lengths.sum()))


def _mean(flags: list[bool]) -> float:
    return sum(flags) / len(flags) if flags else math.nan


# ------------------------------------------------------------------ SPIN


class SpinPairs(PairSource):
    """SFT data against the policy's own samples (dpo.pairs=spin): train.prompts_per_step SFT examples per
    step, one sample of each prompt; a sample identical to the SFT completion (a pair with no gradient,
    h_w = h_l) is left out."""

    def __init__(self, pool: PromptStream, policy: Policy, engine: RolloutEngine, sampling: SamplingParams,
                 prompts_per_step: int, chat_template: str):
        self.clock = Timed()
        self.pool, self.policy, self.engine, self.sampling = pool, policy, engine, sampling
        self.prompts, self.chat_template = prompts_per_step, chat_template

    def draw(self, version: int) -> Pairs:
        drawn: list[SFTExample] = self.pool.next(self.prompts)   # type: ignore[assignment]
        rollout = self.engine.generate([e.prompt for e in drawn], 1, self.sampling, policy_version=version)
        prompt_ids, chosen = tokenize_pairs(self.policy, drawn, self.chat_template)   # completions end with eos
        sampled = [rollout.completion_ids[r, : int(n)].tolist() for r, n in enumerate(rollout.present_lengths)]
        keep = [i for i in range(len(drawn)) if sampled[i] != chosen[i]]
        correct = [e.correct for e in drawn]
        metrics = {"dpo/pairs": float(len(keep)), "spin/identical": float(len(drawn) - len(keep)),
                   "response_length_mean": float(rollout.lengths.float().mean()),
                   "spin/chosen_correct": _mean(correct)}
        tokens = int(rollout.lengths.sum())
        if not keep:
            return Pairs(None, metrics, tokens)
        rows = [chosen[i] for i in keep] + [sampled[i] for i in keep]
        ids = torch.full((len(rows), max(len(r) for r in rows)), self.policy.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(ids.shape)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r, dtype=torch.long), 1.0
        prompts = [prompt_ids[i] for i in keep] * 2
        return Pairs(pair_sequences(prompts, ids, mask, self.policy.tokenizer.pad_token_id), metrics, tokens)


__all__ = ["SelfJudgedPairs", "SpinPairs", "judged_pairs"]
