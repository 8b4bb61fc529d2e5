"""Nothing of the user's is clobbered: zoo writes over, or deletes, only what zoo itself wrote.

1. a lock file that is a symbolic link (to a file, or to nothing) or not a regular file is refused in one
   sentence, and the link's target is neither truncated nor created;
2. ``--overwrite`` removes an earlier run's tags, ``latest`` and zoo's own files from ``checkpoints/``, and
   leaves everything else there (said in one line); a ``checkpoints`` that is a symbolic link is one
   sentence and exit 2, its target untouched.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

def _one_sentence(message: str) -> str:
    assert "\n" not in message and message.endswith("."), f"not one sentence: {message!r}"
    return message

# ----------------------------------------------------------------------------- 1. the lock file
def _not_a_regular_file(run: Path, what: str) -> str:
    lock = run / ".zoo.lock"
    return (f"--save {run}: its lock file {lock} is {what}, not a regular file, and zoo writes its lock only into a "
            f"file of its own; remove {lock} and run again.")

@pytest.mark.parametrize("flock_works", [True, False], ids=["flock", "exclusive-file"])
def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path, monkeypatch, flock_works):
    import fcntl

    from zoo.training.run_directory import RunDirectoryLock

    if not flock_works:
        def no_flock(fd, operation):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        monkeypatch.setattr(fcntl, "flock", no_flock)
    precious = tmp_path / "precious.txt"
    precious.write_text('{"host": "x", "pid": 1, "since": "then"}\n')   # even a file that reads as a holder line
    run = tmp_path / "run"
    run.mkdir()
    (run / ".zoo.lock").symlink_to(precious)
    with pytest.raises(ValueError) as refused:
        RunDirectoryLock(run).acquire()
    assert _one_sentence(str(refused.value)) == _not_a_regular_file(run, f"a symbolic link to {precious}")
    assert precious.read_text() == '{"host": "x", "pid": 1, "since": "then"}\n'
    assert (run / ".zoo.lock").is_symlink()

    nowhere = tmp_path / "not-there"
    (run / ".zoo.lock").unlink()
    (run / ".zoo.lock").symlink_to(nowhere)
    with pytest.raises(ValueError) as refused:
        RunDirectoryLock(run).acquire()
    assert str(refused.value) == _not_a_regular_file(run, f"a symbolic link to {nowhere}")
    assert not nowhere.exists()

def test_a_lock_path_that_is_a_directory_is_refused(tmp_path):
    from zoo.training.run_directory import RunDirectoryLock

    run = tmp_path / "run"
    (run / ".zoo.lock").mkdir(parents=True)
    with pytest.raises(ValueError) as refused:
        RunDirectoryLock(run).acquire()
    assert str(refused.value) == _not_a_regular_file(run, "a directory")

