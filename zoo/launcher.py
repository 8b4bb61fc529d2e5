"""zoo's launcher: DeepSpeed's ``deepspeed`` runner, waited for to the last rank.

    python launch/run.py --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json

takes exactly ``deepspeed``'s arguments and runs DeepSpeed's runner as its child. What it adds is what a
scheduler that waits on the job's first process needs:

* SIGTERM to the job's whole process group (``scancel``, a batch system, a supervisor) makes the plain
  ``deepspeed`` command return at once (rc -15) while the ranks are still writing their checkpoint. This
  launcher is a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): every process of the job that loses
  its parent becomes its child, and it returns only after every one of them has exited;
* a SIGTERM, SIGINT or SIGUSR1 sent to this process alone reaches the ranks (the processes DeepSpeed's
  per-node launcher started) as SIGTERM (SIGUSR1 as SIGUSR1): they stop at the next iteration boundary
  with a checkpoint. When the whole group was signalled they receive it twice, which changes nothing.
  Before any rank has started, every process of the job gets SIGTERM instead;
* its exit code says how the job ended:

  - :data:`STOPPED_AND_CHECKPOINTED` (75, ``EX_TEMPFAIL`` of sysexits.h): the run stopped before its last
    iteration (a signal, its launcher's exit, ``--exit-interval``, ``--exit-duration-in-mins``) and
    ``latest`` names the checkpoint of that stop: resubmit with ``--load`` the same run directory;
  - otherwise the runner's own code (0 when the run finished; DeepSpeed's code of a failed rank, 2 for a
    user error; a negative one when the runner itself was killed by a signal).

The ranks tell it through the file ``$ZOO_STOP_REPORT`` (:mod:`zoo.stop_report`), which the training loop's
writer rank writes only after the stop's ``latest``; ``$ZOO_LAUNCHER_PID`` names this process to the
ranks' launcher watch (:mod:`zoo.launcher_watch`), so that killing it (even with SIGKILL) also stops them.
The report is a file on this host, so the code 75 is a single-node guarantee: DeepSpeed's multi-node
runners pass only some variables to the other hosts (not these two), and there the runner's code is
returned.

DeepSpeed's per-node launcher, when it gets SIGTERM itself, gives its ranks 30 s to exit and then kills
them; a stop whose checkpoint takes longer needs the signal sent to this process alone (``scancel
--signal=TERM --batch``, ``kill <pid>``), which the per-node launcher never sees.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from zoo.launcher_watch import LAUNCHER_PID_VARIABLE, command_line, parent_of
from zoo.stop_report import STOP_REPORT_VARIABLE, read_stop_report

__all__ = ["main", "run", "STOPPED_AND_CHECKPOINTED"]

STOPPED_AND_CHECKPOINTED = 75          # EX_TEMPFAIL: stopped early, checkpointed; run it again to go on
PR_SET_CHILD_SUBREAPER = 36
PER_NODE_LAUNCHER = "deepspeed.launcher.launch"
FORWARDED = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGTERM, signal.SIGUSR1: signal.SIGUSR1}


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where that is not possible."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list[int]:
    """The pids of every process below ``root``, from ``/proc`` (one pass over the process table)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = parent_of(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [root]
    while frontier:
        below = children.get(frontier.pop(), [])
        found.extend(below)
        frontier.extend(below)
    return found


def ranks_of(root: int) -> list[int]:
    """The ranks below ``root``: the processes whose parent is DeepSpeed's per-node launcher."""
    launchers = {pid for pid in descendants(root) if PER_NODE_LAUNCHER in command_line(pid)}
    return [pid for pid in descendants(root) if parent_of(pid) in launchers]


def forward_to_ranks(signum: int) -> None:
    """Send the ranks below this process the signal that stops them cleanly for ``signum``. Before any
    rank exists there is nothing to checkpoint: every process of the job gets SIGTERM, and ends."""
    targets = ranks_of(os.getpid())
    if not targets:
        targets, signum = descendants(os.getpid()), signal.SIGTERM
    for pid in targets:
        try:
            os.kill(pid, FORWARDED[signum])
        except ProcessLookupError:
            pass


def reap_everything() -> None:
    """Wait until this process has no child left (orphaned descendants are its children as a subreaper)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def run(argv: list[str]) -> int:
    """Run DeepSpeed's runner on ``argv`` (``deepspeed``'s arguments), wait for every process of the job
    and return the exit code documented in the module."""
    become_subreaper()
    with tempfile.TemporaryDirectory(prefix="zoo-launcher-") as scratch:
        report = Path(scratch) / "stop.json"
        env = dict(os.environ, **{STOP_REPORT_VARIABLE: str(report), LAUNCHER_PID_VARIABLE: str(os.getpid())})
        previous = {signum: signal.signal(signum, lambda signum, frame: forward_to_ranks(signum))
                    for signum in FORWARDED}
        try:
            runner = subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", *argv], env=env)
            runner_code = runner.wait()
            reap_everything()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        stopped = read_stop_report(report)
    if stopped is not None:
        print(f"zoo launcher: the run stopped by {stopped['stopped_by']} after iteration {stopped['iteration']} "
              f"with a checkpoint; exit code {STOPPED_AND_CHECKPOINTED}", file=sys.stderr, flush=True)
        return STOPPED_AND_CHECKPOINTED
    return runner_code


def main(argv: list[str] | None = None) -> None:
    code = run(sys.argv[1:] if argv is None else argv)
    sys.exit(code if code >= 0 else 128 - code)
