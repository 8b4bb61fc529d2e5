"""How every command ends: a user error is one ``error: <sentence>`` line and exit code 2, and a process
group the command created is destroyed after it succeeds.

A user error is a :class:`zoo.errors.UserError` (or its :class:`~zoo.errors.MissingInput`) raised with one
sentence naming the value and the fix (:func:`zoo.errors.report_error` prints it); any other exception ends the
command with its traceback. After a failure nothing is torn down, since another rank may
still wait in a collective (:func:`zoo.distributed.process_group_left_on_success`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

from zoo.errors import USER_ERRORS, report_error
from zoo.operations.library_output import library_output
from zoo.options import add_local_rank_argument, add_log_level_argument

USER_ERROR_EXIT_CODE = 2
T = TypeVar("T")


def command_parser(parser: argparse.ArgumentParser, *, launched: bool = True) -> argparse.ArgumentParser:
    """``parser`` with the flags every command takes (``--log-level``) and, where ``launched``, those of a launched
    one (``--local_rank``, passed by the deepspeed launcher); ``launched`` False for commands that run as one
    plain process."""
    add_log_level_argument(parser)
    if launched:
        add_local_rank_argument(parser)
    return parser


@contextlib.contextmanager
def process_group_left_on_success() -> Iterator[None]:
    from zoo.distributed import process_group_left_on_success as left  # local: torch import cost, after parsing

    with left():
        yield


def run_command(work: Callable[[], T], *, teardown: bool = True, return_code: bool = False,
                log_level: str | None = None) -> T | int:
    """``work()``'s result; on a user error, its sentence on stderr and exit code 2 (``return_code``: returned
    as 2 instead of raised as SystemExit). ``teardown``: destroy a process group ``work`` created, once it
    succeeded. ``work`` runs with the libraries' output at ``log_level`` (the command's ``--log-level``; None:
    ``$ZOO_LOG_LEVEL``, else info; zoo.operations.library_output)."""
    try:
        with library_output(log_level), \
                process_group_left_on_success() if teardown else contextlib.nullcontext():
            return work()
    except tuple(USER_ERRORS.values()) as err:
        report_error(err)
        if return_code:
            return USER_ERROR_EXIT_CODE
        sys.exit(USER_ERROR_EXIT_CODE)
