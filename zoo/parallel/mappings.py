"""The conjugate communication operators of Megatron-LM (Shoeybi et al. 2019, Figure 3).

    f = copy_to_tp_region:      forward  Y = X              backward  dX = all-reduce(dY)
    g = reduce_from_tp_region:  forward  Y = all-reduce(X)  backward  dX = dY
    scatter_to_tp_region:       forward  Y = X[..., rank's slice of the last dim]
                                backward dX = all-gather(dY) along the last dim
    gather_from_tp_region:      forward  Y = all-gather(X) along the last dim
                                backward dX = dY[..., rank's slice]

f and g are each other's transpose: a column-parallel GEMM is entered through f and a
row-parallel GEMM is left through g, so an MLP or attention block costs one all-reduce forward
and one backward. With ``parallel`` None or tp_size 1 every operator is the identity and issues
no collective.

Collectives are called as ``torch.distributed.all_reduce`` / ``all_gather`` (looked up at call
time), so the tests can count them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zoo.parallel.state import ParallelState


def _all_reduce_copy(tensor: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """The TP-group sum of ``tensor`` in a new contiguous buffer; ``tensor`` itself is left as it was.

    The copy is needed: ``dist.all_reduce`` overwrites its argument, and neither mapping owns the
    tensor it is handed. In g's forward that is the caller's activation, which the caller may still
    read, or autograd may have saved for backward (then backward would fail the version check); in f's
    backward it is the incoming gradient, which autograd may share with other consumers (an add
    hands the same gradient tensor to both operands, e.g. the residual and the branch), and a custom
    backward must not modify it. One copy is made, straight into contiguous memory (``clone``
    followed by ``contiguous`` would copy a strided input twice). Dropping it would take an
    in-place g that marks its input dirty, legal only for callers that own a throwaway buffer.
    """
    tensor = tensor.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(tensor, group=parallel.tp_group)
    return tensor


def _split_last_dim(tensor: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    last = tensor.shape[-1]
    if last % parallel.tp_size != 0:
        raise ValueError(f"last dimension {last} is not divisible by tensor-parallel size "
                         f"{parallel.tp_size}; pad it to a multiple of {parallel.tp_size}.")
    piece = last // parallel.tp_size
    return tensor[..., parallel.tp_rank * piece:(parallel.tp_rank + 1) * piece].contiguous()


def _gather_last_dim(tensor: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    tensor = tensor.contiguous()
    pieces = [torch.empty_like(tensor) for _ in range(parallel.tp_size)]
    dist.all_gather(pieces, tensor, group=parallel.tp_group)
    return torch.cat(pieces, dim=-1)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, parallel):
        ctx.parallel = parallel
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_copy(grad, ctx.parallel), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, parallel):
        return _all_reduce_copy(x, parallel)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, parallel):
        ctx.parallel = parallel
        return _split_last_dim(x, parallel)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.parallel), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, parallel):
        ctx.parallel = parallel
        return _gather_last_dim(x, parallel)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.parallel), None


def _is_trivial(parallel: ParallelState | None) -> bool:
    return parallel is None or parallel.tp_size == 1


def copy_to_tp_region(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient over the TP group backward."""
    return x if _is_trivial(parallel) else _CopyToTensorParallelRegion.apply(x, parallel)


def reduce_from_tp_region(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """g: all-reduce (sum) over the TP group forward, identity backward."""
    return x if _is_trivial(parallel) else _ReduceFromTensorParallelRegion.apply(x, parallel)


def scatter_to_tp_region(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return x if _is_trivial(parallel) else _ScatterToTensorParallelRegion.apply(x, parallel)


def gather_from_tp_region(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    return x if _is_trivial(parallel) else _GatherFromTensorParallelRegion.apply(x, parallel)
