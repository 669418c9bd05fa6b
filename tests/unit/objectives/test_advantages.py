"""Advantage estimators and transforms: hand-derived values, identities,
vectorised group statistics, and the pipeline's state across batches."""

import math

import pytest
import torch

from reinforge.objectives.advantages import (
    ADVANTAGE_TRANSFORMS,
    ADVANTAGES,
    AdvantagePipeline,
    compute_advantages,
    filter_small,
    gaussian_noise,
    group_stats,
)

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
    # Every group-centred estimator (all but reinforce and REINFORCE++, centred on the batch, ReMax,
    # centred on a greedy completion, and objectives/coverage.py's best-of-group margin, fixed weights
    # and length-weighted baseline) has sum_{i in g} A_i = 0. passk does: every k-subset's z-score is
    # counted k times over its members, and the z-scores sum to 0.
    uncentred = {"reinforce", "reinforce_pp", "reinforce_pp_baseline", "remax", "max_loo", "w_reinforce", "opo"}
    for name in ADVANTAGES.keys() - uncentred:
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


# ------------------------------------------------------------ the other estimators


def test_rloo_hand_example():
    # Group 0, R = 1: the others {0, 0, 1} have mean 1/3 -> A = 2/3; R = 0: others {0, 1, 1} -> -2/3.
    # Same as G/(G-1) (R - mean_g) = 4/3 * +-0.5. Group 1 all equal -> 0; group 2 alone -> 0 (no NaN).
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0, 0])
    torch.testing.assert_close(compute_advantages("rloo", REWARDS, GROUPS), expected)


def test_lite_ppo_hand_example():
    # Batch of 9: seven 1s, two 0s; mean 7/9; unbiased var = (7 (2/9)^2 + 2 (7/9)^2) / 8 = 7/36,
    # std = sqrt(7)/6 = 0.4409586. Group 0: A = +-0.5 / (0.4409586 + 1e-6) = +-1.1338918; others 0.
    a = 0.5 / (math.sqrt(7) / 6 + 1e-6)
    assert a == pytest.approx(1.1338918, abs=1e-6)
    expected = torch.tensor([a, -a, -a, a, 0, 0, 0, 0, 0])
    torch.testing.assert_close(compute_advantages("lite_ppo", REWARDS, GROUPS), expected)


def test_scalerl_hand_example():
    # B = R - mean_g = [.5, -.5, -.5, .5, 0, 0, 0, 0, 0]: mean 0, sum B^2 = 1, unbiased var = 1/8,
    # std = 0.3535534. A = +-0.5 / (0.3535534 + 1e-6) = +-1.4142096; others 0.
    a = 0.5 / (math.sqrt(1 / 8) + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 0, 0, 0, 0, 0])
    torch.testing.assert_close(compute_advantages("scalerl", REWARDS, GROUPS), expected)


def test_batch_normalised_estimators_with_one_sample_are_zero_not_nan():
    # N = 1: batch std is 0 (not NaN), R - mean_g = 0 -> A = 0.
    for name in ("lite_ppo", "scalerl", "reinforce"):
        torch.testing.assert_close(compute_advantages(name, torch.tensor([3.0]), torch.tensor([0])),
                                   torch.tensor([0.0]))


def test_reinforce_batch_mean_and_fixed_baseline():
    # Batch mean 7/9: A = 1 - 7/9 = 2/9 and 0 - 7/9 = -7/9; groups play no part.
    hi, lo = 2 / 9, -7 / 9
    torch.testing.assert_close(compute_advantages("reinforce", REWARDS, GROUPS),
                               torch.tensor([hi, lo, lo, hi, hi, hi, hi, hi, hi]))
    # baseline 0.5: A = +-0.5.
    torch.testing.assert_close(compute_advantages("reinforce", REWARDS, GROUPS, baseline=0.5),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]))


def test_reinforce_ema_baseline_needs_the_pipeline():
    with pytest.raises(ValueError, match="AdvantagePipeline"):
        compute_advantages("reinforce", REWARDS, GROUPS, baseline="ema")
    with pytest.raises(ValueError, match="'ema'"):
        compute_advantages("reinforce", REWARDS, GROUPS, baseline="emma")


