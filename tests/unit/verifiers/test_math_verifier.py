"""Math verifier: notations, extraction rules, hacking attempts, threads and the process pool."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from math_verify.errors import TimeoutException

import reinforge.verifiers.math as math_rewards
from reinforge.verifiers.math import MathVerifier, verify, verify_many

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


# Several values joined where the gold is one: no credit, however the join is spelled. math-verify alone
# drops the text of \text{} and its kin as a unit, so "2 \text{ or 3}" read as 2.
HEDGES = [
    r"\boxed{2 \text{ or 3}}",
    r"\boxed{2 \mbox{ or 3}}",
    r"\boxed{2 \textit{ or 3}}",
    r"\boxed{2 \textbf{ or 3}}",
    r"\boxed{2 \mathrm{ or 3}}",
    r"\boxed{2 \text{ and 3}}",
    r"\boxed{2\text{ OR }3}",
    r"\boxed{2 \text{ (or 3)}}",
    r"\boxed{\text{2 or 3}}",
    r"\boxed{3 \text{ or } 2}",
    r"\boxed{2 \text{, 3}}",
    r"\boxed{2 \text{; } 3}",
    r"\boxed{2; 3}",
    r"\boxed{2 \lor 3}",
    r"\boxed{2 \vee 3}",
    r"\boxed{x = 2 \text{ or } x = 3}",
    r"\boxed{\{2, 3\}}",
    r"The answer is 2 or 3.",
    r"The answer is $2$ \text{or} $3$.",
]


@pytest.mark.parametrize("completion", HEDGES)
def test_hedges_score_zero_against_one_value(completion: str) -> None:
    assert verify(completion, "2") == 0.0
    assert verify(completion, "\\boxed{2}") == 0.0


# The honest side of the same rules: text units, words that contain "or"/"and", thousands separators,
# commas inside brackets, and golds that are themselves lists, sets, intervals or alternatives.
HONEST = [
    (r"\boxed{2}", "2", 1.0),
    (r"\boxed{2 \text{ cm}}", "2", 1.0),
    (r"\boxed{2 \text{ apples}}", "2", 1.0),
    (r"\boxed{\text{2}}", "2", 1.0),
    (r"\boxed{\textbf{2}}", "2", 1.0),
    (r"\boxed{x = 2}", "2", 1.0),
    (r"\boxed{\text{Portland}}", r"\text{Portland}", 1.0),
    (r"\boxed{\text{Orlando}}", r"\text{Orlando}", 1.0),
    (r"\boxed{\max(2, 3)}", "3", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1000}", "1,000", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{12,345.6}", "12345.6", 1.0),
    (r"\boxed{1,000}", "1", 0.0),
    (r"\boxed{2, 3}", "2, 3", 1.0),
    (r"\boxed{3, 2}", "2, 3", 1.0),
    (r"\boxed{2 \text{ and } 3}", "2, 3", 1.0),
    (r"\boxed{2 \text{ or } 3}", r"2 \text{ or } 3", 1.0),
    (r"\boxed{2}", "2, 3", 0.0),
    (r"\boxed{2, 4}", "2, 3", 0.0),
    (r"\boxed{\{1,2\}}", r"\{1,2\}", 1.0),
    (r"\boxed{1, 2}", r"\{1,2\}", 1.0),
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),
    (r"\boxed{[1, 2]}", "(1,2)", 0.0),
]


@pytest.mark.parametrize(("completion", "gold", "expected"), HONEST)
def test_honest_answers_and_list_golds(completion: str, gold: str, expected: float) -> None:
    assert verify(completion, gold) == expected


# A percent sign is a label: "50\%" is the number 50, never 0.5 (see the module docstring for why).
PERCENT = [
    (r"\boxed{2\%}", "2", 1.0),
    (r"\boxed{2\%}", r"2\%", 1.0),
    (r"\boxed{2\%}", "0.02", 0.0),
    (r"\boxed{2\%}", r"\frac{1}{50}", 0.0),
    (r"\boxed{12\%}", "0.12", 0.0),
    (r"The answer is $50\%$.", "50", 1.0),
    (r"The answer is $50\%$.", r"50\%", 1.0),
    (r"The answer is $50\%$.", "0.5", 0.0),
    (r"\boxed{50 \%}", "0.5", 0.0),
    (r"\boxed{50\,\%}", "50", 1.0),
    (r"\boxed{50\text{\%}}", "50", 1.0),
    (r"\boxed{50\text{\%}}", "0.5", 0.0),
    (r"\boxed{50%}", "50", 1.0),
    (r"\boxed{50%}", "0.5", 0.0),
    # answers without a sign are judged as math-verify judges them
    (r"\boxed{50}", r"50\%", 1.0),
    (r"\boxed{0.5}", r"50\%", 1.0),
    (r"\boxed{0.5}", "50", 0.0),
]


@pytest.mark.parametrize(("completion", "gold", "expected"), PERCENT)
def test_percent_is_a_label(completion: str, gold: str, expected: float) -> None:
    assert verify(completion, gold) == expected


def test_a_percent_sign_never_earns_credit() -> None:
    # For every gold, "x\%" scores at most what "x" scores: the sign cannot cover a second reading.
    golds = ["2", "0.02", r"2\%", "20", "0.2", r"20\%", r"\frac{1}{50}"]
    for x in ["2", "0.02", "20", "0.2"]:
        scores = [(verify(f"\\boxed{{{x}\\%}}", gold), verify(f"\\boxed{{{x}}}", gold)) for gold in golds]
        assert all(with_sign <= without for with_sign, without in scores), (x, scores)
        assert sum(with_sign for with_sign, _ in scores) <= 2     # "x" and "x\%" golds only


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


@pytest.fixture
def threads_of_this_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count only the threads this test starts when the verifier asks whether the main thread is alone.

    Earlier tests in the same worker process may leave daemon threads behind (a progress bar's
    monitor, a TensorBoard writer); the rule under test is about the threads a run has while it
    judges, so those are left out. Threads the test starts (a ticker, the sampler) still count. (Subtracting
    how many there were made the count 0, not 1, when one of them ended during the test, and the synchronous
    loop's judge then went to a worker: a flaky failure under xdist.)
    """
    before = set(threading.enumerate())     # the main thread included
    monkeypatch.setattr(math_rewards.threading, "active_count",
                        lambda: 1 + sum(thread not in before for thread in threading.enumerate()))


