"""The rows of a verifiers taskset as a task (`task.name=verifiers_taskset`, option `env`): what a run
with `task.agent=verifiers:ENV_ID` trains on when it names no data of its own.

The taskset (verifiers 0.4.0, reinforge/serve/verifiers_env.py) is loaded and read in its own order; each
task becomes an `Example` whose prompt is the task's prompt text (its key when it has none) and whose
`meta["vf_task"]` is the task's data as verifiers sends it over its wire (`TaskData.model_dump`), which
the agent validates back into the taskset's task, so the episode plays exactly that task. The held-out
split is a hash of the prompt (the base class's rule); a second task with the same prompt text is left
out, since the engines find a row by its prompt (a warning counts them). An endless taskset is read up to
`max_tasks`. Its tasks are scored by their own rubric, through the agent: this task has no verifier and no
SFT traces.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from reinforge.errors import ConfigError
from reinforge.tasks.base import Example, Split, Task

logger = logging.getLogger(__name__)

PREFIX = "verifiers:"     # task.agent=verifiers:ENV_ID
VERSION = "0.4.0"         # the verifiers release whose v1 environments this reads


def verifiers_module() -> Any:
    """`verifiers.v1`, or a ConfigError saying how to install it."""
    try:
        import verifiers
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError(f"task.agent={PREFIX}ENV_ID needs the verifiers package: pip install 'reinforge[extras]' "
                          f"(verifiers=={VERSION})") from None
    if not verifiers.__version__.startswith("0.4."):
        raise ConfigError(f"task.agent={PREFIX}ENV_ID is written against verifiers {VERSION} (its v1 environments); "
                          f"{verifiers.__version__} is installed: pip install verifiers=={VERSION}")
    return vf


class VerifiersTasksetTask(Task):
    name = "verifiers_taskset"

    def __init__(self, env: str, seed: int = 0, eval_fraction: float = 0.2, max_tasks: int = 100_000) -> None:
        super().__init__(seed=seed, eval_fraction=eval_fraction)
        vf = verifiers_module()
        self.env = env
        try:
            taskset = vf.load_taskset(vf.resolve_env_config({"taskset": {"id": env}}).taskset)
            tasks = iter(taskset if taskset.bounded else taskset.take(max_tasks))
            seen, dropped = set(), 0
            for task in tasks:
                data = task.data
                prompt = data.prompt_text or task.key
                if prompt in seen:
                    dropped += 1
                    continue
                seen.add(prompt)
                example = Example(prompt, "", {"vf_task": data.model_dump(mode="json", exclude_none=True)})
                self._splits[self._which_split(example)].append(example)
        except Exception as err:  # the user's taskset or verifiers' loaders: one line with the reason
            raise ConfigError(f"task.options.env={env!r}: verifiers cannot load its taskset: "
                              f"{type(err).__name__}: {err}") from None
        if dropped:
            logger.warning("verifiers taskset %s: %d tasks repeat an earlier task's prompt and are left out",
                           env, dropped)
        self._exhausted = True   # the base class's stream is never drawn from
        self._warned: set[Split] = set()

    def _take(self, split: Split, n: int) -> list[Example]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        available = self._splits[split]
        if n > 0 and not available:
            raise ValueError(f"verifiers taskset '{self.env}' has no {split} examples (task.options.eval_fraction)")
        if n > len(available) and split not in self._warned:
            self._warned.add(split)
            logger.warning("verifiers taskset %s split has %d tasks; %d requested, using all %d",
                           split, len(available), n, len(available))
        return list(available[:n])

    def _sample_problem(self, rng: random.Random) -> Example:
        raise AssertionError("unreachable: the splits are filled from the taskset")

    def reward(self, example: Example, completion: str) -> float:
        raise ValueError("a verifiers taskset's rows are scored by its own rubric, through task.agent=verifiers:ENV_ID")

    def teacher_completion(self, example: Example, rng: random.Random) -> str:
        raise ConfigError("a verifiers taskset has no reference completions: set sft.enabled=false")

    def corrupt_completion(self, example: Example, rng: random.Random) -> str:
        raise ConfigError("a verifiers taskset has no wrong completions: set sft.enabled=false")
