"""A run claims its ``--save`` directory: the run-directory lock (:mod:`zoo.operations.run_lock`) taken after
read-only checks that it would write over no earlier run's checkpoints or metrics, and, with ``--overwrite``,
the removal of only what earlier zoo runs wrote there (:mod:`zoo.checkpoint.earlier_runs`)."""

from __future__ import annotations

import os
from pathlib import Path

from zoo.checkpoint.earlier_runs import (
    checkpoint_summary,
    refuse_symlinked_checkpoints,
    remove_earlier_checkpoints,
)
from zoo.errors import UserError
from zoo.operations.run_lock import RunDirectoryLock
from zoo.training.metrics import METRICS_FILE, check_metrics_file

__all__ = ["FINETUNING_OUTPUTS", "claim_pretraining_directory", "claim_finetuning_directory"]

LEFT_SHOWN = 5   # the files --overwrite left that its line names, then "and N more"


def claim_pretraining_directory(run_dir: str | os.PathLike, *, resuming: bool, overwrite: bool) -> RunDirectoryLock:
    """Lock ``--save`` for a pretraining run (writer rank only), after these read-only checks:

    * a run that does not continue this directory (not ``resuming``: no ``--load``, or a ``--load`` naming
      another run) into a directory holding checkpoints, complete or not (:func:`checkpoint_summary`), is
      refused unless ``overwrite``: its saves would write over that run's tags. A run that continues the
      directory (``--load`` names it) is never refused for its checkpoints: it resumes from the newest
      complete one, or starts from iteration 0 over tags whose save did not finish;
    * a run that does not continue this directory, into one holding a ``metrics.jsonl``, is refused unless
      ``overwrite`` (it is another run's history);
    * a resumed run's ``metrics.jsonl`` must read line by line: a corrupt line before the last one is a
      sentence naming the file and the line (a torn last line is dropped later, with a warning).

    With ``overwrite``, the earlier run's ``metrics.jsonl`` and what zoo wrote into ``checkpoints/``
    (:func:`remove_earlier_checkpoints`) are removed once the lock is held, said in one line, and what was
    left there (the user's files) in another; a ``checkpoints`` that is a symbolic link is refused in one
    sentence instead. A resumed run keeps them. Returns the held lock."""
    from zoo.checkpoint.files import CHECKPOINT_SUBDIR  # local: zoo.checkpoint imports torch and transformers

    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    replaced: list[str] = []

    def check() -> None:
        checkpoints = None if resuming else checkpoint_summary(run_dir)
        if checkpoints is not None and not overwrite:
            raise UserError(f"--save {run_dir} already holds the checkpoints of an earlier run ({checkpoints}), "
                             f"which this run's saves would overwrite; use --load {run_dir} to resume, or another "
                             "--save, or --overwrite to replace them.")
        if not resuming and metrics.exists() and not overwrite:
            raise UserError(f"--save {run_dir} already holds the {METRICS_FILE} of an earlier run; use --load "
                             f"{run_dir} to resume, or another --save, or --overwrite to replace it.")
        if resuming and metrics.is_file():
            check_metrics_file(metrics)
        if checkpoints is not None:
            refuse_symlinked_checkpoints(run_dir)
            replaced.append(f"checkpoints ({checkpoints})")
        if not resuming and metrics.exists():
            replaced.append(METRICS_FILE)

    lock = RunDirectoryLock(run_dir, "--save").acquire(check)
    if overwrite and replaced:
        try:
            left: list[str] = []
            if any(item.startswith("checkpoints") for item in replaced):
                left = remove_earlier_checkpoints(run_dir / CHECKPOINT_SUBDIR)
            if METRICS_FILE in replaced:
                metrics.unlink()
        except BaseException:
            lock.release()
            raise
        print(f"--overwrite: removed the earlier run's {' and '.join(replaced)} from {run_dir}", flush=True)
        if left:
            shown = ", ".join(left[:LEFT_SHOWN]) + (f" and {len(left) - LEFT_SHOWN} more" if len(left) > LEFT_SHOWN else "")
            print(f"--overwrite: left what zoo did not write in {run_dir / CHECKPOINT_SUBDIR}: {shown}", flush=True)
    return lock


FINETUNING_OUTPUTS = (METRICS_FILE, "results.json")


def claim_finetuning_directory(run_dir: str | os.PathLike, overwrite: bool = False) -> RunDirectoryLock:
    """Lock a finetuning run's ``--save`` (writer rank only); a directory holding an earlier finetuning run's
    ``metrics.jsonl`` or ``results.json`` is refused (this run would write over them), unless ``overwrite``
    (``--overwrite``) asks for them to be replaced: they are removed once the lock is held."""
    run_dir = Path(run_dir)

    def check() -> None:
        earlier = [name for name in FINETUNING_OUTPUTS if (run_dir / name).exists()]
        if earlier and not overwrite:
            raise UserError(f"--save {run_dir} already holds the {' and '.join(earlier)} of an earlier finetuning "
                             f"run; pass another --save, or --overwrite to replace them.")

    lock = RunDirectoryLock(run_dir, "--save").acquire(check)
    replaced = [name for name in FINETUNING_OUTPUTS if (run_dir / name).exists()] if overwrite else []
    if replaced:
        try:
            for name in replaced:
                (run_dir / name).unlink()
        except BaseException:
            lock.release()
            raise
        print(f"--overwrite: removed the earlier run's {' and '.join(replaced)} from {run_dir}", flush=True)
    return lock
