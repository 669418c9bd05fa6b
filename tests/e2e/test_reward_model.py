"""The Bradley-Terry reward model (reinforge/rewards/reward_model.py): its loss by hand, training on
verifier-labelled arithmetic pairs, and the saved folder as a plain Hugging Face model."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from learning import MIN_PASS_RATE, constant_answer_task, held_out_pass_rates, train_rewards
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

from reinforge.config import build_config
from reinforge.errors import ConfigError
from reinforge.jobs.reward_model import run_reward_model_job
from reinforge.jobs.train import run
from reinforge.loops.dpo import PreferencePair
from reinforge.models import build_tiny_qwen2
from reinforge.models.tokenizer import load_tokenizer
from reinforge.rewards.compose import RewardComposer
from reinforge.rewards.reward_model import (
    RewardModelSource,
    bradley_terry_loss,
    build_reward_model,
    pair_accuracy,
    save_reward_model,
    score,
    train_reward_model,
)
from reinforge.rewards.source_builders import build_sources
from reinforge.rewards.sources import SourceContext
from reinforge.rollout import Rollout
from reinforge.settings import RewardConfig
from reinforge.tasks import Example
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


@pytest.mark.slow
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

    rm = tiny_reward_model(layers=2, seed=0)
    before = pair_accuracy(rm.model, rm.tokenizer, held_out)
    result = train_reward_model(rm.model, rm.tokenizer, train, steps=1500, batch_size=32, lr=1e-3, seed=0)
    after = pair_accuracy(rm.model, rm.tokenizer, held_out)

    assert before == 0.0                                      # a zero head ties every pair, and a tie is wrong
    assert result.first_loss == pytest.approx(math.log(2), abs=1e-6)
    # Measured with the model's and the batch order's seed 0 / 1 / 2 (0 runs here): final loss 0.074 / 0.171 /
    # 0.189, train accuracy 0.991 / 0.968 / 0.954, held-out 0.968 / 0.921 / 0.921 (61, 58, 58 of 63). The
    # bounds keep a margin of 0.1 or more to the worst seed; chance is 0.5 (ln 2 = 0.69 for the loss).
    assert result.final_loss < 0.4
    assert result.train_accuracy >= 0.85
    assert after >= 0.8


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


# ------------------------------------------------------------------ as a reward source


def _rollout(texts: list[str], group_size: int = 2) -> Rollout:
    n = len(texts)
    return Rollout(prompt_ids=[[0]] * n, completion_ids=torch.zeros(n, 3, dtype=torch.long), pad_id=0,
                   completion_mask=torch.ones(n, 3), sampler_logprobs=torch.zeros(n, 3),
                   truncated=torch.zeros(n, dtype=torch.bool), group_ids=torch.arange(n) // group_size,
                   policy_version=0, texts=texts)


@pytest.fixture(scope="module")
def saved_rm(tmp_path_factory) -> Path:
    """A reward model with a random head (nonzero scores) and reward statistics in its config."""
    rm = tiny_reward_model()
    torch.manual_seed(3)
    torch.nn.init.normal_(rm.model.score.weight)
    rm.model.config.reward_mean, rm.model.config.reward_std = 0.25, 2.0
    return save_reward_model(rm.model, rm.tokenizer, tmp_path_factory.mktemp("rm") / "rm")


EXAMPLES = [Example("1+2=", "3", {}), Example("5+5=", "10", {})]
TEXTS = ["03", "04", "10", "11"]


def _direct(path: Path) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(path)
    with torch.no_grad():
        return score(model, load_tokenizer(path), ["1+2=", "1+2=", "5+5=", "5+5="], TEXTS)


def test_reward_model_source_scores_in_micro_batches_as_one_forward(saved_rm):
    rows = [EXAMPLES[0], EXAMPLES[0], EXAMPLES[1], EXAMPLES[1]]
    expected = _direct(saved_rm)
    assert expected.std() > 0.01                              # distinct scores, so the order is checked
    source = RewardModelSource(saved_rm, micro_batch_size=3)  # micro-batches of 3 and 1 rows
    out = source.score(rows, _rollout(TEXTS))
    torch.testing.assert_close(out.values, expected, atol=1e-5, rtol=0)
    assert out.token_values is None and out.metrics["raw_mean"] == pytest.approx(float(expected.mean()), abs=1e-5)


def test_normalize_and_clip_by_hand(saved_rm):
    rows = [EXAMPLES[0], EXAMPLES[0], EXAMPLES[1], EXAMPLES[1]]
    raw = _direct(saved_rm)
    normalized = RewardModelSource(saved_rm, normalize=True).score(rows, _rollout(TEXTS)).values
    torch.testing.assert_close(normalized, (raw - 0.25) / 2.0, atol=1e-5, rtol=0)      # the saved mean and std
    clip = float(normalized.abs().max()) / 2                      # half the largest: some rows are clipped
    clipped = RewardModelSource(saved_rm, normalize=True, clip=clip).score(rows, _rollout(TEXTS)).values
    torch.testing.assert_close(clipped, normalized.clamp(-clip, clip), atol=1e-5, rtol=0)
    assert int((clipped.abs() == clip).sum()) >= 1


def test_a_reward_model_is_the_whole_reward_or_adds_to_the_verifier(saved_rm):
    raw = _direct(saved_rm)
    alone = RewardConfig(functions=[], model={"path": str(saved_rm)})
    context = SourceContext(task=ArithmeticTask(), device="cpu", chat_template="auto")
    composer = RewardComposer(alone, ArithmeticTask(), 8, build_sources(alone, context))
    out = composer.score(EXAMPLES, _rollout(TEXTS), group_size=2)
    torch.testing.assert_close(out.total, raw, atol=1e-5, rtol=0)
    assert list(out.parts) == ["reward_model"] and out.valid.all()
    assert out.metrics()["reward/reward_model/unscored"] == 0.0

    both = RewardConfig(functions=[{"name": "verifier", "weight": 2.0}], model={"path": str(saved_rm), "weight": 0.5})
    composer = RewardComposer(both, ArithmeticTask(), 8, build_sources(both, context))
    out = composer.score(EXAMPLES, _rollout(TEXTS), group_size=2)
    # verifier: "03" right for 1+2, "04" wrong, "10" right for 5+5, "11" wrong
    torch.testing.assert_close(out.total, 2.0 * torch.tensor([1.0, 0.0, 1.0, 0.0]) + 0.5 * raw, atol=1e-5, rtol=0)


def test_reward_model_config_errors_name_the_key(saved_rm, tmp_path):
    with pytest.raises(ConfigError, match=r"no reward source is set"):
        build_config(["reward.functions=[]"])
    with pytest.raises(ConfigError, match=r"reward.model.path="):         # TRL's reward_funcs=[model folder]
        build_config([f"reward.functions=[{saved_rm}]"])
    with pytest.raises(ConfigError, match=r"not a model folder"):
        RewardModelSource(tmp_path)
    rm = tiny_reward_model()
    plain = save_reward_model(rm.model, rm.tokenizer, tmp_path / "plain")     # no reward statistics
    with pytest.raises(ConfigError, match=r"reward.model.normalize=false"):
        RewardModelSource(plain, normalize=True)


# ------------------------------------------------------------------ the reward-model job


@pytest.mark.slow
def test_reward_model_job_from_a_pairs_file(tmp_path):
    task = ArithmeticTask(seed=0, digits=1)
    problems = task.train_split(80) + task.eval_split(20)
    rows = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}
            for p in arithmetic_pairs(task, problems, reps=10, seed=0)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = build_config(SMALL + ["model.num_layers=2", "rm.pairs=dataset", f"rm.pairs_path={data}", "rm.steps=600",
                                "rm.heldout_fraction=0.25", "threads=1", "seed=0"])
    result = run_reward_model_job(cfg, tmp_path / "rm")
    assert (result.train_pairs, result.heldout_pairs) == (750, 250)
    assert result.first_loss == pytest.approx(math.log(2), abs=1e-6)
    # Held-out pairs of seen problems, measured with the job's seed 0 / 1 / 2 (0 runs here): 0.936 / 0.900 / 0.940.
    # With 4 pairs a problem (300 trained on) they were 0.92 / 0.66 / 0.94: too few pairs for every seed to learn.
    assert result.heldout_accuracy >= 0.8
    summary = json.loads((tmp_path / "rm" / "rm_summary.json").read_text())
    assert summary["heldout_accuracy"] == result.heldout_accuracy
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert loaded.config.reward_std == pytest.approx(result.reward_std) and result.reward_std > 0
    with pytest.raises(FileExistsError):
        run_reward_model_job(cfg, tmp_path / "rm")


# ------------------------------------------------------------------ RL whose only reward is a reward model


@pytest.fixture(scope="module")
def sevens_rm(tmp_path_factory) -> Path:
    """A reward model that learned, from pairs, that "7" is the better answer to the sevens task's prompts."""
    rng = random.Random(0)
    rm = tiny_reward_model()
    # Rejected: every other character the policy can write. Trained only on digits, the reward model scored
    # unseen letters as high as "7", and RL found them: reward hacking in miniature.
    # The empty completion (eos at once) too: left out, the policy found it scored as high as "7".
    others = [""] + [t for t in rm.tokenizer.get_vocab() if t != "7" and t not in rm.tokenizer.all_special_tokens]
    # Each of them rejected 8 times: a token seldom shown kept a score near "7"'s in one run of four.
    pairs = [PreferencePair("".join(rng.choice("abcdefgh") for _ in range(4)) + "=", "7", other)
             for other in others for _ in range(8)]
    train_reward_model(rm.model, rm.tokenizer, pairs, steps=300, batch_size=32, lr=3e-3, seed=0)
    # Every text the policy can write: one character, or none (a special token such as <unk> decodes to
    # nothing in a completion, so its own spelling, never trained on, is no completion the policy can reach).
    texts = ["7"] + others
    with torch.no_grad():
        scores = score(rm.model, rm.tokenizer, ["abcd="] * len(texts), texts)
    assert scores[0] == scores.max()
    assert sorted(scores.tolist())[-2] < scores.max() - 3        # every other completion well below "7"
    return save_reward_model(rm.model, rm.tokenizer, tmp_path_factory.mktemp("sevens") / "rm")


