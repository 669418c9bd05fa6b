"""REINFORCE++, REINFORCE++-baseline, ReMax and T1's on-policy KL normalisation: hand-derived
advantages, their path through the credit assignment, and ReMax's greedy-baseline rollout in the loop."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from reinforge.cli import app
from reinforge.curation.batches import Scores
from reinforge.loops.baselines import greedy_baselines, takes_baselines
from reinforge.loops.credit import GroupCredit
from reinforge.models.factory import load_policy
from reinforge.objectives import RECIPE_OBJECTIVES, advantage_kl_shift, compute_advantages, resolve_spec
from reinforge.objectives.advantages import AdvantagePipeline
from reinforge.objectives.kl import centred_kl_penalty
from reinforge.objectives.token_advantages import masked_whiten, token_returns
from reinforge.rewards.user import register
from reinforge.rollout import NativeEngine, SamplingParams
from reinforge.settings import ModelConfig

runner = CliRunner()

# Two sequences, the second one token shorter.
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
PENALTY = torch.tensor([[0.1, 0.2, 0.3], [0.1, 0.1, 0.0]])      # beta sg(k_t) per token


def test_reinforce_pp_returns_and_global_whitening_by_hand():
    # Row 0: r = [-0.1, -0.2, 1 - 0.3] -> returns G = [0.4, 0.5, 0.7].
    # Row 1 (R = 0, last valid token 1): r = [-0.1, -0.1] -> G = [-0.2, -0.1].
    returns = token_returns(torch.tensor([1.0, 0.0]), MASK, PENALTY)
    torch.testing.assert_close(returns, torch.tensor([[0.4, 0.5, 0.7], [-0.2, -0.1, 0.0]]))
    # Over the 5 valid tokens of the batch: mean 1.3 / 5 = 0.26; deviations 0.14, 0.24, 0.44, -0.46, -0.36;
    # var (no Bessel) = (0.0196 + 0.0576 + 0.1936 + 0.2116 + 0.1296) / 5 = 0.1224.
    expected = torch.tensor([[0.14, 0.24, 0.44], [-0.46, -0.36, 0.0]]) / math.sqrt(0.1224)
    advantages = compute_advantages("reinforce_pp", torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask=MASK,
                                    token_penalty=PENALTY)
    torch.testing.assert_close(advantages, expected)
    # Groups play no part: any ids give the same.
    torch.testing.assert_close(
        compute_advantages("reinforce_pp", torch.tensor([1.0, 0.0]), torch.tensor([5, 9]), mask=MASK,
                           token_penalty=PENALTY), expected)


def test_discounted_returns_by_hand():
    # gamma 0.5 on row 0: G_2 = 0.7, G_1 = -0.2 + 0.5 * 0.7 = 0.15, G_0 = -0.1 + 0.5 * 0.15 = -0.025.
    returns = token_returns(torch.tensor([1.0, 0.0]), MASK, PENALTY, gamma=0.5)
    torch.testing.assert_close(returns[0], torch.tensor([-0.025, 0.15, 0.7]))


def test_masked_whiten_of_a_constant_batch_is_zero_not_nan():
    out = masked_whiten(torch.full((2, 3), 4.0), MASK)
    torch.testing.assert_close(out, torch.zeros(2, 3))


def test_reinforce_pp_baseline_by_hand():
    # Groups {1, 0} and {1, 1}: R - mean_g = [0.5, -0.5, 0, 0]; no KL: every token carries its row's value.
    # Valid tokens: 0.5, 0.5 | -0.5 | 0, 0 | 0, 0 -> mean 0.5 / 7 = 1/14.
    # Deviations 3/7, 3/7, -4/7, -1/14 (x4); var = (18/49 + 16/49 + 4/196) / 7 = 5/49, std = sqrt(5)/7.
    # A = 3/sqrt5 on row 0, -4/sqrt5 on row 1, and -1/(2 sqrt5) on the all-equal group (the batch mean is
    # subtracted too, as OpenRLHF does: unlike GRPO, a degenerate group is not exactly 0).
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    got = compute_advantages("reinforce_pp_baseline", torch.tensor([1.0, 0.0, 1.0, 1.0]),
                             torch.tensor([0, 0, 1, 1]), mask=mask)
    s = math.sqrt(5)
    expected = torch.tensor([[3 / s, 3 / s], [-4 / s, 0.0], [-0.5 / s, -0.5 / s], [-0.5 / s, -0.5 / s]])
    torch.testing.assert_close(got, expected)


def test_remax_by_hand_and_its_inputs_are_required():
    got = compute_advantages("remax", torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]),
                             baselines=torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(got, torch.tensor([0.0, -1.0, 1.0]))
    with pytest.raises(ValueError, match="advantage 'remax' needs baselines"):
        AdvantagePipeline("remax")(torch.tensor([1.0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="per-token advantages"):
        AdvantagePipeline("reinforce_pp", transforms=[("gaussian_noise", {})])(
            torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask=MASK)
    assert takes_baselines(RECIPE_OBJECTIVES["remax"]) and not takes_baselines(RECIPE_OBJECTIVES["grpo"])


# T1: k1 per token = old - ref.
OLD = torch.tensor([[-1.0, -2.0], [-1.0, -1.0], [-1.0, -1.0], [-2.0, -1.0]])
REF = torch.tensor([[-1.5, -2.0], [-1.0, -2.0], [-1.0, -1.0], [-2.0, -1.5]])   # KL_i = 0.5, 1, 0, 0.5


def test_centred_kl_penalty_by_hand():
    # KL = [0.5, 1, 0, 0.5], mean 0.5, beta 0.1 -> [0, 0.05, -0.05, 0].
    got = centred_kl_penalty(OLD, REF, torch.ones(4, 2), 0.1, "k1")
    torch.testing.assert_close(got, torch.tensor([0.0, 0.05, -0.05, 0.0]))
    assert float(got.sum()) == pytest.approx(0.0, abs=1e-7)        # centred: the mean advantage does not move


def test_t1_spec_charges_the_centred_kl_after_the_group_estimator():
    spec = resolve_spec("t1", kl_estimator="k1", kl_coef=0.1)
    rewards, groups, mask = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2)
    credit = GroupCredit(spec)
    result = credit.assign(SimpleNamespace(completion_mask=mask), rewards, torch.ones(4, dtype=torch.bool), groups,
                           OLD, REF, torch.Generator())
    # GRPO of R: +-0.5 / (std_g + 1e-6), std_g = sqrt(0.5) -> +-0.7071058; then - [0, 0.05, -0.05, 0].
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(result.advantages, torch.tensor([a, -a - 0.05, a + 0.05, -a]))
    # Without the normalisation, the same KL in the reward would be shifted by GRPO's group z-score instead.
    plain = GroupCredit(resolve_spec("t1", kl_estimator="k1", kl_coef=0.1, kl_normalization="none"))
    other = plain.assign(SimpleNamespace(completion_mask=mask), rewards, torch.ones(4, dtype=torch.bool), groups,
                         OLD, REF, torch.Generator()).advantages
    assert not torch.allclose(other, result.advantages)
    assert advantage_kl_shift(resolve_spec("grpo"), OLD, REF, mask) is None
    with pytest.raises(ValueError, match="set kl_placement=in_reward"):
        resolve_spec("t1", kl_placement="in_loss")
    with pytest.raises(ValueError, match="charge it twice"):
        resolve_spec("reinforce_pp", kl_normalization="on_policy")


def test_reinforce_pp_credit_places_the_kl_on_each_token_and_skips_invalid_rows():
    spec = resolve_spec("reinforce_pp", kl_coef=0.2)
    mask = torch.ones(4, 2)
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 5.0]), torch.tensor([0, 0, 1, 1])
    valid = torch.tensor([True, True, True, False])        # row 3's reward function failed
    result = GroupCredit(spec).assign(SimpleNamespace(completion_mask=mask), rewards, valid, groups, OLD, REF,
                                      torch.Generator())
    # k1 per token on rows 0-2: [[0.5, 0], [0, 1], [0, 0]]; penalty 0.2 k1. Returns: row 0 [1 - 0.1, 1] = [0.9, 1],
    # row 1 [-0.2, -0.2], row 2 [1, 1]; mean over the 6 valid tokens 3.5 / 6; row 3 (invalid): 0, not in the stats.
    returns = torch.tensor([[0.9, 1.0], [-0.2, -0.2], [1.0, 1.0]])
    centred = returns - returns.mean()
    expected = torch.cat([centred / centred.pow(2).mean().sqrt(), torch.zeros(1, 2)])
    torch.testing.assert_close(result.advantages, expected)
    assert result.keep.tolist() == [True, True, True, False]


# ---------------------------------------------------------------- ReMax's greedy baseline in the loop


def _chars(completion: str) -> float:
    return float(len(completion))


def test_greedy_baselines_score_a_greedy_completion_of_each_prompt():
    torch.manual_seed(0)
    policy = load_policy(ModelConfig(path="builtin", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                     intermediate_size=64), seed=0)
    engine = NativeEngine(policy)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    examples = [SimpleNamespace(prompt="12+34="), SimpleNamespace(prompt="7+8=")]

    def score(rows, rollout):      # reward = the completion's length in characters
        lengths = torch.tensor([_chars(t) for t in rollout.texts])
        return Scores(rewards=lengths, valid=torch.ones(len(lengths), dtype=torch.bool),
                      correct=torch.zeros(len(lengths), dtype=torch.bool), metrics={"reward/total_mean": 0.0})

    rollout = engine.generate([e.prompt for e in examples], 3, sampling, generator=torch.Generator().manual_seed(1))
    state = torch.get_rng_state()
    scores = greedy_baselines(score, score, engine, sampling, group_size=3)(examples, rollout)
    assert torch.equal(torch.get_rng_state(), state)            # the greedy rollout draws nothing from torch
    greedy = engine.generate([e.prompt for e in examples], 1, SamplingParams(greedy=True, max_new_tokens=6))
    expected = torch.tensor([_chars(t) for t in greedy.texts]).repeat_interleave(3)
    torch.testing.assert_close(scores.baselines, expected)
    torch.testing.assert_close(scores.rewards, torch.tensor([_chars(t) for t in rollout.texts]))
    assert scores.metrics["reward/greedy_baseline_mean"] == pytest.approx(float(expected[::3].mean()))
    assert scores.rows(torch.tensor([0, 4])).baselines.tolist() == [expected[0].item(), expected[4].item()]


def test_remax_run_subtracts_each_prompts_greedy_reward(tmp_path, micro_overrides):
    # The reward is the completion's length: a sample's reward minus its advantage is its prompt's
    # greedy baseline, one value per prompt and step, and their mean is the logged greedy_baseline_mean.
    name = register(_chars, "remax_test_chars")
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", *micro_overrides, "sft.steps=1", "eval.num_prompts=2", "recipe=remax",
                                 "rollout.max_new_tokens=6", "log.samples_per_step=16", "log.samples_every=1",
                                 f"reward.functions=[{{name: '{name}'}}]", f"output_dir={out}"])
    assert result.exit_code == 0, result.output
    rl = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"stage": "rl"' in x]
    assert [r["step"] for r in rl] == [1, 2, 3]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    for record in rl:
        rows = [s for s in samples if s["step"] == record["step"]]
        assert len(rows) == 16                                   # every row of the 4 x 4 batch
        baselines = {}
        for s in rows:
            assert s["reward"] == pytest.approx(len(s["completion"]))
            baselines.setdefault(s["prompt"], set()).add(round(s["reward"] - s["advantage"], 4))
        assert all(len(b) == 1 for b in baselines.values()), baselines       # one greedy reward per prompt
        per_prompt = [b.pop() for b in baselines.values()]
        assert all(0 <= b <= 6 and b == int(b) for b in per_prompt)          # a length, as the reward
        assert record["reward/greedy_baseline_mean"] == pytest.approx(sum(per_prompt) / len(per_prompt), abs=1e-3)


def test_remax_refuses_async(tmp_path, micro_overrides):
    result = runner.invoke(app, ["train", *micro_overrides, "recipe=remax", "train.mode=async",
                                 f"output_dir={tmp_path / 'r'}"])
    assert result.exit_code == 2 and "set train.mode=sync" in result.output


def test_remax_refuses_learner_ranks():
    from reinforge.config import Config
    from reinforge.config.checks import check_data_parallel
    from reinforge.errors import ConfigError

    cfg = Config(recipe="remax", train={"shared_prefix": False})
    with pytest.raises(ConfigError, match="greedy baseline rollout"):
        check_data_parallel(cfg, RECIPE_OBJECTIVES["remax"], 2)
    check_data_parallel(Config(recipe="grpo", train={"shared_prefix": False}), RECIPE_OBJECTIVES["grpo"], 2)
