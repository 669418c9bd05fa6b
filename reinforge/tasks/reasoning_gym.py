"""reasoning-gym's procedural tasks (`task.name=reasoning_gym`): problems nobody here wrote, each dataset
scored by its own `score_answer`.

reasoning-gym (PyPI `reasoning-gym`, pinned in the extras) has about a hundred generators (`chain_sum`,
`spell_backward`, `basic_arithmetic`, ...), each with a scorer. This module owns how its items become
reinforge examples, splits and rewards:

Problems. `datasets` names one or more generators (a name, or {name, weight, config}); a candidate is
drawn by picking a dataset by weight, then an item index in [0, pool_size) of that dataset, created
with this task's seed; both draws come from the task's seeded stream, so the splits are deterministic
for a seed and disjoint (tasks/base.py: a prompt's split is a hash of the prompt). An example keeps
only (dataset, index) in its meta: the item is regenerated where it is scored.

Answers. The answer is extracted from the completion (`answer_format`): plain (the whole completion,
stripped), answer_tag (the last <answer>...</answer>) or boxed (the last \\boxed{...}, by the math
verifier's extraction); or by `pattern`, a regex whose first group is the answer. Only the last
`tail_chars` characters are searched and an answer longer than `max_answer_chars` scores 0.

Scoring. The dataset's `score_answer(answer, entry)` runs in a worker process (verifiers/bounded.py),
killed past `timeout_s` (the call then scores 0): it is third-party code fed model output, as the
math and code verifiers' are. Its score (some datasets give partial credit) becomes the reward 1.0
when it reaches `pass_score` (1.0 by default), else 0.0, so pass@k and binary advantages keep their
meaning. Each dataset is a domain: held-out pass@1 and greedy accuracy are reported per dataset
(eval/<dataset>/pass@1) when there are several.

Cold start: the teacher's completion is the gold answer in the answer format; a wrong one is a
near miss of it that the dataset's own scorer rejects.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from reinforge.tasks.base import Example, Task
from reinforge.verifiers.bounded import BoundedPool

ANSWER_FORMATS = ("plain", "answer_tag", "boxed")
# What the prompt asks for, after the dataset's question, in each format.
_INSTRUCTIONS = {
    "plain": "",
    "answer_tag": "\nGive your final answer inside <answer></answer>.",
    "boxed": "\nGive your final answer inside \\boxed{}.",
}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MISSING = ("reasoning-gym is not installed: pip install 'reinforge[extras]' (it pins reasoning-gym==0.1.25)")


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as err:
        raise ValueError(_MISSING) from err
    return reasoning_gym


@functools.lru_cache(maxsize=64)
def _dataset(spec: str):
    """The reasoning-gym dataset of `spec` (JSON of name, config, seed, size), built once per process."""
    fields = json.loads(spec)
    return _reasoning_gym().create_dataset(fields["name"], seed=fields["seed"], size=fields["size"],
                                           **fields["config"])


def score(spec: str, index: int, answer: str) -> float:
    """The dataset's score_answer of `answer` for item `index` of the dataset `spec`; what a worker runs."""
    dataset = _dataset(spec)
    return float(dataset.score_answer(answer=answer, entry=dataset[index]))


def _warm_up() -> None:
    _reasoning_gym()


# Shared by every task of this kind; the dataset spec travels with each call.
_POOL = BoundedPool(warmup=_warm_up, max_workers=os.cpu_count() or 1)


def _parse_datasets(datasets: Any) -> list[tuple[str, float, dict[str, Any]]]:
    """(name, weight, config) per entry of `task.options.datasets`; ValueError naming the entry otherwise."""
    if isinstance(datasets, str):
        datasets = [datasets]
    if not isinstance(datasets, Sequence) or not datasets:
        raise ValueError("task.options.datasets must be a non-empty list of reasoning-gym dataset names, "
                         f"e.g. [chain_sum, spell_backward], got {datasets!r}")
    known = _reasoning_gym().factory.DATASETS
    out = []
    for i, entry in enumerate(datasets):
        where = f"task.options.datasets[{i}]"
        entry = {"name": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, Mapping) or set(entry) - {"name", "weight", "config"}:
            raise ValueError(f"{where} must be a dataset name or {{name, weight, config}}, got {entry!r}")
        name, weight, config = entry.get("name"), entry.get("weight", 1.0), dict(entry.get("config") or {})
        if name not in known:
            import difflib

            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{where}: unknown reasoning-gym dataset {name!r}{hint} ({len(known)} known, "
                             "e.g. chain_sum, basic_arithmetic, spell_backward)")
        if not isinstance(weight, (int, float)) or weight <= 0:
            raise ValueError(f"{where}.weight must be > 0, got {weight!r}")
        if any(name == seen for seen, _, _ in out):
            raise ValueError(f"{where}: dataset {name!r} is listed twice")
        out.append((name, float(weight), config))
    return out


