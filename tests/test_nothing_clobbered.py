"""Nothing of the user's is clobbered: zoo writes over, or deletes, only what zoo itself wrote.

1. a lock file that is a symbolic link (to a file, or to nothing) or not a regular file is refused in one
   sentence, and the link's target is neither truncated nor created;
2. ``--overwrite`` removes an earlier run's tags, ``latest`` and zoo's own files from ``checkpoints/``, and
   leaves everything else there (said in one line); a ``checkpoints`` that is a symbolic link is one
   sentence and exit 2, its target untouched.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch_env import one_rank_env

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

    from zoo.operations.run_lock import RunDirectoryLock

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
    from zoo.operations.run_lock import RunDirectoryLock

    run = tmp_path / "run"
    (run / ".zoo.lock").mkdir(parents=True)
    with pytest.raises(ValueError) as refused:
        RunDirectoryLock(run).acquire()
    assert str(refused.value) == _not_a_regular_file(run, "a directory")


# ----------------------------------------------------------------------------- 2. --overwrite
def _zoo_tag(checkpoints: Path, tag: str, marked: bool = True) -> None:
    """A tag directory as zoo's save leaves it."""
    from zoo.checkpoint.files import COMPLETE_MARKER, completion_record

    tag_dir = checkpoints / tag
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"states")
    (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optim")
    if marked:
        (tag_dir / COMPLETE_MARKER).write_text(json.dumps(completion_record(tag_dir)))


def _earlier_run(run: Path) -> Path:
    """An earlier run's checkpoints/ (a complete tag, a save cut short, latest, DeepSpeed's recovery script,
    a resharded copy) and metrics.jsonl, beside the user's own files there."""
    checkpoints = run / "checkpoints"
    _zoo_tag(checkpoints, "iter_0000002")
    _zoo_tag(checkpoints, "iter_0000004", marked=False)
    (checkpoints / "latest").write_text("iter_0000002")
    (checkpoints / "zero_to_fp32.py").write_text("# DeepSpeed's recovery script\n")
    copy = checkpoints / "resharded" / "iter_0000002-tp2"
    copy.mkdir(parents=True)
    (copy / "resharded_from.json").write_text(json.dumps({"source": "x", "from_tp": 1, "to_tp": 2}))
    (copy / "mp_rank_01_model_states.pt").write_bytes(b"states")
    (run / "metrics.jsonl").write_text('{"iteration": 1, "loss": 2.0}\n')
    return checkpoints


def test_overwrite_removes_only_what_an_earlier_run_wrote(tmp_path, capsys):
    from zoo.training.run_directory import claim_pretraining_directory

    run = tmp_path / "run"
    checkpoints = _earlier_run(run)
    (checkpoints / "my_readme.txt").write_text("notes\n")
    mine = checkpoints / "iter_9999999_mine"
    mine.mkdir()
    (mine / "weights.bin").write_bytes(b"mine")
    (checkpoints / "iter_0000002" / "NOTES.md").write_text("kept\n")   # the user's file inside a zoo tag

    with claim_pretraining_directory(run, resuming=False, overwrite=True):
        left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.name != ".zoo.lock")
    assert left == ["checkpoints", "checkpoints/iter_0000002", "checkpoints/iter_0000002/NOTES.md",
                    "checkpoints/iter_9999999_mine", "checkpoints/iter_9999999_mine/weights.bin",
                    "checkpoints/my_readme.txt"]
    assert (checkpoints / "my_readme.txt").read_text() == "notes\n"
    assert (mine / "weights.bin").read_bytes() == b"mine"
    out = capsys.readouterr().out.splitlines()
    assert out == [f"--overwrite: removed the earlier run's checkpoints (latest iter_0000002) and metrics.jsonl "
                   f"from {run}",
                   f"--overwrite: left what zoo did not write in {checkpoints}: iter_0000002/NOTES.md, "
                   f"iter_9999999_mine, my_readme.txt"]


