"""zoo's launcher: DeepSpeed's ``deepspeed`` runner, waited for to the last rank.

    python launch/run.py --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json

(the command is :mod:`zoo.cli.run`, also ``python -m zoo.cli.run`` with the same arguments) takes exactly ``deepspeed``'s arguments and runs
DeepSpeed's runner as its child. What it adds is what a scheduler that waits on the job's first process
needs:

* SIGTERM to the job's whole process group (``scancel``, a batch system, a supervisor) makes the plain
  ``deepspeed`` command return at once (rc -15) while the ranks are still writing their checkpoint. This
  launcher is a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): every process of the job that loses
  its parent becomes its child, and it returns only after every one of them has exited. It waits
  without limit while the runner, a per-node launcher or a rank lives (a rank may be writing its
  checkpoint); what outlives the last of them (a W&B service, a stuck DataLoader worker) gets
  :data:`ORPHAN_GRACE_S` (30 s), then SIGKILL, named in one line on stderr;
* a SIGTERM, SIGINT or SIGUSR1 sent to this process alone reaches the ranks (the processes DeepSpeed's
  per-node launcher started) as SIGTERM (SIGUSR1 as SIGUSR1): they stop at the next iteration boundary
  with a checkpoint. When the whole group was signalled they receive it twice, which changes nothing.
  Before any rank has started, every process of the job gets SIGTERM instead;
* its exit code says how the job ended:

  - :data:`STOPPED_AND_CHECKPOINTED` (75, ``EX_TEMPFAIL`` of sysexits.h): the run stopped before its last
    iteration (a signal, its launcher's exit, ``--exit-interval``, ``--exit-duration-in-mins``) and
    ``latest`` names the checkpoint of that stop: resubmit with ``--load`` the same run directory. Only
    when the runner's code agrees (:func:`stopped_cleanly`): 0, or death by the signal sent to the
    group (SIGTERM, or the SIGINT of a Ctrl-C); a rank that fails after the report was written (the
    final barrier, teardown) gets its failure code, with a line saying the checkpoint is there;
  - otherwise the runner's own code (0 when the run finished; DeepSpeed's code of a failed rank, 2 for a
    user error; 128 + N when the runner itself was killed by signal N).

The ranks tell it through the file ``$ZOO_STOP_REPORT`` (:mod:`zoo.stop_report`), which the training loop's
writer rank writes only after the stop's ``latest``; ``$ZOO_LAUNCHER_PID`` names this process to the
ranks' launcher watch (:mod:`zoo.launcher_watch`), so that killing it (even with SIGKILL) also stops them.
The report is a file on this host, so the code 75 is a single-node guarantee: DeepSpeed's multi-node
runners pass only some variables to the other hosts (not these two), and there the runner's code is
returned.

DeepSpeed's per-node launcher, when it gets SIGTERM itself, gives its ranks 30 s to exit and then kills
them; a stop whose checkpoint takes longer needs the signal sent to this process alone (``scancel
--signal=TERM --batch``, ``kill <pid>``), which the per-node launcher never sees.

Ctrl-C in the launcher's terminal sends SIGINT to the whole foreground group: the ranks take a first
SIGINT as the same checkpointing stop as SIGTERM (with the per-node launcher's 30 s), and the launcher
returns 75 once ``latest`` names it; a second Ctrl-C is the immediate stop, without checkpoint.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from zoo.launcher_watch import LAUNCHER_PID_VARIABLE, command_line, parent_of
from zoo.stop_report import STOP_REPORT_VARIABLE, read_stop_report

__all__ = ["run", "wait_for_job", "stopped_cleanly", "STOPPED_AND_CHECKPOINTED", "ORPHAN_GRACE_S"]

STOPPED_AND_CHECKPOINTED = 75          # EX_TEMPFAIL: stopped early, checkpointed; run it again to go on
PR_SET_CHILD_SUBREAPER = 36
PER_NODE_LAUNCHER = "deepspeed.launcher.launch"
RUNNER_COMMAND = (sys.executable, "-m", "deepspeed.launcher.runner")
ORPHAN_GRACE_S = 30.0     # what a process of the job may outlive the last rank by (a W&B service's upload)
POLL_S = 0.5               # a rank lives far longer than this: it is seen under its per-node launcher
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


def process_start(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``): with the pid, it names one
    process even after the pid is reused. None when ``pid`` no longer exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def ranks_of(root: int, job: list[int] | None = None) -> list[int]:
    """The ranks below ``root``: the processes whose parent is DeepSpeed's per-node launcher. ``job`` is
    :func:`descendants` of ``root`` when the caller has it (one pass over the process table either way)."""
    job = descendants(root) if job is None else job
    launchers = {pid for pid in job if PER_NODE_LAUNCHER in command_line(pid)}
    return [pid for pid in job if parent_of(pid) in launchers]


def forward_to_ranks(signum: int) -> None:
    """Send the ranks below this process the signal that stops them cleanly for ``signum``. Before any
    rank exists there is nothing to checkpoint: every process of the job gets SIGTERM, and ends."""
    job = descendants(os.getpid())
    targets = ranks_of(os.getpid(), job)
    if not targets:
        targets, signum = job, signal.SIGTERM
    for pid in targets:
        try:
            os.kill(pid, FORWARDED[signum])
        except ProcessLookupError:
            pass


def reap_finished(statuses: dict[int, int]) -> bool:
    """Reap every child of this process that has exited, recording its exit code (negative: killed by
    that signal) in ``statuses``; False once this process has no child left at all."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        statuses[pid] = os.waitstatus_to_exitcode(status)


