"""Ranks do not outlive their launcher, and zoo's launcher waits for every rank's clean stop.

* the launcher watch (:mod:`zoo.operations.launcher_watch`): a process that loses a launcher it was started under
  (even to SIGKILL) is told so within a few checks, or sends itself SIGTERM with no one listening; a
  process whose parent is no launcher watches nothing;
* through the real ``deepspeed`` launcher: ``kill -9`` of the runner alone during a tp=2 pretraining;
  within 30 s no process of the job is alive, every tag under checkpoints/ is complete and ``latest``
  names the checkpoint of the stop, which rank 0 announced as stopped by the launcher's exit;
* through zoo's launcher (launch/run.py): SIGTERM to its whole process group; it returns 75 only after
  every process of the job has exited, and ``latest`` names the stop's checkpoint;
* zoo's launcher over a fake runner (a ``python -c`` script, no DeepSpeed): 75 only when the runner's
  code agrees with the stop report; a process left behind by the job is killed after the grace, a rank
  is waited for beyond it;
* the training loop: a first SIGINT is a checkpointing stop, a second one KeyboardInterrupt; a stop
  report that cannot be written is a warning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.launcher_runs import SLOW_DRIVER, launcher_command, logged_iterations
from tests.helpers.pretraining import NO_DROPOUT, ds_config

REPO = Path(__file__).resolve().parent.parent
ITERS = 200         # 0.5 s each under the slow driver: far more than the 30 s a kill may take
KILL_BOUND_S = 30          # the bound: no rank alive 30 s after the runner was killed
STOPPED_AND_CHECKPOINTED = 75

CHILD = """
import os, signal, sys, time
from zoo.operations.launcher_watch import LauncherWatch

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


GUARDED = """
import os, sys, time
from tqdm import tqdm
from zoo.operations.output_guard import guard_output, keep_output_in
guard_output()
keep_output_in(sys.argv[1])
print("before", flush=True)
open(sys.argv[1] + "/ready", "w").close()
while not os.path.exists(sys.argv[1] + "/broken"):
    time.sleep(0.01)
bar = tqdm(total=3, file=sys.stdout)
for _ in range(3):
    print("a log line", flush=True)
    bar.update(1)
bar.close()
print("an error line", file=sys.stderr, flush=True)
open(sys.argv[1] + "/survived", "w").close()
"""