def test_any_library_exception_scores_zero(monkeypatch: pytest.MonkeyPatch, threads_of_this_test: None) -> None:
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
    # Off the main thread every answer is judged in a worker process (where the alarm works).
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


# Parse bombs that, judged in a thread of this process, held the GIL for minutes (each ran past a
# 20 s join with a counter thread barely moving: 35 increments in 26 s).
BOMBS = [
    "\\boxed{9^{9^{9^{9^{9}}}}}",
    "\\boxed{10^{10^{10^{10}}}}",
    "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    "\\boxed{(100!)!}",
]


def _in_thread(fn: Callable[[], float]) -> float:
    out: list[float] = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join()
    return out[0]


class _Ticker:
    """A thread that ticks every millisecond, recording the longest gap between two ticks."""

    def __init__(self) -> None:
        self.ticks, self.longest_gap, self._stop = 0, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.001):
            now = time.monotonic()
            self.ticks, self.longest_gap, last = self.ticks + 1, max(self.longest_gap, now - last), now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize("bomb", BOMBS)
def test_parse_bomb_in_a_thread_is_bounded_and_other_threads_run(bomb: str) -> None:
    verifier = MathVerifier(timeout_s=1.0)
    # A right answer first, from a thread: judged correctly, and the worker is started (start-up
    # is not part of an answer's bound).
    assert _in_thread(lambda: verifier("\\boxed{\\frac{1}{2}}", "0.5")) == 1.0
    assert _in_thread(lambda: verifier("\\boxed{\\frac{1}{3}}", "0.5")) == 0.0
    ticker = _Ticker()
    t0 = time.monotonic()
    score = _in_thread(lambda: verifier(bomb, "2"))
    elapsed = time.monotonic() - t0
    ticker.stop()
    assert score == 0.0
    assert elapsed < 1.0 + 2.0  # the bound, plus killing the worker and some slack for a loaded machine
    assert ticker.ticks > 100  # about 1000 if nothing stalls it; a frozen process gives a handful
    assert ticker.longest_gap < 0.5


