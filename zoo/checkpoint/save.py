"""Writing a DeepSpeed training checkpoint of a zoo run: every rank's files, a completion marker, then
the ``latest`` pointer.

A tag counts as a checkpoint only once its save finished on every rank: after the barrier that follows
DeepSpeed's writes, rank 0 writes :data:`~zoo.checkpoint.files.COMPLETE_MARKER` into the tag (every file
and its size, atomically and fsynced), and only then ``latest``. A run killed mid-save leaves a tag
without the marker, which resuming skips (:func:`zoo.checkpoint.files.resume_tag_directory`) and export
refuses.

A write that fails (a full disk: ENOSPC, a quota: EDQUOT, or any other OSError) is caught where DeepSpeed
writes each file (its checkpoint engine's ``save``), so every rank still goes through DeepSpeed's own
collectives; then the ranks agree, what this save created is removed (the tag directory, or the new
files of a tag that existed), ``latest`` is left as it was, and every rank raises the same sentence.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zoo.atomic import write_text_atomic
from zoo.checkpoint.deepspeed_tools import guard_deepspeed_tools, refuse_universal_conversion
from zoo.checkpoint.files import COMPLETE_MARKER, LATEST_FILE, completion_record, read_latest
from zoo.distributed import raise_on_any_rank

__all__ = ["save_checkpoint"]

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def save_checkpoint(engine, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
    """DeepSpeed checkpoint under ``directory/tag``, collective. The completion marker and then ``latest``
    are written atomically by rank 0 only after every rank has finished writing, so a crash mid-save
    leaves the previous checkpoint as ``latest`` and this tag without a marker. A failed write on any rank
    raises the same ValueError on every rank, with what this save created removed."""
    directory = Path(directory)
    tag_dir = directory / tag
    is_first = dist.get_rank() == 0
    existed = raise_on_any_rank(lambda: prepare_tag(tag_dir) if is_first else None)
    writes = FailedWrites(engine.checkpoint_engine)
    engine.checkpoint_engine = writes
    tp_size = engine.mpu.get_tensor_model_parallel_world_size() if getattr(engine, "mpu", None) else 1
    refuse_universal_conversion(engine, tp_size)
    try:
        engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
    except OSError as err:
        # Raised by DeepSpeed outside its checkpoint engine (its copy of the recovery scripts, the last
        # step before its closing barrier): stand in for that barrier so the ranks meet below.
        writes.failure = writes.failure or (str(tag_dir), err, None)
        dist.barrier()
    finally:
        engine.checkpoint_engine = writes.inner
    try:
        raise_on_any_rank(lambda: writes.raise_failure(directory, tag))
    except ValueError:
        if is_first:
            remove_created(tag_dir, existed)
        dist.barrier()
        raise
    # DeepSpeed's copied recovery scripts refuse tp > 1 shards, before the marker lists the tag's files.
    raise_on_any_rank(lambda: guard_deepspeed_tools(directory, tp_size) if is_first else None)
    raise_on_any_rank(lambda: mark_complete(tag_dir, directory) if is_first else None)
    dist.barrier()


def prepare_tag(tag_dir: Path) -> set[str] | None:
    """On rank 0 before DeepSpeed writes: create the tag directory, returning None when this save creates
    it, else the names already in it. A marker of an earlier save of this tag is removed first: the files
    it vouches for are about to be rewritten."""
    try:
        if tag_dir.is_dir():
            (tag_dir / COMPLETE_MARKER).unlink(missing_ok=True)
            return {p.name for p in tag_dir.iterdir()}
        tag_dir.mkdir(parents=True)
        return None
    except OSError as err:
        raise ValueError(write_failure_sentence(tag_dir.parent, tag_dir.name, str(tag_dir), err, None)) from None


def mark_complete(tag_dir: Path, directory: Path) -> None:
    """Rank 0, after every rank's files are written: the completion marker, then ``latest``."""
    import json

    try:
        write_text_atomic(tag_dir / COMPLETE_MARKER, json.dumps(completion_record(tag_dir), indent=1) + "\n",
                          fsync=True)
        write_text_atomic(directory / LATEST_FILE, tag_dir.name, fsync=True)
    except OSError as err:
        with contextlib.suppress(OSError):
            (tag_dir / COMPLETE_MARKER).unlink(missing_ok=True)
        raise ValueError(write_failure_sentence(directory, tag_dir.name, str(tag_dir / COMPLETE_MARKER), err,
                                                None)) from None


def remove_created(tag_dir: Path, existed: set[str] | None) -> None:
    """Remove what this save created: the whole tag directory when it created it, else the files it added."""
    if existed is None:
        shutil.rmtree(tag_dir, ignore_errors=True)
        return
    for path in tag_dir.iterdir() if tag_dir.is_dir() else []:
        if path.name not in existed:
            with contextlib.suppress(OSError):
                shutil.rmtree(path) if path.is_dir() else path.unlink()


class FailedWrites:
    """DeepSpeed's checkpoint engine with its ``save`` (and ``makedirs``) catching OSError: the first failure
    is kept, the partial file removed, and DeepSpeed goes on through its collectives, so that every rank
    reaches the agreement in :func:`save_checkpoint`. Everything else is the wrapped engine's."""

    def __init__(self, inner):
        self.inner = inner
        self.failure: tuple[str, OSError, int | None] | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def save(self, state_dict, path, *args, **kwargs):
        if self.failure is not None:
            return None
        try:
            return self.inner.save(state_dict, path, *args, **kwargs)
        except OSError as err:
            self.failure = (str(path), err, state_bytes(state_dict))
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None

    def makedirs(self, path, *args, **kwargs):
        try:
            return self.inner.makedirs(path, *args, **kwargs)
        except OSError as err:
            self.failure = self.failure or (str(path), err, None)
            return None

    def raise_failure(self, directory: Path, tag: str) -> None:
        if self.failure is not None:
            raise ValueError(write_failure_sentence(directory, tag, *self.failure))


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (nested dicts, lists, tuples): about what saving it writes."""
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def write_failure_sentence(directory: Path, tag: str, path: str, err: OSError, needed: int | None) -> str:
    """One sentence for a checkpoint write that failed: the directory, the file, and for a full disk the
    bytes the file needed and the bytes free."""
    previous = read_latest(directory)
    kept = (f"'{LATEST_FILE}' still names {previous}" if previous else f"no '{LATEST_FILE}' was written")
    if err.errno in DISK_FULL:
        try:
            free = f", {shutil.disk_usage(directory).free / 1e6:.1f} MB free"
        except OSError:
            free = ""
        size = f" (about {needed / 1e6:.1f} MB needed for it{free})" if needed else (f" ({free[2:]})" if free else "")
        what = "the disk quota is exhausted" if err.errno == errno.EDQUOT else "the disk is full"
        return (f"checkpoint {tag} could not be saved in {directory}: {what} writing {path}{size}; the partial "
                f"checkpoint was removed and {kept}, free space there or pass another --save, then resume with "
                "--load.")
    return (f"checkpoint {tag} could not be saved in {directory}: writing {path} failed ({err.strerror or err}); "
            f"the partial checkpoint was removed and {kept}, make the directory writable or pass another --save, "
            "then resume with --load.")
