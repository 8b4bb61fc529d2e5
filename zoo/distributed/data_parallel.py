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


def weighted_means_over_dp(sums: dict[str, tuple[torch.Tensor, torch.Tensor]], parallel: ParallelState,
                           device: torch.device | str | None = None) -> dict[str, float]:
    """Per-key means over every item the DP ranks evaluated: sum(value * weight) / sum(weight), from each rank's
    (weighted sum, total weight) pair, in fp64 (token counts pass 2^24 in fp32), in one all-reduce on
    ``device`` (the engine's: NCCL reduces only accelerator tensors). Each item counts once with its weight,
    so the mean is the same however the items were split over ranks and micro-batches. A key whose weight is
    0 on every rank gives nan. With context parallelism every context rank holds its micro-batch's whole mean
    and weighs it by its own tokens: summed over the context ranks too, value and weight are the whole
    micro-batch's."""
    stacked = torch.stack([torch.as_tensor(value, dtype=torch.float64) for pair in sums.values() for value in pair])
    group = parallel.seq_dp_group if parallel.cp_size > 1 else parallel.dp_group
    if parallel.dp_size * parallel.cp_size > 1:
        stacked = stacked.to(device) if device is not None else stacked
        dist.all_reduce(stacked, group=group)
    totals = stacked.view(-1, 2).tolist()
    return {key: (total / weight if weight else float("nan")) for key, (total, weight) in zip(sums, totals)}
