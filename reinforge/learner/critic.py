"""The critic of PPO-family methods (PPO, VC-PPO, VAPO): a value model V(s_t)
for every completion token, trained alongside the policy on GAE returns.

The value model is a copy of the policy's decoder body with a linear head to a
scalar, so it starts from the policy's features (PPO / InstructGPT initialise
the critic from the reward model or the policy; here there is no reward model).
The head starts at zero: V = 0 everywhere before training. With `shared` the
head reads the policy's own body instead (no copy; the value loss trains the
head only).

V(s_t) is read at the position that predicts completion token t (it has seen
the prompt and y_<t), the same alignment as the learner's log-probs.
The math (GAE, decoupled GAE, the clipped value loss) is
`reinforge.objectives.value`; this module owns the model, its optimizer and
its updates.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
from torch import nn
from transformers import PreTrainedModel

from reinforge.learner.forward import ForwardPlan
from reinforge.learner.optim import build_optimizer
from reinforge.learner.sequences import SequenceBatch
from reinforge.objectives import loss_weights
from reinforge.objectives.value import value_loss


class ValueModel(nn.Module):
    """V(s): a decoder body and a zero-initialised scalar head.

    shared=False (default): the body is a copy of the policy's, trained by the value loss.
    shared=True: a value head on the policy's own body, which the value loss does not train (its
    hidden states are detached): one body in memory, the critic is a linear read-out of the
    policy's features. (A jointly trained shared body, as in some PPO code, couples the two
    losses; here the policy's update stays the policy objective alone.)
    """

    def __init__(self, policy: PreTrainedModel, shared: bool = False):
        super().__init__()
        decoder = policy.get_decoder()
        self.shared = shared
        # A shared body sits in a list, so it is not a submodule: not in the critic's optimizer or state_dict.
        self._shared_body = [decoder] if shared else []
        self.body = None if shared else copy.deepcopy(decoder).requires_grad_(True)
        weight = next(decoder.parameters())
        self.head = nn.Linear(policy.config.hidden_size, 1, dtype=weight.dtype, device=weight.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch: SequenceBatch) -> torch.Tensor:
        """V of every completion token's state, [N, T] fp32, 0 off the loss mask (padding, environment
        tokens: GAE skips them), on the model's device."""
        body = self._shared_body[0] if self.shared else self.body
        batch = batch.to(self.head.weight.device)
        with torch.no_grad() if self.shared else contextlib.nullcontext():
            hidden = body(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state  # [N, L, H]
        n, t = batch.completion_ids.shape
        positions = (batch.starts.unsqueeze(1) - 1 + torch.arange(t, device=hidden.device).unsqueeze(0)).clamp(
            max=hidden.shape[1] - 1
        )
        picked = hidden.gather(1, positions.unsqueeze(-1).expand(n, t, hidden.shape[-1]))  # [N, T, H]
        return self.head(picked).squeeze(-1).float() * batch.completion_mask


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over valid tokens: 1 is a perfect critic, 0 no better than a constant,
    negative worse. NaN when the returns do not vary."""
    valid = mask.bool()
    r, v = returns[valid].double(), values[valid].double()
    var = r.var(unbiased=False)
    return float(1.0 - (r - v).var(unbiased=False) / var) if r.numel() > 1 and var > 0 else float("nan")


class Critic:
    """The value model with its own optimizer."""

    def __init__(self, policy: PreTrainedModel, lr: float, weight_decay: float = 0.0, shared_body: bool = False):
        self.model = ValueModel(policy, shared=shared_body)
        self.optimizer = build_optimizer(self.model, lr, weight_decay)

    @torch.no_grad()
    def values(self, batch: SequenceBatch, plan: ForwardPlan) -> torch.Tensor:
        """V of the batch's completion tokens, [N, T], computed in micro-batches; on the batch's device."""
        out = torch.zeros_like(batch.completion_mask)
        for rows in plan.micro_batches(batch):
            seq = batch.rows(rows)
            out[rows, : seq.completion_ids.shape[1]] = self.model(seq).to(out.device)
        return out

    def update(self, batch: SequenceBatch, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float | None,
               epochs: int, mini_batches: int, grad_clip: float, generator: torch.Generator,
               plan: ForwardPlan) -> dict[str, float]:
        """Fit V to `returns` [N, T] with the clipped value loss (token mean per mini-batch), like the
        policy's update: `epochs` passes of `mini_batches` optimizer steps. Returns critic metrics."""
        n = batch.completion_mask.shape[0]
        mask = batch.completion_mask
        device = self.model.head.weight.device     # the batch stays put; each micro-batch goes to the model
        losses, clipped, norms = [], [], []
        for _ in range(epochs):
            for mb in torch.tensor_split(torch.randperm(n, generator=generator), mini_batches):
                if len(mb) == 0:
                    continue
                weights = loss_weights("token_mean", mask[mb])      # [M, T]
                self.optimizer.zero_grad(set_to_none=True)
                for local in plan.micro_batches(batch, mb):
                    rows = mb[local]
                    seq = batch.rows(rows).to(device)
                    width = seq.completion_ids.shape[1]
                    terms = value_loss(
                        self.model(seq),
                        old_values[rows, :width].to(device),
                        returns[rows, :width].to(device),
                        seq.completion_mask,
                        clip=clip,
                    )
                    w = weights[local][:, :width].to(device)
                    loss = (w * terms.loss).sum()
                    loss.backward()
                    losses.append(loss.item())
                    clipped.append(float((w * terms.clip_frac).sum()))
                norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip))
                if math.isfinite(norm):       # the policy's guard: a NaN/inf step is skipped
                    self.optimizer.step()
                    norms.append(norm)
        steps = max(1, epochs * mini_batches)
        with torch.no_grad():
            after = self.values(batch, plan)
        return {
            "critic/value_loss": sum(losses) / steps,
            "critic/value_clip_frac": sum(clipped) / steps,
            "critic/grad_norm": sum(norms) / len(norms) if norms else float("nan"),
            # Of the values before this update: how much of the return's variance the critic explained
            # on data it had not been fitted to yet (the honest figure).
            "critic/explained_variance": explained_variance(old_values, returns, mask),
            "critic/explained_variance_after": explained_variance(after, returns, mask),
            "critic/value_mean": float((old_values * mask).sum() / mask.sum().clamp_min(1)),
            "critic/return_mean": float((returns * mask).sum() / mask.sum().clamp_min(1)),
        }

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
