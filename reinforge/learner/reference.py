"""The reference policy of the KL term: the policy as RL starts (fixed), or an
exponential moving average of the policy (T1, arXiv 2501.11651).

The loop asks it for log-probs before each update and tells it after each
update; which kind it is never shows in the loop.

With LoRA (a peft model) the base weights are frozen, so the reference and the
policy differ only in their adapter weights: `AdapterReference` keeps those
(or nothing) and runs the policy's own model, never a second copy of it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from reinforge.learner.forward import ForwardPlan, token_logprobs
from reinforge.learner.sequences import SequenceBatch
from reinforge.models.lora import is_peft, trainable_parameters
from reinforge.objectives import ObjectiveSpec
from reinforge.objectives.kl import ema_update_


class Reference:
    """A frozen copy of the policy; with `ema` set, it tracks the policy: ref <- ema ref + (1 - ema) theta."""

    def __init__(self, model: torch.nn.Module, ema: float | None = None):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.ema = ema

    @classmethod
    def build(cls, model: torch.nn.Module, spec: ObjectiveSpec) -> Reference | None:
        """The reference `spec` asks for, or None when its loss has no KL term (no model is copied);
        for a LoRA policy an `AdapterReference` (no model is copied either)."""
        if not spec.needs_reference:
            return None
        return cls.of(model, ema=spec.reference_ema if spec.reference == "ema" else None)

    @classmethod
    def of(cls, model: torch.nn.Module, ema: float | None = None) -> Reference:
        """A reference starting at `model` as it is now: a frozen copy, or for a LoRA policy an
        `AdapterReference` (no copy of the model)."""
        return AdapterReference(model, ema) if is_peft(model) else cls(model, ema)

    def logprobs(self, seq: SequenceBatch, temperature: float, plan: ForwardPlan) -> torch.Tensor:
        """log pi_ref of the completion tokens, [N, T], under the full distribution (learner/truncation.py)."""
        return token_logprobs(self.model, seq, temperature, plan.for_reference())

    def after_update(self, policy: torch.nn.Module) -> None:
        """Called once per RL step, after the policy update: the EMA reference moves toward the policy."""
        if self.ema is not None:
            with torch.no_grad():   # else the in-place average would join the autograd graph, step after step
                ema_update_(self.model.parameters(), policy.parameters(), self.ema)

    def state_dict(self) -> dict:
        """What a checkpoint saves of the reference."""
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)


class AdapterReference(Reference):
    """The reference of a LoRA policy: the policy's model (shared, not copied) with the reference's
    adapter weights in place of the policy's while it computes log-probs.

    `adapters` (name -> tensor, the policy's trainable parameters as RL starts) is None when those
    adapters add nothing (peft initialises B = 0, so before any LoRA training the policy is its base
    model): a fixed reference is then the base model itself, run under peft's `disable_adapter()`,
    which skips the adapter matmuls and holds no tensor at all. Otherwise (adapters trained by SFT
    before RL, or an EMA reference) it holds one copy of the adapters, swapped in and back out
    around each reference forward (exact: copies, no arithmetic).

    EMA (T1) with LoRA averages the adapter weights only: ref_A <- ema ref_A + (1 - ema) A, the
    same for B. The base weights never move, so this is the full-model EMA of `Reference`
    restricted to the parameters that change, at the memory of the adapters. (As there, the
    reference's update is (alpha / r) ref_B ref_A, not an average of the policy's B A products.)
    """

    def __init__(self, model: torch.nn.Module, ema: float | None = None):
        self.model, self.ema = model, ema
        live = trainable_parameters(model)
        fresh = all(not bool(p.any()) for name, p in live.items() if "lora_B" in name)
        self.adapters = None if fresh and ema is None else {name: p.detach().clone() for name, p in live.items()}

    def logprobs(self, seq: SequenceBatch, temperature: float, plan: ForwardPlan) -> torch.Tensor:
        with self._as_reference():
            return token_logprobs(self.model, seq, temperature, plan.for_reference())

    @contextmanager
    def _as_reference(self) -> Iterator[None]:
        """The policy's model computing as the reference: eval mode (no adapter dropout, as the
        copied reference), and the reference's adapters; the policy is restored bit for bit after."""
        was_training = self.model.training
        self.model.eval()
        try:
            if self.adapters is None:
                with self.model.disable_adapter():
                    yield
            else:
                params = dict(self.model.named_parameters())
                with torch.no_grad():
                    policy = {name: params[name].detach().clone() for name in self.adapters}
                    for name, ref in self.adapters.items():
                        params[name].copy_(ref)
                try:
                    yield
                finally:
                    with torch.no_grad():
                        for name, theta in policy.items():
                            params[name].copy_(theta)
        finally:
            self.model.train(was_training)

    def after_update(self, policy: torch.nn.Module) -> None:
        if self.ema is not None:
            live = dict(policy.named_parameters())
            with torch.no_grad():
                ema_update_(self.adapters.values(), [live[name] for name in self.adapters], self.ema)

    def state_dict(self) -> dict:
        return {"adapters": self.adapters}

    def load_state_dict(self, state: dict) -> None:
        # A checkpoint loads on the CPU; the adapters live where the model's do.
        params = dict(self.model.named_parameters())
        self.adapters = None if state["adapters"] is None else {
            name: t.to(params[name].device) for name, t in state["adapters"].items()}
