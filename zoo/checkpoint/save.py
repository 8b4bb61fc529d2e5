"""Writing a DeepSpeed training checkpoint of a zoo run: every rank's files, a completion marker, then
the ``latest`` pointer.

A tag counts as a checkpoint only once its save finished on every rank: after the barrier that follows
DeepSpeed's writes, rank 0 writes :data:`~zoo.checkpoint.files.COMPLETE_MARKER` into the tag (every file
and its size, atomically and fsynced), and only then ``latest``. A run killed mid-save leaves a tag
without the marker, which resuming skips (:func:`zoo.checkpoint.files.resume_tag_directory`) and export
refuses.

A write that fails is caught where DeepSpeed writes each file (its checkpoint engine's ``save``), so every
rank still goes through DeepSpeed's own collectives; then the ranks agree, what this save created is
removed (the tag directory, or the new files of a tag that existed, whose marker is gone so it is not
resumed), ``latest`` is left as it was, and every rank raises the same sentence. ``torch.save`` reports a
failed write as an OSError only on some paths: its zip writer (DeepSpeed's default serialization) raises a
RuntimeError ("[enforce fail at inline_container.cc:...] . unexpected pos ..." or "... file write
failed"), its legacy writer "write(): fd N failed with <strerror>". So both are caught, and a full disk is
recognized by the errno where there is one, else by the strerror in torch's text, else by the free space
at the moment of the failure being below the bytes the file needed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zoo.atomic import write_text_atomic
from zoo.checkpoint.deepspeed_tools import guard_deepspeed_tools, refuse_universal_conversion
from zoo.checkpoint.files import COMPLETE_MARKER, LATEST_FILE, completion_record, read_latest
from zoo.distributed import collective_device, raise_on_any_rank
from zoo.errors import UserError

__all__ = ["save_checkpoint"]

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
WRITE_ERRORS = (OSError, RuntimeError)


def save_checkpoint(engine, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
    """DeepSpeed checkpoint under ``directory/tag``, collective. The completion marker and then ``latest``
    are written atomically by rank 0 only after every rank has finished writing, so a crash mid-save
    leaves the previous checkpoint as ``latest`` and this tag without a marker. A failed write on any rank
    raises the same UserError on every rank, with what this save created removed."""
    directory = Path(directory)
    tag_dir = directory / tag
    is_first = dist.get_rank() == 0
    existed = raise_on_any_rank(lambda: prepare_tag(tag_dir) if is_first else None)
    resaved = torch.tensor([int(existed is not None)], dtype=torch.int32, device=collective_device())
    dist.broadcast(resaved, src=0)
    writes = FailedWrites(engine.checkpoint_engine, resaved=bool(resaved.item()))
    engine.checkpoint_engine = writes
    tp_size = engine.mpu.get_tensor_model_parallel_world_size() if getattr(engine, "mpu", None) else 1
    refuse_universal_conversion(engine, tp_size)
    try:
        engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
    except WRITE_ERRORS as err:
        # Raised by DeepSpeed outside its checkpoint engine (its copy of the recovery scripts, the last
        # step before its closing barrier): stand in for that barrier so the ranks meet below.
        writes.failure = writes.failure or WriteFailure(str(tag_dir), err)
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
        raise UserError(write_failure_sentence(tag_dir.parent, tag_dir.name, WriteFailure(str(tag_dir), err))) \
            from None


def mark_complete(tag_dir: Path, directory: Path) -> None:
    """Rank 0, after every rank's files are written: the completion marker, then ``latest``."""
    try:
        write_text_atomic(tag_dir / COMPLETE_MARKER, json.dumps(completion_record(tag_dir), indent=1) + "\n",
                          fsync=True)
        write_text_atomic(directory / LATEST_FILE, tag_dir.name, fsync=True)
    except OSError as err:
        with contextlib.suppress(OSError):
            (tag_dir / COMPLETE_MARKER).unlink(missing_ok=True)
        raise UserError(write_failure_sentence(directory, tag_dir.name,
                                                WriteFailure(str(tag_dir / COMPLETE_MARKER), err))) from None


def remove_created(tag_dir: Path, existed: set[str] | None) -> None:
    """Remove what this save created: the whole tag directory when it created it, else the files it added."""
    if existed is None:
        shutil.rmtree(tag_dir, ignore_errors=True)
        return
    for path in tag_dir.iterdir() if tag_dir.is_dir() else []:
        if path.name not in existed:
            with contextlib.suppress(OSError):
                shutil.rmtree(path) if path.is_dir() else path.unlink()


