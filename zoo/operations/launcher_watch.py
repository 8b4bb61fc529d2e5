"""Ranks do not outlive their launcher, on any node.

``deepspeed`` (the runner) starts ``python -m deepspeed.launcher.launch`` on each node (locally, or through
pdsh and ssh on other nodes), which starts the ranks. Killing the runner alone (``kill -9``, or ``kill
-TERM``, which it does not handle on one node) leaves the per-node launchers and every rank running: they
would train on and write checkpoints into a run directory whose job has ended. A rank therefore watches,
from a daemon thread (:class:`LauncherWatch`, one check a second, a few ``/proc`` reads):

* the launchers above it, as they were when it started: the consecutive ancestors, from the parent up,
  that are a launcher: DeepSpeed's per-node launcher or runner, torchrun, or zoo's own wrapper
  (:mod:`zoo.operations.launcher`, named by ``$ZOO_LAUNCHER_PID``). A process whose parent is none of these (a test
  harness, a shell, ``wandb agent``, ``nohup``) watches nothing: its parent's exit is not a reason to stop;
* on the node where a multi-node runner runs, the job's head: a per-node launcher started over ssh is no
  descendant of the runner, so the rank finds the job's pdsh by its arguments (:func:`job_head`) and
  watches it and the launchers above it. One rank that sees the runner go is enough: the training loop's
  stop agreement stops every rank of every node at the same iteration;
* zoo's launcher, when it started the job (``$ZOO_LAUNCHER_STORE``, :mod:`zoo.operations.stop_report`), on any node:
  its stop request, and its exit (the store's connection fails);
* a launcher is gone when a link recorded at start-up breaks: this process's parent changed, or a
  launcher's parent did (the kernel reparents the children of a process that exits);
* then a listener, when one is set (:class:`zoo.operations.stop_requests.StopRequests`, which a pretraining
  installs for its whole process), turns it into the same clean stop as SIGTERM: a
  checkpoint at the next iteration boundary, then the exit; with no listener the process sends itself
  SIGTERM, which ends it at once unless its handler records it.

A rank under a launcher also survives losing its stdout and stderr (:mod:`zoo.operations.output_guard`).
What runs on a node where no rank of the job runs (a runner on a login node) is seen only through zoo's
launcher's store.

This module imports nothing from zoo but :mod:`zoo.operations.output_guard` and :mod:`zoo.operations.stop_report`: every layer
may use it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from zoo.operations.output_guard import guard_output
from zoo.operations.stop_report import LauncherLink, store_address

__all__ = ["LauncherWatch", "LAUNCHER_PID_VARIABLE", "watch_launchers", "current_watch", "launcher_ancestors",
           "parent_of", "command_line"]

LAUNCHER_PID_VARIABLE = "ZOO_LAUNCHER_PID"   # zoo's wrapper names itself to every process it starts
THREAD_NAME = "zoo-launcher-watch"
CHECK_INTERVAL_S = 1.0

# How a launcher shows in /proc/<pid>/cmdline: modules run with -m, and scripts by their file name.
LAUNCHER_MODULES = ("deepspeed.launcher.launch", "deepspeed.launcher.runner", "torch.distributed.run",
                    "zoo.cli.run")
LAUNCHER_SCRIPTS = ("deepspeed", "ds", "torchrun", "run.py")
PER_NODE_MODULE = "deepspeed.launcher.launch"


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from ``/proc/<pid>/stat``; None when ``pid`` no longer exists (or is a
    zombie, which has exited already)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()   # the command name may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else int(fields[1])


def command_line(pid: int) -> list[str]:
    """The arguments ``pid`` was started with ([] when unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def runs_module(argv: Sequence[str], module: str) -> bool:
    """Whether ``argv`` is a Python interpreter running ``module`` (``python [options] -m module ...``).
    A program that only carries such a command line as its arguments (pdsh, ssh, a shell) does not."""
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return False
    index = 1
    while index < len(argv) - 1 and argv[index].startswith("-"):
        if argv[index] == "-m":
            return argv[index + 1] == module
        index += 2 if argv[index] in ("-X", "-W") else 1
    return False


def is_launcher(pid: int, argv: Sequence[str], wrapper_pid: int | None) -> bool:
    """Whether ``pid`` (started as ``argv``) is a launcher of ranks: zoo's wrapper, DeepSpeed's runner or
    per-node launcher, or torchrun. ``run.py`` counts only as zoo's ``launch/run.py``."""
    if wrapper_pid is not None and pid == wrapper_pid:
        return True
    if any(runs_module(argv, module) for module in LAUNCHER_MODULES):
        return True
    for arg in argv[:2]:     # the program, or the script an interpreter runs
        name = os.path.basename(arg)
        if name in LAUNCHER_SCRIPTS and (name != "run.py" or os.path.basename(os.path.dirname(arg)) == "launch"):
            return True
    return False


def launcher_ancestors(pid: int | None = None, environ: dict[str, str] | None = None) -> list[int]:
    """The launchers above ``pid`` (this process), nearest first: its parent, its grandparent, ... while
    each is a launcher (:func:`is_launcher`); empty when the parent is not one."""
    environ = os.environ if environ is None else environ
    wrapper = environ.get(LAUNCHER_PID_VARIABLE, "")
    wrapper_pid = int(wrapper) if wrapper.isdigit() else None
    chain: list[int] = []
    current = parent_of(os.getpid() if pid is None else pid)
    while current is not None and current > 1 and is_launcher(current, command_line(current), wrapper_pid):
        chain.append(current)
        current = parent_of(current)
    return chain


class LauncherWatch(threading.Thread):
    """A daemon thread that checks every ``interval_s`` that this process's launchers are all there and
    that zoo's launcher, when it started the job, neither asked for a stop nor went away.

    ``chain`` are the launchers above this process, nearest first (:func:`launcher_ancestors`); ``head``
    the job's multi-node runner on this node, when this rank's per-node launcher came over ssh
    (:func:`job_head`: pdsh, then the launchers above it); ``link`` None, or an
    ``(host, port)`` of zoo's launcher's store (:mod:`zoo.operations.stop_report`), connected from this thread.

    ``exited`` is None until the watch fires, then the reason: a phrase naming the launcher found gone
    ("the exit of the launcher (pid 123, deepspeed)"), or the stop zoo's launcher asked for ("signal
    SIGTERM"). At that moment the watch calls its listener with it, or, with none set, sends this process
    SIGTERM (whose default action ends it). It stops after firing."""

    def __init__(self, chain: Sequence[int], interval_s: float = CHECK_INTERVAL_S, head: Sequence[int] = (),
                 link: tuple[str, int] | None = None):
        super().__init__(name=THREAD_NAME, daemon=True)
        self.chain = list(chain)
        self.head = list(head)
        self.names = {pid: launcher_name(command_line(pid)) for pid in self.chain + self.head[1:]}
        self.names.update({pid: os.path.basename(command_line(pid)[0]) for pid in self.head[:1]})   # pdsh
        self.interval_s = interval_s
        self.link_address = link
        self.exited: str | None = None
        self.listener: Callable[[str], None] | None = None
        self._stopped = threading.Event()

    def listen(self, listener: Callable[[str], None] | None) -> None:
        """Hand the watch's reason to ``listener`` from now on (None: end the process with SIGTERM); a
        listener set after the watch fired is called at once."""
        self.listener = listener
        if listener is not None and self.exited is not None:
            listener(self.exited)

    def links(self) -> list[tuple[int, int]]:
        """The (child, parent) pairs recorded at start-up: this process and its launchers, then the head."""
        chain = list(zip([os.getpid(), *self.chain], self.chain))
        return chain + list(zip(self.head, self.head[1:]))

    def gone(self) -> int | None:
        """The pid of the nearest watched launcher that has exited, or None while all are there.

        Only the recorded links are checked (a child's parent changes when its parent exits), and that
        the topmost launchers still exist, never their parents (a shell that exits under ``nohup
        deepspeed ...`` ends nothing)."""
        for child, parent in self.links():
            now = parent_of(child)
            if now != parent:
                return child if now is None else parent
        for top in (self.chain[-1:] + self.head[-1:]):
            if parent_of(top) is None:
                return top
        return None

    def reason(self, link) -> str | None:
        """Why this process should stop now, or None: a launcher gone, or zoo's launcher's request."""
        pid = self.gone()
        if pid is not None:
            name = self.names.get(pid)
            return f"the exit of the launcher (pid {pid}{', ' + name if name else ''})"
        if link is None:
            return None
        try:
            return link.requested_stop()
        except OSError:
            return link.describe_exit()

    def run(self) -> None:
        link = self.connect()
        while not self._stopped.wait(self.interval_s):
            reason = self.reason(link)
            if reason is None:
                continue
            self.exited = reason
            listener = self.listener
            if listener is not None:
                listener(reason)
            else:
                os.kill(os.getpid(), signal.SIGTERM)
            return

    def connect(self):
        """The link to zoo's launcher, or None (none named, or unreachable: said once on stderr)."""
        if self.link_address is None:
            return None
        try:
            return LauncherLink(self.link_address)
        except OSError as err:
            print(f"warning: {err}; this rank goes on without its stop requests, and the launcher returns "
                  f"DeepSpeed's exit code instead of 75", file=sys.stderr, flush=True)
            return None

    def stop(self) -> None:
        self._stopped.set()


def job_head(chain: Sequence[int], environ: dict[str, str] | None = None) -> list[int]:
    """On the node where DeepSpeed's multi-node runner runs, when this rank's per-node launcher was started
    over ssh (its parent is no launcher): the job's pdsh (the process whose arguments carry the per-node
    launcher's ``--world_info`` and ``--master_port`` and whose parent is a launcher, the runner), then the
    launchers above it (the runner, zoo's launcher). Empty on every other node, and for a local launch.

    One pass over the process table, once per rank."""
    if not chain or not runs_module(command_line(chain[-1]), PER_NODE_MODULE):
        return []
    marks = {arg for arg in command_line(chain[-1]) if arg.startswith(("--world_info=", "--master_port="))}
    if len(marks) < 2:
        return []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in chain:
            continue
        pid = int(entry.name)
        argv = command_line(pid)
        if marks <= set(argv) and not runs_module(argv, PER_NODE_MODULE):
            above = launcher_ancestors(pid, environ)
            if above:
                return [pid, *above]
    return []


def launcher_name(argv: Sequence[str]) -> str:
    """A launcher's short name for messages: the module it runs, or its script's file name."""
    for module in LAUNCHER_MODULES:
        if runs_module(argv, module):
            return module
    for arg in argv[:2]:
        if os.path.basename(arg) in LAUNCHER_SCRIPTS:
            return os.path.basename(arg)
    return ""


def current_watch() -> LauncherWatch | None:
    """This process's running watch, if one was started."""
    return next((thread for thread in threading.enumerate()
                 if isinstance(thread, LauncherWatch) and thread.is_alive()), None)


def watch_launchers(interval_s: float = CHECK_INTERVAL_S) -> LauncherWatch | None:
    """Start watching the launchers above this process, the job's head on this node and zoo's launcher
    (once per process: a running watch is returned as it is), and guard its output against a broken pipe
    (:mod:`zoo.operations.output_guard`); None when no launcher started this process."""
    running = current_watch()
    if running is not None:
        return running
    chain = launcher_ancestors()
    if not chain:
        return None
    guard_output()
    watch = LauncherWatch(chain, interval_s, head=job_head(chain), link=store_address())
    watch.start()
    return watch