def test_main_thread_with_another_thread_alive_uses_a_worker(
    monkeypatch: pytest.MonkeyPatch, threads_of_this_test: None
) -> None:
    # The async loop's case: rewards on the main thread while the sampler thread runs. The alarm
    # would bound the parse, but the GIL held inside sympy would stall the sampler meanwhile.
    inline = _spy_inline(monkeypatch)
    ticker = _Ticker()
    try:
        t0 = time.monotonic()
        assert MathVerifier(timeout_s=1.0)(BOMBS[0], "2") == 0.0
        elapsed = time.monotonic() - t0
        assert verify("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    finally:
        ticker.stop()
    assert inline == []
    assert elapsed < 30.0 + 1.0 + 2.0  # a worker's start (up to ~30 s on a loaded machine), the bound, slack
    assert ticker.longest_gap < 0.5
    # Alone on the main thread: judged here, bounded by math-verify's alarm.
    assert verify("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert inline == [("$0.5$",), ("$\\frac{1}{2}$",)]  # the gold's parse, then the answer's


def test_isolation_process_always_uses_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    inline = _spy_inline(monkeypatch)
    assert MathVerifier(isolation="process")("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert inline == []
    with pytest.raises(ValueError, match="isolation must be 'auto' or 'process', got 'thread'"):
        MathVerifier(isolation="thread")
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        MathVerifier(timeout_s=0)


def _spy_inline(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Records math-verify parses made in this process (a worker's parses are its own)."""
    parse, calls = math_rewards.parse, []
    monkeypatch.setattr(math_rewards, "parse", lambda *args, **kwargs: calls.append(args) or parse(*args, **kwargs))
    math_rewards._parse_gold.cache_clear()
    return calls


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_rl_loop_rewards_use_a_worker_exactly_when_the_sampler_thread_runs(
    micro_overrides, monkeypatch, mode, threads_of_this_test
) -> None:
    # The async loop computes rewards on the main thread while its sampler thread decodes: the
    # default must judge in a worker there. The synchronous loop is alone on the main thread.
    import torch

    from reinforge.config import build_config
    from reinforge.jobs.rl import run_rl
    from reinforge.jobs.start import objective_spec
    from reinforge.models import load_policy
    from reinforge.rollout import build_engine
    from reinforge.tasks import build_task

    path = str(Path(math_rewards.__file__).parent.parent / "data" / "math_small.jsonl")
    cfg = build_config([*micro_overrides, f"train.mode={mode}", "train.steps=1", "rollout.max_new_tokens=12",
                        "task.name=dataset", f"task.options.path={path}", "model.max_positions=160"])
    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg.model, cfg.seed)
    task = build_task(cfg.task.name, **cfg.task.options)
    # Every completion carries an answer to judge. The untrained model's carry one only when they hold a
    # digit (the last-number fallback), and which groups make the async loop's batch depends on timing:
    # a batch of digit-free completions judged nothing on a busy machine.
    monkeypatch.setattr(MathVerifier, "extract", lambda self, completion: "1")
    inline = _spy_inline(monkeypatch)
    remote: list[tuple] = []
    pool_call = math_rewards._POOL.call
    monkeypatch.setattr(
        math_rewards._POOL, "call", lambda fn, args, timeout_s: remote.append(args) or pool_call(fn, args, timeout_s)
    )
    run_rl(cfg, policy, build_engine(cfg.rollout, policy), task, objective_spec(cfg), lambda record, state: None)
    judged = remote if mode == "async" else inline
    assert len(judged) > 0 and (inline if mode == "async" else remote) == []