@pytest.mark.parametrize("recipe", ["dr_grpo", "ppo"])
def test_rl_with_only_a_reward_model_raises_held_out_accuracy(tmp_path, sevens_rm, recipe):
    # The verifier never scores a training sample: the reward is the reward model's score alone
    # (ppo: InstructGPT's actor, critic, reference and reward model). Held-out pass@1 is the verifier's.
    # Not grpo: the reward model scores every wrong answer about -3.5, give or take 0.01, and GRPO's division
    # by the group's std turns those differences into full-size advantages; before the untrained policy
    # (1 "7" in ~90 samples) finds "7", it can settle on whichever wrong token the noise favours (3 runs in 4
    # under some thread counts). Dr. GRPO does not divide: the noise stays 0.01 and the one "7" counts. But
    # Adam rescales even 0.01-sized gradients to full steps, so a run whose first steps hold no "7" drifts
    # on noise (1 run in 3 with 64 samples a step): 256 samples a step put a "7" in nearly every step.
    out = tmp_path / "run"
    extra = ["train.steps=30", "critic.lr=3e-2"] if recipe == "ppo" else ["train.prompts_per_step=32"]
    run(build_config([*constant_answer_task(tmp_path), f"recipe={recipe}", "reward.functions=[]",
                      f"reward.model.path={sevens_rm}", f"output_dir={out}", *extra]))
    start, final = held_out_pass_rates(out)
    assert start <= 0.05
    # Measured with the reward model's and the run's seed 0 / 1 / 2 (0 runs here): 0 -> 1.0 on all three, dr_grpo
    # and ppo alike; the train reward rose by 7.0 / 7.6 / 6.8 (dr_grpo) and 7.6 / 7.6 / 7.8 (ppo), "7" scored
    # 7.7-7.8 above the next completion. Bounds: 0.6, 1.0 and 3.
    assert final >= start + MIN_PASS_RATE
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x.get("stage") == "rl"]
    assert "reward/verifier_mean" not in steps[0] and list(json.loads(
        (out / "samples.jsonl").read_text().splitlines()[0])["rewards"]) == ["reward_model"]
    # weight 1, no normalisation: the train reward is the reward model's raw score
    assert steps[-1]["reward/reward_model/raw_mean"] == pytest.approx(steps[-1]["reward/total_mean"], abs=1e-5)
    rewards = train_rewards(out)
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 1.0       # the reward model's score rose
