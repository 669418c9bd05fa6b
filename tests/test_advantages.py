"""Advantage estimators: hand-derived values, identities, vectorised group statistics."""

import math

import pytest
import torch

from reinforge.objectives import ADVANTAGES, compute_advantages
from reinforge.objectives.advantages import group_stats

# Three groups: 0 = {1, 0, 0, 1}, 1 = {1, 1, 1, 1} (all equal), 2 = {1} (a group of one).
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2])


def test_grpo_hand_example():
    # Group 0: mean 0.5; unbiased var = 4 * 0.25 / (4 - 1) = 1/3, std = 0.5773503;
    # A = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239.
    # Group 1: all rewards equal -> R - mean = 0 -> A = 0. Group 2: one sample -> A = 0.
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 0, 0, 0, 0, 0])
    assert a == pytest.approx(0.8660239, abs=1e-7)
    torch.testing.assert_close(compute_advantages("grpo", REWARDS, GROUPS), expected)


def test_dr_grpo_hand_example():
    # R - mean_g: group 0 mean 0.5 -> +-0.5; groups 1 and 2 -> 0.
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0])
    torch.testing.assert_close(compute_advantages("dr_grpo", REWARDS, GROUPS), expected)


def test_eps_is_a_parameter():
    # eps = 1: A = 0.5 / (0.5773503 + 1) = 0.3169873 in group 0.
    advantages = compute_advantages("grpo", REWARDS, GROUPS, eps=1.0)
    assert advantages[0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1), abs=1e-7)


def test_non_contiguous_ids_unordered_rows_and_uneven_groups():
    # id 7 = rows {0, 2}: rewards {1, 3}, mean 2, std = sqrt((1 + 1) / 1) = sqrt(2).
    # id -3 = rows {1, 4}: rewards {2, 4}, mean 3, std sqrt(2). id 100 = row 3 alone.
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 4.0])
    group_ids = torch.tensor([7, -3, 7, 100, -3])
    a = 1 / (math.sqrt(2) + 1e-6)                      # 0.7071064
    torch.testing.assert_close(compute_advantages("grpo", rewards, group_ids),
                               torch.tensor([-a, -a, a, 0.0, a]))
    torch.testing.assert_close(compute_advantages("dr_grpo", rewards, group_ids),
                               torch.tensor([-1.0, -1.0, 1.0, 0.0, 1.0]))
    stats = group_stats(rewards, group_ids)
    torch.testing.assert_close(stats.size, torch.tensor([2, 2, 2, 1, 2]))
    torch.testing.assert_close(stats.std, torch.tensor([2**0.5, 2**0.5, 2**0.5, 0.0, 2**0.5]))


def test_group_stats_match_torch_per_group_reference():
    # The vectorised statistics equal a per-group loop with torch.mean / torch.std (unbiased).
    generator = torch.Generator().manual_seed(0)
    group_ids = torch.randint(0, 6, (40,), generator=generator) * 11 - 20
    rewards = torch.randn(40, generator=generator, dtype=torch.float64)
    stats = group_stats(rewards, group_ids)
    for gid in group_ids.unique():
        members = group_ids == gid
        group = rewards[members]
        torch.testing.assert_close(stats.mean[members], group.mean().expand(len(group)))
        expected_std = group.std() if len(group) > 1 else torch.tensor(0.0, dtype=torch.float64)
        torch.testing.assert_close(stats.std[members], expected_std.expand(len(group)))


def test_dr_grpo_equals_grpo_times_std_plus_eps():
    # Identity per group: (R - mean) = (R - mean) / (std + eps) * (std + eps).
    generator = torch.Generator().manual_seed(1)
    group_ids = torch.randint(0, 5, (30,), generator=generator)
    rewards = torch.rand(30, generator=generator, dtype=torch.float64)
    std = group_stats(rewards, group_ids).std
    torch.testing.assert_close(
        compute_advantages("dr_grpo", rewards, group_ids),
        compute_advantages("grpo", rewards, group_ids) * (std + 1e-6),
    )


def test_group_sums_of_advantages_are_zero():
    # Both estimators centre each group: sum_{i in g} A_i = 0.
    for name in ADVANTAGES:
        advantages = compute_advantages(name, REWARDS, GROUPS)
        sums = torch.zeros(3).index_add_(0, GROUPS, advantages)
        torch.testing.assert_close(sums, torch.zeros(3))


def test_integer_rewards_are_accepted():
    torch.testing.assert_close(compute_advantages("dr_grpo", torch.tensor([1, 0]), torch.tensor([0, 0])),
                               torch.tensor([0.5, -0.5]))


def test_unknown_name_suggests_the_closest():
    with pytest.raises(ValueError, match="did you mean 'dr_grpo'"):
        compute_advantages("dr-grpo", REWARDS, GROUPS)


def test_import_path_escape_hatch():
    via_path = compute_advantages("reinforge.objectives.advantages:dr_grpo", REWARDS, GROUPS)
    torch.testing.assert_close(via_path, compute_advantages("dr_grpo", REWARDS, GROUPS))
    with pytest.raises(ValueError, match="cannot import"):
        compute_advantages("reinforge.objectives.advantages:no_such_fn", REWARDS, GROUPS)


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="must both be"):
        compute_advantages("grpo", REWARDS, GROUPS[:-1])
