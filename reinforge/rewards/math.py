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
* Size caps before the parser: the tail, `max_answer_chars`, and `max_nesting`
  bracket depth (math-verify's parse time grows steeply with nesting: 16 nested
  bare braces take about 5 s, 40 about 8 s).
* Never raises on model output: any exception from math-verify scores 0.0.

Timeouts. math-verify bounds its own parse and compare with `signal.alarm`,
which only works in the main thread (elsewhere it raises). Off the main thread
we pass `parsing_timeout=None` / `timeout_seconds=None`, and nothing inside this
process bounds the time. A signal is also only handled between Python bytecodes,
so one long C call can overrun it. `verify_many(workers > 0)` is the real bound:
each item runs in a worker process that is killed after `timeout_s`.
"""

from __future__ import annotations

import functools
import multiprocessing
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from math_verify import LatexExtractionConfig, parse
from math_verify import verify as _math_verify
from math_verify.errors import TimeoutException

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
    (`signal.alarm` takes ints). Used on the main thread only; None disables it."""

    def __post_init__(self) -> None:
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
        if not isinstance(completion, str) or not isinstance(gold, str):
            return 0.0
        answer = self.extract(completion)
        if answer is None or not self._within_caps(answer):
            return 0.0
        timeout = self.library_timeout_s if _signals_usable() else None
        try:
            gold_parsed = _parse_gold(gold, timeout)
            answer_parsed = parse(
                _as_math(answer), extraction_config=_PARSE_CONFIG, parsing_timeout=timeout
            )
            if not gold_parsed or not answer_parsed:
                return 0.0
            same = _math_verify(list(gold_parsed), answer_parsed, timeout_seconds=timeout)
            return 1.0 if same else 0.0
        except (Exception, TimeoutException):  # TimeoutException is a BaseException
            return 0.0

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


def _as_math(answer: str) -> str:
    """Answer as one `$...$` span, so the library parses it whole, whatever its delimiters."""
    return "$" + _MATH_DELIMITERS.sub("", answer).strip() + "$"


@functools.lru_cache(maxsize=1024)
def _parse_gold(gold: str, timeout: int | None) -> tuple[object, ...]:
    # Cached: a group of samples shares one gold. Sympy values are immutable.
    boxes = list(_BOX_OPEN.finditer(gold))
    text = _braced(gold, boxes[-1].end()) if boxes else gold.strip()
    if not text:
        return ()
    return tuple(parse(_as_math(text), extraction_config=_PARSE_CONFIG, parsing_timeout=timeout))


def _signals_usable() -> bool:
    return threading.current_thread() is threading.main_thread()


# --- process pool: the time bound that works everywhere -----------------------

# spawn: a forked child of a process with threads (torch, tokenizers) can deadlock.
_CONTEXT = multiprocessing.get_context("spawn")


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    ready: bool = False  # set once the worker has imported and warmed the parser
    item: int | None = None  # index of the pair in flight
    deadline: float = 0.0  # time.monotonic() after which the item is abandoned
    dead: bool = False  # its pipe closed: the process exited or crashed


def _worker_main(conn: Connection, verifier: MathVerifier) -> None:
    # Warm the parser first so an item's timeout does not pay for start-up.
    verifier("\\boxed{1}", "1")
    conn.send(None)
    try:
        while (message := conn.recv()) is not None:
            index, completion, gold = message
            conn.send((index, verifier(completion, gold)))
    except EOFError:
        pass  # parent went away


def _start_worker(verifier: MathVerifier) -> _Worker:
    parent_conn, child_conn = _CONTEXT.Pipe()
    process = _CONTEXT.Process(target=_worker_main, args=(child_conn, verifier), daemon=True)
    process.start()
    child_conn.close()
    return _Worker(process, parent_conn)


def _stop_worker(worker: _Worker, graceful: bool) -> None:
    if graceful:
        try:
            worker.conn.send(None)
        except OSError:
            pass
        worker.process.join(timeout=1.0)
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join()
    worker.conn.close()


def verify_many(
    pairs: Sequence[tuple[str, str]],
    workers: int = 0,
    timeout_s: float = 5.0,
    verifier: MathVerifier = _DEFAULT,
) -> list[float]:
    """Scores of `(completion, gold)` pairs, in order.

    `workers == 0`: serial, in this process (bounded only by math-verify's
    signal timeouts, on the main thread). `workers > 0`: that many spawned
    worker processes for this call; an item that takes longer than `timeout_s`
    (counted from when its worker receives it) scores 0.0 and its worker is
    killed and replaced. A worker that dies mid-item also scores it 0.0.
    """
    if workers <= 0:
        return [verifier(completion, gold) for completion, gold in pairs]
    scores = [0.0] * len(pairs)
    todo = deque(range(len(pairs)))
    remaining = len(pairs)
    pool = [_start_worker(verifier) for _ in range(min(workers, len(pairs)))]
    try:
        while remaining:
            for worker in pool:
                if worker.ready and worker.item is None and todo:
                    index = todo.popleft()
                    worker.item = index
                    try:
                        worker.conn.send((index, *pairs[index]))
                    except OSError:  # died while idle: replaced below, the item scores 0.0
                        worker.dead = True
                    worker.deadline = time.monotonic() + timeout_s
            deadlines = [w.deadline for w in pool if w.item is not None]
            wait_s = max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None
            for conn in wait([w.conn for w in pool], timeout=wait_s):
                worker = next(w for w in pool if w.conn is conn)
                try:
                    message = conn.recv()
                except EOFError:  # the worker died (segfault, out of memory)
                    if not worker.ready:
                        raise RuntimeError("math verifier worker died during start-up") from None
                    worker.dead = True  # replaced below; its item, if any, scores 0.0
                    continue
                if message is None:
                    worker.ready = True
                else:
                    index, score = message
                    scores[index] = score
                    worker.item = None
                    remaining -= 1
            now = time.monotonic()
            for worker in [w for w in pool if w.dead or (w.item is not None and w.deadline <= now)]:
                _stop_worker(worker, graceful=False)
                if worker.item is not None:
                    remaining -= 1  # its score stays 0.0
                pool.remove(worker)
                if todo:  # the busy workers finish the rest otherwise
                    pool.append(_start_worker(verifier))
    finally:
        for worker in pool:
            _stop_worker(worker, graceful=True)
    return scores
