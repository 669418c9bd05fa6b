"""Write the small seeded math set shipped as `reinforge/data/math_small.jsonl`.

    python -m reinforge.data.make_math OUT.jsonl [--n 200] [--seed 0]

Five kinds of problem in equal shares, interleaved: fraction arithmetic
(gold a reduced fraction, "3/4" or "-1/8", or an integer), decimal arithmetic
("4.25"), small integer word problems ("17"), simplifying square roots
("6*sqrt(2)") and percentages ("12"). Prompts use only the built-in
tokenizer's characters (`reinforge.models.charset.CHARSET`); every gold answer
is parsed by the math verifier (`reinforge.verifiers.math`). Same arguments, same
bytes: the output depends only on `n` and `seed`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

Problem = tuple[str, str]  # (prompt, gold answer)

_NAMES = ("Ana", "Ben", "Cleo", "Dev", "Emil", "Faye", "Gus", "Hana")
_ITEMS = ("apples", "pencils", "marbles", "stickers", "books", "coins")
# Square-free parts, so "a*sqrt(b)" is already the simplest form.
_SQUARE_FREE = (2, 3, 5, 6, 7, 10, 11)


def _fraction(rng: random.Random) -> Problem:
    a = Fraction(rng.randint(1, 9), rng.randint(2, 9))
    b = Fraction(rng.randint(1, 9), rng.randint(2, 9))
    op = rng.choice("+-*")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    prompt = (
        f"Compute {a.numerator}/{a.denominator} {op} {b.numerator}/{b.denominator}. "
        "Give the answer as a reduced fraction."
    )
    return prompt, str(value)


def _decimal(rng: random.Random) -> Problem:
    a = Decimal(rng.randint(1, 999)) / Decimal(rng.choice((10, 100)))
    b = Decimal(rng.randint(1, 999)) / Decimal(rng.choice((10, 100)))
    op = rng.choice("+-")
    value = a + b if op == "+" else a - b
    return f"Compute {a} {op} {b}.", format(value.normalize(), "f")


def _word(rng: random.Random) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?", str(a + b)
    if kind == 1:
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item} and gives {b} of them away. How many {item} are left?", str(a - b)
    if kind == 2:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return f"A box holds {a} {item}. How many {item} are in {b} boxes?", str(a * b)
    share, children = rng.randint(2, 12), rng.randint(2, 9)
    return (
        f"{share * children} {item} are shared equally among {children} children. How many {item} does each child get?",
        str(share),
    )


def _sqrt(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 9), rng.choice(_SQUARE_FREE)
    return f"Simplify sqrt({a * a * b}). Write it as a*sqrt(b).", f"{a}*sqrt({b})"


def _percent(rng: random.Random) -> Problem:
    percent = rng.choice((5, 10, 20, 25, 50, 75))
    whole = rng.randint(1, 40) * 20  # a multiple of 20: every percentage above is a whole number
    return f"What is {percent} percent of {whole}?", str(percent * whole // 100)


KINDS: dict[str, Callable[[random.Random], Problem]] = {
    "fraction": _fraction,
    "decimal": _decimal,
    "word": _word,
    "sqrt": _sqrt,
    "percent": _percent,
}


def make_math(n: int = 200, seed: int = 0) -> list[dict[str, str]]:
    """`n` distinct problems as records {prompt, answer, kind}, kinds in turn."""
    rng = random.Random(seed)
    records: list[dict[str, str]] = []
    seen: set[str] = set()
    kinds = list(KINDS)
    while len(records) < n:
        kind = kinds[len(records) % len(kinds)]
        prompt, answer = KINDS[kind](rng)
        if prompt not in seen:  # each space is far larger than n / len(KINDS)
            seen.add(prompt)
            records.append({"prompt": prompt, "answer": answer, "kind": kind})
    return records


def write_jsonl(records: list[dict], path: str | Path) -> None:
    with Path(path).open("w", encoding="utf-8", newline="\n") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="output .jsonl path")
    parser.add_argument("--n", type=int, default=200, help="number of problems")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)
    write_jsonl(make_math(args.n, args.seed), args.out)


if __name__ == "__main__":
    main()
