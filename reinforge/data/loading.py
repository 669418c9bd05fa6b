"""Problem records from data files: the column mapping and row validation.

Owns what a row must hold; the file formats (JSON Lines, JSON, Parquet, CSV,
Arrow, `datasets` folders) are `reinforge.data.formats`, what a record means
(prompt templates, verifiers, splits) belongs to `reinforge.tasks.dataset`.

Records. `fields` maps our names (prompt, answer, tests, completion, ...) to the
file's columns, e.g. `{"prompt": "question"}`; a column inside a nested one is
named by a dotted path, as verl's `reward_model.ground_truth` or
`extra_info.answer` (a top-level column whose name holds the dot wins). A
returned record holds the mapped fields under our names and every column of
the row under its own name too (reward functions written for TRL or verl read
the columns they know, e.g. `solution`); a column whose name is one of our
mapped names is left out: the mapped column owns that name.

`defaults` names columns to use for one of our fields when the caller's mapping
does not say and the file has no column of that name, e.g. answer from verl's
`reward_model.ground_truth`. The choice is made once, from the first row, and
logged; it then holds for every row.

Prompts. A prompt is text, or a conversation: a list of {role, content}
messages (TRL's conversational layout, verl's parquet files), returned as a
`reinforge.data.chat.Conversation`. A completion given as assistant messages
becomes their text.

Validation. The strict default rejects the whole file on its first bad row,
with a `DatasetError` naming the file, the row and what is wrong: bad JSON, a
row that is not an object, a missing field (with the row's columns and the
mapping that would fix it), a field of the wrong type (see `FIELD_TYPES`), an
empty prompt, malformed messages. `skip_invalid=True` skips bad rows instead
and reports every one in `LoadedRecords.skipped`; nothing is dropped silently.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reinforge.data.chat import Conversation, looks_like_messages, message_problem
from reinforge.data.formats import (
    DATASETS_SUFFIXES,
    JSONL_SUFFIXES,
    SPLIT_SEPARATOR,
    DatasetError,
    Unreadable,
    rows,
    split_suffix,
)

logger = logging.getLogger(__name__)

# Types our named fields must have; a column of any other name may hold any JSON value.
# An `answer` may be a number in the file ("42"); it is converted with str(). A prompt may
# also be a list of messages (checked by reinforge.data.chat.message_problem).
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "prompt": (str,),
    "answer": (str, int, float),
    "tests": (str,),
    "completion": (str,),
    "solution": (str,),
}

# Columns people name these fields in the layouts they bring, for the hint of a missing field.
LIKELY_COLUMNS: dict[str, tuple[str, ...]] = {
    "prompt": ("question", "problem", "input", "instruction", "query", "messages"),
    "answer": ("reward_model.ground_truth", "solution", "ground_truth", "gold", "target", "label", "final_answer",
               "extra_info.answer"),
    "tests": ("test", "test_cases", "reward_model.ground_truth"),
    "completion": ("response", "output", "solution", "chosen"),
}


@dataclass(frozen=True)
class LoadedRecords:
    """The valid records of a file, in file order, and why each skipped row was skipped."""

    records: list[dict[str, Any]]
    locations: list[str]  # per record, where it is in the file: "'FILE', line N" or "'FILE', row N"
    skipped: list[str]  # one DatasetError message per skipped row; empty unless skip_invalid
    fields: dict[str, str]  # the mapping used: the caller's, plus any column taken from `defaults`


def load_records(
    path: str | Path,
    fields: Mapping[str, str] | None = None,
    *,
    split: str | None = None,
    required: Iterable[str] = ("prompt",),
) -> list[dict[str, Any]]:
    """Every record of `path` (strict: the first bad row raises `DatasetError`).

    `required` names our fields every row must have; mapped fields are always
    required. See the module docstring for `fields`, and `reinforge.data.formats`
    for formats and `split`.
    """
    return read_records(path, fields, split=split, required=required).records


def read_records(
    path: str | Path,
    fields: Mapping[str, str] | None = None,
    *,
    split: str | None = None,
    required: Iterable[str] = ("prompt",),
    skip_invalid: bool = False,
    defaults: Mapping[str, Sequence[str]] | None = None,
    fields_option: str = "task.options.fields",
) -> LoadedRecords:
    """`load_records`, with the option to skip bad rows and report them instead.

    `defaults`: our field -> columns to try, in order, when `fields` does not map it and the file
    has no column of its name. `fields_option`: the config key of the mapping, for error messages.
    """
    source, split = split_suffix(str(path), split)
    fields = dict(fields or {})
    for ours, column in fields.items():
        if not isinstance(ours, str) or not isinstance(column, str) or not column:
            raise DatasetError(f"fields must map field names to column names, got {ours!r}: {column!r}")
    needed = list(dict.fromkeys([*required, *fields]))
    records: list[dict[str, Any]] = []
    locations: list[str] = []
    skipped: list[str] = []
    for where, row in rows(source, split):
        location = f"'{source}', {where}"
        if defaults and not records and not skipped and isinstance(row, dict):
            fields = _with_defaults(fields, defaults, row, source, fields_option)
            needed = list(dict.fromkeys([*needed, *fields]))
        try:
            records.append(_record(row, fields, needed, location, fields_option))
            locations.append(location)
        except DatasetError as err:
            if not skip_invalid:
                raise
            skipped.append(str(err))
    return LoadedRecords(records, locations, skipped, fields)


def _with_defaults(fields: dict[str, str], defaults: Mapping[str, Sequence[str]], row: dict[str, Any], source: Path,
                   fields_option: str) -> dict[str, str]:
    out = dict(fields)
    for ours, candidates in defaults.items():
        if ours in out or ours in row:
            continue
        for column in candidates:
            if _lookup(row, column) is not _MISSING:
                out[ours] = column
                logger.warning("'%s' has no '%s' column: using '%s' (set %s.%s to choose another)",
                               source, ours, column, fields_option, ours)
                break
    return out


# --------------------------------------------------------------- validation


class _Missing:
    pass


_MISSING = _Missing()


def _lookup(row: Mapping[str, Any], column: str) -> Any:
    """row[column], else the dotted path walked through nested objects; _MISSING when absent."""
    if column in row:
        return row[column]
    node: Any = row
    for key in column.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return _MISSING
        node = node[key]
    return node


def column_names(row: Mapping[str, Any], depth: int = 2) -> list[str]:
    """The row's columns, nested objects as dotted paths (to `depth` levels): what `fields` may name."""
    out = []
    for key, value in row.items():
        out.append(str(key))
        if isinstance(value, Mapping) and depth > 1:
            out += [f"{key}.{sub}" for sub in column_names(value, depth - 1)]
    return out


