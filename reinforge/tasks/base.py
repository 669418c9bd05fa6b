"""The task interface: problems, splits, verifiable rewards and teacher traces.

This module owns what every task shares: the `Example` / `SFTExample` records,
the deterministic train / held-out split machinery, the noisy-teacher SFT
data generator, and the `TASKS` registry (filled by the package). Concrete
tasks only say how to sample one problem, how to verify a completion, and how
to write a right and a wrong completion.

Splits. A task draws candidate problems from one `random.Random(seed)` stream.
Each distinct problem goes to the held-out split when a stable hash of its
split key (by default its prompt) falls below `eval_fraction`, else to train;
duplicates are dropped. Hence:

* the splits are disjoint and deterministic for a seed;
* `train_split(n)` is a prefix of `train_split(n + k)`, whatever order the
  splits are asked for in (each split is a filter of the same stream);
* membership does not depend on the seed (the hash is not salted with it), so
  the train split of one seed never contains a held-out problem of another.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

Split = Literal["train", "eval"]

# When the size of the problem space is unknown, this many draws in a row
# that yield nothing new is taken to mean the space is exhausted.
_MAX_CONSECUTIVE_DUPLICATES = 100_000


@dataclass(frozen=True)
class Example:
    """One problem. `meta` must stay JSON-serialisable (it goes into logs)."""

    prompt: str  # the text given to the model, already in the task's prompt format
    answer: str  # gold answer as a string, e.g. "46"
    meta: dict[str, Any]  # task-specific fields, e.g. {"numbers": [3, 5, 7], "target": 24}


@dataclass(frozen=True)
class SFTExample:
    """One supervised trace; `correct` is False for deliberately corrupted ones."""

    prompt: str
    completion: str
    correct: bool
    # A multi-turn trace (a task with tools): the conversation after the prompt, the model's turns
    # (role assistant, trained on) and the tools' results (context only); `completion` is its last turn.
    turns: tuple[dict[str, str], ...] = ()


class Task(ABC):
    """A family of problems with a verifier. Subclasses set `name`."""

    name: str
    # The tools its problems are meant to be solved with (rollout.tools when that is not given), and
    # whether this run gives them (set by the pipeline): then SFT traces are conversations (`teacher_turns`).
    tools: tuple[str, ...] = ()
    use_tools: bool = False
    # Config values this task runs best with, under the recipe and the user's (a nested dict like a YAML file).
    preset: dict[str, Any] = {}

    def __init__(self, seed: int = 0, eval_fraction: float = 0.2) -> None:
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
        self.seed = seed
        self.eval_fraction = eval_fraction
        self._stream_rng = random.Random(seed)
        self._splits: dict[Split, list[Example]] = {"train": [], "eval": []}
        self._seen: dict[Split, set[str]] = {"train": set(), "eval": set()}
        self._exhausted = False

    # ------------------------------------------------------------------ hooks

    @abstractmethod
    def _sample_problem(self, rng: random.Random) -> Example:
        """Draw one candidate problem (duplicates are fine, they are dropped)."""

    def _split_key(self, example: Example) -> str:
        """Problems with the same key always land in the same split."""
        return example.prompt

    def _space_size(self) -> int | None:
        """Number of distinct prompts, when known (lets exhaustion be exact)."""
        return None

    @abstractmethod
    def reward(self, example: Example, completion: str) -> float:
        """1.0 if the verifier accepts `completion`, else 0.0; never raises."""

    @abstractmethod
    def teacher_completion(self, example: Example, rng: random.Random) -> str:
        """A correct completion, as an expert would write it."""

    @abstractmethod
    def corrupt_completion(self, example: Example, rng: random.Random) -> str:
        """A plausible but wrong completion (reward 0.0 guaranteed)."""

    # ---------------------------------------------------------------- domains

    # A task is one domain, named after it; a mix (tasks/mix.py) has several, and each of its examples
    # says which it belongs to. Reward functions restricted to domains and per-domain figures read these.

    @property
    def domains(self) -> tuple[str, ...]:
        """The names of this task's domains."""
        return (self.name,)

    def domain_of(self, example: Example) -> str:
        """The domain `example` belongs to."""
        return self.name

    @classmethod
    def domain_specs(cls, options: dict[str, Any]) -> list[Any]:
        """The domains these constructor options declare (tasks/mix.py's `DomainSpec`), read before
        the task is built (config checks); [] for a task that is one domain."""
        return []

    def teacher_turns(self, example: Example, rng: random.Random) -> list[dict[str, str]] | None:
        """A correct multi-turn trace with the task's tools (see SFTExample.turns); None: the task has none."""
        return None

    def corrupt_turns(self, example: Example, rng: random.Random) -> list[dict[str, str]] | None:
        """A plausible but wrong multi-turn trace; None: the task has none."""
        return None

    # ----------------------------------------------------------------- splits

    # prompt.system (set by the pipeline): a system message put before every prompt the splits and
    # SFT hand out, which makes each a chat conversation (reinforge.data.chat.with_system).
    system: str | None = None

    def train_split(self, n: int) -> list[Example]:
        """The first `n` examples of the train split."""
        return self._with_system(self._take("train", n))

    def eval_split(self, n: int) -> list[Example]:
        """The first `n` examples of the held-out split."""
        return self._with_system(self._take("eval", n))

    def train_problems(self, n: int) -> list[Example]:
        """The first `n` train problems, or all there are when the split has fewer (`train_split` raises)."""
        self._fill("train", n)
        return self._with_system(self._splits["train"][:n])

    def drawn(self) -> list[Example]:
        """Every example drawn so far, train then held-out, as the splits hand them out."""
        return self._with_system(self._splits["train"] + self._splits["eval"])

    def _with_system(self, examples: list[Example]) -> list[Example]:
        if self.system is None:
            return examples
        from reinforge.data.chat import with_system

        return [Example(with_system(e.prompt, self.system), e.answer, e.meta) for e in examples]

    def _which_split(self, example: Example) -> Split:
        key = f"{self.name}\0{self._split_key(example)}".encode()
        bucket = int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64
        return "eval" if bucket < self.eval_fraction else "train"

    def _fill(self, split: Split, n: int) -> None:
        """Draw from the stream until `split` has `n` examples or the space runs out."""
        target = self._splits[split]
        space = self._space_size()
        misses = 0
        while len(target) < n and not self._exhausted:
            example = self._sample_problem(self._stream_rng)
            which = self._which_split(example)
            if example.prompt in self._seen[which]:
                misses += 1
                if misses >= _MAX_CONSECUTIVE_DUPLICATES:
                    self._exhausted = True
                continue
            misses = 0
            self._seen[which].add(example.prompt)
            self._splits[which].append(example)
            if space is not None and len(self._seen["train"]) + len(self._seen["eval"]) >= space:
                self._exhausted = True

    def _take(self, split: Split, n: int) -> list[Example]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._fill(split, n)
        available = self._splits[split]
        if len(available) < n:
            raise ValueError(
                f"task {self.name!r} has only {len(available)} distinct {split} examples "
                f"with these options, but {n} were requested"
            )
        return list(available[:n])

    # -------------------------------------------------------------------- SFT

    def sft_examples(self, n: int, corrupt_fraction: float, seed: int) -> list[SFTExample]:
        """`n` noisy teacher traces drawn from the train split.

        Each trace is corrupted with probability `corrupt_fraction`: SFT on a
        partly wrong teacher leaves a policy that RL can still improve. When the
        train split has fewer than `n` problems, they are cycled in a reshuffled
        order each pass. Deterministic for a given `seed`.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if not 0.0 <= corrupt_fraction <= 1.0:
            raise ValueError(f"corrupt_fraction must be in [0, 1], got {corrupt_fraction!r}")
        if n == 0:
            return []
        self._fill("train", n)
        pool = self._splits["train"][:n]
        if not pool:
            raise ValueError(f"task {self.name!r} has no train examples")
        rng = random.Random(seed)
        out: list[SFTExample] = []
        order: list[Example] = []
        for _ in range(n):
            if not order:
                order = list(pool)
                rng.shuffle(order)
            example = order.pop()
            prompt = self._with_system([example])[0].prompt
            correct = rng.random() >= corrupt_fraction
            turns = (self.teacher_turns if correct else self.corrupt_turns)(example, rng) if self.use_tools else None
            if turns is not None:
                out.append(SFTExample(prompt, turns[-1]["content"], correct, tuple(turns)))
            elif correct:
                out.append(SFTExample(prompt, self.teacher_completion(example, rng), True))
            else:
                out.append(SFTExample(prompt, self.corrupt_completion(example, rng), False))
        return out


# Every task by `task.name`: filled by the package (reinforge.tasks), read there and by the mix (tasks/mix.py),
# whose domains name other tasks; here, below both, so that the mix does not import its own package back.
TASKS: dict[str, type[Task]] = {}
