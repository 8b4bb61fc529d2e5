"""The arg-max over a vocabulary split across the tensor-parallel group, without gathering the logits.

Rank i holds the logits Z_i of vocabulary slice V_i:

    (m_i, j_i) = (max, first argmax) of Z_i over its real (unpadded) columns
    m          = all-reduce-max_i m_i
    argmax     = all-reduce-min_i ( j_i if m_i == m else +inf )

which is torch.argmax's "first maximal index" rule over the full vocabulary, for O(n) scalars on the
wire instead of the n x V logits. Greedy decoding and LAMBADA's accuracy use it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zoo.parallel.state import ParallelState, as_state
from zoo.parallel.utils import real_vocab_columns


def vocab_parallel_argmax(local_logits: torch.Tensor, parallel: ParallelState | None,
                          vocab_size: int | None = None) -> torch.Tensor:
    """Global vocabulary id of the largest logit, from this rank's shard (..., V_padded / p).

    Columns at or beyond ``vocab_size`` (the padding) never win. Returns int64 of shape (...).
    """
    parallel = as_state(parallel)
    local_vocab = local_logits.shape[-1]
    start = parallel.tp_rank * local_vocab
    real = real_vocab_columns(local_vocab, parallel.tp_rank, vocab_size)
    shape = local_logits.shape[:-1]
    never = torch.iinfo(torch.int64).max
    if real > 0:
        values, index = local_logits[..., :real].float().max(dim=-1)             # (...)
        index = index + start
    else:                                                                       # a shard of padding only
        values = torch.full(shape, float("-inf"), device=local_logits.device)
        index = torch.full(shape, never, dtype=torch.int64, device=local_logits.device)
    if parallel.tp_size == 1:
        return index
    best = values.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=parallel.tp_group)
    index = torch.where(values == best, index, torch.full_like(index, never))
    dist.all_reduce(index, op=dist.ReduceOp.MIN, group=parallel.tp_group)
    return index
