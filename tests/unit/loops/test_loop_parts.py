"""The loop's pluggable parts: the EMA reference, the KL placed in the reward, and samples
dropped by an advantage transform leaving the batch."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.learner import LearnerBatch, Reference, build_sequences
from reinforge.objectives import resolve_spec, shaped_rewards
from reinforge.objectives.kl import ema_update_

runner = CliRunner()


def test_ema_update_hand_values():
    # ref <- 0.9 ref + 0.1 theta: 0.9 * 1 + 0.1 * 3 = 1.2 and 0.9 * -2 + 0.1 * 0 = -1.8.
    ref, theta = [torch.tensor([1.0, -2.0])], [torch.tensor([3.0, 0.0])]
    ema_update_(ref, theta, 0.9)
    torch.testing.assert_close(ref[0], torch.tensor([1.2, -1.8]))
    ema_update_(ref, theta, 1.0)                             # ema 1: a fixed reference
    torch.testing.assert_close(ref[0], torch.tensor([1.2, -1.8]))
    ema_update_(ref, theta, 0.0)                             # ema 0: the current policy
    torch.testing.assert_close(ref[0], theta[0])


def test_reference_kinds():
    policy = torch.nn.Linear(2, 1, bias=False)
    assert Reference.build(policy, resolve_spec("dr_grpo")) is None        # no KL term: no copy at all
    fixed, ema = Reference.build(policy, resolve_spec("grpo")), Reference.build(policy, resolve_spec("t1"))
    start = policy.weight.detach().clone()
    with torch.no_grad():
        policy.weight.add_(1.0)
    fixed.after_update(policy)
    ema.after_update(policy)
    torch.testing.assert_close(fixed.model.weight, start)                  # frozen
    torch.testing.assert_close(ema.model.weight, start + 0.01)             # 0.99 start + 0.01 (start + 1)
    assert not ema.model.weight.requires_grad


def test_kl_in_reward_hand_value():
    # k1 = old - ref per token: row 0 tokens 0.5 and 0.25 -> sum 0.75 -> R - 0.05 * 0.75;
    # row 1 has one valid token (the masked one must not count): 1.0 -> R - 0.05.
    old = torch.tensor([[-1.0, -1.0], [-2.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.25], [-3.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    rewards = torch.tensor([1.0, 0.0])
    spec = resolve_spec("grpo", kl_estimator="k1", kl_placement="in_reward", kl_coef=0.05)
    torch.testing.assert_close(shaped_rewards(spec, rewards, old, ref, mask), torch.tensor([1 - 0.0375, -0.05]))
    # In the loss (grpo's default), the rewards are untouched.
    assert torch.equal(shaped_rewards(resolve_spec("grpo"), rewards, old, ref, mask), rewards)


def test_select_keeps_rows_and_trims_to_their_width():
    seq = build_sequences([[5, 6], [7]], torch.tensor([[1, 2, 3], [4, 0, 0]]),
                          torch.tensor([[1.0, 1, 1], [1, 0, 0]]), pad_id=0)
    logprobs = torch.tensor([[-1.0, -2, -3], [-4, 0, 0]])
    batch = LearnerBatch(sequences=seq, advantages=torch.tensor([1.0, -1.0]), old_logprobs=logprobs,
                         sampler_logprobs=logprobs, group_ids=torch.tensor([0, 0]), correct=torch.tensor([True, False]))
    kept = batch.select(torch.tensor([False, True]))
    assert kept.sequences.input_ids.tolist() == [[7, 4]]
    assert kept.old_logprobs.tolist() == [[-4.0]] and kept.advantages.tolist() == [-1.0]
    assert kept.correct.tolist() == [False]
    assert batch.select(torch.tensor([True, True])) is batch
    empty = batch.select(torch.tensor([False, False]))
    assert empty.sequences.input_ids.shape[0] == 0


def test_advantage_filter_drops_samples_in_a_run(tmp_path, micro_overrides):
    # |A| < 0.5 leaves the batch: with grpo's z-scores some samples go, so kept_frac < 1 at some step.
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, "sft.steps=1", "eval.num_prompts=2",
                                 "objective.advantage_transforms=[{name: filter_small, params: {tau: 0.5}}]",
                                 f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept = [r["kept_frac"] for r in rl if r.get("stage") == "rl"]
    assert len(kept) == 3 and min(kept) < 1.0
    assert all(0.0 <= k <= 1.0 for k in kept)


@pytest.mark.parametrize("transform", ["gaussian_noise", "ema_baseline_mix"])
def test_other_transforms_keep_every_sample(tmp_path, micro_overrides, transform):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, "sft.steps=1", "eval.num_prompts=2", "recipe=dr_grpo",
                                 f"objective.advantage_transforms=[{{name: {transform}}}]", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["kept_frac"] for r in rl if r.get("stage") == "rl"] == [1.0, 1.0, 1.0]
