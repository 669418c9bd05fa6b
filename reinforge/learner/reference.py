"""The reference policy of the KL term: a frozen copy of the policy as RL
starts, or an exponential moving average of the policy (T1, arXiv 2501.11651).

The loop asks it for log-probs before each update and tells it after each
update; which kind it is never shows in the loop.
"""

from __future__ import annotations

import copy

import torch

from reinforge.learner.forward import ForwardPlan, token_logprobs
from reinforge.learner.sequences import SequenceBatch
from reinforge.objectives import ObjectiveSpec
from reinforge.objectives.kl import ema_update_


class Reference:
    """A frozen copy of the policy; with `ema` set, it tracks the policy: ref <- ema ref + (1 - ema) theta."""

    def __init__(self, model: torch.nn.Module, ema: float | None = None):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.ema = ema

    @classmethod
    def build(cls, model: torch.nn.Module, spec: ObjectiveSpec) -> Reference | None:
        """The reference `spec` asks for, or None when its loss has no KL term (no model is copied)."""
        if not spec.needs_reference:
            return None
        return cls(model, ema=spec.reference_ema if spec.reference == "ema" else None)

    def logprobs(self, seq: SequenceBatch, temperature: float, plan: ForwardPlan) -> torch.Tensor:
        """log pi_ref of the completion tokens, [N, T]."""
        return token_logprobs(self.model, seq, temperature, plan)

    def after_update(self, policy: torch.nn.Module) -> None:
        """Called once per RL step, after the policy update: the EMA reference moves toward the policy."""
        if self.ema is not None:
            ema_update_(self.model.parameters(), policy.parameters(), self.ema)
