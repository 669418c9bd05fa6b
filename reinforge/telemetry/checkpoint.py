"""Resumable checkpoints: written so that a crash never leaves a broken one, and verified before a
resume trusts one.

A checkpoint is a folder `checkpoints/step-NNNNNN/` holding

- `state.pt`: every tensor a run carries (weights, optimizer, scheduler,
  reference, advantage state, torch RNG states), one `torch.save` file;
- `trainer_state.json`: the rest (step, policy version, prompt-pool order,
  python and numpy RNG states, metrics position, alert state, ...);
- `manifest.json`, written last: the format version, the step, and the size
  and sha256 of every other file.

It is written under a temporary name, every file fsync'ed (the manifest
through a temporary file and a rename of its own), then the folder is renamed
into place and the parent fsync'ed: a rename is atomic, so a crash at any
moment leaves either the complete new checkpoint or none, and the previous one
stays valid. Leftover temporary folders are removed at the next save. Only the
newest `keep_last` checkpoints are kept, older ones are deleted after a newer
one is complete; so are checkpoints of later steps than the one saved (the
history a resumed run replaces, a damaged newest checkpoint among them).

A write that fails (disk full) removes what it wrote and raises
`CheckpointWriteError`, whose message is one line saying what to do.

Resume (`CheckpointStore.load_for_resume`) checks the newest checkpoint's
manifest (it parses, every file is there with its size and checksum) and
loads it; a damaged one is skipped for the newest intact one before it, and
one line says which was skipped and why. Checkpoints written before manifests
existed are unverified: they are used when both files load, and skipped the
same way when one does not (a cut-short state.pt fails to unzip, broken JSON
fails to parse). Nothing is read into the run until a checkpoint has loaded
completely, so a caller that writes only after this call changes nothing
when every checkpoint is damaged.

sha256 rather than a cheaper checksum: on the built-in model's checkpoint
(17 MB: weights, Adam moments, reference) a save takes 37 ms, 10 ms of it
hashing (1.8 GB/s on this CPU), and the check adds 10 ms to a 30 ms load.
crc32 would hash 4x faster but is no check a person can repeat with
`sha256sum`.

Global RNG states are part of the checkpoint (`global_rng_state`): the
sampler draws from torch's global generator, so resuming must continue that
exact stream for the resumed run to equal an uninterrupted one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reinforge.errors import ConfigError

_NAME = re.compile(r"step-(\d{6,})")
_TMP_PREFIX = ".tmp-"
STATE_FILE = "state.pt"
META_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1          # of the manifest and the files it lists; bump when either changes meaning


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, ...); nothing of it is left behind."""


class CheckpointDamaged(Exception):
    """A checkpoint fails its manifest or does not load; the message is the reason, e.g.
    `state.pt: checksum mismatch`."""


@dataclass
class LoadedCheckpoint:
    """A checkpoint read completely into memory."""

    step: int
    path: Path
    meta: dict[str, Any]         # trainer_state.json
    tensors: dict[str, Any]      # state.pt


