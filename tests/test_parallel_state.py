"""ParallelState: the tp x dp grid ("TP groups are consecutive ranks"), its process groups, DeepSpeed's
mpu duck type, and its one-sentence errors.

One world-4 spawn builds the grid at tp = 1, 2 and 4 and checks every rank's coordinates and what an
all-reduce over its tp_group and dp_group actually sums. Exact integer arithmetic: no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import spawn

WORLD = 4


def _expected_grid(rank: int, world: int, tp: int) -> dict:
    """The contract, written out independently of zoo: rank r -> (r mod t, r div t)."""
    first = (rank // tp) * tp
    return {
        "tp_rank": rank % tp, "tp_size": tp, "dp_rank": rank // tp, "dp_size": world // tp,
        "tp_members": list(range(first, first + tp)),
        "dp_members": list(range(rank % tp, world, tp)),
    }


def _grid_worker(rank, world_size):
    import torch.distributed as dist

    from zoo.parallel import ParallelState

    out = {}
    for tp in (1, 2, 4):
        ps = ParallelState.initialize(tp)
        # 2**rank makes the sum of any subset of ranks identify that subset.
        code = torch.tensor([2 ** rank], dtype=torch.int64)
        tp_sum = code.clone()
        dist.all_reduce(tp_sum, group=ps.tp_group)
        dp_sum = code.clone()
        dist.all_reduce(dp_sum, group=ps.dp_group)
        out[tp] = {
            "rank": ps.rank, "world_size": ps.world_size,
            "tp_rank": ps.tp_rank, "tp_size": ps.tp_size, "dp_rank": ps.dp_rank, "dp_size": ps.dp_size,
            "tp_members": [r for r in range(world_size) if tp_sum.item() >> r & 1],
            "dp_members": [r for r in range(world_size) if dp_sum.item() >> r & 1],
            "mpu": {
                "get_model_parallel_rank": ps.get_model_parallel_rank(),
                "get_model_parallel_world_size": ps.get_model_parallel_world_size(),
                "get_tensor_model_parallel_rank": ps.get_tensor_model_parallel_rank(),
                "get_tensor_model_parallel_world_size": ps.get_tensor_model_parallel_world_size(),
                "get_data_parallel_rank": ps.get_data_parallel_rank(),
                "get_data_parallel_world_size": ps.get_data_parallel_world_size(),
                "get_pipeline_model_parallel_world_size": ps.get_pipeline_model_parallel_world_size(),
            },
            "groups_are_the_fields": (ps.get_model_parallel_group() is ps.tp_group
                                      and ps.get_tensor_model_parallel_group() is ps.tp_group
                                      and ps.get_data_parallel_group() is ps.dp_group),
            "has_initialize_sequence_parallel": hasattr(ps, "initialize_sequence_parallel"),
        }
    # tp = 3 does not divide world 4: every rank must refuse (before any collective).
    try:
        ParallelState.initialize(3)
        out["tp3_error"] = None
    except ValueError as err:
        out["tp3_error"] = str(err)
    out["timeouts"] = _group_timeout_outcomes(rank)
    return out


def _group_timeout_outcomes(rank):
    """At tp = 2 with a 1 s timeout, rank 0 all-reduces over its TP group {0, 1} and rank 3 over its DP group
    {1, 3} while their peers never come: each gives up after the timeout (torch's default would be 30 minutes
    on gloo). Last in the worker: the groups whose collectives timed out are not used again."""
    from datetime import timedelta

    import torch.distributed as dist

    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(2, timeout=timedelta(seconds=1))
    lonely = {0: ps.tp_group, 3: ps.dp_group}.get(rank)
    outcome = None
    if lonely is not None:
        try:
            dist.all_reduce(torch.ones(1), group=lonely)
            outcome = "arrived"
        except RuntimeError as err:
            outcome = str(err)
    dist.barrier()   # on the world group: the peers stay connected until the lonely ranks gave up
    return {"timeout_s": ps.timeout.total_seconds(), "outcome": outcome}


@pytest.fixture(scope="module")
def grid_results():
    return spawn(_grid_worker, WORLD)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_grid_coordinates_and_groups(grid_results, tp):
    for rank, results in enumerate(grid_results):
        got = results[tp]
        want = _expected_grid(rank, WORLD, tp)
        assert got["rank"] == rank and got["world_size"] == WORLD, got
        for key in ("tp_rank", "tp_size", "dp_rank", "dp_size"):
            assert got[key] == want[key], f"tp={tp} rank {rank}: {key}={got[key]}, expected {want[key]}"
        assert got["tp_members"] == want["tp_members"], (
            f"tp={tp} rank {rank}: all-reduce over tp_group summed ranks {got['tp_members']}, "
            f"expected the consecutive ranks {want['tp_members']}")
        assert got["dp_members"] == want["dp_members"], (
            f"tp={tp} rank {rank}: all-reduce over dp_group summed ranks {got['dp_members']}, "
            f"expected the strided ranks {want['dp_members']}")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mpu_duck_type(grid_results, tp):
    for rank, results in enumerate(grid_results):
        got = results[tp]
        want = _expected_grid(rank, WORLD, tp)
        assert got["mpu"] == {
            "get_model_parallel_rank": want["tp_rank"],
            "get_model_parallel_world_size": tp,
            "get_tensor_model_parallel_rank": want["tp_rank"],
            "get_tensor_model_parallel_world_size": tp,
            "get_data_parallel_rank": want["dp_rank"],
            "get_data_parallel_world_size": WORLD // tp,
            "get_pipeline_model_parallel_world_size": 1,
        }, f"tp={tp} rank {rank}"
        assert got["groups_are_the_fields"], f"tp={tp} rank {rank}: get_*_group() is not tp_group/dp_group"
        # DeepSpeed would take an mpu with this attribute for a sequence-parallel (Ulysses) one.
        assert not got["has_initialize_sequence_parallel"]


def test_tp_not_dividing_world_is_refused(grid_results):
    for rank, results in enumerate(grid_results):
        message = results["tp3_error"]
        assert message is not None, f"rank {rank}: initialize(3) at world 4 did not raise ValueError"
        assert "3" in message and "4" in message, f"message does not name tp=3 and world=4: {message}"


def test_tp_and_dp_groups_take_the_timeout(grid_results):
    """initialize(tp, timeout) gives the TP and DP groups that timeout (--distributed-timeout-minutes), not
    torch's default: a lonely all-reduce over either ends after 1 s instead of hanging."""
    outcomes = [results["timeouts"] for results in grid_results]
    assert all(o["timeout_s"] == 1.0 for o in outcomes), outcomes
    assert [o["outcome"] is None for o in outcomes] == [False, True, True, False], outcomes
    for rank in (0, 3):
        assert "timed out" in outcomes[rank]["outcome"].lower(), f"rank {rank}: {outcomes[rank]['outcome']}"


