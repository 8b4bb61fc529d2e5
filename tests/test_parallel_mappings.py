"""The conjugate mappings f (copy_to_tp_region), g (reduce_from_tp_region), scatter and gather.

Forward and backward values are checked against hand-computed expectations at tp = 2 and tp = 4 (one
world-4 spawn: at tp = 2 there are two TP groups, which must not mix). Every input is small integers
in fp32, so sums are exact and the comparisons are exact (torch.equal). Each mapping must also issue
exactly the one collective of its direction and none in the other; with ``parallel`` None or tp = 1
every mapping is the identity and issues no collective at all.
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import spawn

WORLD = 4
SHAPE = (2, 3)           # leading dims; the last dim is chosen per test


def _value(rank: int, last: int, salt: int) -> torch.Tensor:
    """A distinct integer-valued fp32 tensor per (rank, salt)."""
    n = SHAPE[0] * SHAPE[1] * last
    return (torch.arange(n, dtype=torch.float32) * (rank + 1) + 1000 * salt + 100 * rank).view(*SHAPE, last)


def _members(rank: int, tp: int) -> list[int]:
    first = (rank // tp) * tp
    return list(range(first, first + tp))


class _Counter:
    """Counts torch.distributed.all_reduce / all_gather calls (the mappings look them up at call time)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.calls: list[str] = []

    def __enter__(self):
        dist = self.dist
        self.real = dist.all_reduce, dist.all_gather

        def all_reduce(tensor, *args, **kwargs):
            self.calls.append("all_reduce")
            return self.real[0](tensor, *args, **kwargs)

        def all_gather(tensor_list, tensor, *args, **kwargs):
            self.calls.append("all_gather")
            return self.real[1](tensor_list, tensor, *args, **kwargs)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce, self.dist.all_gather = self.real

    def take(self) -> list[str]:
        calls, self.calls = self.calls, []
        return calls


def _mapping_worker(rank, world_size):
    from zoo.parallel import (
        ParallelState,
        copy_to_tp_region,
        gather_from_tp_region,
        reduce_from_tp_region,
        scatter_to_tp_region,
    )

    results = {}
    for tp in (2, 4):
        ps = ParallelState.initialize(tp)
        members = _members(rank, tp)
        r = ps.tp_rank
        res = {}
        with _Counter() as counter:
            # f: identity forward, all-reduce(sum) of the gradient backward.
            x = _value(rank, 4, salt=1).requires_grad_()
            y = copy_to_tp_region(x, ps)
            res["copy_fwd_calls"] = counter.take()
            res["copy_fwd"] = torch.equal(y, _value(rank, 4, 1))
            y.backward(_value(rank, 4, salt=2))
            res["copy_bwd_calls"] = counter.take()
            res["copy_bwd"] = torch.equal(x.grad, sum(_value(m, 4, 2) for m in members))
            res["copy_input_untouched"] = torch.equal(x.detach(), _value(rank, 4, 1))

            # g: all-reduce(sum) forward, identity backward.
            x = _value(rank, 4, salt=3).requires_grad_()
            y = reduce_from_tp_region(x, ps)
            res["reduce_fwd_calls"] = counter.take()
            res["reduce_fwd"] = torch.equal(y, sum(_value(m, 4, 3) for m in members))
            res["reduce_input_untouched"] = torch.equal(x.detach(), _value(rank, 4, 3))
            y.backward(_value(rank, 4, salt=4))
            res["reduce_bwd_calls"] = counter.take()
            res["reduce_bwd"] = torch.equal(x.grad, _value(rank, 4, 4))

            # scatter: keep this rank's slice of the last dim; backward all-gathers the gradient.
            piece = 2
            full = _value(0, tp * piece, salt=5).requires_grad_()       # the same full tensor on every rank
            y = scatter_to_tp_region(full, ps)
            res["scatter_fwd_calls"] = counter.take()
            res["scatter_fwd"] = torch.equal(y, _value(0, tp * piece, 5)[..., r * piece:(r + 1) * piece])
            y.backward(_value(rank, piece, salt=6))
            res["scatter_bwd_calls"] = counter.take()
            res["scatter_bwd"] = torch.equal(full.grad, torch.cat([_value(m, piece, 6) for m in members], -1))

            # gather: all-gather along the last dim forward; backward keeps this rank's slice.
            x = _value(rank, piece, salt=7).requires_grad_()
            y = gather_from_tp_region(x, ps)
            res["gather_fwd_calls"] = counter.take()
            res["gather_fwd"] = torch.equal(y, torch.cat([_value(m, piece, 7) for m in members], -1))
            upstream = _value(rank, tp * piece, salt=8)
            y.backward(upstream)
            res["gather_bwd_calls"] = counter.take()
            res["gather_bwd"] = torch.equal(x.grad, upstream[..., r * piece:(r + 1) * piece])
        results[tp] = res
    return results


