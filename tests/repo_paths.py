"""Where the tests and the repository are, for tests in any folder below tests/ (unit/<package>/, e2e/)."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
