"""Routing replay in the learner's forward, and the sampler-learner routing mismatch it removes.

An MoE model's log-prob of a token depends on which experts its router picks, a discrete top-k that
flips under tiny numeric differences (another kernel, another precision, weights one optimizer step
apart). When the sampler and the learner pick different experts for a token, its importance ratio
measures the routing noise rather than the policy change: GSPO (arXiv 2507.18071 sec. 4) names this
as what destabilises token-level ratios on MoE models, and "routing replay" (R3 in slime / NeMo-RL)
fixes it by running the learner with the experts the sampler used.

`routing(model, routes, replay)` hooks every transformers sparse-MoE router (`mlp.gate` of Qwen2-MoE,
Mixtral, Qwen3-MoE: it returns (logits, gates, experts)) for one forward:

- it always counts the tokens whose own top-k expert SET differs from the recorded one in any MoE
  layer (`moe/routing_mismatch`, over the tokens with a record);
- with `replay`, the recorded experts replace the top-k, and the gates are the learner router's own
  probabilities of those experts, renormalised as the architecture does (`models.moe.route`). The
  choice carries no gradient either way; the gates do, so the router still trains. (Replaying the
  sampler's gate VALUES too would make the router untrainable and import the sampler's numerics.)

Positions without a record (-1: padding, the completion's last token, which no sampler pass read,
rows the engine did not record) keep the learner's own choice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from reinforge.models.moe import route, router_normalizes


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers in layer order (the `gate` of each sparse MoE block); [] for a dense model."""
    return [m.gate for m in model.modules()
            if isinstance(getattr(m, "gate", None), torch.nn.Module) and hasattr(m.gate, "top_k")
            and hasattr(m, "experts")]


def is_moe(model: torch.nn.Module) -> bool:
    return bool(moe_routers(model))


@dataclass
class RoutingCount:
    """What the hooked forward saw: tokens with a record, and those whose top-k set differed in any layer."""

    recorded: int = 0
    mismatched: int = 0

    def metrics(self) -> dict[str, float]:
        if not self.recorded:
            return {}
        return {"moe/routing_mismatch": self.mismatched / self.recorded}


def mismatched_tokens(own: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """[M] bool: the tokens whose expert sets own [M, k] and recorded [M, k] differ (order ignored)."""
    return (own.sort(dim=-1).values != recorded.sort(dim=-1).values).any(dim=-1)


@contextmanager
def routing(model: torch.nn.Module, routes: torch.Tensor | None, replay: bool) -> Iterator[RoutingCount]:
    """Within the block, the forwards of `model` on an input of routes' [N, L] layout count the routing
    mismatch against `routes` [N, L, layers, k] and, with `replay`, route as recorded (module docstring).
    Without routes, or for a dense model, the block runs the model untouched (nothing counted)."""
    count = RoutingCount()
    routers = moe_routers(model)
    if routes is None or not routers:
        yield count
        return
    if routes.shape[2] != len(routers):
        raise ValueError(f"the routing record has {routes.shape[2]} MoE layers, the model {len(routers)}")
    differs = torch.zeros(routes.shape[:2], dtype=torch.bool, device=routes.device)   # [N, L]

    def hook_for(layer: int):
        def hook(module: torch.nn.Module, args, output):
            logits, gates, own = output
            recorded = routes[:, :, layer].reshape(-1, routes.shape[-1]).to(own.device)   # [N L, k]
            if recorded.shape[0] != own.shape[0]:
                raise ValueError(f"the routing record covers {recorded.shape[0]} tokens, the forward {own.shape[0]}")
            present = recorded[:, 0] >= 0
            differs.view(-1).logical_or_(present.to(differs.device)
                                         & mismatched_tokens(own, recorded).to(differs.device))
            if not replay:
                return output
            chosen = route(logits, own.shape[-1], router_normalizes(module), replay=recorded)
            return logits, chosen.gates.to(gates.dtype), chosen.experts
        return hook

    handles = [router.register_forward_hook(hook_for(i)) for i, router in enumerate(routers)]
    try:
        yield count
    finally:
        for h in handles:
            h.remove()
    present = routes[:, :, :, 0].ge(0).any(dim=2)
    count.recorded, count.mismatched = int(present.sum()), int((differs & present).sum())
