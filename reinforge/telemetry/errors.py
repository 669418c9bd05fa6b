"""Operating-system errors as one line a person can act on (disk full, permission denied)."""

from __future__ import annotations

import errno

_ADVICE = {
    errno.ENOSPC: "the disk is full: free space or choose another output_dir, then continue with --resume",
    errno.EDQUOT: "the disk quota is exhausted: free space or choose another output_dir, then continue with --resume",
    errno.EACCES: "permission denied: choose an output_dir you can write to",
    errno.EPERM: "operation not permitted: choose an output_dir you can write to",
    errno.EROFS: "the file system is read-only: choose another output_dir",
}


def os_error_message(err: OSError) -> str:
    """`err` as "<what happened> (<file>): <what to do>"; unknown errors keep their own text."""
    where = f" ({err.filename})" if err.filename else ""
    advice = _ADVICE.get(err.errno)
    if advice is None:
        return f"{err.strerror or err}{where}"
    return f"{err.strerror or 'I/O error'}{where}: {advice}"
