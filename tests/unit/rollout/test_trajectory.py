"""The trajectory record: segments, loss masks, the batch view and back, by hand and on engine output."""

from __future__ import annotations

import pytest
import torch

from reinforge.models import build_tiny_qwen2
from reinforge.models.tokenizer import build_char_tokenizer
from reinforge.rollout import HFEngine, NativeEngine, SamplingParams
from reinforge.rollout.rows import FinishedRow, rows_to_rollout
from reinforge.rollout.trajectory import SCHEMA_VERSION, Segment, Trajectory, collate, split
from reinforge.settings import ModelConfig


def decode_ids(ids: torch.Tensor) -> list[str]:
    """A stand-in tokenizer: token k is the letter chr(97 + k), token 9 (the pad) is skipped."""
    return ["".join(chr(97 + int(t)) for t in row if int(t) != 9) for row in ids]


def sampled(tokens: list[int], logprobs: list[float], version: int) -> Segment:
    return Segment.sampled(torch.tensor(tokens), torch.tensor(logprobs), version)


def test_collate_pads_every_field_as_derived_by_hand() -> None:
    a = Trajectory(prompt_ids=(1, 2), segments=(sampled([3, 4, 5], [-0.5, -1.0, -0.25], 2),), truncated=False, group=0)
    b = Trajectory(prompt_ids=(1, 2), segments=(sampled([6], [-2.0], 3),), truncated=True, group=0)
    c = Trajectory(prompt_ids=(7,), segments=(sampled([], [], 3),), truncated=False, group=1)
    rollout = collate([a, b, c], pad_id=9, policy_version=2, decode=decode_ids)
    assert rollout.completion_ids.tolist() == [[3, 4, 5], [6, 9, 9], [9, 9, 9]]
    assert rollout.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert rollout.sampler_logprobs.tolist() == [[-0.5, -1.0, -0.25], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert rollout.truncated.tolist() == [False, True, False]
    assert rollout.group_ids.tolist() == [0, 0, 1]
    assert rollout.prompt_ids == [[1, 2], [1, 2], [7]]
    assert rollout.texts == ["def", "g", ""]
    assert rollout.policy_version == 2


def test_an_environment_segment_is_context_not_loss() -> None:
    turn = Trajectory(prompt_ids=(1,), group=0, truncated=False, segments=(
        sampled([3, 4], [-0.1, -0.2], 5), Segment.observed(torch.tensor([7, 7, 8])), sampled([2], [-0.3], 6)))
    assert turn.tokens().tolist() == [3, 4, 7, 7, 8, 2]
    assert turn.loss_mask().tolist() == [1, 1, 0, 0, 0, 1]
    assert turn.sampler_logprobs().tolist() == pytest.approx([-0.1, -0.2, 0, 0, 0, -0.3])
    assert turn.versions().tolist() == [5, 5, -1, -1, -1, 6]
    assert (turn.model_tokens, turn.environment_tokens) == (3, 3)
    # tests/unit/learner/test_loss_mask.py for more
    rollout = collate([turn], pad_id=9, policy_version=5, decode=decode_ids)
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 1, 1, 1]]
    assert rollout.loss_mask.tolist() == [turn.loss_mask().tolist()]


def test_a_record_of_another_schema_is_refused_and_bad_segments_are_named() -> None:
    old = Trajectory(prompt_ids=(1,), segments=(sampled([3], [-1.0], 0),), truncated=False, group=0,
                     schema=SCHEMA_VERSION + 1)
    with pytest.raises(ValueError, match="schema"):
        collate([old], pad_id=9, policy_version=0, decode=decode_ids)
    with pytest.raises(ValueError, match="role"):
        Segment("tool", torch.tensor([1]), torch.tensor([0.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"\[L\] each"):
        Segment.sampled(torch.tensor([1, 2]), torch.tensor([0.0]), 0)


@pytest.mark.parametrize("engine", [NativeEngine, HFEngine])
def test_an_engines_rollout_splits_into_trajectories_and_collates_back_bit_for_bit(engine) -> None:
    policy = build_tiny_qwen2(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                          intermediate_size=64), seed=0)
    torch.manual_seed(0)
    rollout = engine(policy).generate(["12+34=", "7+8=", "1+1="], 3, SamplingParams(temperature=1.0, max_new_tokens=6),
                                      policy_version=4)
    versions = torch.full(rollout.completion_ids.shape, 4).masked_fill(rollout.completion_mask == 0, 0)
    trajectories = split(rollout, versions)
    assert [t.group for t in trajectories] == rollout.group_ids.tolist()
    assert [t.model_tokens for t in trajectories] == rollout.lengths.long().tolist()
    back = collate(trajectories, policy.tokenizer.pad_token_id, rollout.policy_version,
                   lambda ids: policy.tokenizer.batch_decode(ids, skip_special_tokens=True))
    width = int(rollout.lengths.max())   # the engine may pad wider than its longest row
    assert torch.equal(back.completion_ids, rollout.completion_ids[:, :width])
    assert torch.equal(back.completion_mask, rollout.completion_mask[:, :width])
    assert torch.equal(back.sampler_logprobs, rollout.sampler_logprobs[:, :width])
    assert torch.equal(back.truncated, rollout.truncated) and torch.equal(back.group_ids, rollout.group_ids)
    assert back.prompt_ids == rollout.prompt_ids and back.texts == rollout.texts and back.pad_id == rollout.pad_id


def test_finished_rows_padded_directly_are_what_collate_makes_of_them() -> None:
    """rows_to_rollout pads plain rows (no top-K, no routes) itself: every field must equal `collate` of the same
    rows as single-turn trajectories, for rows of mixed lengths, an empty one included."""
    tok = build_char_tokenizer()
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 0, 5, 1, 5, 2]
    rows = [FinishedRow(tag=r, tokens=torch.randint(3, 30, (n,), generator=gen), logprobs=-torch.rand(n, generator=gen),
                        versions=torch.full((n,), 4), truncated=n == 5) for r, n in enumerate(lengths)]
    prompts = [[5, 6], [5, 6], [5, 6], [7], [7], [7]]
    direct = rows_to_rollout(rows, prompts, 3, tok, policy_version=4)
    trajectories = [Trajectory(tuple(p), (Segment.sampled(row.tokens, row.logprobs, row.versions),), row.truncated,
                               r // 3) for r, (row, p) in enumerate(zip(rows, prompts, strict=True))]
    via = collate(trajectories, tok.pad_token_id, 4, lambda ids: tok.batch_decode(ids, skip_special_tokens=True))
    for field in ("completion_ids", "completion_mask", "sampler_logprobs", "truncated", "group_ids"):
        a, b = getattr(direct, field), getattr(via, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
    assert direct.completion_ids.shape == (6, 5) and direct.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert (direct.prompt_ids, direct.texts, direct.pad_id, direct.policy_version, direct.loss_mask) == \
        (via.prompt_ids, via.texts, via.pad_id, via.policy_version, via.loss_mask)
    assert len(set(direct.texts)) == 6 and direct.texts[1] == ""
