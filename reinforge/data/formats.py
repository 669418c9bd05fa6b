"""Data files to raw rows: which reader a path gets, and where each row is in the file.

Owns the formats; what the rows mean and their validation belong to
`reinforge.data.loading`. Readers, chosen by the path:

* `*.jsonl`, and `*.json` holding one object per line: read line by line
  with the standard library, rows numbered by physical line (blank lines
  allowed). Not `datasets`: its JSON loader (pyarrow) unifies a column's type
  over the file, so a gold answer that is "3/4" in one row and 4 in the next
  fails the whole file, a row without a key reads as null, and a bad line is
  reported without its line number.
* `*.json` holding one array of objects: `json.load`, rows numbered from 1.
* `*.parquet`, `*.csv`, `*.arrow`: `datasets` (`Dataset.from_parquet`,
  `from_csv`, `from_file`), rows numbered from 1. A CSV cell left empty
  reads as null.
* a folder written by `datasets`' `save_to_disk` (`load_from_disk`), or a
  folder of data files (`load_dataset(folder)`: Parquet / JSON / CSV files,
  splits by file name as `datasets` names them). A DatasetDict needs a split:
  `folder::test`. A folder holding a loading script (`*.py`) is refused: the
  pinned `datasets` 5.x no longer runs loading scripts.

Nothing is downloaded: every reader works on the local path it is given.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reinforge.errors import ConfigError

JSONL_SUFFIXES = (".jsonl", ".json")
DATASETS_SUFFIXES = (".parquet", ".csv", ".arrow")
SPLIT_SEPARATOR = "::"
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")   # what save_to_disk writes


class DatasetError(ConfigError):
    """A data file the user can fix; the message names the file and, for a bad row, the row."""


@dataclass(frozen=True)
class Unreadable:
    """A row that could not be decoded; validation turns it into the row's error."""

    reason: str


def split_suffix(path: str, split: str | None) -> tuple[Path, str | None]:
    """'folder::split' -> (folder, split); a split given both ways must agree."""
    if SPLIT_SEPARATOR in path:
        path, _, suffix_split = path.rpartition(SPLIT_SEPARATOR)
        if split is not None and split != suffix_split:
            raise DatasetError(f"'{path}': split given twice ('{suffix_split}' in the path, '{split}' as an argument)")
        split = suffix_split
    return Path(path).expanduser(), split    # "~/data.jsonl" from a YAML file or Python, where no shell expands it


def rows(path: Path, split: str | None) -> Iterator[tuple[str, Any]]:
    """(where, raw row) pairs; `where` is "line N" or "row N", 1-based; an undecodable row is `Unreadable`."""
    if not path.exists():
        raise DatasetError(f"data file '{path}' does not exist")
    if path.is_dir():
        yield from _folder_rows(path, split)
        return
    if split is not None:
        raise DatasetError(
            f"'{path}': a split ('{split}') only applies to a datasets folder (save_to_disk or data files)"
        )
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        empty = True
        for row in _json_rows(path):
            empty = False
            yield row
        if empty:
            raise DatasetError(f"'{path}' has no rows (the file is empty)")
    elif suffix in DATASETS_SUFFIXES:
        if _no_rows(path, suffix):  # datasets' readers fail on these with an unrelated message
            raise DatasetError(
                f"'{path}' has no rows (the file is empty" + (", or only its header)" if suffix == ".csv" else ")")
            )
        yield from _datasets_file_rows(path, suffix)
    elif suffix == ".py":
        raise DatasetError(_script_message(path))
    else:
        known = ", ".join([*JSONL_SUFFIXES, *DATASETS_SUFFIXES])
        raise DatasetError(f"'{path}': unknown data file extension '{path.suffix}' (known: {known}, or a datasets "
                            "folder: save_to_disk, or a folder of data files)")


