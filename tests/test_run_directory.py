"""One run owns its run directory, and torn or unwritable metrics never end in a traceback.

1. a second run on a directory a live run holds (a real pretraining run, blocked after its first
   iteration) is refused on every rank with the holder named, and changes nothing there (listing, sizes
   and mtimes compared); the holder then finishes normally;
2. in one 2-rank spawn: a fresh run over an earlier run's checkpoints is refused; a torn last line of
   metrics.jsonl is dropped on resume with a warning; a corrupt line before it is one sentence with its
   line number (nothing touched); a full disk during a metrics append is one sentence on every rank;
   ``--overwrite`` replaces the earlier run;
3. directory-level claims: a run that does not continue ``--save`` (no ``--load``, or ``--load`` of another run)
   is refused over checkpoints there, marker-less tags included; a failing W&B never stops training;
4. pure checks: the lock where flock is refused (exclusive file, stale holders taken over), a killed
   holder's lock vanishing, the finetuning runner's refusal, metrics reading with torn and corrupt lines.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launch_env import one_rank_env
from tests.helpers.pretraining import TINY_MODEL, ds_config, run_config, train_events
from tests.spawn import free_port, spawn

REPO = Path(__file__).resolve().parent.parent


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``directory`` (itself included) with its size and mtime in nanoseconds."""
    entries = {".": (0, directory.stat().st_mtime_ns)}
    for path in sorted(directory.rglob("*")):
        stat = path.lstat()
        entries[str(path.relative_to(directory))] = (stat.st_size if path.is_file() else 0, stat.st_mtime_ns)
    return entries


def _outcome(fn):
    """("ok", value, stdout + stderr) or (exception type name, message, stdout + stderr)."""
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            value = fn()
        return "ok", value, output.getvalue()
    except Exception as err:  # noqa: BLE001 - the test compares what every rank raised
        return type(err).__name__, str(err), output.getvalue()


# ----------------------------------------------------------------------------- two runs on one directory
HOLDING_DRIVER = """
import sys, time
from pathlib import Path
from zoo.training.loop import TrainingLoop
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
real_step = TrainingLoop.train_step
def step_after_go(self, state):
    if state.iteration == 1:              # iteration 1 logged and saved: the run holds its directory
        ready.write_text("ready")
        deadline = time.monotonic() + 180
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return real_step(self, state)
TrainingLoop.train_step = step_after_go
from zoo.cli.pretrain import main
main(sys.argv[3:])
"""


def _second_run_worker(rank, world_size, data_path, run):
    from zoo.training.pretrain import pretrain

    return {"resume": _outcome(lambda: pretrain(run_config(data_path, run, 2, 2, 4, train_iters=3, load=run))),
            "overwrite": _outcome(lambda: pretrain(run_config(data_path, run, 2, 2, 4, train_iters=3,
                                                              overwrite=True)))}


def test_a_second_run_on_a_held_directory_is_refused_and_touches_nothing(corpus_prefix, tmp_path):
    config = ds_config(2, 2)
    config["zoo"] = {"tensor_parallel_size": 1, "model": "gpt2-tiny", "seq_length": 32, "eval_interval": 0,
                     "split": "80,20,0", "log_interval": 1, "save_interval": 1, "model_overrides": TINY_MODEL}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    run, ready, go = tmp_path / "run", tmp_path / "ready", tmp_path / "go"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDING_DRIVER, str(ready), str(go), "--deepspeed_config", str(tmp_path / "ds.json"),
         "--data-path", corpus_prefix, "--save", str(run), "--train-iters", "3"],
        env=one_rank_env(free_port()), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists() and holder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), holder.communicate(timeout=60)
        before = snapshot(run)

        ranks = spawn(_second_run_worker, 2, corpus_prefix, str(run))

        assert snapshot(run) == before, "the refused run changed the directory"
        for name in ("resume", "overwrite"):
            outcomes = [r[name][:2] for r in ranks]
            assert outcomes[0] == outcomes[1] and outcomes[0][0] == "UserError", (name, ranks)
            message = outcomes[0][1]
            assert message.startswith(f"--save {run} is in use by another run (process {holder.pid} on host "), message
            assert ", since 20" in message and "or pass another --save" in message, message
    finally:
        go.write_text("go")
        out, err = holder.communicate(timeout=240)
    assert holder.returncode == 0, err[-3000:]
    assert [e["iteration"] for e in train_events(run)] == [1, 2, 3]
    assert not (run / ".zoo.lock").exists()


