"""Ranks do not outlive their launcher.

``deepspeed`` (the runner) starts ``python -m deepspeed.launcher.launch`` on each node, which starts the
ranks. Killing the runner alone (``kill -9``, or ``kill -TERM``, which it does not handle on one node)
leaves the per-node launcher and every rank running: they would train on and write checkpoints into a
run directory whose job has ended. A rank therefore watches the launchers above it, as they were when it
started, from a daemon thread (:class:`LauncherWatch`, one check a second, a few ``/proc`` reads):

* the launchers are the consecutive ancestors, from the parent up, that are a launcher: DeepSpeed's
  per-node launcher or runner, torchrun, or zoo's own wrapper (:mod:`zoo.launcher`, named by
  ``$ZOO_LAUNCHER_PID``). A process whose parent is none of these (a test harness, a shell, ``wandb
  agent``, ``nohup``) watches nothing: its parent's exit is not a reason to stop;
* a launcher is gone when the link recorded at start-up breaks: this process's parent changed, or a
  launcher's parent did (the kernel reparents the children of a process that exits);
* then a listener, when one is set (the training loop's stop conditions, while the loop runs), turns it
  into the same clean stop as SIGTERM: a checkpoint at the next iteration boundary, then the exit; with
  no listener (set-up, evaluation, generation) the process sends itself SIGTERM and ends at once.

This module imports nothing from zoo: every layer may use it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["LauncherWatch", "LAUNCHER_PID_VARIABLE", "watch_launchers", "current_watch", "launcher_ancestors",
           "parent_of", "command_line"]

LAUNCHER_PID_VARIABLE = "ZOO_LAUNCHER_PID"   # zoo's wrapper names itself to every process it starts
THREAD_NAME = "zoo-launcher-watch"
CHECK_INTERVAL_S = 1.0

# How a launcher shows in /proc/<pid>/cmdline: modules run with -m, and scripts by their file name.
LAUNCHER_MODULES = ("deepspeed.launcher.launch", "deepspeed.launcher.runner", "torch.distributed.run",
                    "zoo.cli.run")
LAUNCHER_SCRIPTS = ("deepspeed", "ds", "torchrun", "run.py")


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


def is_launcher(pid: int, argv: Sequence[str], wrapper_pid: int | None) -> bool:
    """Whether ``pid`` (started as ``argv``) is a launcher of ranks: zoo's wrapper, DeepSpeed's runner or
    per-node launcher, or torchrun. ``run.py`` counts only as zoo's ``launch/run.py``."""
    if wrapper_pid is not None and pid == wrapper_pid:
        return True
    if any(module in argv for module in LAUNCHER_MODULES):
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
    """A daemon thread that checks every ``interval_s`` that the launchers of ``chain`` are all there.

    ``exited`` is None until the first one is found gone, then a phrase naming it ("the exit of the
    launcher (pid 123, deepspeed)"). At that moment the watch calls its listener with the phrase, or,
    with none set, sends this process SIGTERM (whose default action ends it). It stops after firing."""

    def __init__(self, chain: Sequence[int], interval_s: float = CHECK_INTERVAL_S):
        super().__init__(name=THREAD_NAME, daemon=True)
        self.chain = list(chain)
        self.names = {pid: launcher_name(command_line(pid)) for pid in self.chain}
        self.interval_s = interval_s
        self.exited: str | None = None
        self.listener: Callable[[str], None] | None = None
        self._stopped = threading.Event()

    def listen(self, listener: Callable[[str], None] | None) -> None:
        """Hand a launcher's exit to ``listener`` from now on (None: end the process with SIGTERM); a
        listener set after the watch fired is called at once."""
        self.listener = listener
        if listener is not None and self.exited is not None:
            listener(self.exited)

    def gone(self) -> int | None:
        """The pid of the nearest launcher of the chain that has exited, or None while all are there.

        Only the links between this process and its launchers are checked, never the parent of the
        topmost launcher (a shell that exits under ``nohup deepspeed ...`` ends nothing)."""
        if not self.chain:
            return None
        if os.getppid() != self.chain[0]:
            return self.chain[0]
        for launcher, above in zip(self.chain, self.chain[1:]):
            if parent_of(launcher) != above:
                return launcher if parent_of(launcher) is None else above
        return self.chain[-1] if parent_of(self.chain[-1]) is None else None

    def run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            pid = self.gone()
            if pid is None:
                continue
            name = self.names.get(pid)
            self.exited = f"the exit of the launcher (pid {pid}{', ' + name if name else ''})"
            listener = self.listener
            if listener is not None:
                listener(self.exited)
            else:
                os.kill(os.getpid(), signal.SIGTERM)
            return

    def stop(self) -> None:
        self._stopped.set()


def launcher_name(argv: Sequence[str]) -> str:
    """A launcher's short name for messages: the module it runs, or its script's file name."""
    for module in LAUNCHER_MODULES:
        if module in argv:
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
    """Start watching the launchers above this process (once per process: a running watch is returned
    as it is); None when no launcher started this process."""
    running = current_watch()
    if running is not None:
        return running
    chain = launcher_ancestors()
    if not chain:
        return None
    watch = LauncherWatch(chain, interval_s)
    watch.start()
    return watch
