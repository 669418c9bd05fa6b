"""Batch curation (curation/batches.py): group filters, refill rounds, the prompt pool, masks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from reinforge.curation.batches import (
    BatchCollector,
    Groups,
    PromptStream,
    SampleNow,
    Scores,
    zero_variance,
)
from reinforge.rollout import Rollout, SamplingParams
from reinforge.rollout.base import concat_rollouts
from reinforge.settings import CurationConfig
from reinforge.tasks import Example

G = 4


class ScriptedEngine:
    """Completions whose reward the example decides: meta["rewards"] are the G rewards of its group,
    meta["truncated"] which samples ran out of tokens. Records the prompts of every call."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def generate(self, prompts, group_size, params, policy_version=0, generator=None) -> Rollout:
        self.calls.append(list(prompts))
        n = len(prompts) * group_size
        width = 2 + len(self.calls) % 2          # rounds differ in width: concat must pad
        return Rollout(
            prompt_ids=[[1, 2]] * n,
            completion_ids=torch.full((n, width), 7),
            pad_id=3,
            completion_mask=torch.ones(n, width),
            sampler_logprobs=torch.full((n, width), -0.5),
            truncated=torch.zeros(n, dtype=torch.bool),
            group_ids=torch.arange(len(prompts)).repeat_interleave(group_size),
            policy_version=policy_version,
            texts=[f"{p}#{j}" for p in prompts for j in range(group_size)],
        )


def scripted_scores(examples: list[Example], rollout: Rollout) -> Scores:
    rewards = torch.tensor([r for e in examples for r in e.meta["rewards"]], dtype=torch.float32)
    valid = torch.tensor([v for e in examples for v in e.meta.get("valid", [True] * G)])
    return Scores(
        rewards=rewards, valid=valid, correct=rewards > 0.5, metrics={"reward/verifier_mean": float(rewards.mean())}
    )


def example(i: int, rewards, valid=None) -> Example:
    meta = {"rewards": list(rewards)}
    if valid is not None:
        meta["valid"] = list(valid)
    return Example(prompt=f"p{i}", answer="", meta=meta)


def collector(examples, engine, prompts_per_step=3, pool=None, **curation) -> BatchCollector:
    pool = pool or PromptStream(examples, seed=0)
    return BatchCollector(
        CurationConfig(**curation),
        pool,
        SampleNow(pool, engine, G, SamplingParams()),
        scripted_scores,
        prompts_per_step=prompts_per_step,
        group_size=G,
    )


def kept_prompts(batch) -> list[str]:
    return [e.prompt for e in batch.examples]


def test_zero_variance_keeps_groups_whose_valid_rewards_differ():
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0],
                            [0.0, 1.0, 0.0, 0.0],
                            [0.5, 0.5, 0.2, 0.5],
                            [1.0, 0.0, 1.0, 1.0]])
    valid = torch.tensor([[True] * 4, [True] * 4, [True, True, False, True], [True, False, False, False]])
    groups = Groups(rewards, valid, rewards > 0.5, torch.zeros(4, 4, dtype=torch.bool))
    # Row 2 differs only through an invalid sample; row 3 has one valid sample: both count as degenerate.
    assert zero_variance(groups).tolist() == [False, True, False, False]


def test_dynamic_sampling_trains_only_groups_with_reward_variance_and_fills_the_batch():
    # Prompts 0, 2, 4, ... are degenerate (all 1.0), the odd ones have variance.
    pool = [example(i, [1, 1, 1, 1] if i % 2 == 0 else [1, 0, 0, 1]) for i in range(12)]
    engine = ScriptedEngine()
    batch = collector(pool, engine, filters=["zero_variance"], refill="dynamic", max_rounds=5).collect(0)
    grouped = batch.scores.rewards.view(-1, G)
    assert len(batch.examples) == 3 and batch.rollout.num_rows == 3 * G
    assert bool((grouped.max(dim=1).values > grouped.min(dim=1).values).all())
    assert all(int(e.prompt[1:]) % 2 == 1 for e in batch.examples)
    # Each round draws a whole batch of 3 prompts; it takes at least 2 rounds to find 3 odd ones.
    rounds = len(engine.calls)
    assert rounds >= 2 and all(len(call) == 3 for call in engine.calls)
    assert batch.metrics["curation/rounds"] == rounds
    assert batch.metrics["curation/prompts_sampled"] == 3 * rounds
    evens = sum(1 for call in engine.calls for p in call if int(p[1:]) % 2 == 0)
    assert batch.metrics["curation/dropped_zero_variance"] == evens
    assert batch.metrics["curation/short"] == 0.0
    # Rows and texts line up with their prompts; group ids are renumbered 0..P-1.
    assert batch.rollout.group_ids.tolist() == [p for p in range(3) for _ in range(G)]
    assert [t.split("#")[0] for t in batch.rollout.texts] == [e.prompt for e in batch.examples for _ in range(G)]


