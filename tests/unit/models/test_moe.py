"""Mixture-of-Experts decoders: the router's numbers, the native engine against transformers' forward on
Qwen2-MoE, Mixtral and Qwen3-MoE, the routing record, and routing replay in the learner."""

from __future__ import annotations

import math

import pytest
import torch

from reinforge.config import build_config
from reinforge.errors import ConfigError
from reinforge.learner.forward import ForwardPlan, token_stats
from reinforge.learner.reference import Reference
from reinforge.learner.routing import moe_routers
from reinforge.learner.sequences import build_sequences
from reinforge.models import build_tiny_moe
from reinforge.models.decoder import DecoderWeights, decoder_shape, run_pass
from reinforge.models.moe import route
from reinforge.models.positions import pass_geometry, rotary_factors
from reinforge.rollout.base import SamplingParams
from reinforge.rollout.native import NativeEngine
from reinforge.settings import ModelConfig

ARCHS = ["qwen2_moe", "mixtral", "qwen3_moe"]
PROMPTS = ["12+34=", "7+8=", "55+1="]


def tiny(arch: str, seed: int = 0):
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                      moe={"experts": 4, "top_k": 2, "expert_size": 64, "architecture": arch})
    return build_tiny_moe(cfg, seed)


def sample(policy, seed: int = 0):
    rollout = NativeEngine(policy).generate(PROMPTS, 4, SamplingParams(max_new_tokens=10, temperature=1.0),
                                            generator=torch.Generator().manual_seed(seed))
    seq = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask,
                          policy.tokenizer.pad_token_id, group_ids=rollout.group_ids, routes=rollout.routes)
    return rollout, seq


def test_route_hand_numbers() -> None:
    # logits log(1, 2, 3): p = (1, 2, 3) / 6; top-2 = experts 2, 1 with p 1/2, 1/3; renormalised 3/5, 2/5.
    logits = torch.tensor([[0.0, math.log(2), math.log(3)]])
    r = route(logits, 2, normalize=True)
    assert r.experts.tolist() == [[2, 1]]
    assert r.gates[0].tolist() == pytest.approx([0.6, 0.4])
    assert route(logits, 2, normalize=False).gates[0].tolist() == pytest.approx([0.5, 1 / 3])
    # Replay experts (0, 2): gates 1/6, 1/2 of p, renormalised 1/4, 3/4; the router's own choice is kept aside.
    r = route(logits, 2, normalize=True, replay=torch.tensor([[0, 2]]))
    assert r.experts.tolist() == [[0, 2]] and r.own.tolist() == [[2, 1]]
    assert r.gates[0].tolist() == pytest.approx([0.25, 0.75])
    # -1: not recorded, the router chooses.
    assert route(logits, 2, True, replay=torch.tensor([[-1, -1]])).experts.tolist() == [[2, 1]]


def test_replayed_gates_have_the_router_gradient() -> None:
    # g_0 = p_0 / (p_0 + p_2) = 1 / (1 + e^(z_2 - z_0)): d g_0 / d z_0 = g_0 (1 - g_0) = 3/16 at g_0 = 1/4.
    logits = torch.tensor([[0.0, math.log(2), math.log(3)]], requires_grad=True)
    route(logits, 2, True, replay=torch.tensor([[0, 2]])).gates[0, 0].backward()
    assert logits.grad[0].tolist() == pytest.approx([3 / 16, 0.0, -3 / 16])


@pytest.mark.parametrize("arch", ARCHS)
def test_native_logits_equal_transformers(arch: str) -> None:
    policy = tiny(arch)
    model = policy.model
    ids = torch.tensor([policy.tokenizer(p + "3")["input_ids"][:7] for p in ["12+34=", "55+10="]])
    with torch.no_grad():
        reference = model(input_ids=ids).logits                                # [B, S, V]
        shape, w = decoder_shape(model), DecoderWeights.of(model)
        freqs = rotary_factors(model, shape.head_dim, ids.shape[1])
        hidden, _, _ = run_pass(shape, w, ids, pass_geometry(freqs, ids.shape[1], torch.zeros(2, dtype=torch.long)),
                                freqs)
        native = hidden.float() @ w.head.t()
    assert (native - reference).abs().max() < 1e-4
    # Decoding with the KV cache: the sampler's log-probs are the learner's (the HF forward's), routing equal.
    rollout, seq = sample(policy)
    stats = token_stats(model, seq, 1.0, ForwardPlan())
    assert ((stats.logprobs.detach() - rollout.sampler_logprobs) * seq.completion_mask).abs().max() < 1e-4
    assert stats.metrics == {"moe/routing_mismatch": 0.0}


