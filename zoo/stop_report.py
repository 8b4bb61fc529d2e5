"""How a training run tells zoo's launcher (:mod:`zoo.launcher`) that it stopped early with a checkpoint.

The launcher names a file in ``$ZOO_STOP_REPORT`` for every process it starts. The writer rank writes it
(one JSON object: why the run stopped, after which iteration) once the checkpoint of an early stop (a
signal, the launcher's exit, ``--exit-interval``, ``--exit-duration-in-mins``) is saved and ``latest``
names it, never before. The launcher reads it after every process of the job has exited, so "the file is
there" means "stopped and checkpointed". Without the variable (the plain ``deepspeed`` launcher, the test
harness) nothing is written.

This module imports nothing from zoo but :mod:`zoo.atomic`: every layer may use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zoo.atomic import write_text_atomic

__all__ = ["STOP_REPORT_VARIABLE", "report_stop", "read_stop_report"]

STOP_REPORT_VARIABLE = "ZOO_STOP_REPORT"


def report_stop(reason: str, iteration: int, environ: dict[str, str] | None = None) -> Path | None:
    """Write the stop report (atomically) where ``$ZOO_STOP_REPORT`` names it; the path, or None without
    the variable. Call it only after the stop's checkpoint and its ``latest`` are written."""
    environ = os.environ if environ is None else environ
    target = environ.get(STOP_REPORT_VARIABLE)
    if not target:
        return None
    path = Path(target)
    write_text_atomic(path, json.dumps({"stopped_by": reason, "iteration": iteration}) + "\n", fsync=True)
    return path


def read_stop_report(path: str | os.PathLike) -> dict[str, Any] | None:
    """The report at ``path``, or None when there is none (or it is not a report)."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) and "stopped_by" in report else None
