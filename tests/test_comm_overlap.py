"""Megatron's communication overlap and copy-free g in the tensor-parallel layers, at tp = 2.

- A column-parallel layer's backward starts its collective before the GEMM it can hide behind and
  waits for it only after that GEMM: plain, the all-reduce of dX = dY A_i is started before the weight
  gradient dA_i = dY^T X is computed; with sequence parallelism the all-gather of the saved s/p tokens is
  started before dY A_i, and the reduce-scatter of dY A_i before dY^T AG(X_i).
- A row-parallel layer's and the vocab-parallel embedding's g all-reduce their own partial product in
  place: the forward makes no copy of it.

The order is recorded from the collectives (wrapped to log their start and their wait) and from the
aten matmuls (a dispatch mode logging every ``mm`` with its shapes). Values are checked elsewhere
(tests/test_parallel_layers.py, tests/test_sequence_parallel.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import spawn

B, S, IN, OUT = 2, 8, 16, 24


def _record(events: list, names: tuple[str, ...]):
    """Wrap the named torch.distributed collectives to log ("start", name) and, on wait, ("wait", name)."""
    import torch.distributed as dist

    real = {name: getattr(dist, name) for name in names}

    class LoggedWork:
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self, *args, **kwargs):
            events.append(("wait", self.name))
            return self.work.wait(*args, **kwargs)

    def wrap(name):
        def logged(*args, **kwargs):
            events.append(("start", name))
            work = real[name](*args, **kwargs)
            if kwargs.get("async_op"):
                return LoggedWork(work, name)
            events.append(("wait", name))       # a blocking call has finished when it returns
            return work
        return logged

    for name in names:
        setattr(dist, name, wrap(name))
    return real


class _MatmulLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Logs ("mm", shape of the result) for every aten mm / addmm, and counts the copies made."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm"):
            self.events.append(("mm", tuple(out.shape)))
        if name in ("clone", "copy_", "_to_copy"):
            self.copies += 1
        return out


def _overlap_worker(rank, world_size, sequence_parallel):
    import torch.distributed as dist

    from zoo.parallel import ColumnParallelLinear, ParallelState

    ps = ParallelState.initialize(world_size)
    reduce_scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    names = ("all_reduce", "all_gather", reduce_scatter)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN, OUT, parallel=ps, sequence_parallel=sequence_parallel)
    seq = S // world_size if sequence_parallel else S
    x = torch.randn(B, seq, IN, requires_grad=True)
    y = layer(x)
    events: list = []
    real = _record(events, names)
    try:
        with _MatmulLog(events):
            y.sum().backward()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    rename = {reduce_scatter: "reduce_scatter"}
    return [(kind, rename.get(what, what)) if kind != "mm" else (kind, what) for kind, what in events]


def _position(events, event):
    assert event in events, f"{event} not in {events}"
    return events.index(event)


@pytest.fixture(scope="module")
def backward_orders():
    return {sp: spawn(_overlap_worker, 2, sp)[0] for sp in (False, True)}


def test_plain_column_parallel_backward_overlaps_its_all_reduce_with_the_weight_gradient(backward_orders):
    events = backward_orders[False]
    grad_input, grad_weight = ("mm", (B * S, IN)), ("mm", (OUT // 2, IN))
    start, wait = _position(events, ("start", "all_reduce")), _position(events, ("wait", "all_reduce"))
    assert _position(events, grad_input) < start < _position(events, grad_weight) < wait, events
    assert [e for e in events if e[0] == "start"] == [("start", "all_reduce")], events


def test_sequence_parallel_column_backward_overlaps_gather_and_reduce_scatter(backward_orders):
    events = backward_orders[True]
    grad_input, grad_weight = ("mm", (B * S, IN)), ("mm", (OUT // 2, IN))
    gather_start, gather_wait = _position(events, ("start", "all_gather")), _position(events, ("wait", "all_gather"))
    rs_start, rs_wait = _position(events, ("start", "reduce_scatter")), _position(events, ("wait", "reduce_scatter"))
    assert gather_start < _position(events, grad_input) < gather_wait, events
    assert gather_wait < rs_start < _position(events, grad_weight) < rs_wait, events
    assert not any(what == "all_reduce" for _, what in events), events


def _copy_worker(rank, world_size):
    from zoo.parallel import ParallelState, RowParallelLinear, VocabParallelEmbedding

    ps = ParallelState.initialize(world_size)
    torch.manual_seed(0)
    row = RowParallelLinear(IN, OUT, bias=False, parallel=ps)
    embedding = VocabParallelEmbedding(64, IN, parallel=ps, pad_multiple=8)
    x = torch.randn(B, S, IN // world_size, requires_grad=True)
    ids = torch.randint(0, 64, (B, S))
    copies = {}
    for name, run in (("row", lambda: row(x)), ("embedding", lambda: embedding(ids))):
        log = _MatmulLog([])
        with log:
            out = run()
        out.sum().backward()                     # the in-place g leaves a graph autograd accepts
        copies[name] = log.copies
    return copies


def test_row_parallel_and_embedding_g_make_no_copy_of_their_partial_product():
    for rank, copies in enumerate(spawn(_copy_worker, 2)):
        assert copies == {"row": 0, "embedding": 0}, f"rank {rank}: copies made in forward {copies}"


def _autocast_worker(rank, world_size):
    import torch.distributed as dist
    import torch.nn.functional as F

    from zoo.parallel import ColumnParallelLinear, ParallelState

    ps = ParallelState.initialize(world_size)
    errors = {}
    for sp in (False, True):
        torch.manual_seed(0)
        layer = ColumnParallelLinear(IN, OUT, parallel=ps, sequence_parallel=sp)
        with torch.no_grad():
            layer.bias.normal_()
        shards = [torch.empty_like(layer.weight) for _ in range(world_size)]
        dist.all_gather(shards, layer.weight.detach())
        bias_shards = [torch.empty_like(layer.bias) for _ in range(world_size)]
        dist.all_gather(bias_shards, layer.bias.detach())
        weight, bias = torch.cat(shards).requires_grad_(), torch.cat(bias_shards).requires_grad_()
        x_full = torch.randn(B, S, IN, generator=torch.Generator().manual_seed(1))
        x_ref = x_full.clone().requires_grad_()
        x = (x_full.chunk(world_size, dim=1)[rank] if sp else x_full).clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
            y_ref = F.linear(x_ref, weight, bias)
        cols = slice(rank * OUT // world_size, (rank + 1) * OUT // world_size)
        y.float().pow(2).sum().backward()
        y_ref[..., cols].float().pow(2).sum().backward()      # this rank's columns: the same loss terms
        dist.all_reduce(x_ref.grad)                           # the reference's input grad summed over ranks' terms
        want_x = x_ref.grad.chunk(world_size, dim=1)[rank] if sp else x_ref.grad
        errors[sp] = {
            "dtypes": (y.dtype, x.grad.dtype, layer.weight.grad.dtype, layer.bias.grad.dtype),
            "y": ((y.float() - y_ref[..., cols].float()).abs().max() / y_ref.float().abs().max()).item(),
            "x": ((x.grad - want_x).abs().max() / want_x.abs().max()).item(),
            "w": ((layer.weight.grad - weight.grad[cols]).abs().max() / weight.grad[cols].abs().max()).item(),
            "b": ((layer.bias.grad - bias.grad[cols]).abs().max() / bias.grad[cols].abs().max()).item(),
        }
    return errors


def test_column_parallel_layer_under_autocast_matches_plain_linear():
    """Under torch.autocast (bf16 on CPU) the layer computes as F.linear does there and returns gradients in
    the parameters' and input's own dtype, plain and sequence-parallel (backward runs outside autocast, so
    the fused layer casts its saved operands itself). Reference: F.linear on the merged weight under the
    same autocast; both sides round through the same bf16 GEMMs, bound 1e-2 relative."""
    for rank, errors in enumerate(spawn(_autocast_worker, 2)):
        for sp, error in errors.items():
            assert error.pop("dtypes") == (torch.bfloat16, torch.float32, torch.float32, torch.float32), (rank, sp)
            assert all(value <= 1e-2 for value in error.values()), (rank, sp, error)