@pytest.fixture(scope="module")
def mapping_results():
    return spawn(_mapping_worker, WORLD)


EXPECTED_CALLS = {
    "copy_fwd_calls": [], "copy_bwd_calls": ["all_reduce"],
    "reduce_fwd_calls": ["all_reduce"], "reduce_bwd_calls": [],
    "scatter_fwd_calls": [], "scatter_bwd_calls": ["all_gather"],
    "gather_fwd_calls": ["all_gather"], "gather_bwd_calls": [],
}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mapping", ["copy", "reduce", "scatter", "gather"])
def test_mapping_values(mapping_results, tp, mapping):
    for rank, results in enumerate(mapping_results):
        res = results[tp]
        assert res[f"{mapping}_fwd"], f"{mapping} forward value wrong at tp={tp} rank {rank}"
        assert res[f"{mapping}_bwd"], f"{mapping} backward value wrong at tp={tp} rank {rank}"
        if f"{mapping}_input_untouched" in res:
            assert res[f"{mapping}_input_untouched"], f"{mapping} modified its input at tp={tp} rank {rank}"


@pytest.mark.parametrize("tp", [2, 4])
def test_mapping_collectives(mapping_results, tp):
    for rank, results in enumerate(mapping_results):
        got = {k: v for k, v in results[tp].items() if k.endswith("_calls")}
        assert got == EXPECTED_CALLS, f"tp={tp} rank {rank}"


# ---------------------------------------------------------------- single process: identity, no collective
@pytest.mark.parametrize("single", [False, True], ids=["parallel=None", "ParallelState.single()"])
def test_mappings_are_identity_without_tp(monkeypatch, single):
    import torch.distributed as dist

    from zoo.parallel import (
        ParallelState,
        copy_to_tp_region,
        gather_from_tp_region,
        reduce_from_tp_region,
        scatter_to_tp_region,
    )

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective was issued at tp = 1")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    monkeypatch.setattr(dist, "all_gather", no_collective)
    parallel = ParallelState.single() if single else None
    for mapping in (copy_to_tp_region, reduce_from_tp_region, scatter_to_tp_region, gather_from_tp_region):
        x = _value(0, 4, salt=1).requires_grad_()
        y = mapping(x, parallel)
        assert torch.equal(y, x), mapping.__name__
        upstream = _value(1, 4, salt=2)
        y.backward(upstream)
        assert torch.equal(x.grad, upstream), mapping.__name__


def test_scatter_of_indivisible_last_dim_is_refused():
    from zoo.parallel import ParallelState, scatter_to_tp_region

    # A tp = 3 grid built by hand (no process group is touched: the check comes first).
    fake = ParallelState(tp_size=3, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=3, rank=0)
    with pytest.raises(ValueError, match=r"last dimension 4 is not divisible by tensor-parallel size 3"):
        scatter_to_tp_region(torch.zeros(2, 4), fake)
