"""Ranks do not outlive their launcher, and zoo's launcher waits for every rank's clean stop.

* the launcher watch (:mod:`zoo.launcher_watch`): a process that loses a launcher it was started under
  (even to SIGKILL) is told so within a few checks, or sends itself SIGTERM with no one listening; a
  process whose parent is no launcher watches nothing;
* through the real ``deepspeed`` launcher: ``kill -9`` of the runner alone during a tp=2 pretraining;
  within 30 s no process of the job is alive, every tag under checkpoints/ is complete and ``latest``
  names the checkpoint of the stop, which rank 0 announced as stopped by the launcher's exit;
* through zoo's launcher (launch/run.py): SIGTERM to its whole process group; it returns 75 only after
  every process of the job has exited, and ``latest`` names the stop's checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.test_preemption import SLOW_DRIVER, _launcher, _logged_iterations
from tests.test_pretrain import NO_DROPOUT, corpus_prefix, ds_config  # noqa: F401

REPO = Path(__file__).resolve().parent.parent
ITERS = 200         # 0.5 s each under the slow driver: far more than the 30 s a kill may take
KILL_BOUND_S = 30          # the bound: no rank alive 30 s after the runner was killed
STOPPED_AND_CHECKPOINTED = 75

CHILD = """
import os, signal, sys, time
from zoo.launcher_watch import LauncherWatch

def write_and_exit(reason):
    with open(sys.argv[2], "w") as marker:
        marker.write(reason)
    os._exit(0)

watch = LauncherWatch([os.getppid()], interval_s=0.05)
if sys.argv[1] == "listen":
    watch.listen(write_and_exit)
else:                                    # what ended the process: SIGTERM, sent by the watch
    signal.signal(signal.SIGTERM, lambda signum, frame: write_and_exit(signal.Signals(signum).name))
watch.start()
open(sys.argv[2] + ".ready", "w").close()
time.sleep(60)
"""


def _wait_for(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _orphan_child(mode: str, marker: Path) -> tuple[subprocess.Popen, int]:
    """A middle process that starts the watching child and is then killed with SIGKILL; the child's pid."""
    middle = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "p = subprocess.Popen(sys.argv[1:]); print(p.pid, flush=True); time.sleep(60)",
                               sys.executable, "-c", CHILD, mode, str(marker)], stdout=subprocess.PIPE, text=True)
    child = int(middle.stdout.readline())
    _wait_for(Path(str(marker) + ".ready"))
    middle.kill()
    middle.wait()
    return middle, child


def test_a_watch_reports_its_launchers_exit_to_its_listener(tmp_path):
    import psutil

    marker = tmp_path / "reason"
    middle, child = _orphan_child("listen", marker)
    _wait_for(marker, 30)
    assert marker.read_text() == f"the exit of the launcher (pid {middle.pid})"
    if psutil.pid_exists(child):
        psutil.wait_procs([psutil.Process(child)], timeout=30)


def test_a_watch_without_listener_ends_its_process_with_sigterm(tmp_path):
    marker = tmp_path / "reason"
    _orphan_child("alone", marker)
    _wait_for(marker, 30)
    assert marker.read_text() == "SIGTERM"


def test_a_process_under_no_launcher_watches_nothing():
    from zoo.launcher_watch import is_launcher, launcher_ancestors, watch_launchers

    assert launcher_ancestors() == []                      # pytest's parent is a shell or a runner, no launcher
    assert watch_launchers() is None
    assert is_launcher(5, ["python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=x"], None)
    assert is_launcher(5, ["/venv/bin/python", "/venv/bin/deepspeed", "--num_gpus", "2", "x.py"], None)
    assert is_launcher(5, ["python", "launch/run.py", "--num_gpus", "2"], None)
    assert is_launcher(5, ["bash"], 5)
    assert not is_launcher(5, ["python", "finetune/run.py"], None)
    assert not is_launcher(5, ["python", "-m", "pytest", "tests/test_launcher_stop.py"], None)


# ------------------------------------------------------------------------------------ through launchers

