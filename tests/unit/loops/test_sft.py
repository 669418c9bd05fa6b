"""SFT: the loss is the token-mean NLL of the completion (eos included), and it goes down."""

from __future__ import annotations

import math

import pytest
import torch

from reinforge.config import build_config
from reinforge.learner import build_sequences, completion_token_stats
from reinforge.learner.forward import ForwardPlan
from reinforge.loops.sft import run_sft, tokenize_pairs
from reinforge.models import build_tiny_qwen2
from reinforge.tasks import SFTExample, build_task


def test_tokenized_pairs_end_with_eos(micro_overrides) -> None:
    policy = build_tiny_qwen2(build_config(micro_overrides).model, seed=0)
    prompts, completions = tokenize_pairs(policy, [SFTExample("05+34=", "039", True)], "auto")
    tok = policy.tokenizer
    assert tok.decode(prompts[0]) == "05+34="
    assert completions[0][-1] == tok.eos_token_id and tok.decode(completions[0][:-1]) == "039"


def test_untrained_loss_is_near_uniform_and_sft_lowers_it(micro_overrides) -> None:
    cfg = build_config([*micro_overrides, "sft.steps=80", "sft.batch_size=32", "sft.num_examples=256", "sft.lr=1e-2"])
    policy = build_tiny_qwen2(cfg.model, seed=0)
    data = build_task("arithmetic", digits=2).sft_examples(256, corrupt_fraction=0.0, seed=0)
    result = run_sft(policy, data, cfg.sft, chat_template="auto", seed=0)
    # A random init predicts about uniformly over the 77-token vocabulary: NLL ~ ln 77 = 4.34.
    assert abs(result.first_loss - math.log(len(policy.tokenizer))) < 0.3
    # Digits of 2-digit sums are far from uniform (the eos always follows the 3rd digit, the 1st is 0 or 1).
    # Measured 1.58 / 1.43 / 1.79 (seeds 0 / 1 / 2 of the model, the data and the SFT order; seed 0 runs here):
    # 2.5 leaves 0.7 to the worst seed and is 2 nats below the untrained 4.47.
    assert result.final_loss < 2.5, result


def test_sft_loss_equals_token_mean_nll(micro_overrides) -> None:
    cfg = build_config(micro_overrides)
    policy = build_tiny_qwen2(cfg.model, seed=0)
    examples = [SFTExample("05+34=", "039", True), SFTExample("99+99=", "198", True), SFTExample("1+2=", "3", True)]
    prompts, completions = tokenize_pairs(policy, examples, "auto")
    width = max(len(c) for c in completions)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width)
    for i, c in enumerate(completions):
        ids[i, : len(c)] = torch.tensor(c)
        mask[i, : len(c)] = 1
    seq = build_sequences(prompts, ids, mask, policy.tokenizer.pad_token_id)
    with torch.no_grad():
        stats = completion_token_stats(policy.model, seq)
        # By hand: run each sequence alone, unpadded, and average -log p over its 4, 4 and 2 completion tokens.
        nll = []
        for p, c in zip(prompts, completions, strict=True):
            logits = policy.model(torch.tensor([p + c])).logits[0]
            logp = torch.log_softmax(logits, dim=-1)
            nll += [-logp[len(p) - 1 + t, tok].item() for t, tok in enumerate(c)]
    expected = sum(nll) / len(nll)
    got = (-(stats.logprobs * mask).sum() / mask.sum()).item()
    assert len(nll) == 10
    assert abs(got - expected) < 1e-5


def test_the_shared_prompt_forward_trains_sft_as_the_models_own_forward(micro_overrides) -> None:
    # The pipeline runs SFT through train's ForwardPlan (the shared-prompt forward, each trace its own
    # group, with the fused CPU kernels); the model's own forward is the reference.
    cfg = build_config([*micro_overrides, "sft.steps=5", "sft.batch_size=16", "sft.num_examples=64"])
    data = build_task("countdown").sft_examples(64, corrupt_fraction=0.0, seed=0)   # prompts of many lengths
    runs = {}
    for name, plan in {"own": ForwardPlan(), "shared": ForwardPlan.from_config(cfg.train)}.items():
        policy = build_tiny_qwen2(cfg.model, seed=0)
        losses: list[float] = []
        run_sft(policy, data, cfg.sft, chat_template="auto", seed=0, forward=plan,
                on_step=lambda step, loss, losses=losses: losses.append(loss))
        runs[name] = (losses, torch.cat([p.detach().flatten() for p in policy.model.parameters()]))
    assert runs["shared"][0] == pytest.approx(runs["own"][0], abs=1e-4)
    assert (runs["shared"][1] - runs["own"][1]).abs().max() < 1e-4
    assert runs["own"][0][-1] < runs["own"][0][0]        # it trained