# ---------------------------------------------------------------- plain pytest process (no torch.distributed)
def test_no_distributed_in_this_process():
    # The checks below rely on it; spawn() runs its ranks in child processes only.
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())


def test_tp_above_one_without_distributed_is_refused():
    from zoo.parallel import ParallelState

    with pytest.raises(ValueError, match=r"tensor-parallel size 2 .*torch\.distributed"):
        ParallelState.initialize(2)


def test_tp_one_without_distributed_is_single():
    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(1)
    assert ps == ParallelState.single()
    assert (ps.tp_size, ps.tp_rank, ps.dp_size, ps.dp_rank, ps.world_size, ps.rank) == (1, 0, 1, 0, 1, 0)
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_data_parallel_world_size() == 1
    assert ps.get_pipeline_model_parallel_world_size() == 1
    assert not hasattr(ps, "initialize_sequence_parallel")


@pytest.mark.parametrize("bad", [0, -2, 2.0, "2"])
def test_invalid_tp_size_is_refused(bad):
    from zoo.parallel import ParallelState

    with pytest.raises(ValueError, match=r"tensor-parallel size .* is invalid"):
        ParallelState.initialize(bad)


def test_state_is_immutable():
    import dataclasses

    from zoo.parallel import ParallelState

    ps = ParallelState.single()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ps.tp_size = 2
