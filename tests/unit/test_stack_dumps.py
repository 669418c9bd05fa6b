"""Private stack-dump files (reinforge/stack_dumps.py): nothing another user plants in the shared temp
directory stops a worker from starting or makes reinforge write to a file it did not create."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reinforge import stack_dumps

VICTIM_TEXT = "owned by someone else; must survive\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    return victim


def _private(tmp_path: Path, name: str = "dumps") -> Path:
    directory = tmp_path / name
    directory.mkdir(mode=0o700)
    return directory


def test_a_dump_file_is_made_new_and_private(tmp_path):
    directory = _private(tmp_path)
    fd = stack_dumps.open_dump_file(directory)
    assert fd is not None
    os.close(fd)
    made = directory / f"{os.getpid()}.txt"
    assert stat.S_IMODE(made.stat().st_mode) == 0o600 and made.stat().st_uid == os.geteuid()
    assert stack_dumps.open_dump_file(directory) is None          # exists already: never reopened or truncated


@pytest.mark.parametrize("plant", ["file", "symlink", "dangling_symlink", "directory", "fifo"])
def test_anything_at_the_dump_files_name_is_left_alone(tmp_path, plant):
    directory, victim = _private(tmp_path), _victim(tmp_path)
    name = directory / f"{os.getpid()}.txt"
    if plant == "file":
        name.write_text(VICTIM_TEXT)
    elif plant == "symlink":
        name.symlink_to(victim)
    elif plant == "dangling_symlink":
        name.symlink_to(tmp_path / "would-be-created.txt")
    elif plant == "directory":
        name.mkdir()
    else:
        os.mkfifo(name)
    assert stack_dumps.open_dump_file(directory) is None
    assert victim.read_text() == VICTIM_TEXT
    assert not (tmp_path / "would-be-created.txt").exists()
    if plant == "file":
        assert name.read_text() == VICTIM_TEXT


def test_a_directory_others_can_reach_is_refused(tmp_path):
    victim = _victim(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)                                        # anyone could plant or swap files in it
    assert stack_dumps.open_dump_file(shared) is None
    link = tmp_path / "link"
    link.symlink_to(_private(tmp_path, "real"), target_is_directory=True)
    assert stack_dumps.open_dump_file(link) is None            # the directory itself may not be a symlink
    assert stack_dumps.open_dump_file(victim) is None          # not a directory
    assert stack_dumps.open_dump_file(tmp_path / "missing") is None
    assert victim.read_text() == VICTIM_TEXT
    assert list(shared.iterdir()) == [] and list((tmp_path / "real").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    theirs = _private(tmp_path, "theirs")
    os.chown(theirs, 65534, 65534)
    assert stack_dumps.open_dump_file(theirs) is None
    assert list(theirs.iterdir()) == []


# A fresh interpreter whose temp directory is TMP: the plants sit at the predictable path reinforge used to
# write to (TMP/reinforge-stacks/<pid>.txt), for the next pids this machine will hand out.
_SCRIPT = textwrap.dedent("""
    import os, threading
    from reinforge import stack_dumps
    from reinforge.verifiers.math import _POOL, verify
    out = []
    thread = threading.Thread(target=lambda: out.append(verify("so \\\\boxed{2}", "2")))   # off the main thread:
    thread.start(); thread.join()                                                        # judged in a worker
    (worker,) = _POOL._live
    mode = os.stat(stack_dumps.current_dir()).st_mode & 0o777
    print(out[0], oct(mode), *os.listdir(stack_dumps.current_dir()), f"{worker.process.pid}.txt")
""")


@pytest.mark.parametrize("plant", ["file", "symlinks", "symlinked_dir"])
def test_workers_start_and_verify_whatever_is_planted_in_the_temp_dir(tmp_path, plant):
    tmp, victim = tmp_path / "tmp", _victim(tmp_path)
    tmp.mkdir()
    old = tmp / "reinforge-stacks"
    victim_dir = tmp_path / "victim-dir"
    victim_dir.mkdir()
    if plant == "file":                       # used to stop every worker from starting (mkdir failed)
        old.write_text(VICTIM_TEXT)
    elif plant == "symlinks":                 # used to truncate the victim, as the trainer's user
        old.mkdir()
        for pid in range(os.getpid(), os.getpid() + 3000):
            (old / f"{pid}.txt").symlink_to(victim)
    else:                                     # used to create files in someone else's directory
        old.symlink_to(victim_dir, target_is_directory=True)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    score, mode, made, expected = done.stdout.split()
    assert (score, mode) == ("1.0", "0o700")           # verified in a worker; the dump directory is private
    assert made == expected                            # the worker registered its stack handler there
    assert victim.read_text() == VICTIM_TEXT
    assert list(victim_dir.iterdir()) == []
    # The private directory was made fresh beside the plant, and removed at exit.
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith("reinforge")) == ["reinforge-stacks"]
