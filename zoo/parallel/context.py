"""Context parallelism: each sample's sequence split over c ranks, attention through DeepSpeed-Ulysses.

Jacobs et al. 2023, "DeepSpeed Ulysses": context rank j holds tokens [j S/c, (j+1) S/c) of every sample of
its micro-batch, (b, S/c, h), from the embedding to the loss. Everything a transformer does per token
(embeddings, norms, the GEMMs, the MLP, the loss) runs on those tokens alone. Attention needs every key, so
around it one all-to-all over the context group trades the sequence split for a head split and a second
one trades it back:

    Q, K, V:  (b, S/c, n, d) --all-to-all--> (b, S, n/c, d)      attention over all S positions, n/c heads
    O:        (b, S, n/c, d) --all-to-all--> (b, S/c, n, d)

Each all-to-all moves (c - 1)/c of its tensor. With tensor parallelism the n heads above are this TP rank's
n/t (and under Korthikanti sequence parallelism the column-parallel GEMM first gathers the S/c tokens its
TP group split t ways), so a layer splits its heads t c ways: n/t and, under grouped-query attention, the
n_kv/t key/value heads must split c ways, or divide c (each is then repeated c t / n_kv times before the
exchange, so that the c head groups are whole: query head h reads key/value head h // (n / n_kv) as before).

What changes outside attention: positions are global (rank j's RoPE angles and GPT-2 position embeddings
are those of positions j S/c ...), the loss is the mean over all the micro-batch's tokens (``g`` over the
context group: a sum forward, the identity backward, so each rank back-propagates its own tokens' share),
and DeepSpeed sums the gradients over the context ranks (its sequence-data-parallel group; see
:mod:`zoo.parallel.state`). The data path hands each rank its shard (:func:`context_shard`), labels
carrying the one token after the shard that its last position predicts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from zoo.errors import UserError
from zoo.parallel.state import ParallelState

__all__ = ["context_shard", "context_positions", "sum_over_context", "UlyssesAttention",
           "check_context_heads", "kv_head_repeats"]


def context_shard(batch: dict[str, torch.Tensor], parallel: ParallelState) -> dict[str, torch.Tensor]:
    """This context rank's part of a causal-LM micro-batch: ``input_ids`` (b, S) -> (b, S/c), tokens
    [j S/c, (j+1) S/c); ``labels`` (b, S) -> (b, S/c + 1), the same tokens and the next one (-100 after the
    sample's end), so that the model scores position t against label t + 1 with no label crossing ranks. The
    identity at c = 1."""
    c = parallel.cp_size
    if c == 1:
        return batch
    input_ids = batch["input_ids"]
    seq_len = input_ids.shape[1]
    if seq_len % c:
        raise UserError(f"sequence length {seq_len} does not divide by the context-parallel size {c}; pass "
                         f"--seq-length a multiple of {c}.")
    part = seq_len // c
    start = parallel.cp_rank * part
    shard = dict(batch)
    shard["input_ids"] = input_ids[:, start:start + part]                                     # (b, S/c)
    if "labels" in batch:
        labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)                   # (b, S + 1)
        shard["labels"] = labels[:, start:start + part + 1]                                     # (b, S/c + 1)
    return shard


def context_positions(local_len: int, parallel: ParallelState, device) -> torch.Tensor:
    """The global positions of this context rank's ``local_len`` tokens, (1, local_len): j S/c ... ."""
    start = parallel.cp_rank * local_len
    return torch.arange(start, start + local_len, device=device).unsqueeze(0)


class _SumOverContext(torch.autograd.Function):
    """``g`` over the context group: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=parallel.cp_group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_context(x: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """The sum of ``x`` over the context-parallel ranks, whose gradient reaches each rank's ``x`` unchanged: a
    loss summed this way back-propagates only this rank's tokens' terms, and the gradients DeepSpeed then sums
    over the context ranks are the whole sequence's. The identity at c = 1."""
    if parallel.cp_size == 1:
        return x
    return _SumOverContext.apply(x, parallel)


def kv_head_repeats(local_kv_heads: int, cp_size: int) -> int:
    """How many times each of a TP rank's key/value heads is repeated before the head exchange: 1 where c
    divides them, c / n_kv where they divide c."""
    return 1 if local_kv_heads % cp_size == 0 else cp_size // local_kv_heads


def check_context_heads(heads: int, kv_heads: int, tp_size: int, cp_size: int) -> None:
    """One sentence unless the t c layout can split the attention heads: n/t query heads in c groups, and the
    n_kv/t key/value heads in c groups or a divisor of c."""
    if cp_size == 1:
        return
    local, local_kv = heads // tp_size, kv_heads // tp_size
    if local % cp_size:
        raise UserError(f"{heads} attention heads over tensor-parallel size {tp_size} leave {local} per rank, which "
                         f"the context-parallel size {cp_size} does not divide; pass a --context-parallel-size that "
                         f"divides {local}.")
    if local_kv % cp_size and cp_size % local_kv:
        raise UserError(f"{kv_heads} key/value heads over tensor-parallel size {tp_size} leave {local_kv} per rank, "
                         f"which neither divides nor is divided by the context-parallel size {cp_size}; pass a "
                         f"--context-parallel-size that {local_kv} divides or that divides {local_kv}.")


def ensure_deepspeed_comm() -> None:
    """DeepSpeed's communication layer over the process group that exists (Ulysses' all-to-all runs through
    it); a no-op where DeepSpeed already joined it."""
    from deepspeed import comm  # local: DeepSpeed costs seconds to import

    if not comm.is_initialized():
        comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)


class UlyssesAttention(nn.Module):
    """Attention over the whole sequence from this context rank's tokens, through DeepSpeed's
    ``DistributedAttention`` (the all-to-alls of the module docstring) around ``core``.

    ``forward(q, k, v)`` takes this rank's tokens' heads, q (b, n_local, S/c, d), k and v (b, n_kv_local, S/c, d)
    after RoPE, and returns the attention output of the same tokens, (b, n_local, S/c, d). ``core(q, k, v)`` is
    the attention of one head group over all S positions, (b, heads, S, d) layout in and out.
    """

    def __init__(self, core: Callable[..., torch.Tensor], parallel: ParallelState, local_heads: int,
                 local_kv_heads: int):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention  # local: DeepSpeed costs seconds to import

        ensure_deepspeed_comm()
        self.repeats = kv_head_repeats(local_kv_heads, parallel.cp_size)
        self.core = core
        self.exchange = DistributedAttention(self._core_seq_major, parallel.cp_group, scatter_idx=2, gather_idx=1,
                                             num_kv_heads=local_kv_heads * self.repeats)

    def _core_seq_major(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
        """``core`` on (b, S, heads/c, d) tensors, as DeepSpeed hands them over."""
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **options)   # (b, heads/c, S, d)
        return out.transpose(1, 2)                                                            # (b, S, heads/c, d)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
        """``options`` go to ``core`` unchanged."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                           # (b, S/c, heads, d)
        if self.repeats > 1:
            k = k.repeat_interleave(self.repeats, dim=2)                           # (b, S/c, c, d)
            v = v.repeat_interleave(self.repeats, dim=2)
        out = self.exchange(q, k, v, 0, None, **options)                           # (b, S/c, n_local, d)
        return out.transpose(1, 2)                                                 # (b, n_local, S/c, d)
