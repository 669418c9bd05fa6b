"""The Bradley-Terry reward model (reinforge/rewards/reward_model.py): its loss by hand, training on
verifier-labelled arithmetic pairs, and the saved folder as a plain Hugging Face model."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

from reinforge.config import build_config
from reinforge.loops.dpo import PreferencePair
from reinforge.models import build_tiny_qwen2
from reinforge.models.tokenizer import load_tokenizer
from reinforge.rewards.reward_model import (
    bradley_terry_loss,
    build_reward_model,
    pair_accuracy,
    save_reward_model,
    score,
    train_reward_model,
)
from reinforge.tasks.arithmetic import ArithmeticTask

SMALL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64"]


def tiny_reward_model(layers: int = 1, seed: int = 0):
    cfg = build_config(SMALL + [f"model.num_layers={layers}"])
    return build_reward_model(build_tiny_qwen2(cfg.model, seed=seed), seed=seed)


def test_bradley_terry_loss_by_hand():
    # margins z = r_chosen - r_rejected = [2, -1, 0]
    chosen = torch.tensor([3.0, 0.0, 1.5], requires_grad=True)
    rejected = torch.tensor([1.0, 1.0, 1.5])
    out = bradley_terry_loss(chosen, rejected)
    # -log sigmoid(z) = log(1 + e^-z): log(1 + e^-2) = 0.126928, log(1 + e) = 1.313262, log 2 = 0.693147
    expected = [math.log1p(math.exp(-2.0)), math.log1p(math.exp(1.0)), math.log(2.0)]
    assert out.losses.tolist() == pytest.approx(expected, abs=1e-6)
    assert out.loss.item() == pytest.approx(sum(expected) / 3, abs=1e-6)      # 0.711112
    assert out.accuracy == pytest.approx(1 / 3)                                # a tie (z = 0) is wrong
    assert out.margin_mean == pytest.approx(1 / 3)                             # (2 - 1 + 0) / 3
    # d loss / d r_chosen_p = -(1 - sigmoid(z_p)) / P = -sigmoid(-z_p) / 3:
    # z = 2: -0.119203 / 3, z = -1: -0.731059 / 3, z = 0: -0.5 / 3
    out.loss.backward()
    by_hand = [-(1 - 1 / (1 + math.exp(-z))) / 3 for z in (2.0, -1.0, 0.0)]
    assert chosen.grad.tolist() == pytest.approx(by_hand, abs=1e-6)


def test_bradley_terry_loss_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[P\]"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))


def test_reward_model_starts_from_the_policy_backbone_with_a_zero_head():
    cfg = build_config(SMALL)
    policy = build_tiny_qwen2(cfg.model, seed=0)
    rm = build_reward_model(policy)
    assert type(rm.model).__name__ == "Qwen2ForSequenceClassification"
    assert rm.model.config.num_labels == 1
    assert rm.model.config.pad_token_id == rm.tokenizer.pad_token_id != rm.tokenizer.eos_token_id
    lm_weights = policy.model.model.state_dict()
    for name, value in rm.model.model.state_dict().items():
        assert torch.equal(value, lm_weights[name]), name
    # A zero head: every reward is 0, so the first Bradley-Terry loss is log 2.
    assert score(rm.model, rm.tokenizer, ["1+2=", "11+22="], ["3", "33"]).tolist() == [0.0, 0.0]


def test_right_padding_does_not_change_a_score():
    rm = tiny_reward_model()
    torch.nn.init.normal_(rm.model.score.weight)
    alone = score(rm.model, rm.tokenizer, ["1+2="], ["3"])
    padded = score(rm.model, rm.tokenizer, ["1+2=", "111+222="], ["3", "333"])   # row 0 padded by 6
    assert padded[0].item() == pytest.approx(alone[0].item(), abs=1e-5)


def arithmetic_pairs(task: ArithmeticTask, examples, reps: int, seed: int) -> list[PreferencePair]:
    """`reps` pairs per problem: chosen its right answer, rejected a near miss (one digit changed, or off by 1..10)."""
    rng = random.Random(seed)
    return [PreferencePair(e.prompt, task.teacher_completion(e, rng), task.corrupt_completion(e, rng))
            for e in examples for _ in range(reps)]


def test_reward_model_learns_to_prefer_right_arithmetic_answers():
    # The simpler signal the brief allows: 1-digit addition ("3+4=" -> "07", zero-padded), all 100
    # problems. A 2-layer, width-32 model does not learn to verify unseen problems within seconds (2-digit
    # addition, or 1-digit with held-out problems, stayed near 0.55-0.65), so the held-out pairs here are of
    # the same problems with near misses the model never saw as rejected: it must have learned which answer
    # is right for each problem, not which wrong strings it was shown. ~8 s on one CPU thread.
    task = ArithmeticTask(seed=0, digits=1)
    problems = task.train_split(80) + task.eval_split(20)
    assert len({e.prompt for e in problems}) == 100
    train = arithmetic_pairs(task, problems, reps=10, seed=0)
    seen = {(p.prompt, p.rejected) for p in train}
    held_out = [p for p in arithmetic_pairs(task, problems, reps=1, seed=1) if (p.prompt, p.rejected) not in seen]
    assert len(held_out) == 63

    rm = tiny_reward_model(layers=2)
    before = pair_accuracy(rm.model, rm.tokenizer, held_out)
    result = train_reward_model(rm.model, rm.tokenizer, train, steps=1500, batch_size=32, lr=1e-3, seed=0)
    after = pair_accuracy(rm.model, rm.tokenizer, held_out)

    assert before == 0.0                                      # a zero head ties every pair, and a tie is wrong
    assert result.first_loss == pytest.approx(math.log(2), abs=1e-6)
    assert result.final_loss < 0.2                            # measured 0.074
    assert result.train_accuracy >= 0.95                      # measured 0.991
    assert after >= 0.9                                       # measured 0.968 (61 of 63)


def test_saved_reward_model_loads_with_transformers_and_gives_the_same_scores(tmp_path):
    rm = tiny_reward_model()
    pairs = [PreferencePair("1+2=", "03", "04"), PreferencePair("5+5=", "10", "11")]
    train_reward_model(rm.model, rm.tokenizer, pairs, steps=5, batch_size=2, lr=1e-2, seed=0)
    save_reward_model(rm.model, rm.tokenizer, tmp_path / "rm")

    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert type(loaded).__name__ == "Qwen2ForSequenceClassification"
    assert loaded.config.num_labels == 1 and loaded.config.pad_token_id == rm.tokenizer.pad_token_id
    tokenizer = load_tokenizer(tmp_path / "rm")
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and tokenizer.get_vocab() == rm.tokenizer.get_vocab()
    text = "12+34=0046"
    assert tokenizer(text)["input_ids"] == rm.tokenizer(text)["input_ids"] == [rm.tokenizer.convert_tokens_to_ids(c)
                                                                              for c in text]

    prompts, completions = ["1+2=", "5+5=", "123+4="], ["03", "10", "0127"]
    with torch.no_grad():
        original = score(rm.model, rm.tokenizer, prompts, completions)
        reloaded = score(loaded, tokenizer, prompts, completions)
    assert original.abs().max() > 0                           # trained: the head is no longer zero
    assert torch.allclose(reloaded, original, atol=1e-5)