def test_maxrl_hand_example():
    # id 5 = {1, 0, 0, 0}: rhat = 1/4 -> (1 - 1/4) / (1/4) = 3 and (0 - 1/4) / (1/4) = -1 (sum 0).
    # id 9 = {0, 0}: rhat = 0 -> A = 0, not NaN. id 2 = {1} alone: rhat = 1 -> 0.
    # id -1 = {1, 0} (rows 7, 8 interleaved ids): rhat = 1/2 -> +1, -1.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    group_ids = torch.tensor([5, 5, 9, 5, 9, 5, 2, -1, -1])
    expected = torch.tensor([3.0, -1.0, 0.0, -1.0, 0.0, -1.0, 0.0, 1.0, -1.0])
    advantages = compute_advantages("maxrl", rewards, group_ids)
    torch.testing.assert_close(advantages, expected)
    # On the shared example: group 0 rhat 1/2 -> +-1; all-equal group 1 (rhat 1) and group 2 -> 0.
    torch.testing.assert_close(compute_advantages("maxrl", REWARDS, GROUPS),
                               torch.tensor([1.0, -1.0, -1.0, 1.0, 0, 0, 0, 0, 0]))


def test_gpg_alpha_hand_example():
    # B = 9 samples; M = 4 (group 1, all equal) + 1 (group 2, alone) = 5; alpha = 9 / (9 - 5) = 2.25.
    # A = 2.25 * (R - mean_g) = +-1.125 in group 0, 0 elsewhere.
    expected = torch.tensor([1.125, -1.125, -1.125, 1.125, 0, 0, 0, 0, 0])
    torch.testing.assert_close(compute_advantages("gpg", REWARDS, GROUPS), expected)
    # Non-contiguous ids: {1, 3} (id 7) and {2, 4} (id -3) informative, id 100 alone: alpha = 5 / 4.
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 4.0])
    group_ids = torch.tensor([7, -3, 7, 100, -3])
    torch.testing.assert_close(compute_advantages("gpg", rewards, group_ids),
                               1.25 * torch.tensor([-1.0, -1.0, 1.0, 0.0, 1.0]))


def test_gpg_all_groups_degenerate_gives_zero_not_inf():
    # M = B = 4: alpha = 1 by definition, every R - mean_g = 0.
    advantages = compute_advantages("gpg", torch.tensor([1.0, 1.0, 0.3, 0.3]), torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(advantages, torch.zeros(4))


def test_rloo_on_uneven_non_contiguous_groups():
    # Groups of 2: G/(G-1) = 2, so A = 2 (R - mean_g): id 7 {1, 3} -> -2, 2; id -3 {2, 4} -> -2, 2; id 100 alone -> 0.
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 4.0])
    group_ids = torch.tensor([7, -3, 7, 100, -3])
    torch.testing.assert_close(compute_advantages("rloo", rewards, group_ids),
                               torch.tensor([-2.0, -2.0, 2.0, 0.0, 2.0]))


def test_rloo_is_leave_one_out_and_g_over_g_minus_1_dr_grpo():
    generator = torch.Generator().manual_seed(2)
    group_ids = torch.randint(0, 6, (40,), generator=generator)
    rewards = torch.rand(40, generator=generator, dtype=torch.float64)
    advantages = compute_advantages("rloo", rewards, group_ids)
    size = group_stats(rewards, group_ids).size.to(torch.float64)
    torch.testing.assert_close(
        advantages, size / (size - 1).clamp(min=1) * compute_advantages("dr_grpo", rewards, group_ids)
    )
    for i in range(40):   # the definition, one sample at a time
        others = (group_ids == group_ids[i]) & (torch.arange(40) != i)
        expected = rewards[i] - rewards[others].mean() if others.any() else torch.tensor(0.0, dtype=torch.float64)
        torch.testing.assert_close(advantages[i], expected)


def test_rloo_and_maxrl_group_sums_are_zero_on_random_batches():
    generator = torch.Generator().manual_seed(3)
    group_ids = torch.randint(0, 7, (64,), generator=generator) * 3 - 5
    rewards = torch.randint(0, 2, (64,), generator=generator).to(torch.float64)
    index = torch.unique(group_ids, return_inverse=True)[1]
    for name in ("rloo", "maxrl"):
        sums = torch.zeros(index.max() + 1, dtype=torch.float64).index_add_(
            0, index, compute_advantages(name, rewards, group_ids)
        )
        torch.testing.assert_close(sums, torch.zeros_like(sums))


def test_gae_is_not_an_outcome_estimator():
    with pytest.raises(ValueError, match=r"needs a critic.*reinforge\.objectives\.value\.gae"):
        compute_advantages("gae", REWARDS, GROUPS)
    with pytest.raises(ValueError, match="needs a critic"):
        AdvantagePipeline("gae")


