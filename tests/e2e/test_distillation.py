"""Distillation (reinforge/rewards/teacher.py, sft.teacher_path): the per-token reverse KL advantage by
hand, its expected gradient against the exact reverse KL, the tokenizer check, curation and pass metrics
of a teacher-only run, and short runs where on-policy and offline distillation raise held-out pass@1."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from learning import constant_answer_task, held_out_pass_rates
from repo_paths import REPO

from reinforge.config import build_config
from reinforge.curation.batches import Groups, zero_variance
from reinforge.errors import ConfigError
from reinforge.jobs.multistage import PipelineSpec, run_pipeline, stage_configs
from reinforge.jobs.train import run
from reinforge.learner import ForwardPlan, build_sequences, token_logprobs
from reinforge.loops.rl import composed_scores, with_token_terms
from reinforge.models import build_tiny_qwen2
from reinforge.models.factory import save_policy
from reinforge.objectives.policy import ppo_clip
from reinforge.rewards.compose import RewardComposer
from reinforge.rewards.source_builders import build_sources
from reinforge.rewards.sources import SourceContext
from reinforge.rewards.teacher import TeacherSource, check_teacher, load_teacher, reverse_kl_terms
from reinforge.rollout import Rollout, SamplingParams, build_engine
from reinforge.tasks import Example, build_task

SMALL = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64"]


def close(actual: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def tiny_policy(seed: int = 0):
    return build_tiny_qwen2(build_config(SMALL).model, seed=seed)


def uniform_teacher(directory: Path) -> Path:
    """A 1-layer built-in model whose final norm is zeroed: every hidden state is 0, so every logit is 0
    (tied embeddings, no bias) and the teacher's next-token distribution is uniform, log p = -log V."""
    policy = tiny_policy(seed=3)
    with torch.no_grad():
        policy.model.model.norm.weight.zero_()
    save_policy(policy, directory)
    return directory


def hand_rollout(sampler_logprobs: list[list[float]], lengths: list[int]) -> Rollout:
    """Two samples of "1+2=": "3<eos>" and "9" (tokens of the char vocabulary), sampler log-probs by hand."""
    tok = tiny_policy().tokenizer
    ids = [tok("3")["input_ids"] + [tok.eos_token_id], tok("9")["input_ids"] + [tok.pad_token_id]]
    mask = torch.tensor([[1.0] * n + [0.0] * (2 - n) for n in lengths])
    return Rollout(prompt_ids=[tok("1+2=")["input_ids"]] * 2,
                   completion_ids=torch.tensor(ids), pad_id=tok.pad_token_id, completion_mask=mask,
                   sampler_logprobs=torch.tensor(sampler_logprobs) * mask, truncated=torch.tensor([False, False]),
                   group_ids=torch.tensor([0, 0]), policy_version=0, texts=["3", "9"])


# ------------------------------------------------------------------ the advantage by hand


