"""The little communication zero-shot evaluation needs on the tp x dp grid.

* Data parallelism: every item (a WikiText window, a LAMBADA passage) is scored by exactly one DP
  rank. Items are split into ``dp`` disjoint contiguous blocks (no sampler padding, so nothing is
  counted twice) and the per-rank sums are all-reduced over the DP group. The TP ranks of a group
  share a DP rank, so they run the same forwards, as the tensor-parallel layers require.
* Tensor parallelism: rank i holds the logits Z_i of vocabulary slice V_i. The arg-max over the
  whole vocabulary is taken without gathering the logits:

      (m_i, j_i) = (max, first argmax) of Z_i over its real (unpadded) columns
      m          = all-reduce-max_i m_i
      argmax     = all-reduce-min_i ( j_i if m_i == m else +inf )

  which is torch.argmax's "first maximal index" rule over the full vocabulary, for O(n) scalars on
  the wire instead of the n x V logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from zoo.parallel.state import ParallelState, tp_rank_of, tp_size_of


def dp_block(num_items: int, parallel: ParallelState | None) -> range:
    """This DP rank's contiguous block of ``range(num_items)``; blocks are disjoint and cover all items."""
    dp_size = 1 if parallel is None else parallel.dp_size
    dp_rank = 0 if parallel is None else parallel.dp_rank
    return range(dp_rank * num_items // dp_size, (dp_rank + 1) * num_items // dp_size)


def dp_sum(values: Sequence[float], parallel: ParallelState | None,
           device: torch.device | str = "cpu") -> list[float]:
    """Sum each value over the DP group (fp64, one all-reduce); identity with one DP rank."""
    totals = torch.tensor(list(values), dtype=torch.float64, device=device)
    if parallel is not None and parallel.dp_size > 1:
        dist.all_reduce(totals, group=parallel.dp_group)
    return totals.tolist()


def vocab_parallel_argmax(local_logits: torch.Tensor, parallel: ParallelState | None,
                          vocab_size: int | None = None) -> torch.Tensor:
    """Global vocabulary id of the largest logit, from this rank's shard (..., V_padded / p).

    Columns at or beyond ``vocab_size`` (the padding) never win. Returns int64 of shape (...).
    """
    local_vocab = local_logits.shape[-1]
    start = tp_rank_of(parallel) * local_vocab
    real = local_vocab if vocab_size is None else min(max(vocab_size - start, 0), local_vocab)
    shape = local_logits.shape[:-1]
    never = torch.iinfo(torch.int64).max
    if real > 0:
        values, index = local_logits[..., :real].float().max(dim=-1)             # (...)
        index = index + start
    else:                                                                       # a shard of padding only
        values = torch.full(shape, float("-inf"), device=local_logits.device)
        index = torch.full(shape, never, dtype=torch.int64, device=local_logits.device)
    if tp_size_of(parallel) == 1:
        return index
    best = values.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=parallel.tp_group)
    index = torch.where(values == best, index, torch.full_like(index, never))
    dist.all_reduce(index, op=dist.ReduceOp.MIN, group=parallel.tp_group)
    return index
