"""Tensor-parallel layers of Megatron-LM (Shoeybi et al. 2019, section 3).

Every layer initialises the *master* weight from the global torch RNG (identical on every rank
for one seed) and keeps only this rank's slice, so a model built at tp = 1, 2 or 4 starts from
the same merged weights. Sharded parameters carry ``tensor_model_parallel = True``,
``partition_dim`` and ``partition_stride`` (read by DeepSpeed's gradient norm); replicated parameters
carry none of them. Each layer also declares its parameters' :class:`~zoo.parallel.partition.PartitionSpec`
(``own_partition_specs()``: split dimension, stride, vocabulary rows), which is all zoo's checkpoint code
knows about how shards merge and split. How a file format stores a tensor (transformers' GPT-2 keeps its
GEMM weights transposed) is the format's business (:mod:`zoo.checkpoint.hf.hf_io`), not the layers'.

Sequence parallelism (Korthikanti et al. 2022; see ``zoo.parallel.mappings``): with
``sequence_parallel=True`` a column-parallel layer all-gathers its (b, s/p, h) input along the
sequence instead of entering through f, and a row-parallel layer reduce-scatters its output to
(b, s/p, h) instead of leaving through g. Replicated parameters used on s/p tokens (LayerNorms,
the row-parallel bias) carry ``sequence_parallel = True``; their gradients are summed over the TP
group inside the autograd graph (:func:`zoo.parallel.mappings.all_reduce_grads_of_replicated`), so
they stay replicated and are counted once by any gradient norm. The option is a no-op at tp = 1,
and a ``forward(..., sequence_parallel=False)`` call runs the layer without it (cached decoding).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zoo.errors import UserError
from zoo.parallel.host_all_reduce import start_tp_all_reduce_
from zoo.parallel.mappings import (
    _gather_sequence,
    _start_gather_sequence,
    _start_reduce_scatter_sequence,
    all_reduce_grads_of_replicated,
    check_sequence_divisible,
    gather_from_tp_region,
    records_grad,
    reduce_from_tp_region_,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from zoo.parallel.partition import PartitionSpec
from zoo.parallel.state import ParallelState, as_state
from zoo.parallel.utils import divide, pad_vocab_size, shard_tensor, vocab_range


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int, stride: int = 1) -> nn.Parameter:
    """Tag a sharded parameter the way DeepSpeed and Megatron expect."""
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    return param


def is_tensor_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def mark_sequence_parallel(param: nn.Parameter) -> nn.Parameter:
    """Tag a replicated parameter that sees only this rank's s/p tokens under sequence parallelism
    (its gradient is all-reduced over the TP group in the graph; it stays a replicated parameter)."""
    param.sequence_parallel = True
    return param


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, "sequence_parallel", False))


def uses_sequence_parallel(parallel: ParallelState | None, requested: bool, seq_len: int | None = None) -> bool:
    """Whether sequence parallelism takes effect: it is ``requested`` and there is more than one TP rank (at
    tp = 1 it is a no-op). Given the ``seq_len`` of a full-sequence forward that will use it, that length must
    divide by tp, else the one-sentence UserError of :func:`zoo.parallel.mappings.check_sequence_divisible`."""
    if not requested or as_state(parallel).tp_size == 1:
        return False
    if seq_len is not None:
        check_sequence_divisible(seq_len, parallel)
    return True


class _ColumnParallelLinear(torch.autograd.Function):
    """Y_j,i = f(X) A_j,i^T + b_j,i for n >= 1 column-parallel weights A_1 ... A_n that read the same X, or with
    sequence parallelism Y_j,i = AG(X_i) A_j,i^T + b_j,i, with Megatron's backward overlap (its
    ``LinearWithGradAccumulationAndAsyncCommunication``). The n GEMMs share one f (or one all-gather), so the
    input is kept once and its gradient crosses the wire once, summed: dX = sum_j dY_j A_j,i.

    Backward, plain: dX = all-reduce(sum_j dY_j A_j,i) (this is f's backward) runs asynchronously while the
    weight gradients dA_j,i = dY_j^T X are computed. The all-reduce writes into the summed product, a fresh
    tensor, so f's copy of the gradient is not needed.

    Backward, sequence parallel (Korthikanti et al. 2022, 4.2.2): only the local tokens X_i (b, s/p, in) are
    kept; their all-gather is started first and overlaps sum_j dY_j A_j,i, then the one reduce-scatter of that
    sum along the sequence (the conjugate of the forward gather) overlaps dA_j,i = dY_j^T AG(X_i).

    ``apply(x, parallel, sequence_parallel, *weights, *biases)`` with n weights and n biases (None where a GEMM
    has none); returns the n outputs.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, parallel: ParallelState, sequence_parallel: bool,
                *weights_and_biases: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        n = len(weights_and_biases) // 2
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        ctx.parallel = parallel
        ctx.sequence_parallel = sequence_parallel
        ctx.has_bias = tuple(bias is not None for bias in biases)
        ctx.grad_dtypes = (x.dtype, *(t.dtype for t in weights), *(None if t is None else t.dtype for t in biases))
        x, weights, biases = _autocast_operands(x, weights, biases)
        ctx.save_for_backward(x, *weights)
        return _column_parallel_outputs(x, weights, biases, parallel, sequence_parallel)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        n = len(weights)
        parallel, sequence_parallel = ctx.parallel, ctx.sequence_parallel
        need_input = ctx.needs_input_grad[0]
        need_weights, need_biases = ctx.needs_input_grad[3:3 + n], ctx.needs_input_grad[3 + n:]
        gather = _start_gather_sequence(x, parallel)[1] if sequence_parallel and any(need_weights) else None
        grad_input = work = None
        if need_input:
            grad_input = _summed_input_gradient(grads, weights)                      # (b, s, in), partial
        x_full = gather() if gather is not None else x                                # (b, s, in)
        if need_input:
            if sequence_parallel:
                work, grad_input = _start_reduce_scatter_sequence(grad_input, parallel)  # -> (b, s/p, in)
            else:
                work = start_tp_all_reduce_(grad_input, parallel.tp_group)
        x_2d = x_full.reshape(-1, x_full.shape[-1])                                  # (b*s, in)
        grad_weights, grad_biases = [None] * n, [None] * n
        for j, grad in enumerate(grads):
            grad_2d = grad.reshape(-1, grad.shape[-1])                                # (b*s, out_j / p)
            if need_weights[j]:
                grad_weights[j] = grad_2d.t().matmul(x_2d)                            # (out_j / p, in)
            if ctx.has_bias[j] and need_biases[j]:
                grad_biases[j] = grad_2d.sum(dim=0)
        if work is not None:
            work.wait()
        return tuple(None if g is None else g.to(dtype)
                     for g, dtype in zip((grad_input, None, None, *grad_weights, *grad_biases),
                                         (ctx.grad_dtypes[0], None, None, *ctx.grad_dtypes[1:])))


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def _autocast_operands(x: torch.Tensor, weights, biases) -> tuple:
    """(x, weights, biases) in autocast's dtype where autocast is on. Under autocast F.linear would compute in that
    dtype; backward runs outside autocast, so the operands are cast once, before the forward, and saved as cast
    (as torch.amp.custom_fwd(cast_inputs=...) does)."""
    dtype = autocast_dtype(x.device.type)
    if dtype is None:
        return x, list(weights), list(biases)
    return x.to(dtype), [w.to(dtype) for w in weights], [_cast(b, dtype) for b in biases]


def _column_parallel_outputs(x: torch.Tensor, weights, biases, parallel: ParallelState,
                             sequence_parallel: bool) -> tuple[torch.Tensor, ...]:
    """Y_j = f(X) A_j^T + b_j, or AG(X_i) A_j^T + b_j with ``sequence_parallel``: the forward of
    :class:`_ColumnParallelLinear`, n x (b, s, out_j / p)."""
    total = _gather_sequence(x, parallel) if sequence_parallel else x             # (b, s, in)
    return tuple(F.linear(total, w, b) for w, b in zip(weights, biases))


def _summed_input_gradient(grads: tuple[torch.Tensor, ...], weights: list[torch.Tensor]) -> torch.Tensor:
    """sum_j dY_j A_j (b, s, in), this rank's partial input gradient, accumulated in place into the first
    product (one (b, s, in) buffer whatever the number of weights)."""
    total = grads[0].matmul(weights[0])                                               # (b, s, in)
    if len(weights) == 1:
        return total
    total = total.contiguous()
    total_2d = total.view(-1, total.shape[-1])                                        # (b*s, in)
    for grad, weight in zip(grads[1:], weights[1:]):
        total_2d.addmm_(grad.reshape(-1, grad.shape[-1]), weight)
    return total


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes GEMMs in on ``device_type``, or None where it is off (or unknown there)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:                     # a device type autocast does not know, e.g. meta
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           parallel: ParallelState, sequence_parallel: bool = False) -> torch.Tensor:
    """F.linear(f(x), weight, bias) for a column-parallel ``weight`` (out / p, in); with ``sequence_parallel``
    ``x`` is this rank's tokens (b, s/p, in) and f is replaced by an all-gather along the sequence, only the
    local tokens being kept for backward (an all-gather forward, another in backward, and a reduce-scatter of
    the input gradient, its conjugate). The backward collectives overlap the GEMMs (see
    :class:`_ColumnParallelLinear`). At tp = 1 it is F.linear."""
    return column_parallel_linears(x, (weight,), (bias,), parallel, sequence_parallel)[0]


