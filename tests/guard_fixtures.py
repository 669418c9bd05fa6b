"""A policy loss that is NaN everywhere: what a diverged run looks like to the guards (test_resume.py)."""

from __future__ import annotations

from reinforge.objectives.policy import PolicyTerms, reinforce


def nan_loss(*, logprobs, old_logprobs, advantages, mask, sampler_logprobs=None) -> PolicyTerms:
    terms = reinforce(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    return PolicyTerms(loss=terms.loss * float("nan"), metrics=terms.metrics)
