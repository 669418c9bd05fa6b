"""Reading problem records from files: JSON Lines, Parquet, and `datasets` folders.

Owns the file formats, the column mapping and row validation; what a record
means (prompt templates, verifiers, splits) belongs to `reinforge.tasks.dataset`.

Formats, chosen by the path:

* `*.jsonl` / `*.json`: JSON Lines, one object per line (blank lines allowed).
  Rows are numbered by physical line.
* `*.parquet`: read with pyarrow (installed with `datasets`). Rows numbered from 1.
* a folder written by `datasets.Dataset.save_to_disk` or
  `DatasetDict.save_to_disk`. A DatasetDict needs a split: `split="test"`, or
  the path suffix `folder::test` (usable from a config file). Rows numbered from 1.

Records. `fields` maps our names (prompt, answer, tests, completion, ...) to the
file's column names, e.g. `{"prompt": "question"}`. A returned record holds the
mapped fields under our names and every other column under its own name (an
unmapped column whose name equals one of our mapped names is left out: the
mapped column owns that name).

Validation. The strict default rejects the whole file on its first bad row,
with a `DatasetError` naming the file, the row and what is wrong: bad JSON, a
row that is not an object, a missing field, a field of the wrong type (see
`FIELD_TYPES`), an empty prompt. `skip_invalid=True` skips bad rows instead and
reports every one in `LoadedRecords.skipped`; nothing is ever dropped silently.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reinforge.config import ConfigError

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SPLIT_SEPARATOR = "::"

# Types our named fields must have; a column of any other name may hold any JSON value.
# An `answer` may be a number in the file ("42"); it is converted with str().
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "prompt": (str,),
    "answer": (str, int, float),
    "tests": (str,),
    "completion": (str,),
    "solution": (str,),
}


class DatasetError(ConfigError):
    """A data file the user can fix; the message names the file and, for a bad row, the row."""


@dataclass(frozen=True)
class LoadedRecords:
    """The valid records of a file, in file order, and why each skipped row was skipped."""

    records: list[dict[str, Any]]
    locations: list[str]  # per record, where it is in the file: "'FILE', line N" or "'FILE', row N"
    skipped: list[str]  # one DatasetError message per skipped row; empty unless skip_invalid


def load_records(
    path: str | Path,
    fields: Mapping[str, str] | None = None,
    *,
    split: str | None = None,
    required: Iterable[str] = ("prompt",),
) -> list[dict[str, Any]]:
    """Every record of `path` (strict: the first bad row raises `DatasetError`).

    `required` names our fields every row must have; mapped fields are always
    required. See the module docstring for formats, `fields` and `split`.
    """
    return read_records(path, fields, split=split, required=required).records


def read_records(
    path: str | Path,
    fields: Mapping[str, str] | None = None,
    *,
    split: str | None = None,
    required: Iterable[str] = ("prompt",),
    skip_invalid: bool = False,
) -> LoadedRecords:
    """`load_records`, with the option to skip bad rows and report them instead."""
    source, split = _split_suffix(str(path), split)
    fields = dict(fields or {})
    for ours, column in fields.items():
        if not isinstance(ours, str) or not isinstance(column, str) or not column:
            raise DatasetError(f"fields must map field names to column names, got {ours!r}: {column!r}")
    needed = list(dict.fromkeys([*required, *fields]))
    records: list[dict[str, Any]] = []
    locations: list[str] = []
    skipped: list[str] = []
    for where, row in _rows(source, split):
        location = f"'{source}', {where}"
        try:
            records.append(_record(row, fields, needed, location))
            locations.append(location)
        except DatasetError as err:
            if not skip_invalid:
                raise
            skipped.append(str(err))
    return LoadedRecords(records, locations, skipped)


# ------------------------------------------------------------------ formats


def _split_suffix(path: str, split: str | None) -> tuple[Path, str | None]:
    if SPLIT_SEPARATOR in path:
        path, _, suffix_split = path.rpartition(SPLIT_SEPARATOR)
        if split is not None and split != suffix_split:
            raise DatasetError(f"'{path}': split given twice ('{suffix_split}' in the path, '{split}' as an argument)")
        split = suffix_split
    return Path(path), split


def _rows(path: Path, split: str | None) -> Iterator[tuple[str, Any]]:
    """(where, raw row) pairs; `where` is "line N" or "row N", 1-based; an undecodable row is `_Unreadable`."""
    if not path.exists():
        raise DatasetError(f"data file '{path}' does not exist")
    if path.is_dir():
        yield from _saved_dataset_rows(path, split)
        return
    if split is not None:
        raise DatasetError(f"'{path}': a split ('{split}') only applies to a datasets folder saved with save_to_disk")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        yield from _jsonl_rows(path)
    elif suffix in PARQUET_SUFFIXES:
        yield from _parquet_rows(path)
    else:
        known = ", ".join([*JSONL_SUFFIXES, *PARQUET_SUFFIXES])
        raise DatasetError(
            f"'{path}': unknown data file extension '{path.suffix}' (known: {known}, "
            "or a folder saved with datasets' save_to_disk)"
        )


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                hint = ""
                if number == 1 and line.lstrip().startswith("["):
                    hint = " (expected JSON Lines: one object per line, not one JSON array)"
                row = _Unreadable(f"bad JSON: {err.msg} at column {err.colno}{hint}")
            yield f"line {number}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a corrupt file
        raise DatasetError(f"'{path}': not a readable Parquet file: {err}") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"row {number}", row


def _saved_dataset_rows(path: Path, split: str | None) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DatasetError(f"'{path}': a folder, but not one saved with datasets' save_to_disk ({err})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = ", ".join(loaded)
        if split is None:
            raise DatasetError(f"'{path}' holds several splits ({splits}): pick one with '{path}::SPLIT'")
        if split not in loaded:
            raise DatasetError(f"'{path}' has no split '{split}' (splits: {splits})")
        loaded = loaded[split]
    elif split is not None:
        raise DatasetError(f"'{path}' holds a single Dataset, not splits: drop '{SPLIT_SEPARATOR}{split}'")
    for number, row in enumerate(loaded, start=1):
        yield f"row {number}", row


# --------------------------------------------------------------- validation


@dataclass(frozen=True)
class _Unreadable:
    """A row that could not be decoded; `_record` turns it into the row's error."""

    reason: str


def _record(row: Any, fields: dict[str, str], needed: list[str], location: str) -> dict[str, Any]:
    def fail(what: str) -> DatasetError:
        return DatasetError(f"{location}: {what}")

    if isinstance(row, _Unreadable):
        raise fail(row.reason)
    if not isinstance(row, dict):
        raise fail(f"expected an object with named fields, got {type(row).__name__}")
    mapped_columns = set(fields.values())
    record = {k: v for k, v in row.items() if k not in mapped_columns and k not in fields}
    for ours, column in fields.items():
        if column in row:
            record[ours] = row[column]
    for name in needed:
        if name not in record or record[name] is None:
            via = f" (column '{fields[name]}')" if name in fields else ""
            state = "is null" if name in record else "is missing"
            raise fail(f"field '{name}'{via} {state}")
    for name, types in FIELD_TYPES.items():
        value = record.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            expected = " or ".join(t.__name__ for t in types)
            raise fail(f"field '{name}' must be {expected}, got {type(value).__name__}")
        if isinstance(value, float) and not math.isfinite(value):
            raise fail(f"field '{name}' is not a finite number: {value!r}")
    if "prompt" in record and not record["prompt"].strip():
        raise fail("empty prompt")
    if isinstance(record.get("answer"), int | float):
        record["answer"] = str(record["answer"])
    return record