def test_reverse_kl_terms_by_hand():
    sampler = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, 0.0, 0.0]])
    teacher = torch.tensor([[-1.5, -0.25, -2.0], [-3.0, -9.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # k = sampler - teacher: 1.0, -0.75, 0.0 | 2.9, and 0 on padding whatever the teacher says there
    close(reverse_kl_terms(sampler, teacher, mask), [[1.0, -0.75, 0.0], [2.9, 0.0, 0.0]], atol=1e-6)


def test_uniform_teacher_gives_each_token_minus_k_by_hand(tmp_path):
    teacher = TeacherSource(load_teacher(uniform_teacher(tmp_path / "uniform"), tiny_policy().tokenizer, "cpu"))
    vocab = len(tiny_policy().tokenizer)                       # 89 characters and specials
    rollout = hand_rollout([[-0.5, -2.0], [-1.0, 0.0]], lengths=[2, 1])
    out = teacher.score([], rollout)
    log_v = math.log(vocab)                                    # 4.488636
    # -k_t = log p_teacher - log p_sampler = -log 89 - s: -3.988636, -2.488636 | -3.488636, padding 0
    assert out.values is None
    close(out.token_values, [[-log_v + 0.5, -log_v + 2.0], [-log_v + 1.0, 0.0]])
    # per token: the mean of k over the 3 tokens; per sample: the mean of each row's sum
    k = [log_v - 0.5, log_v - 2.0, log_v - 1.0]
    assert out.metrics["reverse_kl"] == pytest.approx(sum(k) / 3, abs=1e-5)              # 2.988636
    assert out.metrics["reverse_kl_seq"] == pytest.approx((k[0] + k[1] + k[2]) / 2, abs=1e-5)
    assert out.metrics["teacher_logprob"] == pytest.approx(-log_v, abs=1e-5)


def test_composer_weights_the_teacher_terms_and_the_learner_adds_them_to_the_group_advantage(tmp_path):
    path = uniform_teacher(tmp_path / "uniform")
    cfg = build_config([*SMALL, "reward.functions=[]", f"reward.teacher.path={path}", "reward.teacher.weight=0.5"])
    task = build_task("arithmetic")
    policy = tiny_policy()
    composer = RewardComposer(cfg.reward, task, 4, build_sources(cfg.reward, SourceContext(
        task=task, device="cpu", chat_template="auto", policy=policy, temperature=1.0)))
    rollout = hand_rollout([[-0.5, -2.0], [-1.0, 0.0]], lengths=[2, 1])
    examples = [Example("1+2=", "3", {"a": 1, "op": "+", "b": 2})]      # a group of 2: "3" is right, "9" wrong
    scores = composed_scores(composer, group_size=2)(examples, rollout)
    log_v = math.log(len(policy.tokenizer))
    # no reward function: every sequence reward is 0, and the tokens carry 0.5 * -k_t
    assert scores.rewards.tolist() == [0.0, 0.0] and scores.valid.all()
    close(scores.token_advantages, [[0.5 * (0.5 - log_v), 0.5 * (2.0 - log_v)], [0.5 * (1.0 - log_v), 0.0]])
    # pass rates still mean "the verifier accepted it": the task's verifier judges each row
    assert scores.correct.tolist() == [True, False]
    assert scores.metrics["reward/teacher/reverse_kl"] == pytest.approx(log_v - 3.5 / 3, abs=1e-5)
    # the learner: the group advantage (here [0.3, -0.3], say from a verifier) plus the token terms, on the mask
    total = with_token_terms(torch.tensor([0.3, -0.3]), scores.token_advantages, rollout.completion_mask)
    close(total, [[0.3 + 0.5 * (0.5 - log_v), 0.3 + 0.5 * (2.0 - log_v)], [-0.3 + 0.5 * (1.0 - log_v), 0.0]])


def test_teacher_equal_to_the_student_gives_zero_advantages(tmp_path):
    policy = tiny_policy(seed=1)
    save_policy(policy, tmp_path / "same")
    source = TeacherSource(load_teacher(tmp_path / "same", policy.tokenizer, "cpu"), temperature=0.7)
    rollout = build_engine(build_config(SMALL).rollout, policy).generate(
        ["1+2=", "33+44="], 4, SamplingParams(temperature=0.7, max_new_tokens=5),
        generator=torch.Generator().manual_seed(0))
    # The learner's log-probs of the same rows (what the sampler's are, up to its kernels' rounding): exactly 0.
    sequences = build_sequences(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask, rollout.pad_id)
    learner = token_logprobs(policy.model, sequences, 0.7, ForwardPlan(micro_batch_tokens=None, chunk_size=1024))
    exact = Rollout(**{**rollout.__dict__, "sampler_logprobs": learner})
    assert torch.equal(source.score([], exact).token_values, torch.zeros_like(learner))
    # The native sampler's own log-probs: the same distribution, so every term is float rounding.
    assert source.score([], rollout).token_values.abs().max() < 1e-4
    assert rollout.completion_mask.sum() > 8


# ------------------------------------------------------------------ the gradient


def test_expected_policy_gradient_with_minus_k_is_the_reverse_kl_gradient():
    # A student softmax(theta) over 3 tokens and a fixed teacher q. Enumerating every token y (one row each),
    # the PPO surrogate at ratio 1 with A(y) = -k(y) = log q(y) - log pi(y), weighted by pi(y) (detached, the
    # sampling probability), has gradient sum_y pi(y) k(y) grad log pi(y) = grad KL(pi || q): the score-function
    # identity, with sum_y pi grad log pi = 0 removing the "+1" of d/dpi (pi log pi).
    theta = torch.tensor([0.3, -1.2, 0.8], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64)
    logp = torch.log_softmax(theta, dim=0)
    kl = (logp.exp() * (logp - q.log())).sum()
    (expected,) = torch.autograd.grad(kl, theta)

    logprobs = torch.log_softmax(theta, dim=0)[:, None]                 # [3, 1]: row y holds token y
    advantages = -reverse_kl_terms(logprobs.detach(), q.log()[:, None], torch.ones(3, 1, dtype=torch.float64))
    terms = ppo_clip(logprobs=logprobs, old_logprobs=logprobs.detach(), advantages=advantages,
                     mask=torch.ones(3, 1, dtype=torch.float64)).loss   # [3, 1] -r A
    loss = (logprobs.detach().exp() * terms).sum()
    (gradient,) = torch.autograd.grad(loss, theta)
    assert gradient.tolist() == pytest.approx(expected.tolist(), abs=1e-12)
    assert expected.abs().max() > 0.05                                    # a real gradient, not 0 = 0
    # and with q = pi the gradient vanishes: the teacher agrees with every token
    same = -reverse_kl_terms(logprobs.detach(), logprobs.detach(), torch.ones(3, 1, dtype=torch.float64))
    assert torch.equal(same, torch.zeros(3, 1, dtype=torch.float64))


# ------------------------------------------------------------------ checks and plumbing


def test_a_teacher_with_another_tokenizer_is_a_config_error(llama_dir):
    with pytest.raises(ConfigError, match=r"reward.teacher.path .*tokenizer is not the policy's"):
        check_teacher(str(llama_dir), "builtin")
    with pytest.raises(ConfigError, match="reward.teacher.path: "):
        check_teacher("/nonexistent/teacher", "builtin")


def test_a_run_with_a_mismatched_teacher_stops_before_writing(llama_dir, tmp_path, micro_overrides):
    out = tmp_path / "run"
    cfg = build_config([*micro_overrides, "reward.functions=[]", f"reward.teacher.path={llama_dir}",
                        f"output_dir={out}"])
    with pytest.raises(ConfigError, match="tokenizer is not the policy's"):
        run(cfg)
    assert not out.exists()


def test_zero_variance_keeps_a_group_with_token_terms():
    equal = torch.zeros(2, 3)
    groups = Groups(rewards=equal, valid=torch.ones(2, 3, dtype=torch.bool), correct=equal.bool(),
                    truncated=equal.bool())
    assert zero_variance(groups).tolist() == [False, False]
    with_terms = Groups(**{**groups.__dict__, "token_signal": torch.tensor([True, False])})
    assert zero_variance(with_terms).tolist() == [True, False]


def test_sft_teacher_path_needs_rejection():
    with pytest.raises(ConfigError, match="sft.source=rejection"):
        build_config(["sft.teacher_path=/x"])


def test_r1_distill_stages_read_the_teacher_from_an_earlier_stage(tmp_path):
    teacher_sft, teacher_rl, student, distill = stage_configs(PipelineSpec.load("r1_distill"), [], tmp_path / "out")
    assert teacher_rl.model.path == str(tmp_path / "out" / "1-teacher_cold_start" / "model")
    # the student starts from the pipeline's own model, not from the teacher
    assert student.model.path == "builtin"
    assert student.sft.source == "teacher" and student.train.steps == 0
    assert distill.model.path == str(tmp_path / "out" / "3-student_cold_start" / "model")
    assert distill.sft.source == "rejection"
    assert distill.sft.teacher_path == str(tmp_path / "out" / "2-teacher_rl" / "model")


def test_a_stage_cannot_name_a_later_stage(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps({"stages": [
        {"name": "a", "settings": {"sft.source": "rejection", "sft.teacher_path": "{b}/model"}},
        {"name": "b", "settings": {"train.steps": 0}}]}))
    with pytest.raises(ConfigError, match="stage 'a': .*names stage 'b', which has not run yet"):
        stage_configs(PipelineSpec.load(str(path)), [], tmp_path / "out")


# ------------------------------------------------------------------ short runs


@pytest.fixture(scope="module")
def sevens_teacher(tmp_path_factory) -> tuple[list[str], Path, float]:
    """The micro model taught by GRPO to answer "7" (tests/learning.py): (the task's overrides, its model
    folder, its held-out pass@1)."""
    directory = tmp_path_factory.mktemp("sevens")
    task = constant_answer_task(directory)
    run(build_config([*task, f"output_dir={directory / 'teacher'}"]))
    return task, directory / "teacher" / "model", held_out_pass_rates(directory / "teacher")[1]


def test_on_policy_distillation_alone_raises_held_out_pass_rate_toward_the_teacher(sevens_teacher, tmp_path):
    # A fresh student (another seed: answers "7" about 1 time in 40) trained only by the teacher's per-token
    # reverse KL: no reward function, so every sequence reward and group advantage is 0.
    task, teacher, teacher_pass = sevens_teacher
    out = tmp_path / "student"
    run(build_config([*task, "seed=5", "reward.functions=[]", f"reward.teacher.path={teacher}",
                      "objective.kl_coef=0", "train.steps=12", f"output_dir={out}"]))
    start, final = held_out_pass_rates(out)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x.get("stage") == "rl"]
    # Measured with the teacher's seed 0 / 1 / 2 and the student's 5 / 6 / 7 (0 and 5 run here): teacher 0.92 /
    # 0.98 / 1.00, student 0.008 / 0 / 0 -> 1.0 / 1.0 / 1.0, reverse KL 5.19 / 6.68 / 9.24 -> -0.04 / 0.01 / -0.002.
    assert teacher_pass >= 0.7
    assert start <= 0.1
    assert final >= 0.6
    assert all(x["reward_mean"] == 0.0 for x in steps)              # the sequence reward says nothing
    kl = [x["reward/teacher/reverse_kl"] for x in steps]
    assert kl[-1] < 0.5 * kl[0]
    # the pass rate of the training samples comes from the verifier, and rises with the held-out one
    assert steps[-1]["pass_rate"] > steps[0]["pass_rate"]


@pytest.mark.slow
def test_offline_distillation_fine_tunes_on_the_teachers_verified_samples(tmp_path):
    # The teacher: the micro model fine-tuned on "7<eos>" (the sevens task with a completion column); it
    # ends its answers, which rejection sampling needs (a sample cut at max_new_tokens is never kept).
    task = [o for o in constant_answer_task(tmp_path) if not o.startswith("rollout.max_new_tokens")]
    data = Path(next(o for o in task if o.startswith("task.options.path=")).partition("=")[2])
    data.write_text("".join(json.dumps({**json.loads(line), "completion": "7"}) + "\n"
                            for line in data.read_text().splitlines()))
    sft = ["sft.enabled=true", "sft.batch_size=16", "sft.lr=1e-2", "sft.warmup_steps=0", "rollout.max_new_tokens=3",
           "train.steps=0"]
    run(build_config([*task, *sft, "sft.steps=60", "sft.corrupt_fraction=0", f"output_dir={tmp_path / 'teacher'}"]))
    teacher_pass = held_out_pass_rates(tmp_path / "teacher")[1]
    # The student: a fresh model (another seed) fine-tuned on the teacher's verified samples only.
    out = tmp_path / "student"
    run(build_config([*task, *sft, "seed=5", "sft.steps=60", "sft.source=rejection",
                      f"sft.teacher_path={tmp_path / 'teacher' / 'model'}", "sft.rejection_prompts=64",
                      "sft.rejection_samples=2", "sft.rejection_max_per_prompt=1", f"output_dir={out}"]))
    summary = json.loads((out / "summary.json").read_text())
    # The teacher's samples (a fresh student's own would be right about once in 40 x 40), one per prompt.
    # Measured with the teacher's seed 0 / 1 / 2 and the student's 5 / 6 / 7 (0 and 5 run here): teacher 0.996,
    # acceptance 1.0 and student 0.996 on each; 0.8 leaves a margin of 0.2, chance is 1/40.
    assert teacher_pass >= 0.8
    assert summary["sft"]["rejection/acceptance_rate"] >= 0.8 and summary["sft"]["rejection/kept"] == 64
    assert summary["eval"]["final"]["pass@1"] >= 0.8


@pytest.mark.slow
def test_distill_benchmark_runs_in_a_small_configuration(tmp_path, micro_overrides):
    # benchmarks/learned_rewards_distill.py on the micro model (its figures are the docs'; here: that it runs
    # against the current code, and that its gains and step counts are read off its own curves).
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from learned_rewards_distill import distill_gain

    micro = [o for o in micro_overrides if not o.startswith(("train.steps=", "threads="))]
    out = distill_gain(0, steps=4, eval_every=2, threads=1, overrides=micro, workdir=tmp_path)
    start = out["student_start_pass@1"]
    assert out["distill_gain"] == pytest.approx(out["distill_pass@1"] - start)
    assert out["grpo_gain"] == pytest.approx(out["grpo_pass@1"] - start)
    assert [step for step, _ in out["distill_curve"]] == [step for step, _ in out["grpo_curve"]] == [0, 2, 4]
    assert out["distill_curve"][0][1] == out["grpo_curve"][0][1] == start
    assert len(out["distill_reverse_kl"]) == 4 and all(k == k for k in out["distill_reverse_kl"])
    for method in ("distill", "grpo"):
        reached = out[f"{method}_steps_to_gain"]
        assert reached is None or dict(out[f"{method}_curve"])[reached] - start >= out["gain_counted"] - 1e-9
    assert 0 < out["seconds"] and (tmp_path / "teacher" / "model" / "config.json").is_file()


@pytest.mark.slow
def test_r1_distill_runs_its_four_stages_end_to_end(tmp_path, micro_overrides):
    # One-digit sums and a longer cold start give the micro teacher correct samples to hand over.
    micro = [o for o in micro_overrides if not o.startswith(("train.steps=", "sft.steps="))]
    args = [*micro, "train.steps=2", "task.options.digits=1", "train.num_prompts=40", "sft.steps=150",
            "sft.batch_size=32", "sft.num_examples=4800", "distill:sft.steps=5", "distill:sft.rejection_prompts=16"]
    stages = run_pipeline("r1_distill", args, tmp_path / "out").stages
    assert [(s.name, s.rl_steps) for s in stages] == [
        ("teacher_cold_start", 0), ("teacher_rl", 2), ("student_cold_start", 0), ("distill", 0)]
    sft = json.loads((tmp_path / "out" / "4-distill" / "summary.json").read_text())["sft"]
    assert sft["source"] == "rejection" and sft["rejection/kept"] >= 1 and sft["steps"] == 5
    # the distill stage fine-tunes the student (its own cold start) on the RL teacher's samples
    cfg = yaml.safe_load((tmp_path / "out" / "4-distill" / "config.yaml").read_text())
    assert cfg["model"]["path"] == str(tmp_path / "out" / "3-student_cold_start" / "model")
    assert cfg["sft"]["teacher_path"] == str(tmp_path / "out" / "2-teacher_rl" / "model")
    student = yaml.safe_load((tmp_path / "out" / "3-student_cold_start" / "config.yaml").read_text())
    assert student["model"]["path"] == "builtin" and student["seed"] == 1
