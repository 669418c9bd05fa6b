"""task.name=reasoning_gym: seeded disjoint splits of reasoning-gym's generators, its score_answer as
the verifier (in a bounded worker process), configurable answer extraction, a domain per dataset.
No training here."""

from __future__ import annotations

import random

import pytest

from reinforge.config import build_config
from reinforge.errors import ConfigError
from reinforge.jobs.start import prepare
from reinforge.tasks import build_task
from reinforge.tasks.reasoning_gym import ReasoningGymTask

DATASETS = ["chain_sum", "spell_backward"]


@pytest.fixture(scope="module")
def task() -> ReasoningGymTask:
    return build_task("reasoning_gym", datasets=DATASETS, answer_format="answer_tag", seed=3)


def test_splits_are_seeded_disjoint_and_prefix_stable(task):
    train, held_out = task.train_split(40), task.eval_split(10)
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    again = build_task("reasoning_gym", datasets=DATASETS, answer_format="answer_tag", seed=3)
    assert again.eval_split(10) == held_out and again.train_split(20) == train[:20]
    other = build_task("reasoning_gym", datasets=DATASETS, answer_format="answer_tag", seed=4)
    assert [e.prompt for e in other.train_split(10)] != [e.prompt for e in train[:10]]
    # every prompt asks for the answer format, every example names its dataset and item
    assert all(e.prompt.endswith("Give your final answer inside <answer></answer>.") for e in train)
    assert {e.meta["dataset"] for e in train} == set(DATASETS)
    assert task.domains == tuple(DATASETS) and [task.domain_of(e) for e in train] == [e.meta["dataset"] for e in train]


def test_the_datasets_scorer_is_the_verifier(task):
    rng = random.Random(0)
    for example in task.train_split(6):
        gold = example.answer
        assert task.reward(example, task.teacher_completion(example, rng)) == 1.0
        assert task.reward(example, f"I think... <answer>x</answer> then <answer> {gold} </answer>") == 1.0
        assert task.reward(example, gold) == 0.0                       # no <answer> tag: no answer
        assert task.reward(example, f"<answer>{gold}</answer>junk<answer>0{gold}9</answer>") == 0.0   # the last counts
        assert task.reward(example, task.corrupt_completion(example, rng)) == 0.0
        assert task.reward(example, None) == 0.0                       # never raises on model output


def test_sft_traces_are_scored_as_labelled(task):
    traces = task.sft_examples(8, corrupt_fraction=0.5, seed=1)
    by_prompt = {e.prompt: e for e in task.train_split(8)}
    assert {t.correct for t in traces} == {True, False}
    for trace in traces:
        assert task.reward(by_prompt[trace.prompt], trace.completion) == float(trace.correct)


def test_answer_extraction_is_configurable():
    plain = build_task("reasoning_gym", datasets=["chain_sum"])
    example = plain.train_split(1)[0]
    assert plain.extract(f"  {example.answer}\n") == example.answer
    assert plain.reward(example, f"  {example.answer}\n") == 1.0
    assert plain.teacher_completion(example, random.Random(0)) == example.answer
    boxed = build_task("reasoning_gym", datasets=["chain_sum"], answer_format="boxed")
    assert boxed.extract("so \\boxed{12} and finally \\boxed{-51}") == "-51"
    assert boxed.teacher_completion(example, random.Random(0)) == f"\\boxed{{{example.answer}}}"
    custom = build_task("reasoning_gym", datasets=["chain_sum"], pattern=r"ANSWER: *(\S+)")
    assert custom.extract("ANSWER: 3 ... ANSWER: 7") == "7" and custom.extract("7") is None
    assert build_task("reasoning_gym", datasets=["chain_sum"], max_answer_chars=3).extract("12345") is None


def test_bad_options_are_config_errors_that_name_the_fix():
    with pytest.raises(ValueError, match=r"unknown reasoning-gym dataset 'chain_sam'; did you mean 'chain_sum'\?"):
        build_task("reasoning_gym", datasets=["chain_sam"])
    with pytest.raises(ValueError, match="answer_format must be one of plain, answer_tag, boxed"):
        build_task("reasoning_gym", answer_format="xml")
    with pytest.raises(ValueError, match=r"reasoning-gym dataset 'chain_sum': bad config"):
        build_task("reasoning_gym", datasets=[{"name": "chain_sum", "config": {"no_such_option": 1}}])
    cfg = build_config(["task.name=reasoning_gym", "task.options.datasets=[chain_sum,spell_bakward]"])
    with pytest.raises(ConfigError, match="did you mean 'spell_backward'"):
        prepare(cfg)


def test_the_scorer_runs_in_a_bounded_worker_process(task):
    # score_answer is third-party code fed model output: it runs in the shared pool's worker processes,
    # which verifiers/bounded.py kills past task.timeout_s (tests/unit/verifiers/test_bounded_calls.py checks the kill).
    from reinforge.tasks import reasoning_gym

    example = task.train_split(1)[0]
    assert task.reward(example, task.teacher_completion(example, random.Random(0))) == 1.0
    assert reasoning_gym._POOL.size >= 1 and task.timeout_s == 10.0


def test_the_task_preset_fits_its_questions_in_the_built_in_model():
    cfg = build_config(["task.name=reasoning_gym", "task.options.datasets=[chain_sum,spell_backward]"])
    assert (cfg.model.max_positions, cfg.rollout.max_new_tokens) == (192, 32)
    assert cfg.task.options["datasets"] == ["chain_sum", "spell_backward"]
    assert build_config(["task.name=reasoning_gym", "model.max_positions=256"]).model.max_positions == 256