def kill_orphans(job: list[int], grace_s: float) -> None:
    """SIGKILL the processes ``job`` still holds once no rank is left, and say so in one line."""
    named = []
    for pid in job:
        name = " ".join(command_line(pid))[:80]
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        named.append(f"pid {pid} ({name})")
    if named:
        print(f"zoo launcher: killed {len(named)} process(es) of the job still running {grace_s:g} s after its "
              f"last rank exited: {', '.join(named)}", file=sys.stderr, flush=True)


def wait_for_job(runner: subprocess.Popen, orphan_grace_s: float = ORPHAN_GRACE_S) -> int:
    """Wait for the runner and every process of the job (as a subreaper, orphaned descendants are this
    process's children); the runner's exit code.

    While the runner, a per-node launcher or a rank (a process seen as a child of a per-node launcher,
    identified by pid and start time) lives, it waits without limit: a rank may be writing its
    checkpoint. Processes left after that (a W&B service, a stuck DataLoader worker, anything a rank
    started and left behind) get ``orphan_grace_s``, then SIGKILL (:func:`kill_orphans`)."""
    statuses: dict[int, int] = {}
    ranks: set[tuple[int, int | None]] = set()
    idle_since: float | None = None
    while reap_finished(statuses):
        job = descendants(os.getpid())
        ranks.update((pid, process_start(pid)) for pid in ranks_of(os.getpid(), job))
        holding = runner.pid not in statuses or any(
            PER_NODE_LAUNCHER in command_line(pid) or (pid, process_start(pid)) in ranks for pid in job)
        if holding:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= orphan_grace_s:
            kill_orphans(job, orphan_grace_s)
            idle_since = None
        time.sleep(POLL_S)
    code = statuses.get(runner.pid, runner.returncode)
    runner.returncode = code
    return code


def run(argv: list[str], runner_command: Sequence[str] = RUNNER_COMMAND,
        orphan_grace_s: float = ORPHAN_GRACE_S) -> int:
    """Run DeepSpeed's runner (``runner_command``, the program and its first arguments) on ``argv``
    (``deepspeed``'s arguments), wait for every process of the job and return the exit code documented
    in the module."""
    become_subreaper()
    with tempfile.TemporaryDirectory(prefix="zoo-launcher-") as scratch:
        report = Path(scratch) / "stop.json"
        env = dict(os.environ, **{STOP_REPORT_VARIABLE: str(report), LAUNCHER_PID_VARIABLE: str(os.getpid())})
        previous = {signum: signal.signal(signum, lambda signum, frame: forward_to_ranks(signum))
                    for signum in FORWARDED}
        try:
            runner = subprocess.Popen([*runner_command, *argv], env=env)
            runner_code = wait_for_job(runner, orphan_grace_s)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        stopped = read_stop_report(report)
    if stopped is not None and stopped_cleanly(runner_code):
        print(f"zoo launcher: the run stopped by {stopped['stopped_by']} after iteration {stopped['iteration']} "
              f"with a checkpoint; exit code {STOPPED_AND_CHECKPOINTED}", file=sys.stderr, flush=True)
        return STOPPED_AND_CHECKPOINTED
    if stopped is not None:
        print(f"zoo launcher: the run saved a checkpoint after iteration {stopped['iteration']} when stopped by "
              f"{stopped['stopped_by']}, but then failed; exit code {runner_code} (DeepSpeed's runner's)",
              file=sys.stderr, flush=True)
    return runner_code


def stopped_cleanly(runner_code: int) -> bool:
    """Whether the job ended as its stop report says, given the runner's exit code: 0 (every rank
    exited 0), or negative: the runner itself died by the signal sent to the whole group (SIGTERM; or
    SIGINT, of which Python re-raises an unhandled KeyboardInterrupt). A positive code is a rank that
    failed after the report was written (the final barrier, teardown)."""
    return runner_code <= 0
