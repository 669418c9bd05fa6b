"""Several tasks in one run (`task.name=mix`): each a domain with its own verifier.

Olmo 3's RL stage (arXiv 2512.13961) trains one policy on math, code,
instruction following and chat at once, each prompt scored by its own domain's
verifier. This module owns how a mix is declared (`DomainSpec`, `parse_domains`),
how its splits interleave the domains' splits (`domain_schedule`) and how a
mixed example finds its own task again (its `meta["domain"]`).

Splits. Each domain is a task of its own with its own splits (generated or read
from a file, as `task.name=<its task>` would draw them, same seed, same
held-out membership). Slot i of a mixed split (train or held-out alike) goes to
the domain whose count lags its share the most, c_d < (i + 1) p_d with
p_d = w_d / sum(w), ties to the domain listed first; then slot i holds that
domain's next example. Hence both splits hold the domains in proportion to
their weights (70/30 of every 10 slots for weights 0.7 and 0.3; a domain is
never a whole example ahead of its share), `train_split(n)` is a prefix of
`train_split(n + k)`, and nothing depends on the order the splits are asked
for in. A domain read from a file that runs out (its split is shorter than its
share) leaves its later slots empty: the split is then shorter than asked, as a
dataset's is (its warning says so).

Dispatch. Every example a mix hands out carries `meta["domain"]` (which
reward functions also receive as the keyword `domain`); its reward, teacher
and wrong completions, and multi-turn traces are its domain task's.
"""

from __future__ import annotations

import inspect
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reinforge.tasks.base import TASKS, Example, SFTExample, Split, Task

DOMAIN_KEY = "domain"     # the meta field of a mixed example that names its domain
_SPEC_KEYS = ("name", "domain", "weight", "options")
# A domain's name goes into metric keys (eval/<domain>/pass@1): no slash, no space.
_DOMAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class DomainSpec:
    """One entry of `task.options.domains`, checked."""

    task: str                      # the registered task it draws from (its `name:` key)
    domain: str                    # its label: in meta["domain"], metric keys, reward.functions[].domains
    weight: float                  # sampling weight, > 0 (normalised over the mix)
    options: dict[str, Any] = field(default_factory=dict)   # the task's constructor options
    where: str = "task.options.domains[0]"                  # its config key, for messages


def parse_domains(specs: Any, where: str = "task.options.domains") -> list[DomainSpec]:
    """The mix's domains from their config form: a list of task names (weight 1 each) or of
    {name: TASK, domain: LABEL, weight: W, options: {...}}. ValueError naming the key otherwise."""
    if not isinstance(specs, Sequence) or isinstance(specs, str) or not specs:
        raise ValueError(f"{where} must be a non-empty list of domains, e.g. [{{name: arithmetic, weight: 0.7}}, "
                         f"{{name: countdown, weight: 0.3}}], got {specs!r}")
    out: list[DomainSpec] = []
    for i, spec in enumerate(specs):
        key = f"{where}[{i}]"
        if isinstance(spec, str):
            spec = {"name": spec}
        if not isinstance(spec, Mapping):
            raise ValueError(f"{key} must be a task name or a mapping with keys {', '.join(_SPEC_KEYS)}, got {spec!r}")
        unknown = [k for k in spec if k not in _SPEC_KEYS]
        if unknown:
            raise ValueError(f"{key}.{unknown[0]} is not a key of a domain (valid: {', '.join(_SPEC_KEYS)})")
        task = spec.get("name")
        if task == MixTask.name:
            raise ValueError(f"{key}.name=mix: a mix cannot hold a mix; list its domains here instead")
        if task not in TASKS:
            valid = ", ".join(n for n in TASKS if n != MixTask.name)
            raise ValueError(f"{key}.name must name a task ({valid}), got {task!r}")
        domain = spec.get("domain", task)
        if not isinstance(domain, str) or not _DOMAIN_NAME.fullmatch(domain):
            raise ValueError(f"{key}.domain must be letters, digits, '_', '.' or '-', got {domain!r}")
        if any(d.domain == domain for d in out):
            raise ValueError(f"{key}: domain '{domain}' is listed twice: name one of them with {key}.domain=NAME")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < float("inf"):
            raise ValueError(f"{key}.weight must be a number > 0, got {weight!r}")
        options = spec.get("options") or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"{key}.options must be a mapping of the task's options, got {options!r}")
        out.append(DomainSpec(task, domain, float(weight), dict(options), key))
    return out


def domain_schedule(weights: Sequence[float], n: int) -> list[int]:
    """The domain index of each of the first `n` slots of a mixed split: slot i goes to the domain
    d whose deficit (i + 1) p_d - c_d is largest (c_d: its slots so far), ties to the lowest index.

    Deterministic and prefix-stable; each count tracks n p_d: the chosen domain's deficit is at
    least 1/K before it drops by one, so no domain is ever a whole slot ahead (c_d - n p_d < 1).
    """
    total = sum(weights)
    shares = [w / total for w in weights]
    counts = [0] * len(shares)
    out: list[int] = []
    for i in range(n):
        d = max(range(len(shares)), key=lambda k: ((i + 1) * shares[k] - counts[k], -k))
        counts[d] += 1
        out.append(d)
    return out


