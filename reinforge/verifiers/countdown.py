"""Verifier for countdown expressions: parse, check number usage, evaluate exactly.

Owns the grammar of an acceptable countdown answer and its exact evaluation.
The parser is a small hand-written recursive descent (no `eval`): model output
is untrusted, and the verifier must return 0.0 rather than raise on anything.

Grammar (spaces allowed between tokens, nothing else):

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := INTEGER | "(" expr ")"

Rules:

* Unary minus is not allowed ("-3+5" is malformed).
* Each number may be used at most as many times as it appears in `numbers`;
  a number not in `numbers` gives 0.0. Not every number has to be used (the
  classic TinyZero countdown likewise only requires each number at most once).
* Integer literals are compared by value, so "03" counts as a use of 3.
* Arithmetic is exact (`fractions.Fraction`), so intermediate fractions are
  fine: numbers [1, 3, 4, 6], "6/(1-3/4)" reaches 24. Division by zero → 0.0.
* Input over `MAX_EXPRESSION_CHARS` characters or nested deeper than
  `MAX_NESTING` parentheses → 0.0.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

MAX_EXPRESSION_CHARS = 200
MAX_NESTING = 16

_OPERATORS = frozenset("+-*/()")


class _Reject(Exception):
    """Internal: the completion is not an acceptable expression."""


@dataclass(frozen=True)
class _Token:
    kind: str  # "int" or one of "+-*/()"
    value: int = 0


def _tokenize(text: str, available: Counter[int]) -> list[_Token]:
    tokens: list[_Token] = []
    remaining = Counter(available)
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == " ":
            i += 1
        elif ch in _OPERATORS:
            tokens.append(_Token(ch))
            i += 1
        elif "0" <= ch <= "9":
            j = i
            while j < len(text) and "0" <= text[j] <= "9":
                j += 1
            value = int(text[i:j])
            # Checked while tokenizing so that values stay bounded by the given numbers.
            if remaining[value] <= 0:
                raise _Reject(f"number {value} not available")
            remaining[value] -= 1
            tokens.append(_Token("int", value))
            i = j
        else:
            raise _Reject(f"unexpected character {ch!r}")
    return tokens


class _Parser:
    def __init__(self, tokens: list[_Token]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def _peek(self) -> str | None:
        return self.tokens[self.pos].kind if self.pos < len(self.tokens) else None

    def parse(self) -> Fraction:
        value = self._expr()
        if self.pos != len(self.tokens):
            raise _Reject("trailing tokens")
        return value

    def _expr(self) -> Fraction:
        value = self._term()
        while self._peek() in ("+", "-"):
            op = self.tokens[self.pos].kind
            self.pos += 1
            rhs = self._term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def _term(self) -> Fraction:
        value = self._factor()
        while self._peek() in ("*", "/"):
            op = self.tokens[self.pos].kind
            self.pos += 1
            rhs = self._factor()
            if op == "*":
                value = value * rhs
            elif rhs == 0:
                raise _Reject("division by zero")
            else:
                value = value / rhs
        return value

    def _factor(self) -> Fraction:
        kind = self._peek()
        if kind == "int":
            token = self.tokens[self.pos]
            self.pos += 1
            return Fraction(token.value)
        if kind == "(":
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise _Reject("nesting too deep")
            self.pos += 1
            value = self._expr()
            if self._peek() != ")":
                raise _Reject("unbalanced parenthesis")
            self.pos += 1
            self.depth -= 1
            return value
        # Covers end of input, ")" and a leading "-" (unary minus is not allowed).
        raise _Reject(f"expected a number or '(', got {kind!r}")


def evaluate_countdown(completion: str, numbers: list[int]) -> Fraction | None:
    """The exact value of `completion`, or None if it is not a valid expression."""
    if not isinstance(completion, str) or len(completion) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tokens = _tokenize(completion.strip(), Counter(numbers))
        return _Parser(tokens).parse()
    except _Reject:
        return None


def verify_countdown(completion: str, numbers: list[int], target: int) -> float:
    """1.0 iff `completion` is a valid expression over `numbers` equal to `target`."""
    value = evaluate_countdown(completion, numbers)
    return 1.0 if value is not None and value == target else 0.0
