"""Gather to one rank: the collective of a streaming writer.

``all_gather`` leaves the full tensor on every rank of the group; a writer that saves a merged
checkpoint needs it on one rank only, one tensor at a time. With shards A_1 … A_p of a tensor A on
the p ranks of a group,

    gather_to_first(A_r, group) = [A_1, …, A_p] on the group's first rank (on the CPU), None elsewhere,

so the first rank holds one merged tensor in flight and the others nothing beyond their own shard.
It is ``torch.distributed.gather``: gloo gathers CPU tensors; NCCL gathers tensors on the
accelerator into buffers on the first rank's accelerator, which are then moved to the CPU one at a
time (each freed from the accelerator as it is copied), so the writer's accelerator never holds more
than one gathered tensor either.

:func:`zoo.parallel.agreement.same_error_everywhere` is the matching agreement: after a writer finished
(or failed), every rank learns its outcome, so a failure on the writer reaches every rank as the same
sentence instead of leaving them waiting in the next collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_BYTES = 16 * 2 ** 20   # one collective moves at most this much per rank: the backends' own buffers stay small


def gather_to_first(tensor: torch.Tensor, group=None, chunk_bytes: int = CHUNK_BYTES) -> list[torch.Tensor] | None:
    """Collective over ``group``: every rank's ``tensor`` (all of one shape and dtype), in group-rank
    order, on the group's first rank, as CPU tensors; None on the other ranks. Without a process group
    (or in a group of one) it is ``[tensor]`` on the CPU.

    A tensor above ``chunk_bytes`` goes in blocks of rows (dim 0), each gathered straight into its place
    in the first rank's buffers, so the backend's transient buffers (gloo flattens a gather's outputs)
    hold one block per rank, not a second copy of the whole tensor."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [tensor.detach().cpu()]
    tensor = tensor.detach().contiguous()
    is_first = dist.get_rank(group) == 0
    buffers = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))] if is_first else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.dim() > 0 and len(tensor) > 0 else 0
    rows = max(chunk_bytes // row_bytes, 1) if row_bytes else max(len(tensor) if tensor.dim() else 1, 1)
    if tensor.dim() == 0:
        dist.gather(tensor, gather_list=buffers, dst=dst, group=group)
    else:
        for start in range(0, max(len(tensor), 1), rows):
            block = tensor[start:start + rows]
            targets = [buffer[start:start + rows] for buffer in buffers] if is_first else None
            dist.gather(block, gather_list=targets, dst=dst, group=group)
    if not is_first:
        return None
    pieces = []
    while buffers:                       # one piece at a time off the accelerator (a no-op copy on the CPU)
        pieces.append(buffers.pop(0).cpu())
    return pieces
