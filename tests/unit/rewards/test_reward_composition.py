"""Reward composition: weighted sums, DAPO overlong shaping, built-in and user functions,
skipped and failing samples, and the `reward` config section. Expected numbers are
derived by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch
from repo_paths import TESTS

from reinforge.config import build_config, config_to_yaml
from reinforge.data.chat import Conversation
from reinforge.errors import ConfigError
from reinforge.rewards.compose import (
    RewardComposer,
    RewardError,
    format_match,
    length_penalty,
    overlong_shaping,
    think_answer,
)
from reinforge.rollout.base import Rollout
from reinforge.settings import RewardConfig
from reinforge.tasks import Example
from reinforge.tasks.arithmetic import ArithmeticTask

NAN = math.nan


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    # User functions are given as 'reward_fixtures:name', whatever pytest's import mode.
    monkeypatch.syspath_prepend(str(TESTS))


def _rollout(texts: list[str], lengths: list[int], truncated: list[bool] | None = None, group_size: int = 2) -> Rollout:
    n, width = len(texts), max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()      # [N, T]
    return Rollout(
        prompt_ids=[[0]] * n, completion_ids=torch.zeros(n, width, dtype=torch.long), pad_id=0, completion_mask=mask,
        sampler_logprobs=torch.zeros(n, width), truncated=torch.tensor(truncated or [False] * n),
        group_ids=torch.arange(n) // group_size, policy_version=0, texts=texts,
    )


def _composer(max_new_tokens: int = 20, check_domains: bool = True, **reward) -> RewardComposer:
    return RewardComposer(RewardConfig(**reward), ArithmeticTask(), max_new_tokens, check_domains=check_domains)


EXAMPLES = [Example("23+23=", "46", {"target": 46}), Example("3+4=", "7", {"target": 7})]


def _close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), equal_nan=True)


# ------------------------------------------------------------------ composition


def test_default_is_the_task_verifier():
    rollout = _rollout(["46", "45", "7", "seven"], [2, 2, 1, 5])
    out = _composer().score(EXAMPLES, rollout, group_size=2)
    _close(out.total, [1.0, 0.0, 1.0, 0.0])    # ArithmeticTask.reward, row r of examples[r // 2]
    assert list(out.parts) == ["verifier"] and out.valid.all()
    assert out.errors == {"verifier": 0} and out.first_traceback is None


def test_weighted_sum_of_three_functions():
    rollout = _rollout(["46", "45", " 7 ", "seven"], [2, 6, 8, 4])
    out = _composer(functions=[
        {"name": "verifier"},
        {"name": "format", "weight": 0.5, "params": {"pattern": "[0-9]+", "mode": "fullmatch"}},
        {"name": "length_penalty", "params": {"target": 4, "coef": 0.5}},
    ]).score(EXAMPLES, rollout, group_size=2)
    # verifier [1, 0, 1, 0] (" 7 " is stripped by the verifier), format [1, 1, 0, 0] (fullmatch: no spaces),
    # length_penalty -0.5 max(0, |y| - 4) / 4 for |y| = [2, 6, 8, 4]: [0, -0.25, -0.5, 0]
    _close(out.parts["verifier"], [1.0, 0.0, 1.0, 0.0])
    _close(out.parts["format"], [1.0, 1.0, 0.0, 0.0])
    _close(out.parts["length_penalty"], [0.0, -0.25, -0.5, 0.0])
    # total = 1 v + 0.5 f + 1 l = [1 + 0.5, 0.5 - 0.25, 1 - 0.5, 0]
    _close(out.total, [1.5, 0.25, 0.5, 0.0])
    metrics = out.metrics()
    assert metrics["reward/verifier_mean"] == 0.5
    assert metrics["reward/length_penalty_mean"] == pytest.approx(-0.1875)   # -0.75 / 4
    assert metrics["reward/total_mean"] == pytest.approx(0.5625)             # 2.25 / 4
    assert metrics["reward/skip_frac"] == 0.0 and metrics["reward/error_frac"] == 0.0


def test_same_function_twice_gets_distinct_keys():
    out = _composer(functions=[
        {"name": "format", "params": {"pattern": "4"}},
        {"name": "format", "weight": 2.0, "params": {"pattern": "6"}},
    ]).score(EXAMPLES[:1], _rollout(["46", "4"], [2, 1]), group_size=2)
    _close(out.parts["format"], [1.0, 1.0])
    _close(out.parts["format_2"], [1.0, 0.0])
    _close(out.total, [3.0, 1.0])


# ------------------------------------------------------------------ overlong shaping


def test_overlong_shaping_regions_and_boundaries():
    # L_max = 20, L_cache = 4: the window starts at 16. (16 - |y|) / 4 inside (16, 20], -1 beyond 20.
    lengths = torch.tensor([1, 15, 16, 17, 18, 19, 20, 21, 40])
    _close(overlong_shaping(lengths, max_length=20, cache=4), [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    # cache = max_length: the ramp covers everything, 0 only at |y| = 0.
    _close(overlong_shaping(torch.tensor([0, 2, 4]), max_length=4, cache=4), [0.0, -0.5, -1.0])
    with pytest.raises(ValueError, match="cache <= max_length"):
        overlong_shaping(lengths, max_length=4, cache=5)


def test_overlong_added_with_its_coef_and_max_length_from_the_rollout():
    rollout = _rollout(["46", "46", "7", "7"], [16, 18, 20, 3])
    # L_max = max_new_tokens = 20, L_cache = 4, coef 0.5: shaping [0, -0.5, -1, 0]; verifier all 1.
    out = _composer(max_new_tokens=20, overlong={"cache": 4, "coef": 0.5}).score(EXAMPLES, rollout, group_size=2)
    _close(out.parts["overlong"], [0.0, -0.5, -1.0, 0.0])
    _close(out.total, [1.0, 0.75, 0.5, 1.0])
    # An explicit max_length wins: L_max = 18, window (14, 18] -> 16: -0.5, 18: -1, 20: -1.
    out = _composer(max_new_tokens=20, overlong={"cache": 4, "max_length": 18}).score(EXAMPLES, rollout, group_size=2)
    _close(out.parts["overlong"], [-0.5, -1.0, -1.0, 0.0])
    with pytest.raises(ValueError, match="cache <= max_length"):
        _composer(max_new_tokens=3, overlong={"cache": 4})


# ------------------------------------------------------------------ built-in functions


@pytest.mark.parametrize(("completion", "kwargs", "expected"), [
    ("answer: 42", {"pattern": r"\d+"}, 1.0),
    ("answer: 42", {"pattern": r"\d+", "mode": "fullmatch"}, 0.0),
    ("42", {"pattern": r"\d+", "mode": "fullmatch"}, 1.0),
    ("a\nb", {"pattern": "a.b"}, 1.0),                 # DOTALL
    ("no digits", {"pattern": r"\d"}, 0.0),
])
def test_format(completion, kwargs, expected):
    assert format_match(completion=completion, **kwargs) == expected


def test_format_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        format_match(completion="x", pattern="x", mode="match")


@pytest.mark.parametrize(("completion", "prefilled", "expected"), [
    ("<think>a</think><answer>1</answer>", False, 1.0),
    ("<think>\nstep 1\nstep 2\n</think>\n<answer>\n1\n</answer>\n", False, 1.0),
    ("<answer>1</answer>", False, 0.0),                                   # no think block
    ("<think>a</think>", False, 0.0),                                     # no answer block
    ("<think>a</think>b</think><answer>1</answer>", False, 0.0),          # nested close tag
    ("<think>a</think>text<answer>1</answer>", False, 0.0),               # text between the blocks
    ("<think>a</think><answer>1</answer> more", False, 0.0),              # text after the answer
    ("<answer>1</answer><think>a</think>", False, 0.0),                   # wrong order
    ("<think>a</think><answer>1</answer><answer>2</answer>", False, 0.0),  # two answers
    ("a</think><answer>1</answer>", True, 1.0),                           # prompt ended with <think>
    ("a</think><answer>1</answer>", False, 0.0),
])
def test_think_answer(completion, prefilled, expected):
    assert think_answer(completion=completion, think_prefilled=prefilled) == expected


def test_length_penalty():
    # -coef max(0, |y| - target) / target with target 10, coef 2: 10 -> 0, 15 -> -1, 20 -> -2
    assert [length_penalty(length=n, target=10, coef=2.0) for n in (3, 10, 15, 20)] == [0.0, 0.0, -1.0, -2.0]


# ------------------------------------------------------------------ user functions


def test_user_function_by_import_path_gets_meta_and_params():
    rollout = _rollout(["46", "40", "7", "9"], [2, 2, 1, 1])
    out = _composer(functions=[
        {"name": "reward_fixtures:target_distance", "weight": 0.5},       # target from example.meta
        {"name": "reward_fixtures:scaled_length", "params": {"scale": 0.25}},
    ]).score(EXAMPLES, rollout, group_size=2)
    _close(out.parts["target_distance"], [0.0, -6.0, 0.0, -2.0])
    _close(out.parts["scaled_length"], [0.5, 0.5, 0.25, 0.25])
    _close(out.total, [0.5, -2.5, 0.25, -0.75])   # 0.5 d + s


def test_user_function_receives_every_input():
    from reward_fixtures import CALLS

    CALLS.clear()
    example = Example("p", "7", {"target": 7, "prompt": "shadowed"})
    rollout = _rollout(["7", "8"], [1, 3], truncated=[False, True])
    task = ArithmeticTask()
    RewardComposer(RewardConfig(functions=[{"name": "reward_fixtures:record", "params": {"k": 1}}]), task, 8).score(
        [example], rollout, group_size=2)
    assert set(CALLS[1]) == {"prompt", "completion", "answer", "length", "truncated", "example", "task", "target", "k"}
    assert CALLS[1]["prompt"] == "p"          # the inputs win over a meta field of the same name
    assert (CALLS[1]["completion"], CALLS[1]["length"], CALLS[1]["truncated"]) == ("8", 3, True)
    assert CALLS[1]["example"] is example and CALLS[1]["task"] is task and CALLS[1]["target"] == 7


def test_none_marks_the_row_invalid():
    rollout = _rollout(["46", "  ", "7", "7"], [2, 1, 1, 1])
    out = _composer(functions=[{"name": "verifier"}, {"name": "reward_fixtures:skip_empty"}]).score(
        EXAMPLES, rollout, group_size=2)
    assert out.valid.tolist() == [True, False, True, True]
    _close(out.parts["skip_empty"], [1.0, NAN, 1.0, 1.0])
    _close(out.parts["verifier"], [1.0, 0.0, 1.0, 1.0])   # the other function's value is still reported
    _close(out.total, [2.0, NAN, 2.0, 2.0])
    assert out.skipped.tolist() == [False, True, False, False] and not out.raised.any()
    assert out.errors == {"verifier": 0, "skip_empty": 0}
    metrics = out.metrics()
    assert metrics["reward/skip_frac"] == 0.25 and metrics["reward/valid_frac"] == 0.75
    assert metrics["reward/skip_empty_mean"] == 1.0 and metrics["reward/total_mean"] == 2.0


def test_raising_function_under_the_error_rate_is_counted():
    rollout = _rollout(["46", "oops", "7", "nan"], [2, 4, 1, 3])
    out = _composer(max_error_rate=0.5, functions=[
        {"name": "reward_fixtures:target_distance"}, {"name": "reward_fixtures:not_finite"},
    ]).score(EXAMPLES, rollout, group_size=2)
    # Row 1: int("oops") raises. Row 3: int("nan") raises in target_distance and not_finite returns NaN.
    assert out.errors == {"target_distance": 2, "not_finite": 1}
    assert out.valid.tolist() == [True, False, True, False] and out.raised.tolist() == [False, True, False, True]
    assert out.first_traceback.startswith("reward function 'target_distance' on row 1:")
    assert "ValueError: invalid literal for int()" in out.first_traceback
    metrics = out.metrics()
    assert metrics["reward/error_frac"] == 0.5          # 2 of 4 rows, although 3 calls raised
    assert metrics["reward/target_distance_errors"] == 2.0 and metrics["reward/not_finite_errors"] == 1.0


def test_raising_function_over_the_error_rate_stops_the_run():
    rollout = _rollout(["46", "oops", "7", "bad"], [2, 4, 1, 3])
    composer = _composer(max_error_rate=0.25, functions=[{"name": "reward_fixtures:target_distance"}])
    with pytest.raises(RewardError) as err:       # 2 / 4 = 0.5 > 0.25
        composer.score(EXAMPLES, rollout, group_size=2)
    message = str(err.value)
    assert message == (
        "reward function reward_fixtures.target_distance raised ValueError(\"invalid literal for int() with base 10: "
        "'oops'\") on sample 1 (prompt '23+23=', completion 'oops'); reward functions raised on 2 of 4 samples "
        "(target_distance: 2), more than reward.max_error_rate=0.25")
    assert "\n" not in message
    assert err.value.details.startswith("reward function 'target_distance' on row 1:\nTraceback")
    assert isinstance(err.value.__cause__, ValueError)
    # Exactly at the rate is allowed: 1 / 4 = 0.25.
    out = composer.score(EXAMPLES, _rollout(["46", "oops", "7", "7"], [2, 4, 1, 1]), group_size=2)
    assert out.errors == {"target_distance": 1}


def test_rows_must_match_examples_times_group_size():
    with pytest.raises(ValueError, match="expected 2 examples x group_size 3"):
        _composer().score(EXAMPLES, _rollout(["1"] * 4, [1] * 4), group_size=3)


# ------------------------------------------------------------------ config


def test_config_overrides_and_yaml_round_trip(tmp_path):
    cfg = build_config([
        "reward.functions=[{name: verifier}, {name: format, weight: 0.5, params: {pattern: '[0-9]+$'}}, "
        "{name: reward_fixtures:skip_empty}]",
        "reward.overlong.cache=4",
        "reward.max_error_rate=0.1",
    ])
    assert [(f.name, f.weight, f.params) for f in cfg.reward.functions] == [
        ("verifier", 1.0, {}), ("format", 0.5, {"pattern": "[0-9]+$"}), ("reward_fixtures:skip_empty", 1.0, {})]
    assert (cfg.reward.overlong.cache, cfg.reward.overlong.max_length, cfg.reward.overlong.coef) == (4, None, 1.0)
    path = tmp_path / "run.yaml"
    path.write_text(config_to_yaml(cfg))
    assert build_config(config_file=str(path)).reward == cfg.reward
    assert build_config([]).reward.functions[0].name == "verifier" and build_config([]).reward.overlong is None


@pytest.mark.parametrize(("override", "message"), [
    ("reward.functions=[{name: fromat}]", "did you mean 'format'"),
    ("reward.functions=[{name: format}]", "needs parameter 'pattern'"),
    ("reward.functions=[{name: format, params: {pattern: x, mdoe: search}}]", "did you mean 'mode'"),
    ("reward.functions=[{name: reward_fixtures:scaled_length, params: {completion: x}}]", "passes itself"),
    ("reward.functions=[{name: reward_fixtures:nope}]", "cannot import"),
    ("reward.overlong={cache: 8, max_length: 4}", "must be <= max_length"),
    ("reward.functions=[]", "no reward source is set"),
])
def test_config_errors_say_what_to_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config([override])


# ------------------------------------------------------------------ TRL and verl conventions


CHAT = [Example(Conversation([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]), "2",
                {"solution": "2", "data_source": "math", "reward_model": {"ground_truth": "2", "style": "rule"},
                 "extra_info": {"index": 0}}),
        Example("2+3=", "5", {"solution": "5", "data_source": "arith", "extra_info": {"index": 1}})]


def _chat_rollout(texts: list[str]) -> Rollout:
    rollout = _rollout(texts, [len(t) or 1 for t in texts])
    return Rollout(
        **{**rollout.__dict__, "completion_ids": torch.arange(4 * rollout.completion_ids.shape[1]).view(4, -1)}
    )


def test_trl_function_gets_the_batch_as_trl_passes_it():
    from convention_fixtures import CALLS

    CALLS.clear()
    rollout = _chat_rollout(["2", "3", "5", " 5"])
    out = _composer(functions=[{"name": "convention_fixtures:trl_accuracy"}]).score(CHAT, rollout, group_size=2)
    _close(out.parts["trl_accuracy"], [1.0, 0.0, 1.0, 1.0])
    (call,) = CALLS["trl_accuracy"]       # one call for the batch
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    # A conversational prompt goes as its messages and its completions as assistant messages; a plain one as text.
    assert call["prompts"] == [messages, messages, "2+3=", "2+3="]
    assert call["completions"] == [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "3"}],
                                   "5", " 5"]
    assert call["solution"] == ["2", "2", "5", "5"] and call["answer"] == ["2", "2", "5", "5"]
    assert call["data_source"] == ["math", "math", "arith", "arith"]
    assert call["reward_model"] == [{"ground_truth": "2", "style": "rule"}] * 2 + [None, None]
    # completion_ids: the row's tokens under the completion mask (lengths 1, 1, 1, 2 of the arange rows, width 2).
    assert call["completion_ids"] == [[0], [2], [4], [6, 7]]
    assert "trainer_state" not in call


def test_trl_none_is_left_out_of_the_sum_and_an_all_none_row_is_skipped():
    # trl_length: len(text), None for "" ; verifier (ArithmeticTask on answer "46"/"7"): [1, 0, 0, 0].
    rollout = _rollout(["46", "", "7x", ""], [2, 1, 2, 1])
    out = _composer(functions=[{"name": "verifier"}, {"name": "convention_fixtures:trl_length", "weight": 0.5}]).score(
        EXAMPLES, rollout, group_size=2)
    _close(out.parts["trl_length"], [2.0, NAN, 2.0, NAN])
    # nansum as TRL: row 1 = verifier 0 + nothing = 0 (valid); row 0 = 1 + 0.5 * 2 = 2; row 2 = 0 + 1 = 1.
    _close(out.total, [2.0, 0.0, 1.0, 0.0])
    assert out.valid.all() and not out.skipped.any()
    # Alone, a None leaves the row with no reward at all: skipped (TRL would train it on 0).
    alone = _composer(functions=[{"name": "convention_fixtures:trl_length"}]).score(EXAMPLES, rollout, group_size=2)
    assert alone.skipped.tolist() == [False, True, False, True]
    _close(alone.total, [2.0, NAN, 2.0, NAN])


def test_verl_compute_score_gets_verl_keywords_and_a_dict_gives_its_score():
    from convention_fixtures import CALLS

    CALLS.clear()
    out = _composer(functions=[{"name": "convention_fixtures:compute_score"}]).score(
        CHAT, _chat_rollout(["2", "3", "5", "4"]), group_size=2)
    _close(out.parts["compute_score"], [1.0, 0.0, 1.0, 0.0])
    calls = CALLS["compute_score"]
    assert [c["solution_str"] for c in calls] == ["2", "3", "5", "4"]
    # ground_truth: reward_model.ground_truth where the row has one, else the answer.
    assert [c["ground_truth"] for c in calls] == ["2", "2", "5", "5"]
    assert [c["data_source"] for c in calls] == ["math", "math", "arith", "arith"]
    assert [c["extra_info"] for c in calls] == [{"index": 0}, {"index": 0}, {"index": 1}, {"index": 1}]


def test_async_functions_are_awaited():
    out = _composer(functions=[{"name": "convention_fixtures:sample_async"},
                               {"name": "convention_fixtures:trl_async"}]).score(
        EXAMPLES, _rollout(["46", "4", "", "777"], [1, 1, 1, 1]), group_size=2)
    _close(out.parts["sample_async"], [2.0, 1.0, 0.0, 3.0])
    _close(out.parts["trl_async"], [2.0] * 4)


@pytest.mark.parametrize(("name", "message"), [
    ("trl_wrong_length", "returned 1 values for 4 completions"),
    ("trl_raises", "ValueError: x"),
    ("verl_no_score", "without a 'score' key"),
])
def test_a_broken_batch_or_verl_result_counts_as_raised(name, message):
    with pytest.raises(RewardError) as err:
        _composer(functions=[{"name": f"convention_fixtures:{name}"}]).score(
            EXAMPLES, _rollout(["1", "2", "3", "4"], [1] * 4), group_size=2)
    assert "on 4 of 4 samples" in str(err.value) and message in err.value.details


@pytest.mark.parametrize(("name", "message"), [
    ("no_form", r"\(x, y\) fits none of the accepted forms"),
    ("mixed_forms", r"mixes the parameters of several forms \(trl and sample\)"),
    ("positional_only", "positional-only parameters"),
])
def test_a_signature_that_fits_no_form_is_refused_at_config_time(name, message):
    with pytest.raises(ConfigError, match=message) as err:
        build_config([f"reward.functions=[{{name: convention_fixtures:{name}}}]"])
    # The line shows the three accepted forms.
    for form in ("f(prompt, completion, answer, **row)", "f(prompts, completions, **kwargs) -> list[float | None]",
                 "compute_score(data_source, solution_str, ground_truth, extra_info=None)"):
        assert form in str(err.value)


def test_each_convention_passes_the_config_check():
    names = ["trl_accuracy", "trl_length", "compute_score", "sample_async", "trl_async"]
    cfg = build_config(["reward.functions=[" + ", ".join(f"{{name: convention_fixtures:{n}}}" for n in names) + "]"])
    assert [f.name for f in cfg.reward.functions] == [f"convention_fixtures:{n}" for n in names]
    with pytest.raises(ConfigError, match="'solution_str' is an input the composer passes itself"):
        build_config(["reward.functions=[{name: convention_fixtures:compute_score, params: {solution_str: x}}]"])


def test_a_function_from_a_file_path_or_the_working_directory(tmp_path, monkeypatch):
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))       # the working directory is put on it
    (tmp_path / "verl_reward_file.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str == ground_truth)}\n")
    (tmp_path / "cwd_reward_mod.py").write_text(
        "def shout(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = build_config([f"reward.functions=[{{name: {tmp_path / 'verl_reward_file.py'}:compute_score}}, "
                        "{name: cwd_reward_mod:shout}]"])
    out = RewardComposer(cfg.reward, ArithmeticTask(), 8).score(EXAMPLES, _rollout(["46", "4", "7", "7"], [1] * 4), 2)
    _close(out.parts["compute_score"], [1.0, 0.0, 1.0, 1.0])
    _close(out.parts["shout"], [1.0] * 4)
    with pytest.raises(ConfigError, match="file 'nope.py' does not exist"):
        build_config(["reward.functions=[{name: nope.py:f}]"])


def test_verl_dict_extra_keys_are_logged_as_metrics():
    # verl logs a dict result's other keys; compute_score returns {"score", "acc"} on the math rows only.
    out = _composer(functions=[{"name": "convention_fixtures:compute_score"}]).score(
        CHAT, _chat_rollout(["2", "3", "5", "4"]), group_size=2)
    _close(out.extras["compute_score/acc"], [1.0, 0.0, NAN, NAN])
    assert out.metrics()["reward/compute_score/acc"] == 0.5


@pytest.mark.parametrize(("name", "message"), [
    ("returns_good", "returned a str ('good'), expected a float"),
    ("trl_strings", "returned a list holding at 0 a str ('1.0'), expected a float"),
    ("trl_returns_none", "returned None, expected a list of 4 floats (one per completion)"),
    ("trl_wrong_length", "returned 1 values for 4 completions, expected one per completion"),
])
def test_a_result_that_is_not_a_reward_names_its_type_and_is_never_converted(name, message):
    # TRL refuses ["1.0", ...] (torch.tensor of strings); a string is never parsed into a reward.
    with pytest.raises(RewardError) as err:
        _composer(functions=[{"name": f"convention_fixtures:{name}"}]).score(
            EXAMPLES, _rollout(["1", "2", "3", "4"], [1] * 4), group_size=2)
    assert message in err.value.details


@pytest.mark.parametrize(("name", "line"), [
    ("returns_good", "reward function convention_fixtures.returns_good returned a str ('good'), expected a float "
                     "(probed on 4 samples before training): return a float (None to leave the sample unscored)"),
    ("trl_strings", "reward function convention_fixtures.trl_strings returned a list holding at 0 a str ('1.0'), "
                    "expected a float (probed on 4 samples before training): return a list of floats, one per "
                    "completion (None where it does not apply)"),
    ("trl_returns_none", "reward function convention_fixtures.trl_returns_none returned None, expected a list of 4 "
                         "floats (one per completion) (probed on 4 samples before training): return a list of "
                         "floats, one per completion (None where it does not apply)"),
    ("verl_no_score", "reward function convention_fixtures.verl_no_score returned a dict without a 'score' key "
                      "(keys: acc) (probed on 4 samples before training): return a float, or a dict with a float "
                      "'score'"),
])
def test_the_probe_refuses_a_result_that_is_not_a_reward(name, line):
    composer = _composer(functions=[{"name": f"convention_fixtures:{name}"}], check_domains=False)
    with pytest.raises(ConfigError) as err:
        composer.probe([EXAMPLES[0], EXAMPLES[0], EXAMPLES[1], EXAMPLES[1]], _rollout(["1", "2", "3", "4"], [1] * 4))
    assert str(err.value) == line


def test_a_per_sample_function_that_scores_nothing_stops_and_one_that_declines_bad_samples_runs():
    # reinforge's per-sample None is "do not score this sample": on every probe sample it may be the untrained
    # model's unreadable output, so the gold answers are tried as completions too; None on them as well is a
    # function that never returns a number.
    with pytest.raises(ConfigError) as err:
        _composer(functions=[{"name": "convention_fixtures:sample_returns_none"}]).probe(
            EXAMPLES, _rollout(["xx", "yy"], [1, 1]))
    assert str(err.value) == (
        "reward function convention_fixtures.sample_returns_none returned None on all 2 probe samples and on their "
        "gold answers: None leaves a sample unscored, so it would score nothing (probed before training): return a "
        "float (None to leave the sample unscored)")
    composer = _composer(functions=[{"name": "convention_fixtures:declines_non_numbers"}, {"name": "verifier"}])
    assert composer.probe(EXAMPLES, _rollout(["xx", "yy"], [1, 1])) == []


def test_verl_none_is_not_a_reward():
    # verl has no "do not score": its reward manager fails on None, and so does the probe, at once.
    with pytest.raises(ConfigError) as err:
        _composer(functions=[{"name": "convention_fixtures:verl_returns_none"}]).probe(
            EXAMPLES, _rollout(["46", "2"], [1, 1]))
    assert str(err.value) == (
        "reward function convention_fixtures.verl_returns_none returned None, expected a float or a dict with a "
        "'score' (probed on 2 samples before training): return a float, or a dict with a float 'score'")