def test_the_round_limit_is_honoured_and_a_short_batch_says_so():
    pool = [example(i, [1, 1, 1, 1]) for i in range(5)] + [example(5, [0, 1, 1, 1])]
    engine = ScriptedEngine()
    batch = collector(pool, engine, filters=["zero_variance"], refill="dynamic", max_rounds=2).collect(0)
    assert len(engine.calls) == 2
    assert batch.metrics["curation/rounds"] == 2 and batch.metrics["curation/short"] == 1.0
    assert kept_prompts(batch) == ["p5"]          # the one group with variance, trained on as it is
    # Nothing survives at all: no batch, and the metrics still report the rounds.
    empty = collector([example(i, [0, 0, 0, 0]) for i in range(4)], ScriptedEngine(),
                      filters=["zero_variance"], refill="dynamic", max_rounds=3).collect(0)
    assert empty.rollout is None and empty.metrics["curation/rounds"] == 3
    assert empty.metrics["curation/prompts_kept"] == 0


def test_active_refill_samples_only_the_missing_prompts():
    # The first draw has one degenerate prompt; the second round asks for exactly one more.
    pool = [example(i, [1, 0, 1, 0]) for i in range(6)]
    pool[0] = example(0, [0, 0, 0, 0])
    engine = ScriptedEngine()
    c = collector(pool, engine, filters=["zero_variance"], refill="active", max_rounds=3)
    first_draw = [e.prompt for e in PromptStream(pool, seed=0).next(3)]
    batch = c.collect(0)
    if "p0" in first_draw:
        assert [len(call) for call in engine.calls] == [3, 1]
    else:
        assert [len(call) for call in engine.calls] == [3]
    assert len(batch.examples) == 3 and "p0" not in kept_prompts(batch)


def test_filter_without_refill_trains_on_what_is_left():
    pool = [example(0, [1, 1, 1, 1]), example(1, [1, 0, 0, 0]), example(2, [0, 1, 0, 1])]
    engine = ScriptedEngine()
    batch = collector(pool, engine, filters=["zero_variance"]).collect(0)
    assert len(engine.calls) == 1 and sorted(kept_prompts(batch)) == ["p1", "p2"]
    assert batch.metrics["curation/short"] == 1.0 and batch.metrics["curation/dropped_zero_variance"] == 1


def test_prompts_that_pass_leave_the_pool():
    # p0 passes 4/4 and p1 3/4 (0.75): with threshold 0.75 both leave; p2 (1/4) stays.
    pool = [example(0, [1, 1, 1, 1]), example(1, [1, 1, 1, 0]), example(2, [1, 0, 0, 0])]
    stream = PromptStream(pool, seed=0)
    c = collector(pool, ScriptedEngine(), pool=stream, retire_pass_rate=0.75)
    batch = c.collect(0)
    assert len(batch.examples) == 3                       # retiring does not drop this step's groups
    assert batch.metrics["curation/retired"] == 2 and batch.metrics["curation/pool_size"] == 1
    assert [e.prompt for e in stream.next(4)] == ["p2"] * 4   # later epochs draw only what is left


