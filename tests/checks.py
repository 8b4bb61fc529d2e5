"""Shared test helpers: counting collectives, and asserting named per-rank check results."""

from __future__ import annotations

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def record_collectives():
    """Within the block, record every torch.distributed all_reduce / all_gather as
    (name, elements moved, op), where op is "MAX", "SUM" or "" (all_gather)."""
    calls: list[tuple[str, int, str]] = []
    real_all_reduce, real_all_gather = dist.all_reduce, dist.all_gather

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        kind = "MAX" if op == dist.ReduceOp.MAX else "SUM" if op == dist.ReduceOp.SUM else str(op)
        calls.append(("all_reduce", tensor.numel(), kind))
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def counting_all_gather(tensor_list, tensor, group=None, async_op=False):
        calls.append(("all_gather", tensor.numel() * len(tensor_list), ""))
        return real_all_gather(tensor_list, tensor, group=group, async_op=async_op)

    dist.all_reduce, dist.all_gather = counting_all_reduce, counting_all_gather
    try:
        yield calls
    finally:
        dist.all_reduce, dist.all_gather = real_all_reduce, real_all_gather


def assert_named_checks(results_by_tp: dict, tp: int, prefix: str, tol: float) -> None:
    """``results_by_tp[tp]`` is a list (one per rank) of {check name: bool or relative error}; every check
    whose name starts with ``prefix`` must be True or have an error <= ``tol``."""
    checks = [(rank, name, value) for rank, results in enumerate(results_by_tp[tp])
              for name, value in results.items() if name.startswith(prefix)]
    assert checks, f"no check named {prefix}*"
    for rank, name, value in checks:
        if isinstance(value, bool):
            assert value, f"{name} failed at tp={tp} rank {rank}"
        else:
            assert value <= tol, f"{name}: relative error {value:.3e} > {tol} at tp={tp} rank {rank}"
