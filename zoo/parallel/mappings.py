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

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.2.2). Between the tensor-parallel GEMMs (LayerNorm, dropout,
residual adds) every rank holds only its s/p tokens. zoo's activations are (b, s, h), so the
sequence dim is dim 1 and rank i holds tokens [i*s/p, (i+1)*s/p) of every sample (with (b, s, h)
the slice is strided, so each split/gather below costs one local copy that Megatron's (s, b, h)
avoids). The three operators are

    scatter_to_sequence_parallel_region:         forward  Y = X[:, rank's s/p tokens]
                                                 backward dX = all-gather(dY) along s
    gather_from_sequence_parallel_region:        forward  Y = all-gather(X) along s        ("g-bar")
                                                 backward dX = reduce-scatter(dY) along s
                  (tensor_parallel_output_grad=False: backward dX = dY[:, rank's tokens])
    reduce_scatter_to_sequence_parallel_region:  forward  Y = reduce-scatter(X) along s    ("g")
                                                 backward dX = all-gather(dY) along s

The all-gather and the reduce-scatter are each other's transpose, so the gather that enters a
column-parallel GEMM (replacing f) and the reduce-scatter that leaves a row-parallel GEMM
(replacing g) form the conjugate pair of the paper's Figure 5: per block one all-gather and one
reduce-scatter forward, one reduce-scatter and one all-gather backward. An all-reduce is a
reduce-scatter followed by an all-gather, so the bytes moved equal those of f and g. (The
column-parallel layers add one all-gather in backward: they keep only their s/p input tokens and
gather them again for the weight gradient, section 4.2.2; see ``zoo.parallel.layers``.)
``tensor_parallel_output_grad=False`` is for a gather whose consumer is replicated (the BERT
pooler): every rank then holds the same full gradient and keeps its own tokens of it.

Collectives are called as ``torch.distributed.all_reduce`` / ``all_gather`` /
``reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.13), looked up at call time, so
the tests can count them. On one host's CPU ranks whose TP group is the world, the sums go through
DeepSpeed's shared-memory kernel instead (``zoo.parallel.host_all_reduce``).

Under ``torch.compile`` (a compiled transformer block, :mod:`zoo.models.compiled`) the same operators trace into
the graph: Dynamo traces each autograd Function's forward and backward, and there every collective is torch's
functional collective (``all_reduce``, ``all_gather_single``, ``reduce_scatter_single`` of
``torch.distributed._functional_collectives``, on NCCL and gloo alike), whose wait the compiler places. The
process-group calls are kept for eager execution: ``async_op=True`` and ``Work.wait()`` break a graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

from zoo.errors import UserError
from zoo.parallel.host_all_reduce import Done, tp_all_reduce_
from zoo.parallel.state import ParallelState, as_state


def _all_reduce_copy(tensor: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """The TP-group sum of ``tensor`` in a new contiguous buffer; ``tensor`` itself is left as it was.

    The copy is needed: ``dist.all_reduce`` overwrites its argument, and neither mapping owns the
    tensor it is handed. In g's forward that is the caller's activation, which the caller may still
    read, or autograd may have saved for backward (then backward would fail the version check); in f's
    backward it is the incoming gradient, which autograd may share with other consumers (an add
    hands the same gradient tensor to both operands, e.g. the residual and the branch), and a custom
    backward must not modify it. One copy is made, straight into contiguous memory (``clone``
    followed by ``contiguous`` would copy a strided input twice). Callers that own a throwaway buffer
    use :func:`reduce_from_tp_region_` (in place, no copy); the column-parallel layers fuse f into their
    GEMM (``zoo.parallel.layers``), whose input gradient is a fresh tensor.
    """
    tensor = tensor.clone(memory_format=torch.contiguous_format)
    tp_all_reduce_(tensor, parallel.tp_group)
    return tensor


def _split_last_dim(tensor: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    last = tensor.shape[-1]
    if last % parallel.tp_size != 0:
        raise UserError(f"last dimension {last} is not divisible by tensor-parallel size "
                         f"{parallel.tp_size}; pad it to a multiple of {parallel.tp_size}.")
    piece = last // parallel.tp_size
    return tensor[..., parallel.tp_rank * piece:(parallel.tp_rank + 1) * piece].contiguous()


def _gather_last_dim(tensor: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    tensor = tensor.contiguous()
    if torch.compiler.is_compiling():
        return funcol.all_gather_single(tensor, tensor.dim() - 1, parallel.tp_group)
    pieces = [torch.empty_like(tensor) for _ in range(parallel.tp_size)]
    dist.all_gather(pieces, tensor, group=parallel.tp_group)
    return torch.cat(pieces, dim=-1)


SEQUENCE_DIM = 1   # activations are (b, s, h)


def check_sequence_divisible(seq_len: int, parallel: ParallelState | None) -> None:
    """Sequence parallelism splits the tokens evenly over the TP ranks: refuse a length that does not divide."""
    tp = as_state(parallel).tp_size
    if seq_len % tp != 0:
        raise UserError(f"sequence length {seq_len} is not divisible by tensor-parallel size {tp}, which sequence "
                         f"parallelism needs; use a sequence length that is a multiple of {tp} or turn "
                         "sequence_parallel off.")


def _split_sequence(tensor: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    check_sequence_divisible(tensor.shape[SEQUENCE_DIM], parallel)
    return tensor.chunk(parallel.tp_size, dim=SEQUENCE_DIM)[parallel.tp_rank].contiguous()   # (b, s/p, ...)


def _start_gather_sequence(tensor: torch.Tensor, parallel: ParallelState):
    """Start the all-gather of ``tensor`` (b, s/p, ...) along s; returns (work, finish), finish() waits and
    gives (b, s, ...). Between the two calls the caller may compute (Megatron's backward overlap); under
    ``torch.compile`` the gather is the functional one and the compiler places its wait."""
    tensor = tensor.contiguous()
    if torch.compiler.is_compiling():
        gathered = funcol.all_gather_single(tensor, SEQUENCE_DIM, parallel.tp_group)        # (b, s, ...)
        return Done(), lambda: gathered
    pieces = [torch.empty_like(tensor) for _ in range(parallel.tp_size)]
    work = dist.all_gather(pieces, tensor, group=parallel.tp_group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return torch.cat(pieces, dim=SEQUENCE_DIM)                                           # (b, s, ...)

    return work, finish


def _gather_sequence(tensor: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    return _start_gather_sequence(tensor, parallel)[1]()                                     # (b, s, ...)


def _start_reduce_scatter_sequence(tensor: torch.Tensor, parallel: ParallelState):
    """Start summing ``tensor`` (b, s, ...) over the TP group keeping this rank's s/p tokens; returns (work,
    out), ``out`` (b, s/p, ...) being valid after ``work.wait()``.

    ``reduce_scatter_tensor`` splits its input along dim 0, so the token blocks are first moved to the
    front, (p, b, s/p, ...) viewed as (p*b, s/p, ...), in one copy (which also leaves the caller's tensor
    untouched). Under ``torch.compile`` it is the functional reduce-scatter along s, already done."""
    check_sequence_divisible(tensor.shape[SEQUENCE_DIM], parallel)
    if torch.compiler.is_compiling():
        return Done(), funcol.reduce_scatter_single(tensor.contiguous(), "sum", SEQUENCE_DIM, parallel.tp_group)
    p = parallel.tp_size
    b, s = tensor.shape[0], tensor.shape[1]
    rest = tensor.shape[2:]
    blocks = tensor.reshape(b, p, s // p, *rest).transpose(0, 1).reshape(p * b, s // p, *rest)  # (p*b, s/p, ...)
    out = torch.empty((b, s // p, *rest), dtype=tensor.dtype, device=tensor.device)
    # torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    work = reduce_scatter(out, blocks, group=parallel.tp_group, async_op=True)
    return work, out


def _reduce_scatter_sequence(tensor: torch.Tensor, parallel: ParallelState) -> torch.Tensor:
    """Sum over the TP group, keeping this rank's s/p tokens: (b, s, ...) -> (b, s/p, ...)."""
    work, out = _start_reduce_scatter_sequence(tensor, parallel)
    work.wait()
    return out


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an operation on ``tensors``: grad mode is on and one of them requires grad.

    Where it does not (evaluation; the first, forward-only pass of full recomputation) the operators whose
    autograd Function takes ``*tensors`` compute their forward directly. The result is the same, and it is what
    ``torch.compile`` traces there: torch 2.13's Dynamo inlines such a Function's forward without autograd and
    drops its ``ctx`` when the number of arguments happens to equal the number of parameters of the forward
    (``*tensors`` counting as one), which makes the block fall back to eager.
    """
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


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


class _ReduceFromTensorParallelRegionInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, parallel):
        ctx.mark_dirty(x)
        tp_all_reduce_(x, parallel.tp_group)
        return x

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


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, parallel):
        ctx.parallel = parallel
        return _split_sequence(x, parallel)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.parallel), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, parallel, tensor_parallel_output_grad):
        ctx.parallel = parallel
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_sequence(x, parallel)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_sequence(grad, ctx.parallel), None, None
        return _split_sequence(grad, ctx.parallel), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, parallel):
        ctx.parallel = parallel
        return _reduce_scatter_sequence(x, parallel)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.parallel), None


class _AllReduceGradOfReplicated(torch.autograd.Function):
    """Identity on several tensors forward; backward all-reduces their gradients in one collective."""

    @staticmethod
    def forward(ctx, parallel, *tensors):
        ctx.parallel = parallel
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        tp_all_reduce_(flat, ctx.parallel.tp_group)
        pieces = flat.split([g.numel() for g in grads])
        return (None, *(piece.view_as(g) for piece, g in zip(pieces, grads)))


def copy_to_tp_region(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient over the TP group backward."""
    return x if as_state(parallel).tp_size == 1 else _CopyToTensorParallelRegion.apply(x, parallel)


def reduce_from_tp_region(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """g: all-reduce (sum) over the TP group forward, identity backward."""
    return x if as_state(parallel).tp_size == 1 else _ReduceFromTensorParallelRegion.apply(x, parallel)


def reduce_from_tp_region_(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """g in place, as Megatron does it: all-reduce ``x`` itself (no copy) forward, identity backward. Only for
    a caller that owns ``x`` as a throwaway buffer nobody else reads or saved for backward, such as the
    partial product a row-parallel GEMM has just made (autograd refuses it otherwise). Under ``torch.compile`` it
    is :func:`reduce_from_tp_region`: a traced graph is functional, so the copy costs nothing there."""
    if as_state(parallel).tp_size == 1:
        return x
    if torch.compiler.is_compiling():
        return _ReduceFromTensorParallelRegion.apply(x, parallel)
    return _ReduceFromTensorParallelRegionInPlace.apply(x, parallel)


def scatter_to_tp_region(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return x if as_state(parallel).tp_size == 1 else _ScatterToTensorParallelRegion.apply(x, parallel)


def gather_from_tp_region(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    return x if as_state(parallel).tp_size == 1 else _GatherFromTensorParallelRegion.apply(x, parallel)


def scatter_to_sequence_parallel_region(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """(b, s, h) -> (b, s/p, h): keep this rank's tokens forward; all-gather the gradient along s backward."""
    return x if as_state(parallel).tp_size == 1 else _ScatterToSequenceParallelRegion.apply(x, parallel)


def gather_from_sequence_parallel_region(x: torch.Tensor, parallel: ParallelState | None,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """(b, s/p, h) -> (b, s, h): all-gather along s forward; backward reduce-scatter the gradient along s
    (its consumer is a tensor-parallel GEMM, each rank holding a partial gradient), or, with
    ``tensor_parallel_output_grad=False`` (a replicated consumer, identical gradients), keep this rank's
    tokens of it."""
    if as_state(parallel).tp_size == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, parallel, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    """(b, s, h) partial sums -> (b, s/p, h): reduce-scatter along s forward; all-gather the gradient backward."""
    return x if as_state(parallel).tp_size == 1 else _ReduceScatterToSequenceParallelRegion.apply(x, parallel)


def all_reduce_grads_of_replicated(parallel: ParallelState | None, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Use replicated parameters inside a sequence-parallel region: identity forward; backward sums their
    gradients over the TP group (one all-reduce for all of them), because each rank saw only its s/p tokens
    and the true gradient is the sum over every token. This is f applied to the parameters.

    Why in the graph and not a gradient hook: the all-reduce then happens once per use in every backward,
    before DeepSpeed sees ``.grad``, so it is right under gradient accumulation (a post-accumulate hook
    would all-reduce the running sum again each micro-step), under activation checkpointing, after
    ``to_empty``/meta materialisation (which makes new Parameter objects and drops hooks) and with any
    DeepSpeed engine, unchanged. The parameters stay replicated (identical gradients on every TP rank), so
    gradient norms count them once, as any parameter without ``tensor_model_parallel``.
    """
    if as_state(parallel).tp_size == 1 or not records_grad(*params):
        return params
    return _AllReduceGradOfReplicated.apply(parallel, *params)
