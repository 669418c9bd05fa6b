"""Math verifier: notations, extraction rules, hacking attempts, threads and the process pool."""

from __future__ import annotations

import threading

import pytest
from math_verify.errors import TimeoutException

import reinforge.rewards.math as math_rewards
from reinforge.rewards.math import MathVerifier, verify, verify_many

# (completion, gold, expected score)
NOTATIONS = [
    # fractions and decimals, either side
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "1/2", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.333333", 1.0),  # math-verify rounds floats to 6 places
    ("\\boxed{0.333}", "\\frac13", 0.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    # radicals and powers
    ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", 0.0),
    ("\\boxed{10^{10}}", "10000000000", 1.0),
    # sets: order does not matter, contents do
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0),
    ("\\boxed{\\{1,2\\}}", "1,2", 1.0),
    ("\\boxed{\\{1,3\\}}", "\\{1,2\\}", 0.0),
    # intervals: the bracket kind matters
    ("\\boxed{(0,1]}", "(0,1]", 1.0),
    ("\\boxed{[0,1]}", "(0,1]", 0.0),
    ("\\boxed{(0,1)}", "(0,1]", 0.0),
    # thousands separators and signs
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{1,000,000}", "1000000", 1.0),
    ("The total is 1,000 dollars.", "1000", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("so x = -3", "-3", 1.0),
    ("\\boxed{3}", "-3", 0.0),
    # other notations the library accepts
    ("\\boxed{12\\%}", "0.12", 1.0),
    ("\\boxed{x=2}", "2", 1.0),
    ("\\boxed{x^2+1}", "1+x^2", 1.0),
    ("\\boxed{\\pi}", "\\pi", 1.0),
    ("\\boxed{3.14159}", "\\pi", 0.0),
    ("\\boxed{\\text{Monday}}", "\\text{Monday}", 1.0),
    ("\\fbox{4}", "4", 1.0),
    ("\\boxed {4}", "4", 1.0),
    # "the answer is X" / "answer: X"
    ("so the answer is 42.", "42", 1.0),
    ("The answer is 3.5.", "3.5", 1.0),  # final period stripped, decimal point kept
    ("Answer: 42", "42", 1.0),
    ("**Answer:** $\\frac{3}{4}$", "0.75", 1.0),
    ("Final Answer: The final answer is $42$. I hope it is correct.", "42", 1.0),
    ("The answer is 42. Checking: 43", "42", 1.0),  # first sentence only
    ("The answer is 41.", "42", 0.0),
    # last-number fallback
    ("we get 7 then 12", "12", 1.0),
    ("we get 12 then 7", "12", 0.0),
    ("so x = 3/4", "0.75", 1.0),
    ("no numbers here", "1", 0.0),
    ("", "1", 0.0),
]


@pytest.mark.parametrize(("completion", "gold", "expected"), NOTATIONS)
def test_notations(completion: str, gold: str, expected: float) -> None:
    assert verify(completion, gold) == expected


@pytest.mark.parametrize("gold", ["1/2", "\\frac{1}{2}", "$\\frac12$", "\\boxed{\\frac12}", "0.5"])
def test_gold_spellings(gold: str) -> None:
    assert verify("\\boxed{0.5}", gold) == 1.0
    assert verify("\\boxed{0.4}", gold) == 0.0


def test_malformed_or_non_string_gold_is_zero() -> None:
    assert verify("\\boxed{1}", "") == 0.0
    assert verify("\\boxed{1}", "\\boxed{\\frac{") == 0.0
    assert verify("\\boxed{1}", None) == 0.0  # type: ignore[arg-type]
    assert verify(None, "1") == 0.0  # type: ignore[arg-type]


HACKS = [
    # only the last box counts, whatever came before
    ("\\boxed{2} wait, no: \\boxed{3}", "2"),
    ("\\boxed{1} \\boxed{2} \\boxed{3} \\boxed{4}", "2"),
    ("\\boxed{2} then \\boxed{\\frac{", "2"),  # malformed last box: no fallback to 2
    # listing every option parses as a set, not as one value
    ("\\boxed{1, 2, 3, 4}", "2"),
    ("\\boxed{2 \\text{ or } 3}", "2"),
    ("\\boxed{x = 1 \\text{ or } x = 2}", "2"),
    ("the answer is 1 or 2 or 3", "2"),
    ("The answer is $1$ or $2$", "2"),
    ("the answer is A or B or C", "2"),
    ("answer: 1, 2, or 3.", "2"),
]


@pytest.mark.parametrize(("completion", "gold"), HACKS)
def test_hacking_attempts_score_zero(completion: str, gold: str) -> None:
    assert verify(completion, gold) == 0.0


def test_last_box_decides_both_ways() -> None:
    # Same boxes, reversed order: the score follows the last one only.
    assert verify("\\boxed{3} \\boxed{2}", "2") == 1.0
    assert verify("\\boxed{2} \\boxed{3}", "2") == 0.0


CRASHERS = [
    "\\boxed{\\frac{",
    "\\boxed{\\frac{1}{}}",
    "\\boxed{\\sqrt}",
    "\\boxed{}}}}",
    "\\boxed{\\begin{matrix}}",
    "\\boxed{^^_}",
    "\\boxed{\\left(}",
    "$$$$",
    "\\boxed{" + "{" * 200 + "1" + "}" * 200 + "}",  # over max_nesting: never parsed
    "\\boxed{" + "(" * 11 + "1" + ")" * 11 + "}",
]


@pytest.mark.parametrize("completion", CRASHERS)
def test_parser_crashers_score_zero(completion: str) -> None:
    assert verify(completion, "1") == 0.0


def test_nesting_cap_is_the_only_difference() -> None:
    # Depth 10 is parsed (and right); depth 11 is refused before the parser.
    assert verify("\\boxed{" + "(" * 10 + "1" + ")" * 10 + "}", "1") == 1.0
    assert verify("\\boxed{" + "(" * 11 + "1" + ")" * 11 + "}", "1") == 0.0


def test_answer_length_cap() -> None:
    short = "+".join(["1"] * 10)  # 19 chars, equals 10
    long = "+".join(["1"] * 501)  # 1001 chars, over max_answer_chars=1000, equals 501
    assert verify(f"\\boxed{{{short}}}", "10") == 1.0
    assert verify(f"\\boxed{{{long}}}", "501") == 0.0
    assert MathVerifier(max_answer_chars=2000)(f"\\boxed{{{long}}}", "501") == 1.0


def test_only_the_tail_is_searched() -> None:
    completion = "\\boxed{7}" + " filler" * 1000  # the box sits 7,000 chars from the end
    assert verify(completion, "7") == 0.0
    assert MathVerifier(tail_chars=8000)(completion, "7") == 1.0


def test_ten_megabyte_completion_in_process() -> None:
    filler = "x" * 10_000_000
    assert verify(filler + " so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert verify(filler + " so \\boxed{\\frac{1}{3}}", "0.5") == 0.0
    assert verify("1 " * 5_000_000, "1") == 1.0  # last-number fallback over 10 MB


def test_any_library_exception_scores_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    for error in (RuntimeError("boom"), RecursionError(), TimeoutException("slow")):

        def broken_parse(*args: object, error: BaseException = error, **kwargs: object) -> list:
            raise error

        monkeypatch.setattr(math_rewards, "parse", broken_parse)
        math_rewards._parse_gold.cache_clear()  # so the gold's parse fails too, not only the answer's
        assert verify("\\boxed{1}", "1") == 0.0


def test_library_signal_timeout_on_main_thread() -> None:
    # 9^(9^9) has ~370 million digits: only math-verify's 1 s alarm ends the compare.
    assert MathVerifier(library_timeout_s=1)("\\boxed{9^{9^{9}}}", "2") == 0.0


def test_custom_pattern_is_the_only_rule() -> None:
    tagged = MathVerifier(pattern=r"<answer>(.*?)</answer>")
    assert tagged("work... <answer>1/2</answer>", "0.5") == 1.0
    assert tagged("<answer>1</answer> <answer>2</answer>", "1") == 0.0  # last match only
    assert tagged("\\boxed{1/2}", "0.5") == 0.0  # no tag: boxes do not count
    assert tagged("<answer></answer>", "0") == 0.0
    with pytest.raises(ValueError, match="capture group"):
        MathVerifier(pattern=r"<answer>.*</answer>")


def test_last_number_fallback_can_be_disabled() -> None:
    assert MathVerifier(last_number_fallback=False)("we get 12", "12") == 0.0
    assert MathVerifier(last_number_fallback=False)("\\boxed{12}", "12") == 1.0


ALL_CASES = [(c, g) for c, g, _ in NOTATIONS] + HACKS + [(c, "1") for c in CRASHERS]


def test_thread_gives_the_same_scores_as_main_thread() -> None:
    # Off the main thread math-verify's signal.alarm would raise; we pass None timeouts.
    main = [verify(c, g) for c, g in ALL_CASES]
    off_main: list[float] = []
    worker = threading.Thread(target=lambda: off_main.extend(verify(c, g) for c, g in ALL_CASES))
    worker.start()
    worker.join()
    assert off_main == main
    assert main == [e for _, _, e in NOTATIONS] + [0.0] * (len(HACKS) + len(CRASHERS))


def test_verify_many_pool_matches_serial() -> None:
    serial = verify_many(ALL_CASES)
    assert serial == [verify(c, g) for c, g in ALL_CASES]
    assert verify_many(ALL_CASES, workers=2, timeout_s=30.0) == serial
    assert verify_many([], workers=2) == []


def test_verify_many_hung_item_scores_zero_and_worker_is_replaced() -> None:
    # One worker: the items after the hang can only be scored by its replacement.
    pairs = [("\\boxed{9^{9^{9}}}", "2"), ("\\boxed{1}", "1"), ("\\boxed{3}", "4")]
    assert verify_many(pairs, workers=1, timeout_s=1.0) == [0.0, 1.0, 0.0]


def test_verify_many_ten_megabytes_within_timeout() -> None:
    # A timeout would score 0.0, so 1.0 proves the 10 MB item finished within 10 s.
    filler = "x" * 10_000_000
    pairs = [(filler + " \\boxed{\\frac{1}{2}}", "0.5"), (filler + " \\boxed{2}", "0.5")]
    assert verify_many(pairs, workers=2, timeout_s=10.0) == [1.0, 0.0]