def test_routes_record_every_token_but_the_last() -> None:
    policy = tiny("qwen2_moe")
    rollout, seq = sample(policy)
    moe_layers, top_k = 2, 2
    assert rollout.routes.shape[2:] == (moe_layers, top_k)
    for r in range(rollout.num_rows):
        n = len(rollout.prompt_ids[r]) + int(rollout.completion_mask[r].sum())
        recorded = (seq.routes[r, :, 0, 0] >= 0).nonzero().squeeze(1).tolist()
        assert recorded == list(range(n - 1))      # the last token is never read by the sampler
        assert bool((seq.routes[r, : n - 1] < 4).all())


def _near_ties(policy, eps: float) -> None:
    """Every router row v + eps * noise: all experts nearly tied, so a 1e-7 numeric difference between two
    forwards flips the choice; experts scaled up so that a flip moves the log-probs visibly."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(policy.model):
            e = router.weight.shape[1]
            router.weight.copy_(torch.randn(1, e, generator=g) + eps * torch.randn(router.weight.shape, generator=g))
        for m in policy.model.modules():
            if hasattr(m, "gate_up_proj"):
                m.gate_up_proj.mul_(5)


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_makes_learner_logprobs_the_samplers(arch: str) -> None:
    """Near-tied routers: the engine (KV-cache decode, its own op order) and transformers' forward pick
    different experts for some tokens, so without replay their log-probs differ by > 1e-2; replaying the
    engine's record, they agree within 1e-5."""
    policy = tiny(arch)
    _near_ties(policy, 1e-6)
    rollout, seq = sample(policy)
    mask = seq.completion_mask
    own = token_stats(policy.model, seq, 1.0, ForwardPlan(routing_replay=False))
    replayed = token_stats(policy.model, seq, 1.0, ForwardPlan(routing_replay=True))
    assert own.metrics["moe/routing_mismatch"] > 0.02
    assert ((own.logprobs.detach() - rollout.sampler_logprobs) * mask).abs().max() > 1e-2
    assert ((replayed.logprobs.detach() - rollout.sampler_logprobs) * mask).abs().max() < 1e-5
    # The router still learns under replay: its gates carry the gradient.
    replayed.logprobs.sum().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in moe_routers(policy.model))


def test_the_reference_routes_by_its_own_router_under_replay() -> None:
    """The KL penalty is to the reference's own distribution: its forward does not take the policy's
    sampled experts even when the policy's does (ForwardPlan.for_reference)."""
    policy = tiny("qwen2_moe")
    _near_ties(policy, 1e-6)
    rollout, seq = sample(policy)
    reference = Reference.of(policy.model)
    plan = ForwardPlan(routing_replay=True)
    own = token_stats(policy.model, seq, 1.0, ForwardPlan(routing_replay=False)).logprobs.detach()
    torch.testing.assert_close(reference.logprobs(seq, 1.0, plan), own, atol=1e-6, rtol=0)
    assert ((own - rollout.sampler_logprobs) * seq.completion_mask).abs().max() > 1e-2   # replay would differ


def test_config_builtin_moe() -> None:
    cfg = build_config(["model.moe.experts=8", "train.routing_replay=true"])
    assert cfg.model.moe.experts == 8 and cfg.model.moe.architecture == "qwen2_moe"
    assert cfg.train.shared_prefix is False          # the learner's own forward, where routing is replayed
    with pytest.raises(ConfigError, match="model.moe.experts"):
        build_config(["train.routing_replay=true"])
    with pytest.raises(ConfigError, match="rollout.engine=native"):
        build_config(["model.moe.experts=8", "train.routing_replay=true", "rollout.engine=hf"])
    with pytest.raises(ConfigError, match="train.shared_prefix=false"):
        build_config(["model.moe.experts=8", "train.shared_prefix=true"])
