"""User errors: which exception types they are, how one rank's error is raised on the others, and how a
CLI reports the error that ends it (``error: <sentence>`` on one line of stderr, exit code 2, printed once
for the whole job).

zoo raises :class:`UserError` (a ValueError) or :class:`MissingInput` (a UserError and a FileNotFoundError)
with one sentence naming the value and the fix. Only those are reported as one line and exit 2: a
ValueError or FileNotFoundError raised by a library (or by a bug of zoo's) is not the user's to fix from its
sentence, so it ends the command with its traceback, as any other exception does.

This module imports no torch, so a CLI reports an error of its argument parsing without paying for it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator
from typing import NoReturn

TRACEBACK_VARIABLE = "ZOO_TRACEBACK"


class UserError(ValueError):
    """A value the user gave (a flag, a config, a file's content, a layout) that zoo cannot run with; its
    message is one sentence naming the value and the fix."""


class MissingInput(UserError, FileNotFoundError):
    """A file or directory the user named that does not exist or lacks a part zoo needs (one sentence)."""


# The exception types of a user error, by name: the name is what crosses between ranks.
USER_ERRORS: dict[str, type[Exception]] = {"UserError": UserError, "MissingInput": MissingInput}
# Set on a user error the ranks agreed on: every rank holds the same sentence (zoo's agreements span the world).
AGREED_ATTRIBUTE = "zoo_agreed_by_every_rank"
# The variables launchers set to a process's global rank: torchrun/DeepSpeed, mpirun, srun.
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def error_kind(err: BaseException) -> str:
    """The name ``err`` crosses between ranks under: its user-error kind (a subclass of UserError travels as
    the kind it is), else its own type's name."""
    for name, kind in reversed(USER_ERRORS.items()):
        if isinstance(err, kind):
            return name
    return type(err).__name__


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


def error_line(err: BaseException, rank: int = 0) -> str:
    """``error: <sentence>`` (``error (rank N): ...`` on a rank other than the writer)."""
    return f"error: {err}" if rank == 0 else f"error (rank {rank}): {err}"


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
