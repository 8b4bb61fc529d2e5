"""Agreeing on success across ranks, so that a failure on one rank reaches every rank as the same error.

A rank that raises while its peers go on into a collective leaves them hung, or dying with a transport
error ("Connection closed by peer") that names neither the problem nor the fix. The rule: run the step
that may fail (reading a file, a batch, a writability check) on every rank, then agree on the outcome
before any collective that would hang. :func:`raise_on_any_rank` does both:

    batches = raise_on_any_rank(lambda: [data.micro_batch_at(...) for k in range(gas)])

Each rank runs ``fn``; one all-reduce of a failure flag follows (the common, successful case costs
that one scalar collective). When any rank failed, the failures are gathered and every rank raises the
first failing rank's error: a user error (ValueError, FileNotFoundError) as the same type with the same
sentence on every rank, anything else unchanged on the rank that raised it and as a RuntimeError naming
that rank and its error on the others.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

USER_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}

__all__ = ["raise_on_any_rank", "agreed_failure", "USER_ERRORS"]


def raise_on_any_rank(fn: Callable[[], T], group=None) -> T:
    """``fn()`` on this rank; raises on every rank of ``group`` (default: the world) if it raised on any.

    Every rank of ``group`` must call it at the same point, as for any collective. Without an
    initialized process group it is just ``fn()``.
    """
    if not dist.is_available() or not dist.is_initialized():
        return fn()
    try:
        result, failure, error = fn(), None, None
    except Exception as err:  # noqa: BLE001 - every rank must reach the agreement, whatever happened
        result, failure, error = None, (type(err).__name__, str(err)), err
    first = agreed_failure(failure, group)
    if first is None:
        return result
    rank, (kind, message) = first
    if kind in USER_ERRORS:
        raise USER_ERRORS[kind](message) from None
    if error is not None and rank == dist.get_rank():
        raise error
    raise RuntimeError(f"rank {rank} failed with {kind}: {message}")


def agreed_failure(failure: tuple[str, str] | None, group=None) -> tuple[int, tuple[str, str]] | None:
    """``(global rank, (exception type name, message))`` of the lowest rank of ``group`` whose ``failure``
    is not None, the same on every rank; None when no rank failed."""
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=_collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return None
    failures: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, (dist.get_rank(), failure), group=group)
    return next((rank, fail) for rank, fail in failures if fail is not None)


def _collective_device(group) -> torch.device:
    """Where the flag lives: the CPU for gloo, the accelerator's current device for NCCL and the like."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())