def _script_message(path: Path) -> str:
    return (f"'{path}' is a datasets loading script: the pinned datasets 5.x no longer runs loading scripts; "
            "convert the data to Parquet or JSONL (e.g. with the script's own datasets version: "
            "load_dataset(...).to_parquet('train.parquet')) and point task.options.path at that")


# ------------------------------------------------------------------ JSON


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        head = handle.read(4096).lstrip()
    if path.suffix.lower() == ".json" and head.startswith("["):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DatasetError(f"'{path}': bad JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None
        for number, row in enumerate(data, start=1):
            yield f"row {number}", row
        return
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                # Without its newline, a row cut short is reported at its own end, not at "column 1" of a next line.
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                hint = ""
                if number == 1 and line.lstrip().startswith("["):
                    hint = " (expected JSON Lines: one object per line, not one JSON array)"
                row = Unreadable(f"bad JSON: {err.msg} at column {err.colno}{hint}")
            yield f"line {number}", row


# ------------------------------------------------------------------ datasets


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()      # "Generating train split" bars would interleave with ours
    datasets.logging.set_verbosity_error()
    return datasets


def _no_rows(path: Path, suffix: str) -> bool:
    """True for a Parquet file of zero rows or a CSV file of at most a header; False when unsure (the
    reader decides)."""
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows == 0
        if suffix == ".csv":
            with path.open(encoding="utf-8", errors="replace") as handle:
                return sum(1 for line in handle if line.strip()) <= 1
    except Exception:   # not Parquet at all: the reader's own message names that
        return False
    return False


def _datasets_file_rows(path: Path, suffix: str) -> Iterator[tuple[str, Any]]:
    datasets = _quiet_datasets()
    readers = {".parquet": ("Parquet", datasets.Dataset.from_parquet), ".csv": ("CSV", datasets.Dataset.from_csv),
               ".arrow": ("Arrow", datasets.Dataset.from_file)}
    kind, read = readers[suffix]
    try:
        loaded = read(str(path)) if suffix == ".arrow" else read(str(path), keep_in_memory=True)
    except Exception as err:  # pyarrow and pandas raise many types for a corrupt file
        raise DatasetError(f"'{path}': not a readable {kind} file: {_one_line(err)}") from None
    yield from _dataset_rows(loaded, csv=suffix == ".csv")


def _folder_rows(path: Path, split: str | None) -> Iterator[tuple[str, Any]]:
    datasets = _quiet_datasets()
    if any((path / marker).is_file() for marker in SAVED_MARKERS):
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as err:
            raise DatasetError(
                f"'{path}': a datasets save_to_disk folder that cannot be read: {_one_line(err)}"
            ) from None
    else:
        scripts = sorted(path.glob("*.py"))
        if scripts:
            raise DatasetError(_script_message(scripts[0]))
        try:
            loaded = datasets.load_dataset(str(path), keep_in_memory=True)
        except Exception as err:
            raise DatasetError(f"'{path}': a folder, but neither saved with datasets' save_to_disk nor one of "
                                f"data files datasets can read: {_one_line(err)}") from None
    if isinstance(loaded, datasets.DatasetDict):
        names = ", ".join(loaded)
        if split is None:
            if len(loaded) != 1:
                raise DatasetError(
                    f"'{path}' holds several splits ({names}): pick one with '{path}{SPLIT_SEPARATOR}SPLIT'"
                )
            split = next(iter(loaded))
        if split not in loaded:
            raise DatasetError(f"'{path}' has no split '{split}' (splits: {names})")
        loaded = loaded[split]
    elif split is not None:
        raise DatasetError(f"'{path}' holds a single Dataset, not splits: drop '{SPLIT_SEPARATOR}{split}'")
    yield from _dataset_rows(loaded)


def _dataset_rows(loaded: Any, csv: bool = False) -> Iterator[tuple[str, Any]]:
    for number, row in enumerate(loaded, start=1):
        if csv:   # pandas reads an empty cell as NaN: it is a missing value, not a number
            row = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}
        yield f"row {number}", row


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    return text[:300] + ("..." if len(text) > 300 else "")