# ----------------------------------------------------------------------------- one directory's life
def _directory_life_worker(rank, world_size, data_path, run):
    import pathlib

    import torch.distributed as dist

    from zoo.training.pretrain import pretrain

    metrics = pathlib.Path(run) / "metrics.jsonl"

    def config(train_iters, **changes):
        return run_config(data_path, run, 2, 2, 4, train_iters=train_iters, **changes)

    def on_rank_0(fn):
        dist.barrier()
        result = fn() if rank == 0 else None
        dist.barrier()
        return result

    results = {"first": _outcome(lambda: pretrain(config(2)))}
    before = on_rank_0(lambda: snapshot(pathlib.Path(run)))
    results["fresh"] = _outcome(lambda: pretrain(config(2)))
    results["fresh_unchanged"] = on_rank_0(lambda: snapshot(pathlib.Path(run)) == before)

    # a disk that filled during the append of iteration 3's line: the line stops mid-number
    on_rank_0(lambda: metrics.open("a").write('{"iteration": 3, "consumed_samples": 12, "loss": 7.'))
    results["torn"] = _outcome(lambda: pretrain(config(3, load=run)))
    results["after_torn"] = on_rank_0(lambda: metrics.read_text())

    lines = on_rank_0(lambda: metrics.read_text().splitlines())
    on_rank_0(lambda: metrics.write_text("\n".join([lines[0], "{not json", *lines[2:]]) + "\n"))
    before = on_rank_0(lambda: snapshot(pathlib.Path(run)))
    results["corrupt"] = _outcome(lambda: pretrain(config(4, load=run)))
    results["corrupt_unchanged"] = on_rank_0(lambda: snapshot(pathlib.Path(run)) == before)
    on_rank_0(lambda: metrics.write_text("".join(line + "\n" for line in lines)))

    real_open = pathlib.Path.open

    def full_disk_open(self, mode="r", *args, **kwargs):
        handle = real_open(self, mode, *args, **kwargs)
        if self.name != "metrics.jsonl" or mode != "a":
            return handle
        real_write = handle.write

        def write_half_then_fail(text):
            real_write(text[: len(text) // 2])
            handle.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        handle.write = write_half_then_fail
        return handle

    if rank == 0:
        pathlib.Path.open = full_disk_open
    try:
        results["full"] = _outcome(lambda: pretrain(config(4, load=run)))
    finally:
        pathlib.Path.open = real_open
    results["after_full"] = on_rank_0(lambda: metrics.read_text())

    results["overwrite"] = _outcome(lambda: pretrain(config(1, overwrite=True)))
    return results


def test_fresh_runs_torn_and_corrupt_metrics_and_a_full_disk(corpus_prefix, tmp_path):
    from zoo.training.metrics import read_metrics

    run = tmp_path / "run"
    ranks = spawn(_directory_life_worker, 2, corpus_prefix, str(run), timeout=300)
    zero, one = ranks
    assert zero["first"][0] == one["first"][0] == "ok", (zero["first"], one["first"])

    # a fresh run over the checkpoints: one sentence on both ranks, nothing changed
    assert zero["fresh"][:2] == one["fresh"][:2], (zero["fresh"], one["fresh"])
    assert zero["fresh"][:2] == ("UserError", f"--save {run} already holds the checkpoints of an earlier run (latest "
                                 "iter_0000002), which this run's saves would overwrite; use --load "
                                 f"{run} to resume, or another --save, or --overwrite to replace them.")
    assert zero["fresh_unchanged"]

    # the torn line is dropped with a warning naming the file; iteration 3 is logged again, whole
    assert zero["torn"][0] == one["torn"][0] == "ok", (zero["torn"], one["torn"])
    assert f"warning: {run / 'metrics.jsonl'} ends in a partial line (line 3" in zero["torn"][2]
    assert [json.loads(line)["iteration"] for line in zero["after_torn"].splitlines()] == [1, 2, 3]

    # a corrupt line before the last: its number, on both ranks, before anything is written
    assert zero["corrupt"][:2] == one["corrupt"][:2], (zero["corrupt"], one["corrupt"])
    assert zero["corrupt"][0] == "UserError"
    assert zero["corrupt"][1].startswith(f"{run / 'metrics.jsonl'} line 2 is not a JSON object ('{{not json'); "
                                         "delete or repair that line"), zero["corrupt"][1]
    assert zero["corrupt_unchanged"]

    # a full disk during the append of iteration 4: one sentence on both ranks, the half line cut off again
    assert zero["full"][:2] == one["full"][:2], (zero["full"], one["full"])
    assert zero["full"][:2] == ("UserError", f"appending to {run / 'metrics.jsonl'} failed (No space left on device); "
                                f"free space in {run} or pass another --save, then run again (a pretraining run "
                                f"resumes from its last checkpoint with --load {run}).")
    assert "Traceback" not in zero["full"][2] + one["full"][2]
    assert zero["after_full"].endswith("\n") and len(zero["after_full"].splitlines()) == 3

    # --overwrite: the earlier run's checkpoints and metrics go, said in one line
    assert zero["overwrite"][0] == one["overwrite"][0] == "ok", (zero["overwrite"], one["overwrite"])
    assert (f"--overwrite: removed the earlier run's checkpoints (latest iter_0000003) and metrics.jsonl from {run}"
            in zero["overwrite"][2])
    assert [e["iteration"] for e in read_metrics(run)] == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_0000001", "latest"]
    assert not (run / ".zoo.lock").exists()


# ----------------------------------------------------------------------------- whose checkpoints these are
def _checkpoint_tag(run: Path, tag: str, marked: bool) -> None:
    """A tag directory as a save leaves it: a model-states file, and the completion marker when it finished."""
    from zoo.checkpoint.files import COMPLETE_MARKER, completion_record

    tag_dir = run / "checkpoints" / tag
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"states")
    if marked:
        (tag_dir / COMPLETE_MARKER).write_text(json.dumps(completion_record(tag_dir)))


def _refusal(run: Path, listed: str) -> str:
    return (f"--save {run} already holds the checkpoints of an earlier run ({listed}), which this run's saves would "
            f"overwrite; use --load {run} to resume, or another --save, or --overwrite to replace them.")


def test_a_run_loading_another_directory_is_refused_over_checkpoints_it_would_overwrite(corpus_prefix, tmp_path,
                                                                                        capsys):
    """--load OTHER --save X, X holding another run's checkpoints and no metrics.jsonl: refused, X untouched;
    --load naming X itself (the run directory or its checkpoints/, through any path) continues it;
    --overwrite replaces X's checkpoints."""
    from zoo.training.pretrain import continues_save_directory
    from zoo.training.run_directory import claim_pretraining_directory

    run = tmp_path / "run"
    _checkpoint_tag(run, "iter_0000002", marked=True)
    (run / "checkpoints" / "latest").write_text("iter_0000002")
    before = snapshot(run)
    with pytest.raises(ValueError) as refused:   # --load OTHER holding a checkpoint: the run starts past 0
        claim_pretraining_directory(run, resuming=False, overwrite=False)
    assert str(refused.value) == _refusal(run, "latest iter_0000002")
    assert snapshot(run) == before

    (tmp_path / "alias").symlink_to(run)
    for load in (run, run / "checkpoints", tmp_path / "alias" / "checkpoints", tmp_path / "alias" / ".." / "run"):
        assert continues_save_directory(run_config(corpus_prefix, str(run), 1, 1, 1, 1, load=str(load))), load
    assert not continues_save_directory(run_config(corpus_prefix, str(run), 1, 1, 1, 1, load=str(tmp_path / "other")))
    with claim_pretraining_directory(run, resuming=True, overwrite=False):
        assert (run / "checkpoints" / "latest").is_file()

    with claim_pretraining_directory(run, resuming=False, overwrite=True):
        assert not (run / "checkpoints").exists()
    assert f"--overwrite: removed the earlier run's checkpoints (latest iter_0000002) from {run}" in capsys.readouterr().out


def test_tags_without_a_completion_marker_are_an_earlier_runs_checkpoints(tmp_path):
    """Marker-less tags and no ``latest`` (a zoo that wrote no markers, or a first save cut short): a fresh run
    is refused over them; the same directory resumed with --load X (it starts from iteration 0) is not."""
    from zoo.training.run_directory import claim_pretraining_directory

    run = tmp_path / "run"
    for tag in ("iter_0000002", "iter_0000004"):
        _checkpoint_tag(run, tag, marked=False)
    before = snapshot(run)
    with pytest.raises(ValueError) as refused:
        claim_pretraining_directory(run, resuming=False, overwrite=False)
    assert str(refused.value) == _refusal(run, "tags iter_0000002, iter_0000004")
    assert snapshot(run) == before

    with claim_pretraining_directory(run, resuming=True, overwrite=False):
        assert (run / "checkpoints" / "iter_0000004" / "mp_rank_00_model_states.pt").is_file()


def test_a_failing_wandb_warns_once_and_training_goes_on(tmp_path, capsys):
    from zoo.training.metrics import MetricsLogger, read_metrics

    class BrokenRun:
        def log(self, values, step=None):
            raise ConnectionError("wandb backend gone")

    logger = MetricsLogger(tmp_path, is_writer=True)
    logger._wandb = BrokenRun()
    logger.log({"iteration": 1, "loss": 2.0})
    logger.log({"iteration": 2, "loss": 1.0})
    logger.summary({"best": 1.0})
    logger.close()
    assert [e["iteration"] for e in read_metrics(tmp_path)] == [1, 2]
    assert capsys.readouterr().err == ("warning: W&B tracking stopped (ConnectionError: wandb backend gone); the run "
                                       f"goes on, its events are still in {tmp_path / 'metrics.jsonl'}.\n")


# ----------------------------------------------------------------------------- the lock itself
def test_where_flock_is_refused_an_exclusive_lock_file_names_the_holder(tmp_path, monkeypatch, capsys):
    import fcntl
    import socket

    from zoo.operations.run_lock import Holder, RunDirectoryLock

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    run = tmp_path / "run"
    first = RunDirectoryLock(run).acquire()
    held = json.loads((run / ".zoo.lock").read_text())
    assert (held["host"], held["pid"]) == (socket.gethostname(), os.getpid())
    with pytest.raises(ValueError, match=rf"--save {run} is in use by another run \(process {os.getpid()} on host "):
        RunDirectoryLock(run).acquire()
    first.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []   # lock file and the directory it created: gone

    # a holder on this host that no longer runs: taken over, with a warning naming it
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    run.mkdir()
    stale = Holder(host=socket.gethostname(), pid=int(finished.stdout), since="2026-01-01T00:00:00+00:00")
    (run / ".zoo.lock").write_text(stale.line())
    with RunDirectoryLock(run).acquire():
        assert f"warning: {run / '.zoo.lock'} names process {stale.pid}" in capsys.readouterr().err
        assert json.loads((run / ".zoo.lock").read_text())["pid"] == os.getpid()
    # a holder on another host cannot be checked from here: refused, saying how to clear it
    elsewhere = Holder(host="another-node", pid=1, since="2026-01-01T00:00:00+00:00")
    (run / ".zoo.lock").write_text(elsewhere.line())
    with pytest.raises(ValueError, match=r"process 1 on host another-node, since 2026-01-01T00:00:00\+00:00\); .*"
                                         rf"\(if that run has ended, remove {run / '.zoo.lock'}\)"):
        RunDirectoryLock(run).acquire()


KILLED_HOLDER = """
import sys, time
from zoo.operations.run_lock import RunDirectoryLock
RunDirectoryLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_killed_holders_lock_vanishes_with_it(tmp_path):
    from zoo.operations.run_lock import RunDirectoryLock

    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", KILLED_HOLDER, str(run)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ValueError, match=f"process {holder.pid} on host"):
            RunDirectoryLock(run).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert (run / ".zoo.lock").exists()          # left behind by the killed process, its flock gone with it
    with RunDirectoryLock(run).acquire() as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def test_finetuning_refuses_an_earlier_finetuning_runs_directory(tmp_path):
    from zoo.training.run_directory import claim_finetuning_directory

    (tmp_path / "results.json").write_text("{}\n")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=rf"--save {tmp_path} already holds the results.json of an earlier finetuning "
                                         rf"run; pass another --save, or --overwrite to replace them\."):
        claim_finetuning_directory(tmp_path)
    assert snapshot(tmp_path) == before
    with claim_finetuning_directory(tmp_path, overwrite=True):
        assert not (tmp_path / "results.json").exists()
    with claim_finetuning_directory(tmp_path / "fresh"):
        assert (tmp_path / "fresh" / ".zoo.lock").is_file()
    assert not (tmp_path / "fresh").exists()


# ----------------------------------------------------------------------------- reading metrics
def test_metrics_readers_leave_a_torn_last_line_out_and_name_a_corrupt_one(tmp_path):
    from zoo.training.metrics import plot_loss, read_metrics

    whole = [{"iteration": i, "loss": 5.0 - i} for i in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in whole) + '{"iteration": 4, "lo')
    assert read_metrics(tmp_path) == whole
    assert plot_loss(tmp_path).stat().st_size > 1000
    from zoo.training.metrics import truncate_metrics_after

    truncate_metrics_after(path, 2)
    assert path.read_text() == "".join(json.dumps(e) + "\n" for e in whole[:2])

    path.write_text(json.dumps(whole[0]) + "\n\x00\x00garbage\n" + json.dumps(whole[1]) + "\n")
    with pytest.raises(ValueError, match=rf"{path} line 2 is not a JSON object \('\\x00\\x00garbage'\)"):
        read_metrics(tmp_path)
