"""One derivation of a rank's seeds, at the start of a run and after a layout change: every pipeline stage and
every TP rank of a stage draws its own dropout masks in TP regions, also after a resume at another layout.

The Checkpointer restores a client state marked ``resharded_from`` (what a layout change returns) in one
process, at two places of a tp2 x pp2 grid that differ only in the stage."""

from __future__ import annotations

import deepspeed
import pytest
import torch

from tests.helpers.checkpointers import single_rank_checkpointer
from zoo.parallel import ParallelState
from zoo.parallel.random import TP_RNG_STATE_NAME

SEED, ITERATION = 1234, 3


def place(tp_rank: int, pp_rank: int) -> ParallelState:
    return ParallelState(tp_size=2, tp_rank=tp_rank, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=4, rank=pp_rank * 2 + tp_rank, pp_size=2, pp_rank=pp_rank)


@pytest.fixture
def kept_streams():
    """Every test here reseeds the process's generators: they are put back afterwards."""
    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    states, default = tracker.get_states(), torch.get_rng_state()
    yield tracker
    tracker.reset()
    tracker.set_states(states)
    torch.set_rng_state(default)


def streams(tracker) -> tuple[torch.Tensor, torch.Tensor]:
    """(TP tracker state, default stream state) as they stand."""
    return tracker.get_states()[TP_RNG_STATE_NAME].clone(), torch.get_rng_state()


def restored_at_new_layout(tmp_path, ps: ParallelState, tracker) -> tuple[torch.Tensor, torch.Tensor]:
    """The streams after the Checkpointer at ``ps`` restored a checkpoint moved from another layout."""
    from zoo.training.loop import LoopState

    checkpointer = single_rank_checkpointer(tmp_path, seed=SEED)
    payload = checkpointer.payload(LoopState(iteration=ITERATION, consumed_samples=8))
    checkpointer.parallel = ps
    checkpointer.restore({**payload, "resharded_from": {"tensor_parallel_size": 1,
                                                        "pipeline_model_parallel_size": 1}})
    return streams(tracker)


def test_stages_differ_in_both_seeds_and_tp_ranks_in_the_tracker_seed():
    from zoo.parallel.random import rank_seeds

    first, second = rank_seeds(SEED, place(1, 0)), rank_seeds(SEED, place(1, 1))
    assert first[0] != second[0] and first[1] != second[1]
    assert rank_seeds(SEED, place(0, 1))[0] == second[0] and rank_seeds(SEED, place(0, 1))[1] != second[1]


def test_after_a_layout_change_each_stage_draws_its_own_tp_masks(tmp_path, kept_streams):
    tp_stage0, default_stage0 = restored_at_new_layout(tmp_path, place(1, 0), kept_streams)
    tp_stage1, default_stage1 = restored_at_new_layout(tmp_path, place(1, 1), kept_streams)
    assert not torch.equal(tp_stage0, tp_stage1)
    assert not torch.equal(default_stage0, default_stage1)


def test_reseeding_after_a_layout_change_is_the_initial_seeding_of_a_derived_seed(tmp_path, kept_streams):
    from zoo.parallel.random import model_parallel_seed, seed_after_layout_change

    for ps in (place(0, 0), place(1, 0), place(0, 1), place(1, 1)):
        restored = restored_at_new_layout(tmp_path, ps, kept_streams)
        model_parallel_seed(seed_after_layout_change(SEED, ITERATION), ps)
        initial = streams(kept_streams)
        assert all(torch.equal(a, b) for a, b in zip(restored, initial)), ps
        model_parallel_seed(SEED, ps)
        assert not torch.equal(streams(kept_streams)[0], restored[0])   # not the run's first streams