def test_invalid_and_overlong_samples_are_masked_out_of_the_loss():
    pool = [example(0, [1, 0, 1, 0], valid=[True, False, True, True]), example(1, [0, 1, 0, 1])]

    class Truncating(ScriptedEngine):
        def generate(self, prompts, group_size, params, policy_version=0, generator=None):
            rollout = super().generate(prompts, group_size, params, policy_version)
            rollout.truncated[0::3] = True          # rows 0, 3, 6
            return rollout

    for overlong in (False, True):
        c = collector(pool, Truncating(), prompts_per_step=2, overlong_filter=overlong)
        batch = c.collect(0)
        invalid = {r for r in range(2 * G) if batch.examples[r // G].prompt == "p0" and r % G == 1}
        expected = invalid | ({0, 3, 6} if overlong else set())
        assert {r for r in range(2 * G) if not batch.row_keep[r]} == expected
        assert batch.metrics["curation/rows_masked"] == len(expected)


def test_concat_rollouts_pads_to_the_widest_and_renumbers_groups():
    engine = ScriptedEngine()
    a = engine.generate(["x"], 2, SamplingParams())        # width 3
    b = engine.generate(["y", "z"], 2, SamplingParams())   # width 2
    both = concat_rollouts([a, b])
    assert both.completion_ids.shape == (6, 3)
    assert both.completion_mask[2:, 2].sum() == 0 and both.completion_mask[:2].sum() == 6
    # No row of either part is padded, so the pad id comes from the rollouts, not from their data.
    assert both.pad_id == 3 and both.completion_ids[2:, 2].tolist() == [3] * 4
    assert both.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert both.texts == ["x#0", "x#1", "y#0", "y#1", "z#0", "z#1"]


def test_concat_rollouts_refuses_parts_padded_with_different_ids():
    a = ScriptedEngine().generate(["x"], 2, SamplingParams())
    b = dataclasses.replace(a, pad_id=0)
    with pytest.raises(ValueError, match=r"different ids \[0, 3\]"):
        concat_rollouts([a, b])


class AnsweringEngine:
    """Sample j of a prompt answers correctly when j < the number in its prompt ("q3": 3 of 4 right)."""

    def generate(self, prompts, group_size, params, policy_version=0, generator=None):
        n = len(prompts) * group_size
        texts = [("right" if j < int(p[1:]) else "wrong") for p in prompts for j in range(group_size)]
        return Rollout(prompt_ids=[[1]] * n, completion_ids=torch.ones(n, 1, dtype=torch.long), pad_id=0,
                       completion_mask=torch.ones(n, 1), sampler_logprobs=torch.zeros(n, 1),
                       truncated=torch.zeros(n, dtype=torch.bool), group_ids=torch.arange(n) // group_size,
                       policy_version=0, texts=texts)


class RightTask:
    def reward(self, example, completion):
        return float(completion == "right")


def test_difficulty_filter_keeps_prompts_in_the_pass_rate_band(tmp_path):
    from reinforge.curation.difficulty import pass_rates, write_filtered

    examples = [Example(prompt=f"q{i}", answer=str(i), meta={"id": i}) for i in range(5)]
    rates = pass_rates(AnsweringEngine(), RightTask(), examples, k=4, sampling=SamplingParams(), batch_prompts=2)
    assert rates == [0.0, 0.25, 0.5, 0.75, 1.0]
    report = write_filtered(tmp_path / "kept.jsonl", examples, rates, lo=0.25, hi=0.75)
    rows = [json.loads(line) for line in (tmp_path / "kept.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["q1", "q2", "q3"]
    assert rows[0] == {"prompt": "q1", "answer": "1", "pass_rate": 0.25, "id": 1}
    assert (report.kept, report.too_easy, report.too_hard) == (3, 1, 1)


def test_filter_command_writes_the_kept_prompts(tmp_path):
    from typer.testing import CliRunner

    from reinforge.cli import app

    out = tmp_path / "kept.jsonl"
    result = CliRunner().invoke(app, ["filter", str(out), "train.num_prompts=6", "rollout.max_new_tokens=4",
                                      "--k", "2", "--lo", "0", "--hi", "1"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and all(r["pass_rate"] in (0.0, 0.5, 1.0) for r in rows)
    assert "kept 6 of 6 prompts" in result.output


def test_a_sample_without_a_reward_does_not_move_its_groups_baseline():
    from reinforge.learner import build_sequences
    from reinforge.loops.credit import GroupCredit
    from reinforge.objectives import resolve_spec

    rewards = torch.tensor([1.0, 0.0, float("nan"), 1.0, 0.5, 0.5, 0.0, 1.0])
    valid = torch.tensor([True, True, False, True, True, True, True, True])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    sequences = build_sequences([[1]] * 8, torch.ones(8, 2, dtype=torch.long), torch.ones(8, 2), 0, group_ids=groups)
    credit = GroupCredit(resolve_spec("dr_grpo")).assign(
        sequences, rewards, valid, groups, None, None, torch.Generator()
    )
    # Group 0's baseline is the mean of its three valid rewards, 2/3; group 1's is 0.5.
    expected = torch.tensor([1 / 3, -2 / 3, 0.0, 1 / 3, 0.0, 0.0, -0.5, 0.5])
    torch.testing.assert_close(credit.advantages, expected)
    assert credit.keep.tolist() == valid.tolist()


def test_scalerl_parts_with_its_curation_train_until_async_lands(tmp_path, micro_overrides):
    # recipe=scalerl itself waits for asynchronous training (issue 8); its objective and its
    # curation (zero-variance filter without refill, pass-rate retirement) run today by composition.
    from typer.testing import CliRunner

    from reinforge.cli import app

    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", *micro_overrides, "sft.steps=1", "eval.num_prompts=2", "recipe=grpo", f"output_dir={out}",
        "objective.advantage=scalerl", "objective.policy_loss=cispo", "objective.policy_params={r_max: 5.0}",
        "objective.ratio_anchor=sampler", "objective.aggregation=prompt_mean", "objective.kl_estimator=none",
        "curation.filters=[zero_variance]", "curation.retire_pass_rate=0.9", "train.steps=3",
    ])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("stage") == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert all(r["curation/rounds"] == 1 for r in rl)           # no refill
    assert all(r["curation/prompts_kept"] + r["curation/dropped_zero_variance"] == r["curation/prompts_sampled"]
               for r in rl)
