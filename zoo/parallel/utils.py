"""Small arithmetic of tensor partitioning: exact division, vocab padding, shard <-> master."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zoo.errors import UserError


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """``numerator / denominator``, refusing a remainder with a one-sentence error."""
    if numerator % denominator != 0:
        raise UserError(f"{what} {numerator} is not divisible by {denominator}; "
                         f"choose a {what} that is a multiple of {denominator}.")
    return numerator // denominator


def pad_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Pad the vocabulary to a multiple of ``multiple * tp_size`` (Megatron's make-vocab-divisible).

    Every TP rank then holds an equal, GEMM-friendly slice: 50257 -> 50304 at tp=1, 51200 at tp=8.
    """
    if multiple < 1:
        raise UserError(f"vocab padding multiple {multiple} is invalid; pass a positive integer.")
    unit = multiple * tp_size
    return ((vocab_size + unit - 1) // unit) * unit


def vocab_range(padded_vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The [start, end) rows of the padded vocabulary owned by ``tp_rank``."""
    per_rank = divide(padded_vocab_size, tp_size, "padded vocab size")
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def real_vocab_columns(local_vocab: int, tp_rank: int, vocab_size: int | None) -> int:
    """How many of a vocab shard's ``local_vocab`` columns are real tokens (ids < ``vocab_size``, the
    unpadded vocabulary; None: all): the rest is padding, kept out of every softmax and arg-max."""
    if vocab_size is None:
        return local_vocab
    return min(max(vocab_size - tp_rank * local_vocab, 0), local_vocab)


def shard_index(size: int, dim_rank: int, tp_size: int, stride: int = 1) -> list[tuple[int, int]]:
    """Ranges of a master dimension of length ``size`` that belong to ``dim_rank``.

    With ``stride`` s the dimension is s equal blocks (e.g. [Q | K | V]) and each block is split
    across ranks, so a rank owns one piece of every block: the fused-QKV layout where each rank
    holds q, k and v of its own heads.
    """
    block = divide(size, stride, "partitioned dimension")
    piece = divide(block, tp_size, "partitioned block")
    return [(b * block + dim_rank * piece, b * block + (dim_rank + 1) * piece) for b in range(stride)]


def shard_tensor(master: torch.Tensor, dim: int, tp_rank: int, tp_size: int, stride: int = 1) -> torch.Tensor:
    """This rank's shard of a master tensor along ``dim`` (see :func:`shard_index`)."""
    pieces = [master.narrow(dim, start, end - start)
              for start, end in shard_index(master.shape[dim], tp_rank, tp_size, stride)]
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def merge_shards(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: rebuild the master tensor from every rank's shard."""
    if stride == 1:
        return torch.cat(list(shards), dim=dim)
    blocks = [torch.chunk(shard, stride, dim=dim) for shard in shards]
    return torch.cat([blocks[r][b] for b in range(stride) for r in range(len(shards))], dim=dim)
