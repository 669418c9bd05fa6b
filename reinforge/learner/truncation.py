"""The learner's log-probs under the sampler's truncation (top-k / top-p / min-p), so that importance
ratios compare the same distribution (`train.truncated_logprobs`, on by default).

The problem. With top-k, top-p or min-p the engine draws y from the truncated, renormalised
distribution over a kept set K (`rollout.sampling.filter_logits`, after temperature):

    mu(y) = p(y) / Z_K  for y in K (0 elsewhere),   p = softmax(z / T),   Z_K = sum_{k in K} p(k) <= 1,

and records log mu(y) (the TIS / MIS corrections need the log-prob of the distribution actually
sampled). A learner that scores y under the full softmax gets log p(y), so at equal weights

    exp(learner - sampler) = p(y) / mu(y) = Z_K  (< 1, not 1)

for every token: PPO's ratio starts off-centre (a token with Z_K < 1 - eps is clipped from its first
step), TIS / MIS weights and mismatch_kl report a "mismatch" that is the truncation, not numerics
(the bias raised in TRL issue #6789 and vLLM's logprobs RFC).

Which fix is right. The policy being trained and deployed is the truncated one, pi^K_theta(y) =
p_theta(y) [y in K_theta] / Z_K(theta); it is what generates the data. The on-policy ratio must be
pi^K_theta(y) / mu(y), which is 1 at theta = theta_sampler. Three ways to get there:

1. Renormalise over K computed from the learner's own temperature-scaled logits (this module):
   log pi^K = z_y / T - logsumexp_{k in K(z)} z_k / T. At theta = theta_sampler the learner's
   logits equal the sampler's up to float rounding, so K is the sampler's set (except for a token
   tied with the boundary to ~1e-6) and the ratio is 1 to rounding. After an update K follows theta,
   so the ratio is that of the truncated policies, pi^K_theta / pi^K_old, which is what PPO's
   trust region should bound. Nothing extra crosses the sampler-learner boundary.
2. Renormalise over the sampler's recorded set: exact at any theta for the same K, but it must ship
   K per token (up to the vocabulary for top-p / min-p), and after an update it scores the new
   policy on a set the new policy would not use.
3. Keep full log-probs and divide by Z_K in the objective: the same number as (1), with Z_K computed
   anyway, so no cheaper.

(1) is implemented. Its gradient: K is a piecewise-constant function of theta (it changes only where
two logits cross the boundary, a measure-zero set), so almost everywhere

    d log pi^K(y) / d z_k = ([k = y] - pi^K(k) [k in K]) / T,

i.e. the full-softmax gradient [k = y] - p(k) plus d(-log Z_K)/dz_k = (p(k) - pi^K(k) [k in K]) / T:
the score function of the truncated policy, which is the policy gradient of the truncated policy
(the REINFORCE identity holds for pi^K as for any distribution). Tokens outside K get no gradient.
The learner computes log p(y) - log Z_K (`kept_log_mass`), so a sampled token that has left the
learner's K after an update (only off-policy: a later mini-batch or epoch) scores p(y) / Z_K rather
than 0: its ratio stays finite, where log 0 would zero it and make its gradient NaN-prone, and PPO's
clip bounds it as it bounds any token. On-policy (the ratio at the sampler's weights) y is always in K.

The entropy the learner reports (and an entropy bonus) stays that of the full distribution, and the
reference's log-probs (the KL penalty) stay full too: a reference truncated by its own logits could
give log 0 to a token the policy samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reinforge.rollout.sampling import filter_logits


@dataclass(frozen=True)
class Truncation:
    """Which tokens the sampler keeps, as `SamplingParams` says (`rollout.top_k`, `top_p`, `min_p`)."""

    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1.0: off
    min_p: float = 0.0        # 0.0: off

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def of(cls, top_k: int, top_p: float, min_p: float) -> Truncation | None:
        """The truncation of these settings; None when they keep every token."""
        truncation = cls(top_k, top_p, min_p)
        return truncation if truncation.active else None

    def kept(self, scores: torch.Tensor) -> torch.Tensor:
        """[C, V] bool: the tokens the sampler keeps given temperature-scaled logits `scores` [C, V]
        (the engine's own filter, `rollout.sampling.filter_logits`, so the two sets are one rule; the fused
        CPU sampler finds the same top-p set by a radix select but keeps every token tied exactly at its edge,
        where the sort here keeps those it puts first: a tied token left out here scores p(y) / Z_K, as
        `kept_log_mass` scores any sampled token outside K)."""
        return torch.isfinite(filter_logits(scores, self.top_k, self.top_p, self.min_p))


def kept_log_mass(scores: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """log Z_K = logsumexp_{k in K} s_k - logsumexp_k s_k of temperature-scaled logits `scores` [..., V],
    differentiable (autograd: d/ds_k = pi^K(k) [k in K] - p(k)); [...]. The kept set is detached."""
    flat = scores.reshape(-1, scores.shape[-1])
    kept = truncation.kept(flat.detach()).view(scores.shape)
    return scores.masked_fill(~kept, float("-inf")).logsumexp(dim=-1) - scores.logsumexp(dim=-1)