# ------------------------------------------------------------ transforms


def _call(transform, advantages, generator=None, **params):
    return transform(advantages, rewards=REWARDS, group_ids=GROUPS, state={}, generator=generator, **params)


def test_gaussian_noise_is_reproducible_and_has_the_requested_std():
    advantages = compute_advantages("grpo", REWARDS, GROUPS)
    first = _call(gaussian_noise, advantages, torch.Generator().manual_seed(7), sigma=0.3)
    again = _call(gaussian_noise, advantages, torch.Generator().manual_seed(7), sigma=0.3)
    torch.testing.assert_close(first.advantages, again.advantages)
    assert not torch.equal(first.advantages, advantages) and bool(first.keep.all())
    # On 100k zeros the noise's sample std is 0.3 within a few 1e-3 (std error 0.3 / sqrt(2e5) ~ 7e-4).
    zeros = torch.zeros(100_000)
    noise = gaussian_noise(zeros, rewards=zeros, group_ids=zeros.long(), state={},
                           generator=torch.Generator().manual_seed(0), sigma=0.3).advantages
    assert noise.std().item() == pytest.approx(0.3, abs=0.005)
    assert noise.mean().item() == pytest.approx(0.0, abs=0.005)


def test_filter_small_keeps_only_large_advantages():
    # tau = 0.25: |A| = .5, .25, .1, .3, 0 -> keep, keep (boundary: |A| >= tau), drop, keep, drop.
    advantages = torch.tensor([0.5, -0.25, 0.1, -0.3, 0.0])
    result = filter_small(advantages, rewards=advantages, group_ids=torch.zeros(5, dtype=torch.long),
                          state={}, generator=None, tau=0.25)
    torch.testing.assert_close(result.keep, torch.tensor([True, True, False, True, False]))
    torch.testing.assert_close(result.advantages, advantages)
    # Default tau = 1e-6 drops exactly the zero-signal samples: groups 1 (all equal) and 2 (alone).
    keep = _call(filter_small, compute_advantages("grpo", REWARDS, GROUPS)).keep
    torch.testing.assert_close(keep, torch.tensor([True] * 4 + [False] * 5))


# Three batches of two groups of two: ids [0, 0, 1, 1].
BATCHES = [torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])]
PAIRS = torch.tensor([0, 0, 1, 1])


def test_ema_baseline_mix_over_three_batches():
    # dr_grpo + mix, w = 0.5, decay 0.9: A' = R - (0.5 mean_g + 0.5 b_ema).
    # Batch 1: mean 0.75, no state -> b = 0.75; mean_g = [.5, .5, 1, 1];
    #   A' = [1 - .625, 0 - .625, 1 - .875, 1 - .875] = [.375, -.625, .125, .125]; ema <- .9 .75 + .1 .75 = .75.
    # Batch 2: mean 0.25, b = 0.75; mean_g = [0, 0, .5, .5];
    #   A' = [0 - .375, 0 - .375, 1 - .625, 0 - .625] = [-.375, -.375, .375, -.625]; ema <- .675 + .025 = .7.
    # Batch 3: mean 0.75, b = 0.7; mean_g = [1, 1, .5, .5];
    #   A' = [1 - .85, 1 - .85, 1 - .6, 0 - .6] = [.15, .15, .4, -.6]; ema <- .63 + .075 = .705.
    expected = [([0.375, -0.625, 0.125, 0.125], 0.75), ([-0.375, -0.375, 0.375, -0.625], 0.7),
                ([0.15, 0.15, 0.4, -0.6], 0.705)]
    pipeline = AdvantagePipeline("dr_grpo", transforms=[("ema_baseline_mix", {"weight": 0.5, "decay": 0.9})])
    for rewards, (advantages, ema) in zip(BATCHES, expected, strict=True):
        result = pipeline(rewards, PAIRS)
        torch.testing.assert_close(result.advantages, torch.tensor(advantages))
        torch.testing.assert_close(pipeline.state_dict(), {"transforms.0.reward_ema": torch.tensor(ema)})


