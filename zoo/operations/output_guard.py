"""A rank survives any state of its stdout and stderr.

A rank's stdout and stderr are pipes its launcher holds; on another node they are the ssh session's. When
the ``deepspeed`` runner dies or kills pdsh, sshd closes its ends of those pipes, and the rank's next write
(a tqdm progress bar, a log line) fails with EPIPE. A user may also start a run with stdout closed
(``>&-``, so ``sys.stdout`` is None and the next file opened would take descriptor 1) or pointed at a
device that refuses writes (``/dev/full``: ENOSPC). Raised from inside tqdm, ``print`` or a logging
handler, any of these would end the rank before it could save its checkpoint.

:func:`guard_output` (called for every rank a launcher started, :func:`zoo.operations.launcher_watch.watch_launchers`)
gives a closed descriptor 1 or 2 ``/dev/null`` (so no file the run opens becomes its stdout), and wraps
``sys.stdout`` and ``sys.stderr``, also in the logging handlers already writing to them. On the first write
that fails with any OSError, or at once for a closed stream, that stream's file descriptor (1 or 2) is
pointed at ``<run directory>/output-rank<RANK>.log`` (:func:`keep_output_in` names the directory once the
run knows it; before that, and when that file cannot be opened, at ``/dev/null``), a line there says why,
and the write is done again: training or stopping goes on, and everything written afterwards, from Python
or native code, lands in that file. SIGPIPE is ignored (Python's default, restored in case a library
changed it), so a broken pipe is always an error to catch, never a silent death.

This module imports nothing from zoo: every layer may use it.
"""

from __future__ import annotations

import errno
import io
import logging
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
        self.reason = ""
        self.fds: set[int] = set()
        self.lock = threading.Lock()

    def divert(self, reason: str = "", fds: tuple[int, ...] = ()) -> None:
        """Point ``fds`` (of 1 and 2), and those diverted before, at the lost-output file (``/dev/null`` while
        no directory is known, or when the file cannot be opened): a stream that still works (stderr on the
        terminal when only stdout was closed) keeps reaching the user. ``reason`` says what happened to the
        streams, written once there."""
        with self.lock:
            self.broken = True
            self.reason = self.reason or reason
            self.fds.update(fds)
            wanted = str(lost_output_file(self.directory)) if self.directory is not None else os.devnull
            try:
                fd = os.open(wanted, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError:
                wanted, fd = os.devnull, os.open(os.devnull, os.O_WRONLY)
            try:
                if wanted != self.target and wanted != os.devnull:
                    try:
                        os.write(fd, self.notice())
                    except OSError:
                        pass
                self.target = wanted
                for diverted in sorted(self.fds):
                    os.dup2(fd, diverted)
            finally:
                if fd > 2:
                    os.close(fd)

    def keep_in(self, directory: str | os.PathLike) -> None:
        """Name the run directory; output already diverted to ``/dev/null`` moves to its file."""
        self.directory = Path(directory)
        if self.broken and self.target == os.devnull:
            self.divert()

    def notice(self) -> bytes:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        return (f"{stamp} rank {os.environ.get('RANK', '0')}: {self.reason}; "
                f"this rank's output continues in this file\n").encode()


def stream_failure(err: OSError) -> str:
    """The notice's words for a failed write to the standard streams."""
    if err.errno == errno.EPIPE:
        return "the launcher's stdout/stderr pipe broke (EPIPE)"
    return f"writing to stdout/stderr failed ({errno.errorcode.get(err.errno, err.errno)}: {err.strerror})"


class OutputGuard:
    """``sys.stdout`` or ``sys.stderr``, whose writes survive a broken pipe (see the module); everything
    else is the wrapped stream's."""

    def __init__(self, stream, diversion: Diversion, fd: int):
        self.stream = stream
        self.diversion = diversion
        self.fd = fd

    def write(self, text: str) -> int:
        """Write ``text``; after a failed write the descriptor is diverted and ``text`` written again there
        (the stream's buffer may have dropped it with the failed flush)."""
        try:
            return self.stream.write(text)
        except OSError as err:
            self._divert(err)
            try:
                self.stream.write(text)
                self.stream.flush()
            except OSError:
                pass
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as err:
            self._divert(err)

    def _divert(self, err: OSError) -> None:
        """Divert the descriptors and flush again; output that still cannot be written is dropped, never
        raised, since a rank's stdout is no reason to lose its training."""
        self.diversion.divert(stream_failure(err), (self.fd,))
        try:
            self.stream.flush()
        except OSError:
            pass

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
    closed = [fd for fd in (1, 2) if not descriptor_open(fd)]
    for fd in closed:
        null = os.open(os.devnull, os.O_WRONLY)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
    streams = {}
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None or fd in closed:
            stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True,
                                      errors="backslashreplace")
        streams[getattr(sys, name)] = guard = OutputGuard(stream, diversion, fd)
        setattr(sys, name, guard)
    for handler in logging_handlers():
        if handler.stream in streams and handler.stream is not None:
            handler.setStream(streams[handler.stream])
    if closed:
        diversion.divert(f"{' and '.join(('stdout', 'stderr')[fd - 1] for fd in closed)} "
                         f"{'were' if len(closed) == 2 else 'was'} closed at start", tuple(closed))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)


def descriptor_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def logging_handlers() -> list[logging.StreamHandler]:
    """Every stream handler of the root logger and of the loggers created so far."""
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    return [handler for logger in loggers for handler in logger.handlers
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)]


def keep_output_in(directory: str | os.PathLike) -> None:
    """Send this rank's output to ``directory`` (the run directory) if its pipes break; nothing without
    :func:`guard_output`."""
    if isinstance(sys.stdout, OutputGuard):
        sys.stdout.diversion.keep_in(directory)
