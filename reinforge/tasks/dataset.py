"""Problems from a data file, scored by a named verifier (`task.name=dataset`).

Owns how file records become `Example`s (prompt template, meta), the
train / held-out split of a file, and the table of verifiers a file can be
scored with. File formats and row validation live in `reinforge.data.loading`.

Splits. With `eval_path`, `path` is the train split and `eval_path` the
held-out split, whole. Without it, each record of `path` goes to the held-out
split when a stable hash of its raw prompt (before the template) falls below
`eval_fraction` (the base class's rule, `Task._which_split`): disjoint,
deterministic, independent of `seed` and of the template, and rows with the
same prompt always land together. Both splits keep file order;
`train_split(n)` / `eval_split(n)` return the first n (all of a split when it
is shorter than n: a file is the whole problem space, so `train.num_prompts`
and `eval.num_prompts` act as caps; a warning says so once per split).
Rows are never deduplicated (nothing is dropped silently).
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reinforge.data.chat import Conversation
from reinforge.data.loading import DatasetError, read_records
from reinforge.errors import ConfigError
from reinforge.tasks.base import Example, Split, Task

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verifier:
    """How one verifier scores a completion, and the record field it needs."""

    field: str | None  # our field every row must have ("answer" or "tests"); None: no field
    score: Callable[[str, Example, float], float]  # (completion, example, code_timeout_s) -> 0.0 | 1.0


def _math(completion: str, example: Example, _timeout_s: float) -> float:
    from reinforge.verifiers.math import verify  # math-verify is an optional dependency

    return verify(completion, example.answer)


def _code(completion: str, example: Example, timeout_s: float) -> float:
    from reinforge.verifiers.code import code_reward

    return code_reward(completion, example.meta["tests"], timeout_s)


def _integer(completion: str, example: Example, _timeout_s: float) -> float:
    from reinforge.verifiers.arithmetic import verify_integer

    return verify_integer(completion, example.answer)


def _exact(completion: str, example: Example, _timeout_s: float) -> float:
    # Surrounding whitespace only: anything more lenient is something RL learns to exploit.
    return 1.0 if completion.strip() == example.answer.strip() else 0.0


# Where a file without an `answer` column (and no fields.answer) keeps its gold answer: verl's
# parquet layout, then TRL's `solution` column, then a top-level `ground_truth` (the name verl's
# compute_score and many RLVR sets give it); a warning names the column taken.
ANSWER_COLUMNS = ("reward_model.ground_truth", "solution", "ground_truth")

# What a row's error starts with (reinforge.data.loading): "'FILE', line N: " or "'FILE', row N: ".
_ROW_ERROR = re.compile(r"^'.*', (line|row) (\d+): ")

def _environment(completion: str, example: Example, _timeout_s: float) -> float:
    raise ValueError("task.options.verifier=none: the rows are scored by task.environment, not by a verifier")


VERIFIERS: dict[str, Verifier] = {
    "math": Verifier("answer", _math),        # last \boxed{} / "answer is" / last number vs gold, by math-verify
    "code": Verifier("tests", _code),         # sandboxed program vs the row's top-level asserts, all must pass
    "integer": Verifier("answer", _integer),  # the completion is exactly the gold integer
    "exact": Verifier("answer", _exact),      # string equality after stripping whitespace
    # rows an environment scores (task.environment): no answer needed, and a row without a prompt is
    # keyed by its fields (the environment's reset writes the opening messages from them)
    "none": Verifier(None, _environment),
}

# "{name}" is a record field; "{{" and "}}" are literal braces; any other brace is literal
# too, so "\boxed{}" in an instruction needs no escaping.
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


class DatasetTask(Task):
    """Prompts and gold data read from a file (see `reinforge.data.loading` for formats).

    Options (all plain values, settable as `task.options.NAME=...`):

    * `path`: the data file (train split, or both splits without `eval_path`);
      a `datasets` folder with several splits as `folder::split`.
    * `eval_path`: a separate held-out file; None: hash split of `path`.
    * `fields`: our field name -> column name, e.g. {prompt: question, answer: gold};
      a nested column by dotted path, e.g. {answer: reward_model.ground_truth}.
      Without a mapping and without an `answer` column, the answer is read from
      `reward_model.ground_truth` (verl's layout), else `solution` (TRL's), else
      `ground_truth`.
    * `verifier`: one of `VERIFIERS` (math, code, integer, exact, none). math,
      integer and exact need an `answer` field; code needs `tests`; none (rows
      an environment scores, the default with task.environment) needs nothing,
      a row without a prompt being keyed by its fields.
    * `prompt_template`: e.g. "Question: {prompt}\\nAnswer:"; any record field
      may be used; None: the prompt as is. A tokenizer's chat template, when
      the model has one, is applied later by the rollout as for every task.
      A prompt given as a list of messages (TRL's conversational layout,
      verl's) goes to the chat template as it is; it takes no prompt_template.
    * `seed`: kept for the Task interface; nothing here is random.
    * `eval_fraction`: the hash split's held-out share (ignored with `eval_path`).
    * `code_timeout_s`: wall-clock limit per program of the code verifier.
    * `skip_invalid`: skip malformed rows (count in `skipped`, each logged)
      instead of failing on the first one.

    Example fields: `prompt` is the templated prompt, `answer` the gold answer
    ("" when the row has none, e.g. code), `meta` every other record field
    (`tests`, `completion`, ...), unchanged.

    SFT: `teacher_completion` is the record's `completion` field (a column of
    that name, or one mapped via `fields`). Files carry no wrong completions,
    so `corrupt_completion` raises: use `sft.corrupt_fraction=0`.
    """

    name = "dataset"

    def __init__(
        self,
        path: str,
        eval_path: str | None = None,
        fields: dict[str, str] | None = None,
        verifier: str = "math",
        prompt_template: str | None = None,
        seed: int = 0,
        eval_fraction: float = 0.2,
        code_timeout_s: float = 5.0,
        skip_invalid: bool = False,
    ) -> None:
        if verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {verifier!r} (valid: {', '.join(VERIFIERS)})")
        if prompt_template is not None and "{prompt}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{prompt}}', got {prompt_template!r}")
        if not code_timeout_s > 0:
            raise ValueError(f"code_timeout_s must be > 0, got {code_timeout_s!r}")
        super().__init__(seed=seed, eval_fraction=eval_fraction)
        self.path = path
        self.eval_path = eval_path
        self.fields = dict(fields or {})
        self.verifier = verifier
        self.prompt_template = prompt_template
        self.code_timeout_s = code_timeout_s
        self.skipped: dict[str, int] = {}  # file -> rows skipped under skip_invalid

        train = self._load(path, skip_invalid)
        if eval_path is None:
            for raw_prompt, example in train:
                # The split key is the raw prompt, so changing the template keeps the split.
                which = self._which_split(Example(raw_prompt, "", {}))
                self._splits[which].append(example)
        else:
            self._splits["train"] = [example for _, example in train]
            self._splits["eval"] = [example for _, example in self._load(eval_path, skip_invalid)]
        self._exhausted = True  # the base class's stream is never drawn from
        self._warned: set[Split] = set()

    # ---------------------------------------------------------------- records

    def _load(self, path: str, skip_invalid: bool) -> list[tuple[str, Example]]:
        """(raw prompt, example) per valid row of `path`, in file order."""
        # Template fields are required too, so a row without one fails (or is skipped) at load.
        template_fields = _PLACEHOLDER.findall(self.prompt_template or "")
        field = VERIFIERS[self.verifier].field
        required = [*(["prompt", field] if field else []), *filter(None, template_fields)]
        defaults = {field: ANSWER_COLUMNS} if field == "answer" else None
        try:
            loaded = read_records(path, self.fields, required=required, skip_invalid=skip_invalid, defaults=defaults)
        except DatasetError as err:
            row = _ROW_ERROR.match(str(err))
            # the first row: more likely the layout than one row
            if skip_invalid or row is None or int(row.group(2)) == 1:
                raise
            # One bad row after good ones: say how to go on without it (each skipped row is still logged and counted).
            raise DatasetError(f"{err}; to skip such rows instead: task.options.skip_invalid=true") from None
        if loaded.skipped:
            self.skipped[str(path)] = len(loaded.skipped)
            for message in loaded.skipped:
                logger.warning("skipped: %s", message)
        out = []
        for where, record in zip(loaded.locations, loaded.records, strict=True):
            if "prompt" not in record:     # verifier none: the row's fields are its prompt
                record = {**record, "prompt": json.dumps(record, sort_keys=True)}
            meta = {k: v for k, v in record.items() if k not in ("prompt", "answer")}
            try:
                json.dumps(meta)
            except (TypeError, ValueError) as err:
                raise DatasetError(f"{where}: fields must be JSON data ({err})") from None
            if self.verifier == "code":
                _check_tests(record["tests"], where)
            if self.prompt_template is not None and isinstance(record["prompt"], Conversation):
                raise DatasetError(f"{where}: the prompt is a list of messages, which prompt_template (text) cannot "
                                   "wrap: drop task.options.prompt_template (the chat template formats messages)")
            example = Example(self._render(record), record.get("answer", ""), meta)
            out.append((record["prompt"], example))
        return out

    def _render(self, record: dict[str, Any]) -> str:
        if self.prompt_template is None:
            return record["prompt"]

        def fill(match: re.Match[str]) -> str:
            name = match.group(1)
            if name is None:
                return match.group(0)[0]  # "{{" -> "{", "}}" -> "}"
            value = record[name]  # present: template fields are required at load
            return value if isinstance(value, str) else json.dumps(value)

        return _PLACEHOLDER.sub(fill, self.prompt_template)

    # ----------------------------------------------------------------- splits

    @property
    def split_sizes(self) -> dict[str, int]:
        """Rows in each split ("train", "eval")."""
        return {split: len(rows) for split, rows in self._splits.items()}

    def split_note(self) -> str | None:
        """One line saying how much of `path` the hash split holds out for evaluation, with the keys that
        decide it; None with eval_path (the user chose the held-out file)."""
        if self.eval_path is not None:
            return None
        held, total = self.split_sizes["eval"], self.split_sizes["train"] + self.split_sizes["eval"]
        return (f"dataset '{self.path}': {held} of its {total} rows ({held / max(total, 1):.0%}) are held out for "
                f"evaluation, the rest trained on (task.options.eval_fraction={self.eval_fraction:g}, a split by a "
                "hash of each prompt; task.options.eval_path=FILE evaluates on a file of your own instead)")

    def _take(self, split: Split, n: int) -> list[Example]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        available = self._splits[split]
        if n > 0 and not available:
            where = self.eval_path if split == "eval" and self.eval_path else self.path
            hint = " (raise eval_fraction or set eval_path)" if split == "eval" and self.eval_path is None else ""
            raise ValueError(f"dataset '{where}' has no {split} examples{hint}")
        if n > len(available) and split not in self._warned:
            self._warned.add(split)
            logger.warning("dataset %s split has %d examples; %d requested, using all %d",
                           split, len(available), n, len(available))
        return list(available[:n])

    def _sample_problem(self, rng: random.Random) -> Example:
        raise AssertionError("unreachable: a dataset's splits are filled from its file")

    # ------------------------------------------------------- reward and SFT

    def reward(self, example: Example, completion: str) -> float:
        if not isinstance(completion, str):
            return 0.0
        return VERIFIERS[self.verifier].score(completion, example, self.code_timeout_s)

    def teacher_completion(self, example: Example, rng: random.Random) -> str:
        if "completion" not in example.meta:
            raise ConfigError(
                f"dataset '{self.path}' has no reference completions (no 'completion' field): "
                "set sft.enabled=false, or map a column with task.options.fields.completion=COLUMN"
            )
        return example.meta["completion"]

    def corrupt_completion(self, example: Example, rng: random.Random) -> str:
        raise ConfigError(
            f"dataset '{self.path}' has no wrong completions to corrupt SFT with: set sft.corrupt_fraction=0"
        )


def _check_tests(tests: str, where: str) -> None:
    """Broken tests would score every program 0.0, silently: fail at load instead."""
    from reinforge.verifiers.code import split_tests

    try:
        suite = split_tests(tests)
    except SyntaxError as err:
        raise DatasetError(f"{where}: tests do not parse: {err.msg} (line {err.lineno})") from None
    if not suite.cases:
        raise DatasetError(f"{where}: tests contain no top-level assert")