def _config(tmp_path: Path) -> Path:
    config = dict(ds_config(2, 4), zoo={"tensor_parallel_size": 2, "model": "gpt2-tiny", "seq_length": 32,
                                        "train_iters": ITERS, "split": "80,20,0", "log_interval": 1,
                                        "eval_interval": 0, "save_interval": 0, "model_overrides": NO_DROPOUT})
    config["scheduler"]["params"]["total_num_steps"] = ITERS
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    (tmp_path / "slow_pretrain.py").write_text(SLOW_DRIVER)
    return path


def _start(cmd: list[str], tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=stdout, stderr=stderr, start_new_session=True)
    return proc, out, err


def _wait_for_iteration(proc: subprocess.Popen, run: Path, iteration: int, err: Path) -> None:
    deadline = time.monotonic() + 300
    while max(_logged_iterations(run), default=0) < iteration:
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.05)


def _job(root: int):
    import psutil

    return psutil.Process(root).children(recursive=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _complete_tags(checkpoints: Path) -> dict[str, bool]:
    return {tag.name: all((tag / f"mp_rank_{r:02d}_model_states.pt").is_file() for r in range(2))
            for tag in checkpoints.glob("iter_*")}


def test_killing_the_deepspeed_runner_stops_every_rank(corpus_prefix, tmp_path):  # noqa: F811
    import psutil

    config = _config(tmp_path)
    run = tmp_path / "run"
    proc, out, err = _start(_launcher(str(tmp_path / "slow_pretrain.py"), config, corpus_prefix, run), tmp_path)
    try:
        _wait_for_iteration(proc, run, 2, err)
        job = _job(proc.pid)
        ranks = [p for p in job if "deepspeed.launcher.launch" in p.parent().cmdline()]
        assert len(ranks) == 2, [p.cmdline() for p in job]
        killed = time.monotonic()
        proc.kill()                              # the `deepspeed` runner alone, with SIGKILL
        proc.wait()
        _, alive = psutil.wait_procs(job, timeout=KILL_BOUND_S)
        seconds = time.monotonic() - killed
    finally:
        _kill_group(proc)
    assert not alive, ([p.cmdline() for p in alive], err.read_text()[-3000:])
    print(f"kill -9 of the deepspeed runner to the last process of the job gone: {seconds:.1f} s")
    reached = max(_logged_iterations(run))
    assert 2 <= reached < ITERS
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text() == f"iter_{reached:07d}", out.read_text()[-3000:]
    assert _complete_tags(checkpoints) == {f"iter_{reached:07d}": True}
    assert (f"stopped by the exit of the launcher (pid {proc.pid}, deepspeed) after iteration {reached}"
            in out.read_text()), out.read_text()[-3000:]


def test_zoo_launcher_returns_75_after_every_rank_stopped_on_sigterm(corpus_prefix, tmp_path):  # noqa: F811
    import psutil

    config = _config(tmp_path)
    run = tmp_path / "run"
    cmd = [sys.executable, "launch/run.py", *_launcher(str(tmp_path / "slow_pretrain.py"), config, corpus_prefix,
                                                       run)[1:]]
    proc, out, err = _start(cmd, tmp_path)
    try:
        _wait_for_iteration(proc, run, 2, err)
        job = _job(proc.pid)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)      # what scancel or a supervisor sends
        code = proc.wait(timeout=120)
        print(f"SIGTERM to the group to zoo's launcher returning {code}: {time.monotonic() - sent:.1f} s")
        alive_after = [p for p in job if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        _kill_group(proc)
    assert code == STOPPED_AND_CHECKPOINTED, (code, err.read_text()[-3000:])
    assert not alive_after, [p.cmdline() for p in alive_after]
    reached = max(_logged_iterations(run))
    assert (run / "checkpoints" / "latest").read_text() == f"iter_{reached:07d}"
    assert _complete_tags(run / "checkpoints") == {f"iter_{reached:07d}": True}
    assert f"stopped by signal SIGTERM after iteration {reached}" in err.read_text(), err.read_text()[-3000:]