def test_reinforce_ema_baseline_over_three_batches_and_resume():
    # b = EMA of past batch means (first batch: its own mean), decay 0.9; same batches as above:
    # batch 1: b = .75 -> A = R - .75, ema .75; batch 2: b = .75, ema .7; batch 3: b = .7, ema .705.
    expected = [([0.25, -0.75, 0.25, 0.25], 0.75), ([-0.75, -0.75, 0.25, -0.75], 0.7), ([0.3, 0.3, 0.3, -0.7], 0.705)]
    pipeline = AdvantagePipeline("reinforce", {"baseline": "ema", "ema_decay": 0.9})
    for rewards, (advantages, ema) in zip(BATCHES, expected, strict=True):
        torch.testing.assert_close(pipeline(rewards, PAIRS).advantages, torch.tensor(advantages))
        torch.testing.assert_close(pipeline.state_dict(), {"estimator.reward_ema": torch.tensor(ema)})


def test_state_dict_round_trip_continues_identically():
    def make():
        return AdvantagePipeline("reinforce", {"baseline": "ema"},
                                 [("ema_baseline_mix", {"weight": 0.3}), ("gaussian_noise", {"sigma": 0.1})])

    original = make()
    for rewards in BATCHES[:2]:
        original(rewards, PAIRS, generator=torch.Generator().manual_seed(1))
    saved = original.state_dict()
    assert set(saved) == {"estimator.reward_ema", "transforms.0.reward_ema"}
    resumed = make()
    resumed.load_state_dict(saved)
    saved["estimator.reward_ema"].fill_(123.0)       # the pipeline holds copies, not the caller's tensors
    for rewards in (BATCHES[2], BATCHES[0]):
        a = original(rewards, PAIRS, generator=torch.Generator().manual_seed(5))
        b = resumed(rewards, PAIRS, generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(a.advantages, b.advantages, rtol=0, atol=0)
    torch.testing.assert_close(original.state_dict(), resumed.state_dict(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="unexpected advantage state"):
        resumed.load_state_dict({"transforms.5.reward_ema": torch.tensor(0.0)})


def test_pipeline_applies_transforms_in_order_and_ands_keep():
    # grpo, then filter_small (drops groups 1, 2), then noise: the filter saw the noise-free advantages.
    pipeline = AdvantagePipeline("grpo", {"eps": 1e-6}, [("filter_small", {}), ("gaussian_noise", {"sigma": 0.5})])
    result = pipeline(REWARDS, GROUPS, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(result.keep, torch.tensor([True] * 4 + [False] * 5))
    noise = 0.5 * torch.randn(9, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(result.advantages, compute_advantages("grpo", REWARDS, GROUPS) + noise)
    # Filtering after the noise instead keeps what the noise pushed over tau: keep is the AND of the steps.
    both = AdvantagePipeline(
        "grpo", transforms=[("filter_small", {}), ("gaussian_noise", {}), ("filter_small", {"tau": 10.0})]
    )
    assert not bool(both(REWARDS, GROUPS).keep.any())


def test_pipeline_checks_names_and_params():
    with pytest.raises(ValueError, match="did you mean 'eps'"):
        AdvantagePipeline("grpo", {"epsilon": 1e-6})
    with pytest.raises(ValueError, match="did you mean 'gaussian_noise'"):
        AdvantagePipeline("grpo", transforms=[("gausian_noise", {})])
    with pytest.raises(ValueError, match="did you mean 'sigma'"):
        AdvantagePipeline("grpo", transforms=[("gaussian_noise", {"sigm": 0.1})])
    with pytest.raises(ValueError, match="unknown parameter"):
        AdvantagePipeline("grpo", {"state": {}})     # an input, not a parameter
    # a string for a number (Python's "2" where the CLI's YAML gives 2) is refused here, not at step 1
    with pytest.raises(ValueError, match="'k' of advantage 'passk' takes an int.*pass k=2 unquoted"):
        AdvantagePipeline("passk", {"k": "2"})
    with pytest.raises(ValueError, match="takes a float"):
        AdvantagePipeline("grpo", {"eps": "1e-6"})
    from reinforge.objectives.coverage import passk

    torch.testing.assert_close(AdvantagePipeline("passk", {"k": 2})(REWARDS, GROUPS).advantages,
                               passk(REWARDS, GROUPS, k=2))
    via_path = AdvantagePipeline("reinforge.objectives.advantages:dr_grpo")(REWARDS, GROUPS)
    torch.testing.assert_close(via_path.advantages, compute_advantages("dr_grpo", REWARDS, GROUPS))
    assert set(ADVANTAGE_TRANSFORMS) == {"gaussian_noise", "filter_small", "ema_baseline_mix"}
