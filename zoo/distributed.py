"""Process-group helpers every layer above the parallel primitives shares.

* Joining: :func:`join_process_group` (under a launcher), :func:`single_process_env` (a world of one
  for ``python script.py``), :func:`share_cpu_threads` (CPU ranks split the cores).
* Data parallelism: :func:`dp_block` (this DP rank's contiguous block of items) and the DP sums and
  means (:func:`dp_sum`, :func:`means_over_dp`), one all-reduce each.
* Agreement: :func:`raise_on_any_rank`. A rank that raises while its peers go on into a collective
  leaves them hung, or dying with a transport error ("Connection closed by peer") that names neither
  the problem nor the fix. The rule: run the step that may fail (reading a file, a batch, a writability
  check) on every rank, then agree on the outcome before any collective that would hang::

      batches = raise_on_any_rank(lambda: [data.micro_batch_at(...) for k in range(gas)])

  Each rank runs ``fn``; one all-reduce of a failure flag follows (the common, successful case costs
  that one scalar collective). When any rank failed, the failures are gathered and every rank raises
  the first failing rank's error: a user error (ValueError, FileNotFoundError) as the same type with
  the same sentence on every rank, anything else unchanged on the rank that raised it and as a
  RuntimeError naming that rank and its error on the others.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from zoo.parallel.state import ParallelState

T = TypeVar("T")

USER_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


# ---------------------------------------------------------------------------------------------- joining

def share_cpu_threads() -> None:
    """On CPU, give each local rank its share of the cores (as torchrun does with OMP_NUM_THREADS=1);
    the deepspeed launcher leaves every rank at all cores, which oversubscribes them 2x at 2 ranks."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


def launched_distributed() -> bool:
    """Started by a launcher (deepspeed, torchrun, mpirun): the process-group variables are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def join_process_group(local_rank: int) -> str:
    """Join the launcher's process group (NCCL on GPUs, gloo on CPU), bind this rank's device and
    return its name."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed()
    share_cpu_threads()
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    return accelerator.current_device_name()


def single_device() -> str:
    """The device of a process that runs alone (no process group)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def single_process_env() -> None:
    """Let ``python script.py`` (e.g. under ``wandb agent``) run as a world of one: without a launcher's
    variables, set the ones ``torch.distributed`` reads, on a free loopback port."""
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


# ------------------------------------------------------------------------------------- data parallelism

def dp_block(num_items: int, parallel: ParallelState | None) -> range:
    """This DP rank's contiguous block of ``range(num_items)``; blocks are disjoint and cover all items
    (no sampler padding, so nothing is counted twice). The TP ranks of a group share a DP rank, so they
    get the same block, as the tensor-parallel layers require. ``None`` is a single process."""
    parallel = parallel or ParallelState.single()
    return range(parallel.dp_rank * num_items // parallel.dp_size, (parallel.dp_rank + 1) * num_items // parallel.dp_size)


def dp_sum(values: Sequence[float], parallel: ParallelState | None,
           device: torch.device | str = "cpu") -> list[float]:
    """Sum each value over the DP group (fp64, one all-reduce on ``device``); identity with one DP rank."""
    totals = torch.tensor(list(values), dtype=torch.float64, device=device)
    if parallel is not None and parallel.dp_size > 1:
        dist.all_reduce(totals, group=parallel.dp_group)
    return totals.tolist()


def means_over_dp(sums: dict[str, torch.Tensor], count: int, parallel: ParallelState,
                  device: torch.device | str | None = None) -> dict[str, float]:
    """Per-key means over ``count`` micro-batches and the DP ranks, in one all-reduce on ``device``
    (the engine's: NCCL reduces only accelerator tensors)."""
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in sums.values()]) / count
    if parallel.dp_size > 1:
        stacked = stacked.to(device) if device is not None else stacked
        dist.all_reduce(stacked, group=parallel.dp_group)
        stacked /= parallel.dp_size
    return dict(zip(sums, stacked.tolist()))


# ------------------------------------------------------------------------------------------- agreement

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
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return None
    failures: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, (dist.get_rank(), failure), group=group)
    return next((rank, fail) for rank, fail in failures if fail is not None)


def collective_device(group=None) -> torch.device:
    """Where a small collective's tensor lives: the CPU for gloo, the accelerator's current device for
    NCCL and the like."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())