def column_parallel_linears(x: torch.Tensor, weights, biases, parallel: ParallelState,
                            sequence_parallel: bool = False) -> tuple[torch.Tensor, ...]:
    """Y_j = F.linear(f(x), A_j, b_j) for column-parallel weights A_j (out_j / p, in) that read the same ``x``
    (Llama's q, k and v): Y_j,i = f(X) A_j,i^T + b_j,i, or with ``sequence_parallel`` Y_j,i = AG(X_i) A_j,i^T
    + b_j,i on this rank's tokens X_i (b, s/p, in). One f (or one all-gather) forward, the input kept once for
    backward (with sequence parallelism only its s/p local tokens, re-gathered once in backward for every
    dA_j = dY_j^T AG(X_i)), and one all-reduce (or reduce-scatter) of the summed input gradient
    sum_j dY_j A_j,i, overlapped with the weight gradients (see :class:`_ColumnParallelLinear`).

    ``biases``: one per weight (None where a GEMM has none), or None for no biases. Returns one output per
    weight, (b, s, out_j / p). At tp = 1 it is F.linear for each weight."""
    weights = tuple(weights)
    biases = (None,) * len(weights) if biases is None else tuple(biases)
    if not weights or len(biases) != len(weights):
        raise ValueError(f"column_parallel_linears got {len(weights)} weights and {len(biases)} biases; pass at "
                         "least one weight and one bias (or None) per weight.")
    if parallel.tp_size == 1:
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    if not records_grad(x, *weights, *biases):
        x, weights, biases = _autocast_operands(x, weights, biases)
        return _column_parallel_outputs(x, weights, biases, parallel, sequence_parallel)
    return _ColumnParallelLinear.apply(x, parallel, sequence_parallel, *weights, *biases)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameter names) that may run on this rank's s/p tokens.

    With sequence parallelism in use, y = LN(X_i; gamma, beta) on the rank's tokens X_i, and
    d gamma = sum_i d gamma_i (likewise beta) over the TP ranks: the parameters enter through f
    (:func:`all_reduce_grads_of_replicated`, one all-reduce for both in backward).
    """

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, parallel: ParallelState | None = None,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)
        self.parallel = as_state(parallel)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            mark_sequence_parallel(self.weight)
            mark_sequence_parallel(self.bias)

    def forward(self, x: torch.Tensor, sequence_parallel: bool | None = None) -> torch.Tensor:
        use = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        if not uses_sequence_parallel(self.parallel, use):
            return super().forward(x)
        weight, bias = all_reduce_grads_of_replicated(self.parallel, self.weight, self.bias)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)   # (b, s/p, h)


@torch.no_grad()
def init_sharded_(param: torch.Tensor, master_shape: tuple[int, ...], std: float, partition_dim: int,
                  parallel: ParallelState | None, stride: int = 1) -> None:
    """Fill ``param`` with this rank's slice of a N(0, std) master tensor of ``master_shape``.

    The master tensor is drawn from the global RNG on every rank, so the result does not depend on
    the tp degree. On the meta device nothing is allocated or drawn.
    """
    master = torch.empty(master_shape, dtype=torch.float32, device=param.device).normal_(0.0, std)
    parallel = as_state(parallel)
    param.copy_(shard_tensor(master, partition_dim, parallel.tp_rank, parallel.tp_size, stride))


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns: A = [A_1, ..., A_p], b = [b_1, ..., b_p].

    Rank i computes Y_i = f(X) A_i + b_i, where f is identity forward and all-reduce backward
    (the gradient of X sums every rank's partial X-gradient). With ``gather_output`` the result is
    all-gathered to Y = [Y_1, ..., Y_p]; otherwise each rank keeps Y_i (e.g. to feed a
    row-parallel layer or a local GeLU).

    ``stride`` s > 1 splits the output into s equal blocks and partitions each block, for fused
    projections: the QKV GEMM uses s = 3 so every rank holds q, k and v of its own heads.
    Weight layout is ``nn.Linear``'s: (out_features / p, in_features).

    ``sequence_parallel``: the input is this rank's tokens (b, s/p, in) and f is replaced by an
    all-gather along the sequence (backward: reduce-scatter of the input gradient), Y_i = AG(X) A_i + b_i.
    Only the s/p local tokens are kept for backward, which all-gathers them again for the weight
    gradient (the paper's section 4.2.2), so the GEMM's saved input shrinks with tp too.

    Partition spec: weight and bias split along dim 0 with ``stride``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 *, parallel: ParallelState | None = None, init_std: float = 0.02, stride: int = 1,
                 sequence_parallel: bool = False, device=None, dtype=None):
        super().__init__()
        self.parallel = as_state(parallel)
        self.sequence_parallel = sequence_parallel
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.stride = stride
        self.init_std = init_std
        tp = self.parallel.tp_size
        if gather_output and stride > 1 and tp > 1:
            raise UserError(f"gather_output=True with stride {stride} would return the fused blocks in rank "
                             "order, not the master order; gather only stride-1 outputs.")
        self.out_features_per_partition = divide(out_features, tp, "output features")
        divide(out_features, stride * tp, "output features")
        factory = {"device": device, "dtype": dtype}
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(self.out_features_per_partition, in_features, **factory)), 0, stride)
        if bias:
            self.bias = mark_tensor_parallel(
                nn.Parameter(torch.empty(self.out_features_per_partition, **factory)), 0, stride)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def own_partition_specs(self) -> dict[str, PartitionSpec]:
        specs = {"weight": PartitionSpec(0, self.stride)}
        if self.bias is not None:
            specs["bias"] = PartitionSpec(0, self.stride)
        return specs

    def reset_parameters(self) -> None:
        init_sharded_(self.weight, (self.out_features, self.in_features), self.init_std, 0, self.parallel,
                      self.stride)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor, sequence_parallel: bool | None = None) -> torch.Tensor:
        use = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        sp = uses_sequence_parallel(self.parallel, use)             # (b, s/p, in) -> (b, s, out / p)
        y = column_parallel_linear(x, self.weight, self.bias, self.parallel, sp)   # f(X) A_i^T + b_i: (..., out / p)
        if self.gather_output:
            y = gather_from_tp_region(y, self.parallel)         # (..., out)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={self.parallel.tp_size}, stride={self.stride}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows, A = [A_1; ...; A_p], and X split by columns, X = [X_1, ..., X_p].

    Rank i computes the partial product X_i A_i; g (all-reduce forward, identity backward) sums
    them, Y = g(sum_i X_i A_i) + b. The bias is replicated and added once, after the all-reduce.
    With ``input_is_parallel=False`` the full X is first scattered along its last dim.
    Weight layout is ``nn.Linear``'s: (out_features, in_features / p).

    ``sequence_parallel``: g is replaced by a reduce-scatter along the sequence (backward: all-gather),
    Y = RS(sum_i X_i A_i) + b on this rank's s/p tokens; the bias then sees s/p tokens, so it is tagged
    ``sequence_parallel`` and its gradient summed over the TP group.

    Partition spec: the weight split along dim 1, the bias replicated.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 *, parallel: ParallelState | None = None, init_std: float = 0.02, sequence_parallel: bool = False,
                 device=None, dtype=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise UserError("a row-parallel layer with sequence_parallel=True needs input_is_parallel=True; its input "
                             "must already be split along the hidden dim.")
        self.parallel = as_state(parallel)
        self.sequence_parallel = sequence_parallel
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        self.init_std = init_std
        self.in_features_per_partition = divide(in_features, self.parallel.tp_size, "input features")
        factory = {"device": device, "dtype": dtype}
        self.weight = mark_tensor_parallel(
            nn.Parameter(torch.empty(out_features, self.in_features_per_partition, **factory)), 1)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))  # replicated
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def own_partition_specs(self) -> dict[str, PartitionSpec]:
        return {"weight": PartitionSpec(1)}

    def reset_parameters(self) -> None:
        init_sharded_(self.weight, (self.out_features, self.in_features), self.init_std, 1, self.parallel)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def forward(self, x: torch.Tensor, sequence_parallel: bool | None = None) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.parallel)          # (..., in / p)
        if self.parallel.tp_size == 1:
            return F.linear(x, self.weight, self.bias)          # (..., out)
        partial = F.linear(x, self.weight)                      # (..., out), this rank's X_i A_i
        use = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        if use:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.parallel)  # (b, s/p, out)
            if self.bias is not None:
                (bias,) = all_reduce_grads_of_replicated(self.parallel, self.bias)
                y = y + bias
            return y
        y = reduce_from_tp_region_(partial, self.parallel)      # g, in place: the layer owns its partial product
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"tp={self.parallel.tp_size}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """E = [E_1; ...; E_p] split along the (padded) vocabulary; Y = g(sum_i onehot_i(X) E_i).

    Rank i looks up only ids in its range [start_i, end_i), writes zeros for the others, and g
    all-reduces the partial embeddings. The vocabulary is padded to a multiple of
    ``pad_multiple * p`` (Megatron's make-vocab-divisible); padded rows start at zero and, because
    the loss excludes them and no id selects them, stay zero.

    ``weight`` is the local shard (padded_vocab_size / p, embedding_dim) and doubles as the tied
    LM-head matrix (see :meth:`lm_logits`). Partition spec: split along dim 0, the padded vocabulary, of
    which merged checkpoints hold the ``vocab_size`` real rows.
    """

    def __init__(self, vocab_size: int, embedding_dim: int, *, parallel: ParallelState | None = None,
                 pad_multiple: int = 128, init_std: float = 0.02, device=None, dtype=None):
        super().__init__()
        self.parallel = as_state(parallel)
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.init_std = init_std
        tp = self.parallel.tp_size
        self.padded_vocab_size = pad_vocab_size(vocab_size, tp, pad_multiple)
        self.vocab_start, self.vocab_end = vocab_range(self.padded_vocab_size, self.parallel.tp_rank, tp)
        self.weight = mark_tensor_parallel(nn.Parameter(
            torch.empty(self.vocab_end - self.vocab_start, embedding_dim, device=device, dtype=dtype)), 0)
        self.reset_parameters()

    def own_partition_specs(self) -> dict[str, PartitionSpec]:
        return {"weight": PartitionSpec(0, vocab_rows=self.vocab_size)}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        master = torch.empty(self.padded_vocab_size, self.embedding_dim, dtype=torch.float32,
                             device=self.weight.device)
        master[:self.vocab_size].normal_(0.0, self.init_std)
        master[self.vocab_size:].zero_()
        self.weight.copy_(master[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)          # (..., h)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight)           # (..., h)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region_(partial, self.parallel)   # g, in place on the owned partial

    def lm_logits(self, hidden: torch.Tensor, gather_output: bool = False,
                  sequence_parallel: bool = False) -> torch.Tensor:
        """Tied output embedding: logits_i = f(H) E_i^T, this rank's vocab shard.

        With ``gather_output`` the shards are all-gathered and the padding is cut, giving the full
        unpadded vocabulary (for inspection and generation; the loss never needs it).
        With ``sequence_parallel`` ``hidden`` is this rank's tokens (b, s/p, h) and f is replaced by an
        all-gather along the sequence (backward: reduce-scatter), as Megatron does before its output
        layer: the vocab-parallel cross-entropy needs every position's logits of its vocab shard. Only
        the local tokens are kept for backward (see :class:`ColumnParallelLinear`).
        """
        sp = uses_sequence_parallel(self.parallel, sequence_parallel)     # (b, s/p, h) -> (b, s, V_padded / p)
        logits = column_parallel_linear(hidden, self.weight, None, self.parallel, sp)   # f(H) E_i^T: (..., V_padded / p)
        if gather_output:
            logits = gather_from_tp_region(logits, self.parallel)[..., :self.vocab_size]  # (..., V)
        return logits

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, padded={self.padded_vocab_size}, dim={self.embedding_dim}, "
                f"rows=[{self.vocab_start}, {self.vocab_end})")


def scaled_init_std(std: float, num_layers: int) -> float:
    """Init std of residual-branch output projections: std / sqrt(2 N) (GPT-2, Megatron)."""
    return std / math.sqrt(2.0 * num_layers)


def materialize_meta_module(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """``module.to_empty(device)`` that keeps the tensor- and sequence-parallel tags (``to_empty`` makes
    new Parameter objects, which would drop them). Contents are uninitialised: load weights next."""
    tags = {name: (p.partition_dim, getattr(p, "partition_stride", 1))
            for name, p in module.named_parameters() if is_tensor_parallel(p)}
    sequence_tags = {name for name, p in module.named_parameters() if is_sequence_parallel(p)}
    module.to_empty(device=device)
    for name, param in module.named_parameters():
        if name in tags:
            mark_tensor_parallel(param, *tags[name])
        if name in sequence_tags:
            mark_sequence_parallel(param)
    return module
