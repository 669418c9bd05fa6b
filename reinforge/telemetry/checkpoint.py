"""Resumable checkpoints, written so that a crash never leaves a broken one.

A checkpoint is a folder `checkpoints/step-NNNNNN/` holding

- `state.pt`: every tensor a run carries (weights, optimizer, scheduler,
  reference, advantage state, torch RNG states), one `torch.save` file;
- `trainer_state.json`: the rest (step, policy version, prompt-pool order,
  python and numpy RNG states, metrics position, alert state, ...),
  written last.

It is written under a temporary name, every file fsync'ed, then renamed into
place and the parent fsync'ed: a rename is atomic, so a crash at any moment
leaves either the complete new checkpoint or none, and the previous one stays
valid. Leftover temporary folders are removed at the next save. Only the
newest `keep_last` checkpoints are kept, older ones are deleted after a newer
one is complete.

Global RNG states are part of the checkpoint (`global_rng_state`): the
sampler draws from torch's global generator, so resuming must continue that
exact stream for the resumed run to equal an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_NAME = re.compile(r"step-(\d{6,})")
_TMP_PREFIX = ".tmp-"
STATE_FILE = "state.pt"
META_FILE = "trainer_state.json"


@dataclass
class Checkpoint:
    """A complete checkpoint on disk."""

    step: int
    path: Path

    def meta(self) -> dict[str, Any]:
        return json.loads((self.path / META_FILE).read_text())

    def tensors(self) -> dict[str, Any]:
        # weights_only: a checkpoint is data, never code (torch's safe unpickler).
        return torch.load(self.path / STATE_FILE, map_location="cpu", weights_only=True)


class CheckpointStore:
    """The `checkpoints/` folder of a run directory."""

    def __init__(self, root: Path, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last

    def all(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first (a folder without its trainer_state.json is not one)."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _NAME.fullmatch(path.name)
            if match and (path / META_FILE).is_file() and (path / STATE_FILE).is_file():
                found.append(Checkpoint(int(match.group(1)), path))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        found = self.all()
        return found[-1] if found else None

    def save(self, step: int, tensors: dict[str, Any], meta: dict[str, Any]) -> Checkpoint:
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(f"{_TMP_PREFIX}*"):      # from a crash during an earlier save
            shutil.rmtree(leftover, ignore_errors=True)
        final = self.root / f"step-{step:06d}"
        tmp = self.root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            _write(tmp / STATE_FILE, lambda f: torch.save(tensors, f))
            _write(tmp / META_FILE, lambda f: f.write(json.dumps(meta).encode()))
            _fsync_dir(tmp)
            if final.exists():          # the same step saved again (a stop right after a periodic save)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in self.all()[: -self.keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)
        return Checkpoint(step, final)


def _write(path: Path, fill) -> None:
    with open(path, "wb") as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def global_rng_state() -> dict[str, Any]:
    """python, numpy and torch (CPU and CUDA) global RNG states; numpy and python as JSON-able lists."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_global_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