class ReasoningGymTask(Task):
    """reasoning-gym datasets as one task, a domain per dataset (see the module docstring)."""

    name = "reasoning_gym"
    # Most questions run 50-110 characters: 192 positions hold one with a 32-token answer.
    preset: dict[str, Any] = {"model": {"max_positions": 192}, "rollout": {"max_new_tokens": 32}}

    def __init__(self, seed: int = 0, datasets: Any = ("chain_sum",), eval_fraction: float = 0.2,
                 answer_format: str = "plain", pattern: str | None = None, instruction: str | None = None,
                 pass_score: float = 1.0, pool_size: int = 100_000, timeout_s: float = 10.0,
                 tail_chars: int = 4000, max_answer_chars: int = 1000) -> None:
        super().__init__(seed=seed, eval_fraction=eval_fraction)
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}")
        if pattern is not None and re.compile(pattern).groups < 1:
            raise ValueError(f"pattern needs a capture group for the answer: {pattern!r}")
        if not 0.0 < pass_score <= 1.0:
            raise ValueError(f"pass_score must be in (0, 1], got {pass_score!r}")
        if not isinstance(pool_size, int) or pool_size < 1:
            raise ValueError(f"pool_size must be a positive int, got {pool_size!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.entries = _parse_datasets(datasets)
        self.answer_format, self.pattern = answer_format, pattern
        self.instruction = _INSTRUCTIONS[answer_format] if instruction is None else instruction
        self.pass_score, self.pool_size, self.timeout_s = pass_score, pool_size, timeout_s
        self.tail_chars, self.max_answer_chars = tail_chars, max_answer_chars
        self.specs = {name: json.dumps({"name": name, "seed": seed, "size": pool_size, "config": config},
                                       sort_keys=True) for name, _, config in self.entries}
        for name, spec in self.specs.items():     # a bad config is a config error now, not at the first reward
            try:
                _dataset(spec)
            except (TypeError, ValueError, AssertionError) as err:
                raise ValueError(f"reasoning-gym dataset {name!r}: bad config: {err}") from None

    # ----------------------------------------------------------------- problems

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.entries)

    def domain_of(self, example: Example) -> str:
        return example.meta["dataset"]

    def _sample_problem(self, rng: random.Random) -> Example:
        names, weights = self.domains, [w for _, w, _ in self.entries]
        name = rng.choices(names, weights)[0]
        index = rng.randrange(self.pool_size)
        item = _dataset(self.specs[name])[index]
        return Example(prompt=item["question"] + self.instruction, answer=str(item["answer"]),
                       meta={"dataset": name, "index": index})

    # ------------------------------------------------------------------- reward

    def extract(self, completion: str) -> str | None:
        """The answer part of `completion` per `pattern` or `answer_format`; None: no answer."""
        if not isinstance(completion, str):
            return None
        tail = completion[-self.tail_chars:]
        if self.pattern is not None:
            matches = list(re.finditer(self.pattern, tail))
            answer = matches[-1].group(1) if matches else None
        elif self.answer_format == "answer_tag":
            matches = _ANSWER_TAG.findall(tail)
            answer = matches[-1] if matches else None
        elif self.answer_format == "boxed":
            from reinforge.verifiers.math import MathVerifier  # math-verify is an optional dependency

            answer = MathVerifier(last_number_fallback=False).extract(tail)
        else:
            answer = tail
        answer = None if answer is None else answer.strip()
        return answer if answer and len(answer) <= self.max_answer_chars else None

    def reward(self, example: Example, completion: str) -> float:
        """1.0 iff the dataset's score_answer of the extracted answer reaches pass_score; 0.0 without an
        answer, past the time bound, or if the scorer raised. Never raises on model output."""
        answer = self.extract(completion)
        if answer is None:
            return 0.0
        outcome = _POOL.call(score, (self.specs[example.meta["dataset"]], example.meta["index"], answer),
                             self.timeout_s)
        return 1.0 if outcome.ok and outcome.value >= self.pass_score else 0.0

    # ---------------------------------------------------------------------- SFT

    def _format(self, answer: str) -> str:
        if self.answer_format == "answer_tag":
            return f"<answer>{answer}</answer>"
        if self.answer_format == "boxed":
            return f"\\boxed{{{answer}}}"
        return answer

    def teacher_completion(self, example: Example, rng: random.Random) -> str:
        """The gold answer in the answer format (reasoning-gym gives no worked solution for most datasets)."""
        return self._format(example.answer)

    def corrupt_completion(self, example: Example, rng: random.Random) -> str:
        """A near miss of the gold answer (a character changed, dropped or added) that the dataset's own
        scorer rejects; an empty answer if none of a few tries is rejected."""
        gold, spec, index = example.answer, self.specs[example.meta["dataset"]], example.meta["index"]
        for _ in range(8):
            wrong = _near_miss(gold, rng)
            if wrong and score(spec, index, wrong) < self.pass_score:
                return self._format(wrong)
        return self._format("")


def _near_miss(text: str, rng: random.Random) -> str:
    """`text` with one character changed, dropped or added (a digit for a digit where it was one)."""
    pos = rng.randrange(len(text)) if text else 0
    kind = rng.choice(("change", "drop", "add")) if text else "add"
    if kind == "drop" and len(text) > 1:
        return text[:pos] + text[pos + 1:]
    if kind == "change" and text:
        pool = "0123456789" if text[pos].isdigit() else "abcdefghijklmnopqrstuvwxyz"
        return text[:pos] + rng.choice([c for c in pool if c != text[pos]]) + text[pos + 1:]
    return text[:pos] + rng.choice("0123456789") + text[pos:]