@dataclass
class Checkpoint:
    """A checkpoint folder on disk (complete when written; `load` checks it still is)."""

    step: int
    path: Path

    def meta(self) -> dict[str, Any]:
        return json.loads((self.path / META_FILE).read_text())

    def tensors(self) -> dict[str, Any]:
        # weights_only: a checkpoint is data, never code (torch's safe unpickler).
        return torch.load(self.path / STATE_FILE, map_location="cpu", weights_only=True)

    def verify(self) -> bool:
        """Checks the manifest: True when it vouches for every file, False when there is none (a
        checkpoint from before manifests); raises CheckpointDamaged otherwise."""
        manifest_path = self.path / MANIFEST_FILE
        if not manifest_path.is_file():
            return False
        try:
            manifest = json.loads(manifest_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointDamaged(f"{MANIFEST_FILE}: not valid JSON ({err})") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise CheckpointDamaged(f"{MANIFEST_FILE}: no list of files")
        if manifest.get("format") != FORMAT_VERSION:
            raise CheckpointDamaged(f"{MANIFEST_FILE}: format {manifest.get('format')!r}, this reinforge reads "
                                    f"format {FORMAT_VERSION}")
        if manifest.get("step") != self.step:
            raise CheckpointDamaged(
                f"{MANIFEST_FILE}: it is of step {manifest.get('step')!r}, the folder's is {self.step}"
            )
        for name in (STATE_FILE, META_FILE):
            if name not in manifest["files"]:
                raise CheckpointDamaged(f"{MANIFEST_FILE}: does not list {name}")
        for name, expected in manifest["files"].items():
            path = self.path / name
            if not path.is_file():
                raise CheckpointDamaged(f"{name}: missing")
            try:
                written, checksum = int(expected["bytes"]), str(expected["sha256"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointDamaged(f"{MANIFEST_FILE}: no size and checksum for {name}") from None
            size = path.stat().st_size
            if size == 0 and written > 0:
                raise CheckpointDamaged(f"{name}: empty, {written} bytes when written")
            if size < written:
                raise CheckpointDamaged(f"{name}: {size} of {written} bytes (file cut short?)")
            if size > written:
                raise CheckpointDamaged(f"{name}: {size} bytes, {written} when written (file changed?)")
            if _sha256(path) != checksum:
                raise CheckpointDamaged(f"{name}: checksum mismatch (changed after it was written)")
        return True

    def load(self) -> LoadedCheckpoint:
        """Both files read into memory, after the manifest check; CheckpointDamaged says why not."""
        # Without a manifest (written before they existed) loading is the only check; the reason says so.
        unverified = "" if self.verify() else "; no manifest"
        for name in (META_FILE, STATE_FILE):
            if not (self.path / name).is_file():
                raise CheckpointDamaged(f"{name}: missing{unverified}")
            if (self.path / name).stat().st_size == 0:
                raise CheckpointDamaged(f"{name}: empty{unverified}")
        try:
            meta = self.meta()
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointDamaged(f"{META_FILE}: not valid JSON ({err}){unverified}") from None
        try:
            tensors = self.tensors()
        except Exception as err:     # torch reports a damaged zip or pickle as RuntimeError, EOFError, ...
            # Its first sentence; the rest of torch's message speculates about causes at length.
            first = str(err).strip().split(". ")[0].splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointDamaged(f"{STATE_FILE}: does not load ({first}){unverified}") from None
        return LoadedCheckpoint(self.step, self.path, meta, tensors)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class CheckpointStore:
    """The `checkpoints/` folder of a run directory."""

    def __init__(self, root: Path, keep_last: int):
        self.root = Path(root)
        self.keep_last = keep_last

    def all(self) -> list[Checkpoint]:
        """Checkpoint folders, oldest first. A folder gets its name only when complete, so each was
        complete once; `Checkpoint.load` checks that it still is."""
        if not self.root.is_dir():
            return []
        found = [Checkpoint(int(m.group(1)), p) for p in self.root.iterdir()
                 if (m := _NAME.fullmatch(p.name)) and p.is_dir()]
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        found = self.all()
        return found[-1] if found else None

    def load_for_resume(self, report: Callable[[str], None] = _stderr_line) -> LoadedCheckpoint | None:
        """The newest checkpoint that loads, read into memory; None when there is no checkpoint.

        Damaged newer ones are skipped, and `report` gets one line naming them and why. When none
        loads, ConfigError says why for each; nothing on disk has changed."""
        skipped: list[str] = []
        for checkpoint in reversed(self.all()):
            try:
                loaded = checkpoint.load()
            except CheckpointDamaged as err:
                skipped.append(f"{checkpoint.path.name} ({err})")
                continue
            if skipped:
                report(f"resume: skipped checkpoint{'s' if len(skipped) > 1 else ''} {', '.join(skipped)}; "
                       f"resuming from {checkpoint.path.name}")
            return loaded
        if skipped:
            raise ConfigError(f"--resume: no intact checkpoint in {self.root}: {', '.join(skipped)}. Nothing was "
                              f"changed; restore a checkpoint from a copy, or start the run over with --overwrite")
        return None

    def save(self, step: int, tensors: dict[str, Any], meta: dict[str, Any]) -> Checkpoint:
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob(f"{_TMP_PREFIX}*"):      # from a crash during an earlier save
            shutil.rmtree(leftover, ignore_errors=True)
        final = self.root / f"step-{step:06d}"
        tmp = self.root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
        try:
            tmp.mkdir()
            _write(tmp / STATE_FILE, lambda f: torch.save(tensors, f))
            _write(tmp / META_FILE, lambda f: f.write(json.dumps(meta).encode()))
            files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
                     for name in (STATE_FILE, META_FILE)}
            manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
            # Last, and whole or not at all: a folder whose manifest is there has every file it lists.
            _write(tmp / f"{MANIFEST_FILE}.tmp", lambda f: f.write(json.dumps(manifest, indent=1).encode()))
            os.rename(tmp / f"{MANIFEST_FILE}.tmp", tmp / MANIFEST_FILE)
            _fsync_dir(tmp)
            if final.exists():          # the same step saved again (a stop right after a periodic save)
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if _out_of_space(err):
                raise CheckpointWriteError(self._write_failed(step, err)) from err
            raise
        # Later steps than this one are the history a resumed run replaces (a damaged newest
        # checkpoint it skipped): they go, so that keep_last counts checkpoints of this history.
        for stale in self.all():
            if stale.step > step:
                shutil.rmtree(stale.path, ignore_errors=True)
        for old in self.all()[: -self.keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)
        return Checkpoint(step, final)

    def _write_failed(self, step: int, err: BaseException) -> str:
        if isinstance(err, OSError):
            what = err.strerror or str(err)
        else:
            what = f"torch could not write {STATE_FILE} ({str(err).strip().splitlines()[0]}; is the disk full?)"
        previous = [c.path.name for c in self.all() if c.step != step]
        resume = (f"continues from {previous[-1]}" if previous else "starts it over")
        return (f"checkpoint of step {step} not written to {self.root}: {what}. Free space on that disk (or move "
                f"the run directory, output_dir, to one with room), then `reinforge train --resume "
                f"{self.root.parent}` {resume}")


def _out_of_space(err: BaseException) -> bool:
    """Whether `err` is the disk (or quota) refusing a write. torch.save into a Python file passes
    the OSError on; writing through its own C++ writer it raises RuntimeError from
    inline_container.cc ('file write failed'), which hides the errno. Other OS errors (permission
    denied, ...) go on as they are: the CLI says what they mean."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(err, RuntimeError) and ("inline_container" in str(err) or "file write failed" in str(err))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


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
