"""Agreement on failure: a rank's error reaches every rank of a group as the same exception.

A rank that raises while its peers go on into a collective leaves them hung, or dying with a transport
error ("Connection closed by peer") that names neither the problem nor the fix. The rule: run the step
that may fail (reading a file, a batch, a writability check) on every rank, then agree on the outcome
before any collective that would hang::

    batches = raise_on_any_rank(lambda: [batch_or_raise(next(loader)) for k in range(gas)])

Three forms, one rule for what is raised (:func:`zoo.errors.raise_failure_of_rank`: a user error as the
same type with the same sentence on every rank, anything else unchanged on the rank that raised it and
as a RuntimeError naming that rank on the others):

* :func:`raise_on_any_rank` runs ``fn`` on every rank; one all-reduce of a failure flag follows (the
  successful case costs that one scalar collective), and the failures are gathered only when one exists.
* :func:`first_error_everywhere` agrees on errors the ranks already caught (the lowest failing rank wins).
* :func:`same_error_everywhere` broadcasts one rank's outcome (a writer's) to the others.

Without an initialized process group each is just the local call or raise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from zoo.errors import error_kind, raise_failure_of_rank

T = TypeVar("T")


def in_process_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def collective_device(group=None) -> torch.device:
    """Where a small collective's tensor lives: the CPU for gloo, the accelerator's current device for
    NCCL and the like."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator  # local: deepspeed's import cost, off gloo only

    return torch.device(get_accelerator().current_device_name())


def raise_on_any_rank(fn: Callable[[], T], group=None) -> T:
    """``fn()`` on this rank; raises on every rank of ``group`` (default: the world) if it raised on any.

    Every rank of ``group`` must call it at the same point, as for any collective."""
    if not in_process_group():
        return fn()
    try:
        result, failure, error = fn(), None, None
    except Exception as err:  # noqa: BLE001 - every rank must reach the agreement, whatever happened
        result, failure, error = None, (error_kind(err), str(err)), err
    first = agreed_failure(failure, group)
    if first is None:
        return result
    rank, (kind, message) = first
    raise_failure_of_rank(rank, kind, message, error, dist.get_rank())


def agreed_failure(failure: tuple[str, str] | None, group=None) -> tuple[int, tuple[str, str]] | None:
    """``(global rank, (exception type name, message))`` of the lowest rank of ``group`` whose ``failure``
    is not None, the same on every rank; None when no rank failed."""
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return None
    failures: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, (dist.get_rank(), failure), group=group)
    return next((rank, fail) for rank, fail in failures if fail is not None)


def first_error_everywhere(error: BaseException | None, group=None) -> None:
    """Collective: if any rank of ``group`` had an error, raise the lowest such rank's error on every rank.
    Use it for checks every rank makes on its own."""
    if not in_process_group():
        if error is not None:
            raise error
        return
    mine = None if error is None else (dist.get_rank(), error_kind(error), str(error))
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [entry for entry in everyone if entry is not None]
    if failed:
        rank, kind, message = min(failed)
        raise_failure_of_rank(rank, kind, message, error, dist.get_rank())


def same_error_everywhere(error: BaseException | None, src: int = 0, group=None) -> None:
    """Collective: raise on every rank of ``group`` the error rank ``src`` (a global rank) had, if it had
    one."""
    if not in_process_group():
        if error is not None:
            raise error
        return
    outcome = [None if error is None else (error_kind(error), str(error))]
    dist.broadcast_object_list(outcome, src=src, group=group, device=collective_device(group))
    if outcome[0] is not None:
        kind, message = outcome[0]
        raise_failure_of_rank(src, kind, message, error, dist.get_rank())
