"""Verifier for free-form math answers: extract the final answer, compare with math-verify.

Owns which part of a completion counts as "the answer" and the limits that keep a
hostile completion cheap. Equivalence (fractions, decimals, radicals, sets,
intervals, percentages) is decided by HuggingFace's `math-verify` (pinned 0.9.0);
nothing here parses LaTeX.

Extraction. Only the last `tail_chars` characters are searched; the first rule
that finds something decides:

1. `pattern`, if set: the first group of its last match. It is then the only
   rule, so a task can demand an answer format (e.g. `<answer>(.*?)</answer>`).
2. The LAST `\\boxed{...}` (or `\\fbox{...}`).
3. The last "answer is X" / "answer: X"; X runs to the end of its sentence
   (a period then a space) or line.
4. The last number ("1,000", "-2.5", "3/4"), unless `last_number_fallback=False`.

Anti-hacking rules (RL optimises whatever the verifier accepts):

* Only the last box counts. Boxing every option earns nothing unless the last
  box is right; a malformed last box scores 0.0 and never falls back to an
  earlier box.
* The extracted answer is parsed as ONE expression: "1, 2, 3, 4" and
  "1 \\text{ or } 2" become sets, which do not equal the gold "2". math-verify is
  never allowed to search the answer for a piece that matches.
* Hedges score 0.0 against a gold that is one value: an answer that joins
  values with "or"/"and" (`\\lor`, `\\vee`, ...) anywhere, or with a comma or
  semicolon outside brackets, once the text of `\\text{}`, `\\mbox{}`,
  `\\textit{}`, `\\textbf{}`, `\\mathrm{}` and their kin is read as plain text
  (math-verify drops such text as a unit, so `2 \\text{ or 3}` would read as
  2). A gold is one value when it has no comma, semicolon, "or" or "and" at
  all; lists, sets, intervals and tuples ("2, 3", "\\{1,2\\}", "(1,2)") are
  judged by math-verify as before. A comma between digit groups ("1,000",
  "12,345.6", "1{,}000") is a thousands separator, not a list: 1,000 == 1000.
* Percentages: a percent sign in the answer (`\\%`, `%`) is a label, never a
  factor of 1/100: the answer and the gold are compared with their signs
  removed, so `50\\%` equals the golds "50" and "50\\%" but never "0.5" or
  "\\frac12". Read as a factor as well (math-verify's default), one answer
  would score under two readings (`2\\%` against both "2" and "0.02"); read as a
  factor only, the common "what percent ..." gold "20" would reject the
  natural answer `20\\%`. So a sign never earns credit: for every gold, x\\%
  scores at most what x scores. An answer without a sign is judged as before
  (against the gold "50\\%", both 50 and 0.5 score).
* Size caps before the parser: the tail, `max_answer_chars`, and `max_nesting`
  bracket depth (math-verify's parse time grows steeply with nesting: 16 nested
  bare braces take about 5 s, 40 about 8 s).
* Never raises on model output: any exception from math-verify scores 0.0.

Time bound. math-verify bounds its own parse and compare with `signal.alarm`,
which works only in the main thread, and only between bytecodes; off the main
thread a parse bomb (`\\boxed{9^{9^{9^{9}}}}`) runs unbounded inside sympy
holding the GIL, freezing every thread of the process for minutes. So the
extracted answer is judged in this process only when that is safe: called
from the main thread while it is the process's only Python thread (the
alarm bounds it, and there is no other thread to stall). Every other call
(a reward thread, the async loop whose sampler thread is running, or
`isolation="process"`) is judged in a persistent worker process
(`reinforge.verifiers.bounded`) that is killed past `timeout_s`; the call then
scores 0.0. Extraction and the size caps run in the caller (cheap), so only
the short answer and the gold cross the pipe.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from math_verify import LatexExtractionConfig, parse
from math_verify import verify as _math_verify
from math_verify.errors import TimeoutException

from reinforge.verifiers.bounded import BoundedPool

# Only LaTeX extraction: the answer is handed over whole, wrapped in `$...$`.
# ExprExtractionConfig would, on a failed parse, pick a bare number out of the
# answer, which would let "1 or 2 or 3" match "2". Boxes are already removed.
_PARSE_CONFIG = (LatexExtractionConfig(boxed_match_priority=-1),)

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
# The phrase only: matching the rest of the line too would swallow a later
# "answer is" on the same line ("Final Answer: The final answer is $42$").
_ANSWER_IS = re.compile(r"\banswer\s*(?:is\b\s*:?|:)", re.IGNORECASE)
# A period that ends a sentence, not a decimal point ("3.5").
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
# ASCII digits; thousands groups before a plain run so "1,000" is one number.
_NUMBER = re.compile(r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:/[0-9]+)?", re.ASCII)
# Unescaped math delimiters around an answer: "$", "\(", "\)", "\[", "\]".
_MATH_DELIMITERS = re.compile(r"(?<!\\)\$|\\[()\[\]]")
# Commands whose argument is text that math-verify drops as a unit ("2 \text{ cm}" reads as 2).
_TEXT_COMMAND = re.compile(r"\\(?:text[a-z]*|mbox|hbox|math(?:rm|it|bf|sf|tt|normal)|operatorname)\s*\{")
# Words and connectives that join alternatives ("2 or 3", "2 \vee 3"); not inside a word ("for", "\land"
# is matched as itself, "\operatorname" is not "or").
_HEDGE_WORD = re.compile(r"(?<![A-Za-z\\])(?:or|and)(?![A-Za-z])|\\(?:lor|vee|land|wedge)(?![A-Za-z])",
                         re.IGNORECASE)
# Digit groups joined by thousands separators: "1,000", "12,345.6", "1{,}000".
_THOUSANDS = re.compile(r"(?<![0-9.])[0-9]{1,3}(?:(?:,|\{,\})[0-9]{3})+(?![0-9])")
_PERCENT = re.compile(r"\\?%")
_SPACING = re.compile(r"\\[,;:! ]")


@dataclass(frozen=True)
class MathVerifier:
    """Options of the math verifier; call it as `verifier(completion, gold) -> 0.0 | 1.0`."""

    pattern: str | None = None
    """Regex whose first group is the answer; when set, the only extraction rule."""
    last_number_fallback: bool = True
    """Rule 4: with no box and no "answer is", use the last number in the tail."""
    tail_chars: int = 4000
    """Only the completion's last `tail_chars` characters are searched."""
    max_answer_chars: int = 1000
    """An extracted answer longer than this scores 0.0 without parsing."""
    max_nesting: int = 10
    """An answer with ({[ nested deeper than this scores 0.0 without parsing."""
    library_timeout_s: int | None = 5
    """math-verify's own bound per parse and per compare, in whole seconds
    (`signal.alarm` takes ints), in whichever process's main thread judges the
    answer; None disables it (then only `timeout_s` bounds a worker)."""
    timeout_s: float = 10.0
    """Wall-clock bound of one answer judged in a worker process: past it the
    worker is killed and the answer scores 0.0. Above 2 x library_timeout_s, so
    the library's own alarm normally ends a slow answer first and the worker
    survives."""
    isolation: str = "auto"
    """"auto": in this process when called from the main thread while it is the
    only Python thread, else in a worker process; "process": always in a worker."""

    def __post_init__(self) -> None:
        if self.isolation not in ("auto", "process"):
            raise ValueError(f"isolation must be 'auto' or 'process', got {self.isolation!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        # A broken pattern is a config error: raise now, not 0.0 on every sample.
        if self.pattern is not None and re.compile(self.pattern).groups < 1:
            raise ValueError(f"pattern needs a capture group for the answer: {self.pattern!r}")

    def extract(self, completion: str) -> str | None:
        """The final answer per the module's rules, or None (no answer / malformed)."""
        tail = completion[-self.tail_chars :]
        if self.pattern is not None:
            matches = list(re.finditer(self.pattern, tail))
            return matches[-1].group(1) if matches and matches[-1].group(1) else None
        boxes = list(_BOX_OPEN.finditer(tail))
        if boxes:
            return _braced(tail, boxes[-1].end())  # None if the last box is malformed
        answers = list(_ANSWER_IS.finditer(tail))
        if answers:
            # First sentence only: "The final answer is $42$. I hope it is correct."
            line = tail[answers[-1].end() :].split("\n", maxsplit=1)[0]
            answer = _SENTENCE_END.split(line, maxsplit=1)[0]
            return answer.strip(" \t*") or None
        if self.last_number_fallback:
            numbers = _NUMBER.findall(tail)
            return numbers[-1] if numbers else None
        return None

    def __call__(self, completion: str, gold: str) -> float:
        answer = self._checked_answer(completion, gold)
        if answer is None:
            return 0.0
        if self.isolation == "auto" and _alone_on_main_thread():
            return _judge(answer, gold, self.library_timeout_s)
        return self._judge_in_worker(answer, gold, self.timeout_s)

    def _judge_in_worker(self, answer: str, gold: str, timeout_s: float) -> float:
        outcome = _POOL.call(_judge, (answer, gold, self.library_timeout_s), timeout_s)
        return outcome.value if outcome.ok else 0.0  # killed past the bound, or the worker died: 0.0

    def _checked_answer(self, completion: object, gold: object) -> str | None:
        """The answer to judge, or None when the pair scores 0.0 without parsing."""
        if not isinstance(completion, str) or not isinstance(gold, str):
            return None
        answer = self.extract(completion)
        return answer if answer is not None and self._within_caps(answer) else None

    def _within_caps(self, answer: str) -> bool:
        if len(answer) > self.max_answer_chars:
            return False
        depth = 0
        for ch in answer:
            if ch in "({[":
                depth += 1
                if depth > self.max_nesting:
                    return False
            elif ch in ")}]":
                depth = max(depth - 1, 0)  # intervals like "(0,1]" mix bracket kinds
        return True


_DEFAULT = MathVerifier()


def verify(completion: str, gold: str) -> float:
    """1.0 iff the final answer of `completion` equals `gold` (default `MathVerifier`).

    Never raises on model output. `gold` may be plain ("1/2"), LaTeX
    ("\\frac{1}{2}"), math-delimited ("$\\frac12$") or boxed.
    """
    return _DEFAULT(completion, gold)


def _braced(text: str, start: int) -> str | None:
    """Content from `start` up to the brace closing the one just before it, or None."""
    depth = 1
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # "\{" and "\}" are literal braces (set notation), not grouping
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip() or None
        i += 1
    return None


def _plain(text: str) -> str:
    """`text` with text commands replaced by their argument and thousands separators dropped: the form
    in which hedges are looked for."""
    while (match := _TEXT_COMMAND.search(text)) is not None:
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        text = f"{text[:match.start()]} {text[match.end():end - 1 if depth == 0 else end]} {text[end:]}"
    text = _SPACING.sub(" ", text)    # "\\," and "\\;" are spaces, not separators
    return _THOUSANDS.sub(lambda m: re.sub(r"\{,\}|,", "", m.group()), text)


def _hedged(answer: str) -> bool:
    """Whether `answer` joins several values: "or"/"and" anywhere, or "," / ";" outside brackets."""
    text = _plain(answer)
    if _HEDGE_WORD.search(text):
        return True
    depth = 0
    for ch in text:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth = max(depth - 1, 0)
        elif ch in ",;" and depth == 0:
            return True
    return False


def _one_value(gold_text: str) -> bool:
    """Whether the gold is a single value (no list, set, interval or tuple, no alternatives)."""
    text = _plain(gold_text)
    return not _HEDGE_WORD.search(text) and "," not in text and ";" not in text


def _as_math(answer: str) -> str:
    """Answer as one `$...$` span, so the library parses it whole, whatever its delimiters."""
    return "$" + _MATH_DELIMITERS.sub("", answer).strip() + "$"


def _gold_text(gold: str) -> str | None:
    """The gold answer's text: the content of its last box, else the whole (None when empty or malformed)."""
    boxes = list(_BOX_OPEN.finditer(gold))
    return (_braced(gold, boxes[-1].end()) if boxes else gold.strip()) or None


@functools.lru_cache(maxsize=1024)
def _parse_gold(gold: str, timeout: int | None) -> tuple[object, ...]:
    # Cached: a group of samples shares one gold. Sympy values are immutable.
    text = _gold_text(gold)
    if not text:
        return ()
    return tuple(parse(_as_math(text), extraction_config=_PARSE_CONFIG, parsing_timeout=timeout))


def _judge(answer: str, gold: str, library_timeout_s: int | None) -> float:
    """1.0 iff math-verify finds `answer` equal to `gold` (hedges and percent signs as the module docstring
    says); never raises. Bounded by the library's alarm only on a main thread; off it, only a worker
    process's kill bounds it."""
    timeout = library_timeout_s if threading.current_thread() is threading.main_thread() else None
    try:
        gold_text = _gold_text(gold)
        if gold_text is None or (_one_value(gold_text) and _hedged(answer)):
            return 0.0
        if _PERCENT.search(answer):      # a label, not a factor: compare the numbers as written
            answer, gold = _PERCENT.sub("", answer), _PERCENT.sub("", gold_text)
        gold_parsed = _parse_gold(gold, timeout)
        answer_parsed = parse(_as_math(answer), extraction_config=_PARSE_CONFIG, parsing_timeout=timeout)
        if not gold_parsed or not answer_parsed:
            return 0.0
        same = _math_verify(list(gold_parsed), answer_parsed, timeout_seconds=timeout)
        return 1.0 if same else 0.0
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return 0.0


def _alone_on_main_thread() -> bool:
    # Another Python thread (the async loop's sampler, a reward thread) would stall while sympy holds
    # the GIL, and off the main thread no alarm can end the parse: both need a worker process.
    return threading.current_thread() is threading.main_thread() and threading.active_count() == 1


def _warm_up() -> None:
    # Run once by each worker: imports math-verify and sympy's parser before the first timed call.
    _judge("1", "1", 5)


# The workers persist between calls and are shared by every MathVerifier (the options travel with
# each call). Size: one per CPU; verify_many raises it to the parallelism it is asked for.
_POOL = BoundedPool(warmup=_warm_up, max_workers=os.cpu_count() or 1)


def verify_many(
    pairs: Sequence[tuple[str, str]],
    workers: int = 0,
    timeout_s: float = 5.0,
    verifier: MathVerifier = _DEFAULT,
) -> list[float]:
    """Scores of `(completion, gold)` pairs, in order.

    `workers == 0`: one by one, each as `verifier(completion, gold)` decides.
    `workers > 0`: up to that many items at once, each in a worker process of
    the shared pool (kept for later calls); an item that takes longer than
    `timeout_s` (counted from when its worker receives it) scores 0.0 and its
    worker is killed and replaced. A worker that dies mid-item also scores it 0.0.
    """
    if workers <= 0:
        return [verifier(completion, gold) for completion, gold in pairs]
    _POOL.max_workers = max(_POOL.max_workers, workers)

    def one(pair: tuple[str, str]) -> float:
        answer = verifier._checked_answer(*pair)
        return 0.0 if answer is None else verifier._judge_in_worker(answer, pair[1], timeout_s)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify-many") as threads:
        return list(threads.map(one, pairs))
