"""How a CLI reports the error that ends it: ``error: <sentence>`` on one line of stderr, exit code 2.

zoo raises ValueError / FileNotFoundError with one sentence naming the value and the fix. A library can
raise the same types for reasons that are not the user's (DeepSpeed's op builder failing on
``TORCH_CUDA_ARCH_LIST=9.0a`` printed ``error: invalid literal for int() with base 10: '0a'``, with no
hint of where). Such a line names where it was raised, and ``ZOO_TRACEBACK=1`` prints the traceback.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback

_OWN_DIRECTORIES = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name) + os.sep
                         for name in ("zoo", "launch", "finetune", "benchmarks"))
_STANDARD_LIBRARY = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
TRACEBACK_VARIABLE = "ZOO_TRACEBACK"


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


def error_line(err: BaseException) -> str:
    line = f"error: {err}"
    origin = raised_outside_zoo(err)
    if origin is not None:
        line += (f" (raised in {origin[0]}:{origin[1]}, not by zoo's checks; {TRACEBACK_VARIABLE}=1 prints the "
                 f"traceback)")
    return line


def report_error(err: BaseException) -> None:
    """Print ``err`` as the CLI's one line (and its traceback first, under ``ZOO_TRACEBACK=1``)."""
    if os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0"):
        traceback.print_exception(err, file=sys.stderr)
    print(error_line(err), file=sys.stderr, flush=True)
