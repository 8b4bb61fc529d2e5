"""A rank survives losing its stdout and stderr.

A rank's stdout and stderr are pipes its launcher holds; on another node they are the ssh session's. When
the ``deepspeed`` runner dies or kills pdsh, sshd closes its ends of those pipes, and the rank's next write
(a tqdm progress bar, a log line) fails with EPIPE. Raised as BrokenPipeError from inside tqdm or
``print``, it would end the rank before it could save the checkpoint of its stop.

:func:`guard_output` (called for every rank a launcher started, :func:`zoo.operations.launcher_watch.watch_launchers`)
wraps ``sys.stdout`` and ``sys.stderr``. On the first EPIPE, the file descriptors 1 and 2 of the process are
pointed at ``<run directory>/output-rank<RANK>.log`` (:func:`keep_output_in` names the directory once the
run knows it; before that, at ``/dev/null``), a line there says so, and the write is done again: training
or stopping goes on, and everything written afterwards, from Python or native code, lands in that file.
SIGPIPE is ignored (Python's default, restored in case a library changed it), so a broken pipe is always
an error to catch, never a silent death.

This module imports nothing from zoo: every layer may use it.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = ["OutputGuard", "guard_output", "keep_output_in", "lost_output_file"]


def lost_output_file(directory: str | os.PathLike, environ: dict[str, str] | None = None) -> Path:
    """Where this rank's output goes in ``directory`` once its launcher's pipes broke."""
    environ = os.environ if environ is None else environ
    return Path(directory) / f"output-rank{environ.get('RANK', '0')}.log"


class Diversion:
    """What the two guards of a process share: whether the pipes broke, and where the output goes."""

    def __init__(self):
        self.directory: Path | None = None
        self.broken = False
        self.target = os.devnull
        self.lock = threading.Lock()

    def divert(self) -> None:
        """Point fds 1 and 2 at the lost-output file (``/dev/null`` while no directory is known)."""
        with self.lock:
            first = not self.broken
            self.broken = True
            self.target = str(lost_output_file(self.directory)) if self.directory is not None else os.devnull
            fd = os.open(self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if first and self.target != os.devnull:
                    os.write(fd, self.notice())
                os.dup2(fd, 1)
                os.dup2(fd, 2)
            finally:
                os.close(fd)

    def keep_in(self, directory: str | os.PathLike) -> None:
        """Name the run directory; output already diverted to ``/dev/null`` moves to its file."""
        self.directory = Path(directory)
        if self.broken and self.target == os.devnull:
            self.divert()

    @staticmethod
    def notice() -> bytes:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        return (f"{stamp} rank {os.environ.get('RANK', '0')}: the launcher's stdout/stderr pipe broke (EPIPE); "
                f"this rank's output continues in this file\n").encode()


class OutputGuard:
    """``sys.stdout`` or ``sys.stderr``, whose writes survive a broken pipe (see the module); everything
    else is the wrapped stream's."""

    def __init__(self, stream, diversion: Diversion):
        self.stream = stream
        self.diversion = diversion

    def write(self, text: str) -> int:
        """Write ``text``; after an EPIPE the text (already in the stream's buffer, which the failed flush
        kept) goes to the diverted descriptor."""
        try:
            return self.stream.write(text)
        except OSError as err:
            self._divert_on_epipe(err)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as err:
            self._divert_on_epipe(err)

    def _divert_on_epipe(self, err: OSError) -> None:
        if err.errno != errno.EPIPE:
            raise err
        self.diversion.divert()
        self.stream.flush()

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def guard_output() -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` (once per process) and ignore SIGPIPE where this is the main
    thread."""
    if isinstance(sys.stdout, OutputGuard):
        return
    diversion = Diversion()
    sys.stdout = OutputGuard(sys.stdout, diversion)
    sys.stderr = OutputGuard(sys.stderr, diversion)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)


def keep_output_in(directory: str | os.PathLike) -> None:
    """Send this rank's output to ``directory`` (the run directory) if its pipes break; nothing without
    :func:`guard_output`."""
    if isinstance(sys.stdout, OutputGuard):
        sys.stdout.diversion.keep_in(directory)