def _build(spec: DomainSpec, seed: int, eval_fraction: float) -> Task:
    """The domain's task, with the mix's seed and eval_fraction unless its options set them."""
    cls = TASKS[spec.task]
    params = inspect.signature(cls.__init__).parameters
    inherited = {k: v for k, v in (("seed", seed), ("eval_fraction", eval_fraction)) if k in params}
    try:
        return cls(**{**inherited, **spec.options})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{spec.where} ({spec.task}): {err}") from None


class MixTask(Task):
    """Several tasks as the domains of one run, each drawn in proportion to its weight.

    Options (`task.options.NAME=...`):

    * `domains`: a list, each a task name or {name: TASK, domain: LABEL, weight: W, options: {...}}:
      `name` the registered task (arithmetic, countdown, dataset, multiply_tool), `domain` its
      label (default: the task's name; labels must be unique, so the same task twice needs one),
      `weight` its share of both splits (default 1, normalised), `options` the task's own.
    * `seed`, `eval_fraction`: passed to every domain whose options do not set them.

    A domain's own preset (multiply_tool's) is not applied: set the values it needs yourself.
    """

    name = "mix"

    def __init__(self, domains: list[Any], seed: int = 0, eval_fraction: float = 0.2) -> None:
        super().__init__(seed=seed, eval_fraction=eval_fraction)
        self.specs = parse_domains(domains)
        self.tasks: dict[str, Task] = {s.domain: _build(s, seed, eval_fraction) for s in self.specs}
        self.weights = [s.weight for s in self.specs]
        # The tools of every domain, in order (a run with tools gives them to every prompt).
        self.tools = tuple(dict.fromkeys(t for task in self.tasks.values() for t in task.tools))
        self._exhausted = True      # the base class's stream is never drawn from

    @classmethod
    def domain_specs(cls, options: Mapping[str, Any]) -> list[DomainSpec]:
        if "domains" not in options:
            return []       # the config check says the option is missing
        return parse_domains(options["domains"])

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(self.tasks)

    def domain_of(self, example: Example) -> str:
        domain = example.meta.get(DOMAIN_KEY)
        if domain not in self.tasks:
            raise ValueError(f"example {example.prompt!r} has meta['{DOMAIN_KEY}']={domain!r}, not a domain of this "
                             f"mix ({', '.join(self.tasks)}): examples of a mix come from its splits")
        return domain

    def _task_of(self, example: Example) -> Task:
        return self.tasks[self.domain_of(example)]

    # ----------------------------------------------------------------- splits

    def _fill(self, split: Split, n: int) -> None:
        have = self._splits[split]
        if len(have) >= n:
            return
        slots = domain_schedule(self.weights, n)
        drawn = []
        for d, (domain, task) in enumerate(self.tasks.items()):
            # base-class _take: the domain's own examples (its prompt.system is the mix's to add)
            drawn.append([self._tagged(e, domain) for e in task._take(split, slots.count(d))])
        taken = [0] * len(drawn)
        out: list[Example] = []
        for d in slots:
            if taken[d] < len(drawn[d]):     # a file's domain that ran out leaves its slot empty
                out.append(drawn[d][taken[d]])
            taken[d] += 1
        # The schedule and each domain's split are prefix-stable: what was handed out stays as it was.
        self._splits[split] = have + out[len(have):]

    def _take(self, split: Split, n: int) -> list[Example]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._fill(split, n)
        return list(self._splits[split][:n])

    @staticmethod
    def _tagged(example: Example, domain: str) -> Example:
        if DOMAIN_KEY in example.meta:
            raise ValueError(f"domain '{domain}': its examples have a field '{DOMAIN_KEY}' of their own, which the mix "
                             "sets to the domain's name: rename that column in the data")
        return Example(example.prompt, example.answer, {**example.meta, DOMAIN_KEY: domain})

    def _sample_problem(self, rng: random.Random) -> Example:
        raise AssertionError("unreachable: a mix's splits are filled from its domains' splits")

    # ------------------------------------------------ reward and SFT: the domain's own

    def sft_examples(self, n: int, corrupt_fraction: float, seed: int) -> list[SFTExample]:
        """`n` noisy teacher traces, each domain's own (`Task.sft_examples`, cycling its train split when
        that is smaller, as a 2-digit sum's is) in its share of the schedule: the SFT data holds the
        domains in proportion to their weights, whatever the size of their splits."""
        slots = domain_schedule(self.weights, n)
        traces = []
        for d, task in enumerate(self.tasks.values()):
            task.system, task.use_tools = self.system, self.use_tools    # as the run set them on the mix
            traces.append(iter(task.sft_examples(slots.count(d), corrupt_fraction, seed)))
        return [next(traces[d]) for d in slots]

    def reward(self, example: Example, completion: str) -> float:
        return self._task_of(example).reward(example, completion)

    def teacher_completion(self, example: Example, rng: random.Random) -> str:
        return self._task_of(example).teacher_completion(example, rng)

    def corrupt_completion(self, example: Example, rng: random.Random) -> str:
        return self._task_of(example).corrupt_completion(example, rng)

    def teacher_turns(self, example: Example, rng: random.Random) -> list[dict[str, str]] | None:
        return self._task_of(example).teacher_turns(example, rng)

    def corrupt_turns(self, example: Example, rng: random.Random) -> list[dict[str, str]] | None:
        return self._task_of(example).corrupt_turns(example, rng)