def test_overwrite_of_a_checkpoints_directory_zoo_wrote_alone_removes_it(tmp_path, capsys):
    from zoo.training.run_directory import claim_pretraining_directory

    run = tmp_path / "run"
    _earlier_run(run)
    with claim_pretraining_directory(run, resuming=False, overwrite=True):
        assert sorted(p.name for p in run.iterdir()) == [".zoo.lock"]
    assert "left what zoo did not write" not in capsys.readouterr().out


def test_overwrite_through_a_symlinked_checkpoints_is_one_sentence(tmp_path):
    from zoo.training.run_directory import claim_pretraining_directory

    elsewhere = tmp_path / "elsewhere"
    _zoo_tag(elsewhere, "iter_0000002")
    (elsewhere / "latest").write_text("iter_0000002")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(ValueError) as refused:
        claim_pretraining_directory(run, resuming=False, overwrite=True)
    assert _one_sentence(str(refused.value)) == (
        f"--save {run}: its checkpoints {run / 'checkpoints'} is a symbolic link to {elsewhere}, whose contents "
        f"--overwrite does not remove; remove the link (or what it points to) yourself, or pass another --save.")
    assert (elsewhere / "iter_0000002" / "mp_rank_00_model_states.pt").is_file()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]


def test_overwrite_through_a_symlinked_checkpoints_exits_2_from_the_script(tmp_path):
    """The script, as a user runs it: one error line and exit 2 (was a rank-0 traceback from rmtree)."""
    from tests.spawn import free_port

    elsewhere = tmp_path / "elsewhere"
    _zoo_tag(elsewhere, "iter_0000002")
    (elsewhere / "latest").write_text("iter_0000002")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(elsewhere)
    proc = subprocess.run([sys.executable, "launch/pretrain.py", "--deepspeed_config", "ds_configs/cpu_demo.json",
                           "--save", str(run), "--overwrite", "--tensor-parallel-size", "1"],
                          env=one_rank_env(free_port()), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "is a symbolic link to" in errors[0], proc.stderr[-2000:]
    assert (elsewhere / "iter_0000002" / "mp_rank_00_model_states.pt").is_file()


# ----------------------------------------------------------------------------- 6. metrics.jsonl in bounded memory
HUGE_LINE_BYTES = 24 << 20


def _metrics_with_a_huge_line(run: Path, last: bool) -> Path:
    """metrics.jsonl with one line of HUGE_LINE_BYTES (no event zoo logs is near that long)."""
    run.mkdir(parents=True, exist_ok=True)
    path = run / "metrics.jsonl"
    with path.open("wb") as out:
        out.write(b'{"iteration": 1, "loss": 2.0}\n')
        out.write(b'{"iteration": 2, "note": "' + b"x" * HUGE_LINE_BYTES + b'"}\n')
        if not last:
            out.write(b'{"iteration": 3, "loss": 1.0}\n')
    return path


@pytest.mark.parametrize("last", [False, True], ids=["inside", "last"])
def test_a_huge_metrics_line_is_one_sentence_read_in_bounded_memory(tmp_path, last):
    """Resuming reads metrics.jsonl (the claim's check, then the cut to the checkpoint's iteration) in pieces:
    a line far longer than any event is a sentence naming it, and Python's allocations stay under 8 MiB
    (reading the whole file held it three times over)."""
    import tracemalloc

    import zoo.checkpoint.files  # noqa: F401 - imported here, not while allocations are traced
    from zoo.training.metrics import truncate_metrics_after
    from zoo.training.run_directory import claim_pretraining_directory

    run = tmp_path / "run"
    path = _metrics_with_a_huge_line(run, last)
    expected = (f"{path} line 2 is {HUGE_LINE_BYTES + 28} bytes long, longer than any event zoo logs (at most "
                f"1048576 bytes), so it is not one; delete or repair that line, then run again.")
    for read in (lambda: claim_pretraining_directory(run, resuming=True, overwrite=False),
                 lambda: truncate_metrics_after(path, 1)):
        tracemalloc.start()
        try:
            with pytest.raises(ValueError) as refused:
                read()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert _one_sentence(str(refused.value)) == expected
        assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB"
    assert path.stat().st_size == 30 + HUGE_LINE_BYTES + 29 + (0 if last else 30)   # untouched
