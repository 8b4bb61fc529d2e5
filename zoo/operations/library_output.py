"""What the libraries under zoo print: at zoo's default log level only zoo's own lines and real warnings, at
``--log-level debug`` (or ``ZOO_LOG_LEVEL=debug``) the libraries' own lines as well.

At the default level ("info"), within :func:`library_output` (every zoo command runs inside it):

* DeepSpeed's logger (``DeepSpeed``) passes warnings and errors only, less the notes that say nothing about a
  zoo run: "Setting accelerator to CPU" (zoo refuses a CPU run on a machine with GPUs itself, in one sentence:
  :func:`zoo.distributed.joining.check_accelerator_matches_machine`) and "Attempting to get learning rate
  from scheduler before it has started" (the engine's first log line asks before the first step). The filter is
  on the logger object, so it holds whenever DeepSpeed is imported, and whatever level DeepSpeed sets on it.
* The ``datasets`` progress bars ("Generating train split") are off: zoo draws its own.
* :func:`prints_dropped` drops the lines DeepSpeed prints with ``print`` around the calls that print them
  ("DeepSpeed ... shm_comm_op built successfully" when a CPU rank loads its all-reduce kernel, "SEED_LAYERS=..."
  when a pipeline is built).

At "debug" nothing is dropped and DeepSpeed's logger shows its INFO lines too. The level is kept in
``ZOO_LOG_LEVEL`` while the block runs, so the processes zoo starts (data workers, preprocessing workers,
launched ranks) print alike. Lines of DeepSpeed's own launcher process (``deepspeed`` before the script runs)
are the launcher's: its ``--log_level`` flag and ``DS_ACCELERATOR`` steer them (see the README).

This module imports nothing from zoo but its errors and options, and no library: every layer may use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from zoo.errors import UserError
from zoo.options import LOG_LEVELS

__all__ = ["LOG_LEVELS", "LOG_LEVEL_VARIABLE", "library_output", "log_level", "prints_dropped"]

LOG_LEVEL_VARIABLE = "ZOO_LOG_LEVEL"
DEEPSPEED_LOGGER = "DeepSpeed"
# DeepSpeed's log records that say nothing about a zoo run (see the module docstring).
DEEPSPEED_NOTES = ("Setting accelerator to CPU", "Attempting to get learning rate from scheduler before it has started")
# Line starts of DeepSpeed's print() calls that say nothing about a zoo run.
DEEPSPEED_PRINTS = ("DeepSpeed deepspeed.ops.", "SEED_LAYERS=")
DATASETS_BARS_VARIABLE = "HF_DATASETS_DISABLE_PROGRESS_BARS"


def log_level(flag: str | None = None, environ: dict[str, str] | None = None) -> str:
    """``flag`` (a command's ``--log-level``) when given, else ``$ZOO_LOG_LEVEL``, else "info"; a value that is no
    level is one sentence."""
    environ = os.environ if environ is None else environ
    level = flag if flag is not None else (environ.get(LOG_LEVEL_VARIABLE, "").strip().lower() or "info")
    if level not in LOG_LEVELS:
        raise UserError(f"{LOG_LEVEL_VARIABLE}={level!r} is not a log level; set it to one of {list(LOG_LEVELS)} "
                         "(or unset it).")
    return level


class _DeepSpeedNotes(logging.Filter):
    """Passes DeepSpeed's warnings and errors, less :data:`DEEPSPEED_NOTES`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        message = record.getMessage()
        return not any(note in message for note in DEEPSPEED_NOTES)


@contextlib.contextmanager
def library_output(flag: str | None = None) -> Iterator[str]:
    """Within the block, the libraries print what the log level says (see the module); yields the level. Every
    setting is restored on exit, so a command run in-process leaves the process as it found it."""
    level = log_level(flag)
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    saved_level = logger.level
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environment(LOG_LEVEL_VARIABLE, level))
        if level == "debug":
            logger.setLevel(logging.INFO)
            stack.callback(logger.setLevel, saved_level)
        else:
            notes = _DeepSpeedNotes()
            logger.addFilter(notes)
            stack.callback(logger.removeFilter, notes)
            stack.enter_context(_environment(DATASETS_BARS_VARIABLE, "1"))
            stack.enter_context(_datasets_bars_off())
        yield level


def shows_library_output(environ: dict[str, str] | None = None) -> bool:
    """Whether the libraries' own lines are shown (the debug level)."""
    environ = os.environ if environ is None else environ
    return environ.get(LOG_LEVEL_VARIABLE, "").strip().lower() == "debug"


@contextlib.contextmanager
def prints_dropped(starts: tuple[str, ...] = DEEPSPEED_PRINTS) -> Iterator[None]:
    """Within the block, lines written to ``sys.stdout`` that begin with one of ``starts`` are dropped (unless the
    libraries' output is shown); every other line goes through unchanged and in order."""
    if shows_library_output():
        yield
        return
    stream = _LinesDropped(sys.stdout, starts)
    try:
        with contextlib.redirect_stdout(stream):
            yield
    finally:
        stream.flush()


class _LinesDropped:
    """A text stream over ``stream`` that drops the lines beginning with one of ``starts``. A partial line is held
    only while it could still become such a line, so everything else (a progress bar's redraw too) goes out as it
    is written."""

    def __init__(self, stream, starts: tuple[str, ...]):
        self.stream, self.starts, self.pending = stream, starts, ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            if not line.startswith(self.starts):
                self.stream.write(line + "\n")
        if self.pending and not any(start.startswith(self.pending) or self.pending.startswith(start)
                                    for start in self.starts):
            self.stream.write(self.pending)
            self.pending = ""
        return len(text)

    def flush(self) -> None:
        if self.pending and not self.pending.startswith(self.starts):
            self.stream.write(self.pending)
        self.pending = ""
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def _datasets_bars_off() -> Iterator[None]:
    """``datasets``' progress bars off where it is already imported (an import later reads the environment)."""
    datasets = sys.modules.get("datasets")
    if datasets is None or not datasets.is_progress_bar_enabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()
