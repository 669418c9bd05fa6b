"""Mixture-of-Experts decoders: which architectures reinforge runs, their routers and expert MLPs as
pure functions of tensors, and the tiny random-init MoE model that `model.moe` builds.

Three transformers architectures, one router (transformers 5.x `*TopKRouter.forward`):

    p = softmax(h W_r^T)                         over all X experts, in fp32
    experts = top-k(p)                           the k largest, in descending order
    gates = p[experts] / sum p[experts]          if the architecture renormalises (norm_topk_prob)
    y = sum_j gates_j * E_{experts_j}(h)        E_x(h) = down_x (SiLU(gate_x h) * up_x h)

- Mixtral (arXiv 2401.04088 eq. 2: softmax over the top-k logits, which is the renormalised
  top-k of the full softmax): always renormalises;
- Qwen2-MoE: renormalises if `norm_topk_prob`, and adds a shared expert scaled by a sigmoid gate,
  y += sigmoid(h w_s) * E_shared(h);
- Qwen3-MoE: renormalises if `norm_topk_prob`, no shared expert.

`route` takes an optional `replay` [M, k] of expert ids (routing replay, arXiv 2507.18071 sec. 4
on GSPO for MoE; "R3" in slime): those experts replace the top-k selection, and the gates are the
router's own probabilities of the replayed experts, renormalised as the architecture does. The
selection is discrete (it never had a gradient); the gates keep theirs, so the router still learns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from reinforge.models.model_dir import MOE_MODEL_TYPES

__all__ = ["MOE_MODEL_TYPES", "MoEWeights", "Routing", "moe_mlp", "route", "router_normalizes"]


@dataclass
class MoEWeights:
    """One MoE layer's weights, as the native decoder reads them (live parameters: no copies)."""

    router: torch.Tensor                # [X, E]
    gate_up: torch.Tensor               # [X, 2 I, E]: each expert's gate and up projections, stacked
    down: torch.Tensor                  # [X, E, I]
    top_k: int
    normalize: bool                     # renormalise the top-k probabilities to sum to 1
    shared_gate_up: torch.Tensor | None = None   # [2 S, E] Qwen2-MoE's shared expert
    shared_down: torch.Tensor | None = None      # [E, S]
    shared_gate: torch.Tensor | None = None      # [1, E] its sigmoid gate

    @classmethod
    def of(cls, mlp: torch.nn.Module) -> MoEWeights | None:
        """The weights of a transformers sparse MoE block (`gate` router, `experts`); None for a dense MLP."""
        router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
        if not isinstance(router, torch.nn.Module) or not hasattr(router, "top_k") or experts is None:
            return None
        shared = getattr(mlp, "shared_expert", None)
        return cls(
            router=router.weight, gate_up=experts.gate_up_proj, down=experts.down_proj, top_k=router.top_k,
            normalize=router_normalizes(router),
            shared_gate_up=None if shared is None else torch.cat([shared.gate_proj.weight, shared.up_proj.weight]),
            shared_down=None if shared is None else shared.down_proj.weight,
            shared_gate=None if shared is None else mlp.shared_expert_gate.weight,
        )


@dataclass(frozen=True)
class Routing:
    """Which experts each token went to, and with what weight."""

    experts: torch.Tensor      # [M, k] long
    gates: torch.Tensor        # [M, k] the weight of each expert's output
    own: torch.Tensor          # [M, k] long: the router's own top-k (equal to `experts` without replay)


def router_normalizes(router: torch.nn.Module) -> bool:
    """Whether a transformers router renormalises its top-k probabilities (Mixtral's always does)."""
    return bool(getattr(router, "norm_topk_prob", True))


def route(logits: torch.Tensor, top_k: int, normalize: bool, replay: torch.Tensor | None = None) -> Routing:
    """The router's choice for logits [M, X] (see the module docstring). `replay` [M, k] long:
    recorded experts that replace the top-k on the rows where replay[:, 0] >= 0 (-1: not recorded,
    the router chooses). Gates in fp32, as transformers computes them."""
    probs = torch.softmax(logits.float(), dim=-1)                  # [M, X]
    _, own = torch.topk(probs, top_k, dim=-1)                       # [M, k]
    experts = own if replay is None else torch.where(replay[:, :1] >= 0, replay, own)
    gates = probs.gather(1, experts)
    if normalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return Routing(experts=experts, gates=gates, own=own)


def moe_mlp(h: torch.Tensor, w: MoEWeights, replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer on tokens h [M, E]: (output [M, E], the experts each token went to [M, k]).
    Each expert runs once on the tokens routed to it (as transformers' `*Experts.forward`)."""
    routing = route(F.linear(h, w.router), w.top_k, w.normalize, replay)
    out = torch.zeros_like(h)
    flat = routing.experts.reshape(-1)                               # [M k]
    for x in flat.unique().tolist():
        token, slot = (routing.experts == x).nonzero(as_tuple=True)
        gate, up = F.linear(h[token], w.gate_up[x]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w.down[x]) * routing.gates[token, slot, None]
        out = out.index_add(0, token, y.to(h.dtype))
    if w.shared_gate_up is not None:
        gate, up = F.linear(h, w.shared_gate_up).chunk(2, dim=-1)
        out = out + torch.sigmoid(F.linear(h, w.shared_gate)) * F.linear(F.silu(gate) * up, w.shared_down)
    return out, routing.experts
