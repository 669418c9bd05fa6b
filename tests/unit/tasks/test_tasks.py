"""Tasks: prompt formats, split hygiene, teacher/corrupt traces, SFT mixing, registry."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from reinforge.models.charset import CHARSET
from reinforge.tasks import TASKS, Example, Task, build_task
from reinforge.tasks.arithmetic import ArithmeticTask
from reinforge.tasks.chain_sum import ChainSumTask
from reinforge.tasks.countdown import CountdownTask, solve
from reinforge.verifiers.countdown import evaluate_countdown

_ARITH_PROMPT = re.compile(r"([0-9]+)([+\-*])([0-9]+)=")


def _task_variants() -> list[Task]:
    return [
        ArithmeticTask(),
        ArithmeticTask(seed=3, digits=3, operators="+-*"),
        CountdownTask(),
        CountdownTask(seed=5, num_numbers=4, max_number=20, max_target=200),
        ChainSumTask(),
        ChainSumTask(seed=2, terms=3, digits=2, zero_pad=False),
    ]


def _prompts(examples) -> set[str]:
    return {e.prompt for e in examples}


# ---------------------------------------------------------------- formats


def test_arithmetic_prompt_and_answer() -> None:
    task = ArithmeticTask(seed=1, digits=2, operators="+-*")
    examples = task.train_split(300)
    assert Counter(e.meta["op"] for e in examples).keys() == {"+", "-", "*"}
    for e in examples:
        match = _ARITH_PROMPT.fullmatch(e.prompt)
        assert match is not None, e.prompt
        a, op, b = int(match[1]), match[2], int(match[3])
        assert 0 <= a <= 99 and 0 <= b <= 99
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert e.answer == str(expected)
        assert e.meta == {"a": a, "op": op, "b": b}
    assert any(e.answer.startswith("-") for e in examples)


def test_countdown_prompt_and_answer() -> None:
    task = CountdownTask(seed=2, num_numbers=3, max_number=10, max_target=100)
    for e in task.train_split(300) + task.eval_split(100):
        numbers, target = e.meta["numbers"], e.meta["target"]
        assert e.prompt == f"{numbers[0]} {numbers[1]} {numbers[2]}>{target}:"
        assert e.answer == str(target)
        assert all(1 <= x <= 10 for x in numbers)
        assert 1 <= target <= 100
        assert json.loads(json.dumps(e.meta)) == e.meta


def test_solver_hand_cases() -> None:
    # Order (3,5,7): no 2-number solution; first 3-number tree that hits 22 is (3*5)+7.
    assert solve([3, 5, 7], 22) == "3*5+7"
    assert solve([3, 5, 7], 8) == "3+5"  # fewest numbers first
    assert solve([2, 3], 7) is None  # 5, -1, 1, 6, 2/3, 3/2
    # Only reachable through a fraction: 6/(1-3/4).
    solution = solve([1, 3, 4, 6], 24)
    assert solution is not None
    example = Example("1 3 4 6>24:", "24", {"numbers": [1, 3, 4, 6], "target": 24})
    assert CountdownTask().reward(example, solution) == 1.0


def test_all_text_is_in_charset() -> None:
    alphabet = set(CHARSET)
    rng = random.Random(0)
    for task in _task_variants():
        for e in task.train_split(200) + task.eval_split(50):
            texts = [
                e.prompt,
                e.answer,
                task.teacher_completion(e, rng),
                task.corrupt_completion(e, rng),
            ]
            for text in texts:
                assert set(text) <= alphabet, (task.name, text)


# ----------------------------------------------------------------- splits


@pytest.mark.parametrize("make", [ArithmeticTask, CountdownTask])
def test_splits_disjoint_and_deterministic(make) -> None:
    train = make().train_split(3000)
    held_out = make().eval_split(700)
    assert len(_prompts(train)) == 3000  # no duplicates within a split
    assert len(_prompts(held_out)) == 700
    assert not _prompts(train) & _prompts(held_out)
    # Membership does not depend on the seed: another seed's train set is disjoint too.
    assert not _prompts(make(seed=1).train_split(3000)) & _prompts(held_out)
    # Same seed, fresh instance: identical lists; different seed: different order.
    assert make().train_split(3000) == train
    assert make(seed=1).train_split(50) != train[:50]


@pytest.mark.parametrize("make", [ArithmeticTask, CountdownTask])
def test_split_prefix_property_and_call_order(make) -> None:
    full = make().train_split(500)
    task = make()
    assert task.eval_split(200) == make().eval_split(200)  # asking eval first...
    assert task.train_split(100) == full[:100]  # ...does not perturb train
    assert task.train_split(500) == full
    assert task.train_split(100) == full[:100]  # repeated calls agree


def test_commuted_problems_share_a_split() -> None:
    task = ArithmeticTask(operators="+*")
    train = _prompts(task.train_split(4000))
    held_out = task.eval_split(800)
    for e in held_out:
        swapped = f"{e.meta['b']}{e.meta['op']}{e.meta['a']}="
        assert swapped not in train


def test_small_space_is_covered_exactly_then_exhausted() -> None:
    # 1-digit addition has exactly 10 * 10 = 100 distinct prompts.
    with pytest.raises(ValueError, match=r"only \d+ distinct train") as info:
        ArithmeticTask(digits=1).train_split(100)
    n_train = int(re.search(r"only (\d+)", str(info.value))[1])
    with pytest.raises(ValueError, match=r"only \d+ distinct eval") as info:
        ArithmeticTask(digits=1).eval_split(100)
    n_eval = int(re.search(r"only (\d+)", str(info.value))[1])
    assert n_train + n_eval == 100
    task = ArithmeticTask(digits=1)
    union = _prompts(task.train_split(n_train)) | _prompts(task.eval_split(n_eval))
    assert union == {f"{a}+{b}=" for a in range(10) for b in range(10)}


def test_negative_n_rejected() -> None:
    with pytest.raises(ValueError):
        ArithmeticTask().train_split(-1)
    assert ArithmeticTask().train_split(0) == []


# ---------------------------------------------------- teacher and corrupt


@pytest.mark.parametrize("task", _task_variants(), ids=lambda t: f"{t.name}-{t.seed}")
def test_teacher_always_right_corrupt_always_wrong(task: Task) -> None:
    rng = random.Random(0)
    for e in task.train_split(300) + task.eval_split(100):
        assert task.reward(e, task.teacher_completion(e, rng)) == 1.0, e
        for _ in range(2):
            corrupt = task.corrupt_completion(e, rng)
            assert task.reward(e, corrupt) == 0.0, (e, corrupt)


def test_arithmetic_corruption_is_a_near_miss() -> None:
    task = ArithmeticTask(digits=2)
    rng = random.Random(0)
    for e in task.train_split(300):
        wrong = task.corrupt_completion(e, rng)
        right = task.teacher_completion(e, rng)
        # Written like the teacher's answer: 3 digits, zero-padded (a negative near miss gets a sign).
        assert re.fullmatch(r"-?[0-9]{3}", wrong), wrong
        assert re.fullmatch(r"[0-9]{3}", right) and int(right) == int(e.answer)
        # Offsets are at most 10; a changed digit of a <=3-digit sum moves it by < 1000.
        assert 0 < abs(int(wrong) - int(e.answer)) < 1000


def test_arithmetic_without_zero_pad_writes_canonical_integers() -> None:
    task = ArithmeticTask(digits=2, zero_pad=False)
    rng = random.Random(0)
    for e in task.train_split(300):
        assert e.prompt == f"{e.meta['a']}+{e.meta['b']}="          # no padding: "5+34="
        assert re.fullmatch(r"-?[1-9][0-9]*|0", task.corrupt_completion(e, rng))
        assert task.teacher_completion(e, rng) == e.answer
    assert ArithmeticTask(digits=2).train_split(1)[0].prompt.count("+") == 1
    assert {len(e.prompt) for e in ArithmeticTask(digits=2).train_split(300)} == {6}   # "05+34="


def test_countdown_corruption_is_a_valid_expression() -> None:
    task = CountdownTask()
    rng = random.Random(0)
    for e in task.train_split(300):
        wrong = task.corrupt_completion(e, rng)
        value = evaluate_countdown(wrong, e.meta["numbers"])
        assert value is not None and value != e.meta["target"], (e, wrong)


def test_reward_on_wrong_answers() -> None:
    task = ArithmeticTask()
    e = task.train_split(1)[0]
    assert task.reward(e, e.answer) == 1.0
    assert task.reward(e, e.answer + "0") == 0.0
    assert task.reward(e, "") == 0.0
    cd = CountdownTask()
    e = cd.train_split(1)[0]
    assert cd.reward(e, e.answer) == (1.0 if int(e.answer) in e.meta["numbers"] else 0.0)
    assert cd.reward(e, "garbage") == 0.0


# -------------------------------------------------------------------- SFT


@pytest.mark.parametrize("make", [ArithmeticTask, CountdownTask])
def test_sft_corrupt_fraction_and_labels(make) -> None:
    task = make()
    data = task.sft_examples(2000, corrupt_fraction=0.3, seed=7)
    assert len(data) == 2000
    wrong = sum(not x.correct for x in data) / len(data)
    assert abs(wrong - 0.3) <= 0.03
    by_prompt = {e.prompt: e for e in task.train_split(2000)}
    for x in data:
        assert task.reward(by_prompt[x.prompt], x.completion) == (1.0 if x.correct else 0.0)


def test_sft_deterministic_and_seeded() -> None:
    a = ArithmeticTask().sft_examples(300, corrupt_fraction=0.5, seed=1)
    b = ArithmeticTask().sft_examples(300, corrupt_fraction=0.5, seed=1)
    c = ArithmeticTask().sft_examples(300, corrupt_fraction=0.5, seed=2)
    assert a == b
    assert a != c


def test_sft_extremes() -> None:
    task = CountdownTask()
    assert all(x.correct for x in task.sft_examples(200, corrupt_fraction=0.0, seed=0))
    assert not any(x.correct for x in task.sft_examples(200, corrupt_fraction=1.0, seed=0))
    assert task.sft_examples(0, corrupt_fraction=0.5, seed=0) == []
    with pytest.raises(ValueError):
        task.sft_examples(10, corrupt_fraction=1.5, seed=0)


def test_sft_cycles_small_train_split_evenly() -> None:
    task = ArithmeticTask(digits=1)  # fewer than 100 train problems
    data = task.sft_examples(1000, corrupt_fraction=0.0, seed=0)
    counts = Counter(x.prompt for x in data)
    pool = len(counts)
    assert pool < 100
    # Whole reshuffled passes: every problem appears floor or ceil of 1000/pool times.
    assert set(counts.values()) <= {1000 // pool, -(-1000 // pool)}


# --------------------------------------------------------------- registry


def test_registry() -> None:
    from reinforge.tasks.dataset import DatasetTask
    from reinforge.tasks.mix import MixTask
    from reinforge.tasks.multiply_tool import MultiplyToolTask
    from reinforge.tasks.reasoning_gym import ReasoningGymTask
    from reinforge.tasks.verifiers_taskset import VerifiersTasksetTask

    assert TASKS == {"arithmetic": ArithmeticTask, "chain_sum": ChainSumTask, "countdown": CountdownTask,
                     "dataset": DatasetTask, "multiply_tool": MultiplyToolTask, "mix": MixTask,
                     "reasoning_gym": ReasoningGymTask, "verifiers_taskset": VerifiersTasksetTask}
    task = build_task("arithmetic", digits=3, operators="-")
    assert isinstance(task, ArithmeticTask)
    assert task.train_split(1)[0].meta["op"] == "-"


def test_unknown_task_message() -> None:
    with pytest.raises(ValueError) as info:
        build_task("arithmetc")
    valid = "valid: arithmetic, chain_sum, countdown, dataset, mix, multiply_tool, reasoning_gym, verifiers_taskset"
    assert str(info.value) == f"unknown task 'arithmetc'; did you mean 'arithmetic'? {valid}"
    with pytest.raises(ValueError, match=f"unknown task 'zzz'; {valid}"):
        build_task("zzz")


@pytest.mark.parametrize(
    ("make", "options"),
    [
        (ArithmeticTask, {"operators": "/"}),
        (ArithmeticTask, {"operators": ""}),
        (ArithmeticTask, {"digits": 0}),
        (ArithmeticTask, {"digits": 10}),
        (ArithmeticTask, {"eval_fraction": 0.0}),
        (ArithmeticTask, {"eval_fraction": 1.0}),
        (CountdownTask, {"num_numbers": 1}),
        (CountdownTask, {"num_numbers": 6}),
        (CountdownTask, {"max_number": 0}),
        (CountdownTask, {"max_target": 0}),
    ],
)
def test_invalid_options(make, options) -> None:
    with pytest.raises(ValueError):
        make(**options)


def test_trailing_spaces_follow_the_capped_discrete_pareto() -> None:
    """trailing_max: P(k >= x) = (x + 1)^-alpha up to the cap; the verifier ignores the spaces."""
    task = ArithmeticTask(trailing_max=40, trailing_alpha=1.0)
    example = task.train_split(1)[0]
    rng = random.Random(0)
    completions = [task.teacher_completion(example, rng) for _ in range(40000)]
    k = [len(c) - len(c.rstrip(" ")) for c in completions]
    for x in (1, 3, 9):
        assert sum(v >= x for v in k) / len(k) == pytest.approx((x + 1) ** -1.0, abs=0.01)
    assert max(k) == 40 and sum(v == 40 for v in k) / len(k) == pytest.approx(1 / 41, abs=0.004)
    assert all(task.reward(example, c) == 1.0 for c in completions[:50])
    wrong = task.corrupt_completion(example, rng)
    assert task.reward(example, wrong) == 0.0
    assert ArithmeticTask().teacher_completion(example, rng) == completions[0].rstrip(" ")    # off by default
    with pytest.raises(ValueError, match="trailing_max"):
        ArithmeticTask(trailing_max=-1)
