"""Agreement on host flags, and work only the first rank does while the others wait.

:func:`host_group` is a gloo group next to NCCL, so small flags agreed every iteration (:func:`agree_max`)
never synchronise the accelerator. :func:`run_on_first_rank` runs rank 0's work (resharding, exporting a
checkpoint) while the others wait, and :func:`run_on_every_rank` work of uneven length on every rank, both
under a timeout sized from the work (:func:`first_rank_timeout`, :func:`directory_bytes`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from zoo.parallel.agreement import collective_device, raise_on_any_rank, same_error_everywhere

T = TypeVar("T")


# Rank 0's own work (resharding a checkpoint, exporting one) moves this many bytes per second at least,
# on the slowest shared filesystem we plan for; the waiting ranks' timeout is sized from it.
SLOWEST_BYTES_PER_S = 20e6
WAIT_MARGIN = timedelta(minutes=10)


def host_group(timeout: timedelta | None = None):
    """A gloo group of the whole world for agreements on host flags (stop requests, data errors): its
    all-reduce runs on the CPU, so agreeing every iteration never waits for the accelerator's queue to
    drain. On a gloo world it is the world group itself. Collective: every rank calls it once."""
    if dist.get_backend() == "gloo" and timeout is None:
        return dist.group.WORLD
    kwargs = {} if timeout is None else {"timeout": timeout}
    return dist.new_group(backend="gloo", **kwargs)


def agree_max(values: Sequence[int], group=None) -> list[int]:
    """Element-wise maximum of small integers over ``group`` (one all-reduce on the group's device; on
    :func:`host_group`, the host). Identity without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return [int(v) for v in values]
    flags = torch.tensor([int(v) for v in values], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags.tolist()


def first_rank_timeout(work_bytes: int) -> timedelta:
    """How long the other ranks wait for rank 0 to process ``work_bytes`` of checkpoint: the bytes at
    :data:`SLOWEST_BYTES_PER_S` (read and written, so twice), plus :data:`WAIT_MARGIN`; at least the
    margin. An 8.3B fp16 checkpoint with its optimizer state (~116 GB) gets about 3 h 20 min."""
    return timedelta(seconds=2 * work_bytes / SLOWEST_BYTES_PER_S) + WAIT_MARGIN


def run_on_first_rank(fn: Callable[[], T], work_bytes: int, first=None) -> T | None:
    """``fn()`` on the first rank (global rank 0, or the ranks for which ``first()`` is true) while the
    others wait; a failure reaches every rank as in :func:`raise_on_any_rank`.

    The approach to the watchdog: the wait is an agreement on a fresh gloo (host) group whose timeout
    fits the work (:func:`first_rank_timeout`), not a collective of the NCCL group, whose watchdog
    (10 minutes by default) would kill the waiting ranks while rank 0 still reshards or exports a
    checkpoint of a hundred gigabytes. Returns ``fn()``'s result on the ranks that ran it, None on the
    others. Collective: every rank calls it with the same ``work_bytes``.
    """
    if not dist.is_available() or not dist.is_initialized():
        return fn()
    runs_here = first() if first is not None else dist.get_rank() == 0
    return run_on_every_rank(lambda: fn() if runs_here else None, work_bytes)


def run_on_every_rank(fn: Callable[[], T], work_bytes: int) -> T:
    """``fn()`` on every rank, then an agreement on its outcome (a failure reaches every rank as in
    :func:`raise_on_any_rank`) on a fresh gloo group whose timeout fits ``work_bytes`` of work
    (:func:`first_rank_timeout`): ranks whose ``fn`` returns at once (a failure, or nothing to do) wait
    there for the ones still working, never under the run group's timeout. Collective: every rank calls
    it with the same ``work_bytes``."""
    if not dist.is_available() or not dist.is_initialized():
        return fn()
    group = dist.new_group(backend="gloo", timeout=first_rank_timeout(work_bytes))
    try:
        return raise_on_any_rank(fn, group=group)
    finally:
        dist.destroy_process_group(group)


def directory_bytes(path: str | os.PathLike) -> int:
    """Total size of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total


def first_rank_result(fn: Callable[[], T], group=None) -> T:
    """``fn()`` run on the group's first rank only, its result handed to every rank of ``group`` (default:
    the world); its failure is raised on every rank (:func:`zoo.parallel.agreement.same_error_everywhere`).
    For what every rank would otherwise find out alike from a shared filesystem (which checkpoint to resume,
    its layout): one rank reads, instead of every rank of the world. Collective over ``group``."""
    if not dist.is_available() or not dist.is_initialized():
        return fn()
    first = dist.get_global_rank(group, 0) if group is not None else 0
    result, error = None, None
    if dist.get_rank() == first:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - every rank must reach the agreement, whatever happened
            error = err
    same_error_everywhere(error, src=first, group=group)
    box = [result]
    dist.broadcast_object_list(box, src=first, group=group, device=collective_device(group))
    return box[0]
