"""benchmarks/widening.py's arithmetic: the crossover k and the widening test that docs/results.md reports,
on hand-made curves (no training)."""

from __future__ import annotations

import importlib.util
import random

import pytest
from repo_paths import REPO

BENCHMARKS = REPO / "benchmarks"


@pytest.fixture(scope="module")
def widening():
    spec = importlib.util.spec_from_file_location("widening", BENCHMARKS / "widening.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


START = {"pass@k": {"1": 0.40, "2": 0.60, "4": 0.80, "8": 0.90, "16": 0.95}, "greedy_accuracy": 0.70}


def test_crossover_is_the_first_k_below_the_start(widening):
    # 0.58 < 0.60 - 0.0005 at k = 2; at k = 1 the recipe is above.
    assert widening.crossover(START["pass@k"], {"1": 0.5, "2": 0.58, "4": 0.9, "8": 0.95, "16": 0.99}) == 2
    # Level within the 0.0005 margin is not a crossing (two curves at 1.000), nor is staying above.
    assert widening.crossover(START["pass@k"], {"1": 0.5, "2": 0.6, "4": 0.7996, "8": 0.9, "16": 0.95}) is None
    assert widening.crossover(START["pass@k"], {"1": 0.5, "2": 0.6, "4": 0.7994, "8": 0.9, "16": 0.95}) == 4


def test_summarise_means_spreads_and_the_widening_test(widening):
    finals = [{"pass@k": {"1": 0.55, "2": 0.7, "4": 0.8, "8": 0.90, "16": 0.94}, "greedy_accuracy": 0.70},
              {"pass@k": {"1": 0.59, "2": 0.7, "4": 0.8, "8": 0.88, "16": 0.94}, "greedy_accuracy": 0.72}]
    r = widening.summarise(START, finals)
    assert r["pass@k"]["1"] == pytest.approx(0.57)
    assert r["pass@k_std"]["1"] == pytest.approx(0.02 * 2 ** 0.5)      # sample std of 0.55, 0.59
    assert r["greedy"] == pytest.approx(0.71) and r["greedy_drop"] == pytest.approx(-0.01)
    assert r["pass@1_gain"] == pytest.approx(0.17) and r["pass@8_drop"] == pytest.approx(0.01)
    assert r["crossover_k"] == 8           # 0.89 < 0.90 - 0.0005; above the start at k = 1, 2, level at 4
    assert r["widens"] is False            # pass@8 fell by 0.01 > 0.005
    finals[1]["pass@k"]["8"] = 0.90
    r = widening.summarise(START, finals)
    assert r["pass@8_drop"] == pytest.approx(0.0) and r["widens"] is True
    finals[0]["pass@k"]["1"] = 0.45        # gain 0.12 < 0.15
    assert widening.summarise(START, finals)["widens"] is False


def test_command_line_settings_win_over_the_tasks_own(widening):
    settings, sft, rl = widening.task_settings("word_sequence_reversal", {}, 120)
    assert (sft, rl, settings["model.max_positions"]) == (300, 120, 224) and "sft.steps" not in settings
    settings, sft, rl = widening.task_settings(
        "word_sequence_reversal", {"sft.steps": 250, "train.steps": 90, "model.max_positions": 256}, 120)
    assert (sft, rl, settings["model.max_positions"]) == (250, 90, 256) and "train.steps" not in settings


def test_every_reasoning_gym_entry_is_a_valid_dataset_config(widening):
    pytest.importorskip("reasoning_gym")
    from reinforge.tasks.reasoning_gym import ReasoningGymTask

    entries = {name: t for name, t in widening.TASKS.items() if t["task.name"] == "reasoning_gym"}
    assert {"spell_backward", "word_sequence_reversal", "rotate_matrix", "simple_equations"} <= set(entries)
    rng = random.Random(0)
    for name, entry in entries.items():
        task = ReasoningGymTask(datasets=entry["task.options.datasets"], pool_size=5000)
        assert task.domains == (name,)
        # the built-in model's char tokenizer: a character a token. A question and the whole budget of new
        # tokens fit in the model's positions, and a gold answer and its end token in that budget, but for
        # a rare one (word_sequence_reversal: 0.25% of answers run past 31 characters, unsolvable at any k)
        positions = entry.get("model.max_positions", ReasoningGymTask.preset["model"]["max_positions"])
        budget = entry.get("rollout.max_new_tokens", ReasoningGymTask.preset["rollout"]["max_new_tokens"])
        examples = [task._sample_problem(rng) for _ in range(1000)]
        assert max(len(e.prompt) for e in examples) + budget <= positions, name
        too_long = sum(len(task.teacher_completion(e, rng)) + 1 > budget for e in examples)
        assert too_long <= 10, (name, too_long)