def test_a_rank_survives_losing_its_stdout_and_stderr(tmp_path):
    """A guarded process whose stdout and stderr pipe loses its reader (sshd closing the session) goes on:
    its progress bar and prints land in the run directory's output-rank<R>.log, and it exits 0."""
    env = dict(os.environ, RANK="3")
    proc = subprocess.Popen([sys.executable, "-c", GUARDED, str(tmp_path)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout.readline() == b"before\n"
    _wait_for(tmp_path / "ready")
    proc.stdout.close()                              # the reader is gone: the next write fails with EPIPE
    (tmp_path / "broken").touch()
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "survived").exists()
    log = (tmp_path / "output-rank3.log").read_text()
    assert "rank 3: the launcher's stdout/stderr pipe broke (EPIPE)" in log
    assert log.count("a log line") >= 2 and "an error line" in log and "3/3" in log, log


def test_pdsh_and_ssh_are_no_per_node_launchers():
    """pdsh and ssh carry the per-node launcher's command line as arguments; only the interpreter running
    the module is the launcher (zoo's rank finder signalled the ssh clients as ranks)."""
    from zoo.operations.launcher_watch import runs_module

    python = "/venv/bin/python"
    launch = [python, "-u", "-m", "deepspeed.launcher.launch", "--world_info=x", "--node_rank=%n"]
    assert runs_module(launch, "deepspeed.launcher.launch")
    assert not runs_module(["pdsh", "-S", "-f", "1024", "-w", "a,b", "export A=1;", "cd /x;", *launch],
                           "deepspeed.launcher.launch")
    assert not runs_module(["ssh", "-2", "a", " ".join(launch)], "deepspeed.launcher.launch")
    assert not runs_module([python, "script.py", "-m", "deepspeed.launcher.launch"], "deepspeed.launcher.launch")


def test_a_process_under_no_launcher_watches_nothing():
    from zoo.operations.launcher_watch import LAUNCHER_PID_VARIABLE, is_launcher

    env = {key: value for key, value in os.environ.items() if key != LAUNCHER_PID_VARIABLE}
    found = subprocess.run([sys.executable, "-c", "from zoo.operations.launcher_watch import launcher_ancestors, "
                            "watch_launchers; print(launcher_ancestors(), watch_launchers())"],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert found.stdout.split() == ["[]", "None"], found.stderr   # its parent, pytest, is no launcher
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
    while max(logged_iterations(run), default=0) < iteration:
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
    """Every tag directory under ``checkpoints``: whether it is a complete checkpoint (its save's marker)."""
    from zoo.checkpoint.files import tags_in

    complete = tags_in(checkpoints)
    return {tag.name: tag.name in complete for tag in checkpoints.glob("iter_*")}


def test_killing_the_deepspeed_runner_stops_every_rank(corpus_prefix, tmp_path):
    import psutil

    config = _config(tmp_path)
    run = tmp_path / "run"
    proc, out, err = _start(launcher_command(str(tmp_path / "slow_pretrain.py"), config, corpus_prefix, run), tmp_path)
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
    reached = max(logged_iterations(run))
    assert 2 <= reached < ITERS
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text() == f"iter_{reached:07d}", out.read_text()[-3000:]
    assert _complete_tags(checkpoints) == {f"iter_{reached:07d}": True}
    assert (f"stopped by the exit of the launcher (pid {proc.pid}, deepspeed) after iteration {reached}"
            in out.read_text()), out.read_text()[-3000:]


def test_zoo_launcher_returns_75_after_every_rank_stopped_on_sigterm(corpus_prefix, tmp_path):
    import psutil

    config = _config(tmp_path)
    run = tmp_path / "run"
    cmd = [sys.executable, "launch/run.py", *launcher_command(str(tmp_path / "slow_pretrain.py"), config, corpus_prefix,
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
    reached = max(logged_iterations(run))
    assert (run / "checkpoints" / "latest").read_text() == f"iter_{reached:07d}"
    assert _complete_tags(run / "checkpoints") == {f"iter_{reached:07d}": True}
    assert f"stopped by signal SIGTERM after iteration {reached}" in err.read_text(), err.read_text()[-3000:]


# ------------------------------------------------------------------------ zoo's launcher, fake runners

LAUNCHER = """
import sys
from zoo.operations.launcher import run
print("code", run([], runner_command=[sys.executable, "-c", sys.argv[1]], orphan_grace_s=float(sys.argv[2])),
      flush=True)
"""
REPORT = ("import os, signal, sys\n"
          "from zoo.operations.stop_report import report_stop\n"
          "assert report_stop('signal SIGTERM', 7)\n")


def _fake_job(runner: str, grace_s: float, timeout_s: float = 120) -> tuple[int, str, str]:
    """zoo's launcher (in a fresh process: it becomes a subreaper) over ``runner``: its result, stdout
    and stderr. Whatever the job leaves is killed afterwards. ``timeout_s`` only guards against a hang: the
    launcher and a rank each import torch (the store), which takes tens of seconds on 2 busy cores."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, runner, str(grace_s)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        for left in psutil.Process(proc.pid).children(recursive=True) if psutil.pid_exists(proc.pid) else []:
            left.kill()
        _kill_group(proc)
        proc.wait()
    codes = [line.split()[1] for line in out.splitlines() if line.startswith("code ")]
    assert codes, (out, err)
    return int(codes[0]), out, err


def test_zoo_launcher_returns_75_only_when_the_runners_code_agrees_with_the_report():
    assert _fake_job(REPORT + "sys.exit(0)", 5)[0] == STOPPED_AND_CHECKPOINTED
    assert _fake_job(REPORT + "os.kill(os.getpid(), signal.SIGTERM)", 5)[0] == STOPPED_AND_CHECKPOINTED
    assert _fake_job(REPORT + "raise KeyboardInterrupt", 5)[0] == STOPPED_AND_CHECKPOINTED   # Ctrl-C
    code, _, err = _fake_job(REPORT + "sys.exit(1)", 5)    # a rank failed after the report
    assert code == 1, err
    assert ("zoo launcher: the run saved a checkpoint after iteration 7 when stopped by signal SIGTERM, "
            "but then failed; exit code 1 (DeepSpeed's runner's)") in err
    assert _fake_job("import sys; sys.exit(3)", 5)[0] == 3


def test_zoo_launcher_kills_what_outlives_the_job_after_the_grace():
    import psutil

    runner = "import subprocess; print(subprocess.Popen(['sleep', '1000']).pid, flush=True)"
    code, out, err = _fake_job(runner, 1)
    orphan = int(out.split()[0])
    assert code == 0, err
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    assert (f"zoo launcher: killed 1 process(es) of the job still running 1 s after its last rank exited: "
            f"pid {orphan} (sleep 1000)") in err


def test_zoo_launcher_waits_for_a_rank_beyond_the_grace(tmp_path):
    rank = REPORT.replace("import os", "import time, os").replace("assert", "time.sleep(3.5); assert", 1)
    # a per-node launcher as the process table shows it: `python -m deepspeed.launcher.launch`, here a
    # stand-in module on PYTHONPATH; it exits first, so its rank is orphaned, still writing
    package = tmp_path / "deepspeed" / "launcher"
    package.mkdir(parents=True)
    for init in (tmp_path / "deepspeed", package):
        (init / "__init__.py").write_text("")
    (package / "launch.py").write_text("import subprocess, sys, time\n"
                                       "subprocess.Popen([sys.executable, '-c', sys.argv[1]])\ntime.sleep(1.5)\n")
    env = f"dict(os.environ, PYTHONPATH={str(tmp_path)!r} + os.pathsep + {str(REPO)!r})"
    runner = (f"import os, subprocess, sys; subprocess.Popen([sys.executable, '-m', 'deepspeed.launcher.launch', "
              f"{rank!r}], env={env})")
    code, _, err = _fake_job(runner, 0.5)
    assert code == STOPPED_AND_CHECKPOINTED, err
    assert "killed" not in err


# --------------------------------------------------------------------------------- the training loop

def test_a_first_sigint_stops_the_loop_cleanly_and_a_second_interrupts():
    from zoo.training.stop_conditions import StopConditions

    stop = StopConditions()
    stop.install()
    try:
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pytest.fail("a first SIGINT interrupted the loop instead of stopping it with a checkpoint")
        assert stop.received == ["signal SIGINT"]
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        stop.uninstall()


def test_a_stop_report_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch, capsys):
    from zoo.training.loop import LoopState, TrainingLoop
    from zoo.training.stop_conditions import StopConditions

    saved = []

    class RecordingCheckpointer:
        def is_save_step(self, iteration: int) -> bool:
            return False

        def save(self, state: LoopState) -> None:
            saved.append(state)

    from tests.spawn import free_port

    monkeypatch.setenv("ZOO_LAUNCHER_STORE", f"127.0.0.1:{free_port()}")    # no launcher listens there
    monkeypatch.setattr("zoo.operations.stop_report.CONNECT_TIMEOUT_S", 0.5)
    state = LoopState(iteration=5, stopped_by="signal SIGTERM")
    TrainingLoop(None, None, None, checkpointer=RecordingCheckpointer(), stop=StopConditions(),
                 is_writer=True).maybe_save(state)
    assert saved == [state]
    assert ("warning: the checkpoint of iteration 5 is saved, but the stop report for zoo's launcher could not "
            "be written") in capsys.readouterr().err