def _missing_hint(name: str, row: Mapping[str, Any], fields: dict[str, str], fields_option: str,
                  needed: Sequence[str]) -> str:
    columns = column_names(row)
    # A column that already is another field (the `prompt` column is the prompt) is never the one to map.
    taken = set(fields.values()) | {n for n in needed if n != name and n not in fields}
    likely = next((c for c in LIKELY_COLUMNS.get(name, ()) if c in columns and c not in taken), None)
    example = likely or next((c for c in columns if c not in taken), None)
    shown = ", ".join(columns) if len(columns) <= 30 else ", ".join(columns[:30]) + ", ..."
    if example is None:
        return f"; the row's columns: {shown}; add a column '{name}', or map one with {fields_option}.{name}=COLUMN"
    mapping = "fix" if name in fields else "map one with"
    return f"; the row's columns: {shown}; {mapping} {fields_option}.{name}={example}"


def _record(row: Any, fields: dict[str, str], needed: list[str], location: str, fields_option: str) -> dict[str, Any]:
    def fail(what: str) -> DatasetError:
        return DatasetError(f"{location}: {what}")

    if isinstance(row, Unreadable):
        raise fail(row.reason)
    if not isinstance(row, dict):
        raise fail(f"expected an object with named fields, got {type(row).__name__}")
    record = {k: v for k, v in row.items() if k not in fields}
    for ours, column in fields.items():
        value = _lookup(row, column)
        if value is not _MISSING:
            record[ours] = value
    for name in needed:
        if name not in record or record[name] is None:
            via = f" (column '{fields[name]}')" if name in fields else ""
            state = "is null" if name in record else "is missing"
            raise fail(f"field '{name}'{via} {state}{_missing_hint(name, row, fields, fields_option, needed)}")
    if looks_like_messages(record.get("prompt")):
        problem = message_problem(record["prompt"])
        if problem is not None:
            raise fail(f"field 'prompt' holds messages, but {problem}")
        record["prompt"] = Conversation(record["prompt"])
    completion = record.get("completion")
    if looks_like_messages(completion) and all(m.get("role") == "assistant" for m in completion):
        record["completion"] = "".join(str(m.get("content", "")) for m in completion)  # TRL's conversational completion
    for name, types in FIELD_TYPES.items():
        value = record.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types) + (" or a list of messages" if name == "prompt" else "")
            several = ("; the verifiers compare with one gold answer: map a column holding one with "
                       f"{fields_option}.answer=COLUMN (a reward function of your own still gets the whole list "
                       "from the row)") if name == "answer" and isinstance(value, list) else ""
            raise fail(f"field '{name}' must be {expected}, got {type(value).__name__}{several}")
        if isinstance(value, float) and not math.isfinite(value):
            raise fail(f"field '{name}' is not a finite number: {value!r}")
    if "prompt" in record and not record["prompt"].strip():
        raise fail("empty prompt")
    if isinstance(record.get("answer"), int | float):
        record["answer"] = str(record["answer"])
    return record


__all__ = ["DATASETS_SUFFIXES", "FIELD_TYPES", "JSONL_SUFFIXES", "SPLIT_SEPARATOR", "DatasetError", "LoadedRecords",
           "column_names", "load_records", "read_records"]
