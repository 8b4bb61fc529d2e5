"""``column_parallel_linears``: several column-parallel weights reading one input (Llama's q, k and v), against a
single-process reference (F.linear of the full weights on the full input) at tp = 1, 2 and 4, with and without
sequence parallelism, in float32 and float64.

Three weights of different widths (a query-like 16 rows and two key/value-like 8 rows, as in grouped-query
attention), the first and last with a bias, the middle without. Checked on every rank:
- each output (this rank's columns), the input gradient (the whole input, or this rank's s/p tokens under
  sequence parallelism), each weight's and bias's gradient (this rank's rows);
- what autograd saves for backward, parameters left out: the input as the rank holds it, once (under sequence
  parallelism its s/p local tokens, not the all-gathered s);
- the collectives: with sequence parallelism one all-gather forward, one re-gather and one reduce-scatter (of the
  summed input gradient) backward; without it nothing forward and one all-reduce backward; in backward Megatron's
  overlap order (the re-gather around the input-gradient GEMMs, the reduce-scatter or all-reduce around the weight
  GEMMs), as tests/test_comm_overlap.py checks for one weight.

Tolerances (as tests/test_parallel_layers.py):
- float32: max|zoo - ref| <= 1e-6 x max of the same computation on the operands' absolute values (the rounding of
  a sum, in any order and over any split across ranks, is bounded by its terms' magnitudes);
- float64: max|zoo - ref| / max|ref| <= 1e-9.
tp = 1 runs in the pytest process; tp = 2 and 4 run in one world-4 spawn.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.checks import FP64_TOL, assert_named_checks, rel_err
from tests.spawn import spawn

REL_TOL = 1e-6
WORLD = 4
B, S, IN = 3, 8, 12                 # S divisible by tp 4
OUTS = (16, 8, 8)                   # each divisible by tp 4
HAS_BIAS = (True, False, True)


def _randn(gen: torch.Generator, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def _reference(X, weights, biases, upstream) -> tuple:
    """Y_j = F.linear(X, W_j, b_j) and the gradients of X, each W_j and b_j for the loss sum_j <Y_j, G_j>.
    Called on the operands' absolute values it gives the magnitudes that bound each quantity's rounding."""
    X = X.clone().requires_grad_()
    weights = [w.clone().requires_grad_() for w in weights]
    biases = [None if b is None else b.clone().requires_grad_() for b in biases]
    ys = [F.linear(X, w, b) for w, b in zip(weights, biases)]
    sum((y * g).sum() for y, g in zip(ys, upstream)).backward()
    return ([y.detach() for y in ys], X.grad, [w.grad for w in weights],
            [None if b is None else b.grad for b in biases])


class _RecordCollectives:
    """Within the block, log ("start", kind) for every torch.distributed all_reduce, all_gather and reduce-scatter
    call and ("wait", kind) when it has finished (its handle's wait(), or its return if blocking)."""

    def __init__(self, events: list):
        import torch.distributed as dist

        self.dist, self.events = dist, events
        scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        self.kinds = {"all_reduce": "all_reduce", "all_gather": "all_gather", scatter: "reduce_scatter"}

    def __enter__(self):
        self.real = {name: getattr(self.dist, name) for name in self.kinds}
        for name, real in self.real.items():
            setattr(self.dist, name, self._logged(self.kinds[name], real))
        return self.events

    def _logged(self, kind, real):
        events = self.events

        class Logged:
            def __init__(self, work):
                self.work = work

            def wait(self, *args, **kwargs):
                events.append(("wait", kind))
                return self.work.wait(*args, **kwargs)

        def call(*args, **kwargs):
            events.append(("start", kind))
            work = real(*args, **kwargs)
            if kwargs.get("async_op"):
                return Logged(work)
            events.append(("wait", kind))
            return work
        return call

    def __exit__(self, *exc):
        for name, real in self.real.items():
            setattr(self.dist, name, real)


class _GemmLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Logs ("gemm", shape of the result) for every aten mm, addmm and addmm_."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ("mm", "addmm", "addmm_"):
            self.events.append(("gemm", tuple(out.shape)))
        return out


def _collective_counts(events: list) -> dict[str, int]:
    return {kind: events.count(("start", kind)) for kind in ("all_gather", "reduce_scatter", "all_reduce")}


def _backward_overlaps(events: list, sequence_parallel: bool, tp: int) -> bool:
    """Megatron's order: with sequence parallelism the re-gather is started before the input-gradient GEMMs
    (dY_j A_j, (b*s, in)) and awaited after them, the reduce-scatter of their sum started before the weight
    GEMMs (dY_j^T X, (out_j / p, in)) and awaited after them; without it the all-reduce sits between the two."""
    def at(event):
        return events.index(event) if event in events else -1

    input_gemms = [i for i, e in enumerate(events) if e == ("gemm", (B * S, IN))]
    weight_gemms = [i for i, e in enumerate(events) if e[0] == "gemm" and e[1] in {(out // tp, IN) for out in OUTS}]
    if len(input_gemms) != len(OUTS) or len(weight_gemms) != len(OUTS):
        return False
    if sequence_parallel:
        gather = (at(("start", "all_gather")), at(("wait", "all_gather")))
        scatter = (at(("start", "reduce_scatter")), at(("wait", "reduce_scatter")))
        return (gather[0] < min(input_gemms) and max(input_gemms) < gather[1] < scatter[0] < min(weight_gemms)
                and max(weight_gemms) < scatter[1])
    reduce = (at(("start", "all_reduce")), at(("wait", "all_reduce")))
    return max(input_gemms) < reduce[0] < min(weight_gemms) and max(weight_gemms) < reduce[1]


def _saved_storages(parameters):
    """A saved_tensors_hooks pair recording {storage pointer: bytes} of every saved tensor that is not one of
    ``parameters``."""
    excluded = {p.untyped_storage().data_ptr() for p in parameters}
    saved: dict[int, int] = {}

    def pack(tensor):
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in excluded:
            saved[ptr] = tensor.untyped_storage().nbytes()
        return tensor

    return saved, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def _checks(ps, sequence_parallel: bool, dtype: torch.dtype) -> dict:
    """{check name: error or bool} of one call at this rank's tp degree."""
    from zoo.parallel.layers import column_parallel_linears

    tp, r = ps.tp_size, ps.tp_rank
    sp = sequence_parallel and tp > 1
    gen = torch.Generator().manual_seed(1)
    X = _randn(gen, dtype, B, S, IN)
    weights = [_randn(gen, dtype, out, IN) for out in OUTS]
    biases = [_randn(gen, dtype, out) if has else None for out, has in zip(OUTS, HAS_BIAS)]
    upstream = [_randn(gen, dtype, B, S, out) for out in OUTS]
    y_ref, x_grad, w_grads, b_grads = _reference(X, weights, biases, upstream)
    mags = _reference(X.abs(), [w.abs() for w in weights], [None if b is None else b.abs() for b in biases],
                      [g.abs() for g in upstream])
    y_mag, x_mag, w_mags, b_mags = mags

    def error(actual, expected, magnitude):
        if dtype == torch.float64:
            return rel_err(actual, expected)
        return ((actual - expected).abs().max() / magnitude.abs().max()).item()

    def mine(tensor, dim):                  # this rank's block along dim
        return tensor.chunk(tp, dim)[r]

    x = (mine(X, 1) if sp else X).clone().requires_grad_()                  # (b, s/p or s, in)
    local_weights = [mine(w, 0).clone().requires_grad_() for w in weights]  # (out_j / p, in)
    local_biases = [None if b is None else mine(b, 0).clone().requires_grad_() for b in biases]
    saved, hooks = _saved_storages([*local_weights, *(b for b in local_biases if b is not None)])
    forward_events, backward_events = [], []
    with _RecordCollectives(forward_events), hooks:
        ys = column_parallel_linears(x, local_weights, local_biases, ps, sp)
    loss = sum((y * mine(g, -1)).sum() for y, g in zip(ys, upstream))
    with _RecordCollectives(backward_events), _GemmLog(backward_events):
        loss.backward()

    out: dict = {"saved is the input as held, once": saved == {x.untyped_storage().data_ptr(): x.nbytes},
                 "input grad shape": tuple(x.grad.shape) == tuple(x.shape)}
    if tp > 1:
        expected_calls = ({"all_gather": 1, "reduce_scatter": 0, "all_reduce": 0},
                          {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 0}) if sp else (
                          {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0},
                          {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 1})
        out["collectives forward"] = _collective_counts(forward_events) == expected_calls[0]
        out["collectives backward"] = _collective_counts(backward_events) == expected_calls[1]
        out["backward overlaps its collectives with the GEMMs"] = _backward_overlaps(backward_events, sp, tp)
    expected_x_grad, x_grad_mag = (mine(x_grad, 1), mine(x_mag, 1)) if sp else (x_grad, x_mag)
    out["input grad"] = error(x.grad, expected_x_grad, x_grad_mag)
    for j in range(len(OUTS)):
        out[f"output {j}"] = error(ys[j], mine(y_ref[j], -1), mine(y_mag[j], -1))
        out[f"weight {j} grad"] = error(local_weights[j].grad, mine(w_grads[j], 0), mine(w_mags[j], 0))
        if HAS_BIAS[j]:
            out[f"bias {j} grad"] = error(local_biases[j].grad, mine(b_grads[j], 0), mine(b_mags[j], 0))
    return out


def _all_checks(ps) -> dict:
    """{(sequence parallel, dtype name): checks}."""
    return {(sp, name): _checks(ps, sp, dtype) for sp in (False, True)
            for name, dtype in (("float32", torch.float32), ("float64", torch.float64))}


def _worker(rank, world_size):
    from zoo.parallel import ParallelState

    return {tp: _all_checks(ParallelState.initialize(tp)) for tp in (2, 4)}


@pytest.fixture(scope="module")
def results():
    from zoo.parallel.state import as_state

    by_tp = {1: [_all_checks(as_state(None))]}
    per_rank = spawn(_worker, WORLD)
    for tp in (2, 4):
        by_tp[tp] = [ranks[tp] for ranks in per_rank]
    return by_tp


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_shared_input_linears_match_f_linear_on_the_full_weights(results, tp, sequence_parallel):
    for name, tol in (("float32", REL_TOL), ("float64", FP64_TOL)):
        by_tp = {tp: [ranks[(sequence_parallel, name)] for ranks in results[tp]]}
        assert_named_checks(by_tp, tp, "", tol)


def test_mismatched_weights_and_biases_are_refused():
    from zoo.parallel.layers import column_parallel_linears
    from zoo.parallel.state import as_state

    weights = [torch.zeros(4, 3), torch.zeros(2, 3)]
    with pytest.raises(ValueError, match="got 2 weights and 1 biases"):
        column_parallel_linears(torch.zeros(1, 2, 3), weights, [None], as_state(None))
