"""Data parallelism: this DP rank's contiguous block of items, and sums and means over the DP group in one
all-reduce each."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from zoo.parallel.state import ParallelState, as_state


def dp_block(num_items: int, parallel: ParallelState | None) -> range:
    """This DP rank's contiguous block of ``range(num_items)``; blocks are disjoint and cover all items
    (no sampler padding, so nothing is counted twice). The TP ranks of a group share a DP rank, so they
    get the same block, as the tensor-parallel layers require. ``None`` is a single process."""
    parallel = as_state(parallel)
    return range(parallel.dp_rank * num_items // parallel.dp_size, (parallel.dp_rank + 1) * num_items // parallel.dp_size)


def dp_sum(values: Sequence[float], parallel: ParallelState | None,
           device: torch.device | str = "cpu") -> list[float]:
    """Sum each value over the DP group (fp64, one all-reduce on ``device``); identity with one DP rank."""
    totals = torch.tensor(list(values), dtype=torch.float64, device=device)
    parallel = as_state(parallel)
    if parallel.dp_size > 1:
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
