"""Problem data from files: loaders, and small data sets shipped with the package.

`math_small.jsonl` is written by `python -m reinforge.data.make_math` (a test
checks it matches); `code_small.jsonl` is hand-written, each row with a reference
`solution` that a test runs against its `tests`.
"""

from pathlib import Path

from reinforge.data.loading import DatasetError, LoadedRecords, load_records, read_records

DATA_DIR = Path(__file__).parent
MATH_SMALL = DATA_DIR / "math_small.jsonl"  # fields: prompt, answer, kind
CODE_SMALL = DATA_DIR / "code_small.jsonl"  # fields: prompt, tests, solution

__all__ = ["CODE_SMALL", "DATA_DIR", "MATH_SMALL", "DatasetError", "LoadedRecords", "load_records", "read_records"]