class WriteFailure:
    """One failed checkpoint write: the file, the error, the bytes the file needed and the bytes free in
    its directory right after the failure (None where unknown)."""

    def __init__(self, path: str, err: Exception, needed: int | None = None, free: int | None = None,
                 resaved: bool = False):
        self.path, self.err, self.needed, self.free, self.resaved = path, err, needed, free, resaved


class FailedWrites:
    """DeepSpeed's checkpoint engine with its ``save`` (and ``makedirs``) catching a failed write (OSError, or
    torch's RuntimeError): the first failure is kept with the free space measured before the partial file
    is removed, and DeepSpeed goes on through its collectives, so that every rank reaches the agreement in
    :func:`save_checkpoint`. ``resaved``: the tag existed before this save (the same on every rank).
    Everything else is the wrapped engine's."""

    def __init__(self, inner, resaved: bool = False):
        self.inner = inner
        self.resaved = resaved
        self.failure: WriteFailure | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def save(self, state_dict, path, *args, **kwargs):
        if self.failure is not None:
            return None
        try:
            return self.inner.save(state_dict, path, *args, **kwargs)
        except WRITE_ERRORS as err:
            self.failure = WriteFailure(str(path), err, state_bytes(state_dict), free_bytes(Path(path).parent))
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None

    def makedirs(self, path, *args, **kwargs):
        try:
            return self.inner.makedirs(path, *args, **kwargs)
        except OSError as err:
            self.failure = self.failure or WriteFailure(str(path), err)
            return None

    def raise_failure(self, directory: Path, tag: str) -> None:
        if self.failure is not None:
            self.failure.resaved = self.resaved
            raise UserError(write_failure_sentence(directory, tag, self.failure))


def free_bytes(directory: Path) -> int | None:
    """The bytes free for this user under ``directory``; None when that cannot be read."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (nested dicts, lists, tuples): about what saving it writes."""
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(value) for value in state)
    return 0


def disk_full_kind(failure: WriteFailure) -> str | None:
    """"the disk quota is exhausted", "the disk is full", or None when ``failure`` is not for lack of space:
    by its errno; else (torch's RuntimeError) by the strerror in its text, or by fewer bytes free right
    after the failure than the file needed."""
    err = failure.err
    code = getattr(err, "errno", None)
    if code is None:
        text = str(err)
        code = next((c for c in DISK_FULL if os.strerror(c) in text), None)
        if code is None and failure.free is not None and failure.needed and failure.free < failure.needed:
            code = errno.ENOSPC
    if code == errno.EDQUOT:
        return "the disk quota is exhausted"
    return "the disk is full" if code == errno.ENOSPC else None


def failure_reason(err: Exception) -> str:
    """The cause of a failed write in a few words: an OSError's strerror, or torch's message on one line
    without its source-location prefix ("[enforce fail at inline_container.cc:672] . ")."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = " ".join(str(err).split())
    text = re.sub(r"^\[enforce fail at [^\]]*\][\s.]*", "", text).rstrip(". ")
    return text or type(err).__name__


def write_failure_sentence(directory: Path, tag: str, failure: WriteFailure) -> str:
    """One sentence for a checkpoint write that failed: the directory, the file, what became of the tag, and
    for a full disk the bytes the file needed and the bytes free."""
    previous = read_latest(directory)
    kept = (f"'{LATEST_FILE}' still names {previous}" if previous else f"no '{LATEST_FILE}' was written")
    if failure.resaved:
        left = (f"{tag} existed before, is now incomplete and will not be resumed (its completion marker was "
                f"removed, and so were the files this save added), and {kept}")
    else:
        left = f"the partial checkpoint was removed and {kept}"
    what = disk_full_kind(failure)
    if what is not None:
        free = failure.free if failure.free is not None else free_bytes(directory)
        free_text = f", {free / 1e6:.1f} MB free" if free is not None else ""
        size = (f" (about {failure.needed / 1e6:.1f} MB needed for it{free_text})" if failure.needed
                else (f" ({free_text[2:]})" if free_text else ""))
        return (f"checkpoint {tag} could not be saved in {directory}: {what} writing {failure.path}{size}; "
                f"{left}; free space there or pass another --save, then resume with --load.")
    return (f"checkpoint {tag} could not be saved in {directory}: writing {failure.path} failed "
            f"({failure_reason(failure.err)}); {left}; fix that cause (permissions, space, a file size limit) "
            "or pass another --save, then resume with --load.")
