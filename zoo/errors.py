"""User errors: which exception types they are, how one rank's error is raised on the others, and how a
CLI reports the error that ends it (``error: <sentence>`` on one line of stderr, exit code 2, printed once
for the whole job).

zoo raises ValueError / FileNotFoundError with one sentence naming the value and the fix
(:data:`USER_ERRORS`). A library can raise the same types for reasons that are not the user's (DeepSpeed's
op builder failing on ``TORCH_CUDA_ARCH_LIST=9.0a`` raises ``invalid literal for int() with base 10: '0a'``,
which names neither the variable nor the fix). Such a line names where it was raised, and
``ZOO_TRACEBACK=1`` prints the traceback.

This module imports no torch, so a CLI reports an error of its argument parsing without paying for it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from typing import NoReturn

_OWN_DIRECTORIES = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name) + os.sep
                         for name in ("zoo", "launch", "finetune", "benchmarks"))
_STANDARD_LIBRARY = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
TRACEBACK_VARIABLE = "ZOO_TRACEBACK"

# The exception types of a user error, by name: the name is what crosses between ranks.
USER_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}
# Set on a user error the ranks agreed on: every rank holds the same sentence (zoo's agreements span the world).
AGREED_ATTRIBUTE = "zoo_agreed_by_every_rank"
# The variables launchers set to a process's global rank: torchrun/DeepSpeed, mpirun, srun.
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def raise_failure_of_rank(rank: int, kind: str, message: str, own_error: BaseException | None,
                          this_rank: int) -> NoReturn:
    """Raise, on every rank, the failure the ranks agreed on: ``rank`` failed with ``kind: message``.

    A user error (:data:`USER_ERRORS`) is raised as the same type with the same sentence on every rank, so
    each CLI prints the same line, and it is marked as agreed so that only the writer rank prints it
    (:func:`report_error`). Anything else is ``own_error`` itself on the rank that raised it (its
    traceback intact) and a RuntimeError naming that rank and its error on the others."""
    if kind in USER_ERRORS:
        agreed = USER_ERRORS[kind](message)
        setattr(agreed, AGREED_ATTRIBUTE, True)
        raise agreed from None
    if own_error is not None and rank == this_rank:
        raise own_error
    raise RuntimeError(f"rank {rank} failed with {kind}: {message}")


@contextlib.contextmanager
def alike_on_every_rank() -> Iterator[None]:
    """Mark a user error raised in the block as one every rank raises alike (checks of the command line and
    the config files, which every rank reads the same), so that only the writer rank prints it."""
    try:
        yield
    except tuple(USER_ERRORS.values()) as err:
        setattr(err, AGREED_ATTRIBUTE, True)
        raise


def _in_standard_library(path: str) -> bool:
    return os.path.abspath(path).startswith(_STANDARD_LIBRARY) and "-packages" + os.sep not in path


def raised_at(err: BaseException) -> tuple[str, int] | None:
    """(file, line) of the innermost frame that raised ``err`` outside Python's standard library (a missing
    file raised by pathlib for zoo's call counts as zoo's), or None without such a frame."""
    frames = traceback.extract_tb(err.__traceback__) if err.__traceback__ is not None else []
    for frame in reversed(frames):
        if not _in_standard_library(frame.filename):
            return frame.filename, frame.lineno
    return None


def raised_outside_zoo(err: BaseException) -> tuple[str, int] | None:
    """Where ``err`` was raised, shortened to the package's path, when that was not zoo's own code."""
    where = raised_at(err)
    if where is None or os.path.abspath(where[0]).startswith(_OWN_DIRECTORIES):
        return None
    path = where[0]
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            path = path.split(marker, 1)[1]
    return path, where[1]


def error_line(err: BaseException, rank: int = 0) -> str:
    """``error: <sentence>`` (``error (rank N): ...`` on a rank other than the writer)."""
    line = f"error: {err}" if rank == 0 else f"error (rank {rank}): {err}"
    origin = raised_outside_zoo(err)
    if origin is not None:
        line += (f" (raised in {origin[0]}:{origin[1]}, not by zoo's checks; {TRACEBACK_VARIABLE}=1 prints the "
                 f"traceback)")
    return line


def global_rank() -> int:
    """This process's rank in the job: torch.distributed's once a process group is up (torch is not imported
    here for it), else the launcher's variable, else 0 (one plain process)."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def report_error(err: BaseException) -> None:
    """Print ``err`` as the CLI's one line (and its traceback first, under ``ZOO_TRACEBACK=1``), once per job.

    The writer rank (global rank 0) prints every error. Another rank stays silent on an error the ranks
    agreed on (the writer prints the same sentence) and prints its own errors as ``error (rank N): ...``,
    since only it knows them. The line goes out in one write, so lines of ranks sharing a terminal or a
    log file never run into each other."""
    rank = global_rank()
    if rank != 0 and getattr(err, AGREED_ATTRIBUTE, False):
        return
    if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
        traceback.print_exception(err, file=sys.stderr)
    sys.stderr.flush()
    sys.stderr.write(error_line(err, rank) + "\n")
    sys.stderr.flush()
