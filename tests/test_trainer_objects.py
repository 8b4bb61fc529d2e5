"""The trainer's objects on their own, without a process group: the loop state a checkpoint keeps, the
Checkpointer's client state read back by the same object (every random generator included), and which
iterations save and evaluate."""

from __future__ import annotations

import random

import numpy as np
import torch

from tests.helpers.checkpointers import single_rank_checkpointer
from tests.helpers.pretraining import run_config


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_loop_state_round_trips_through_its_state_dict():
    from zoo.training.loop import LoopState

    state = LoopState(iteration=7, consumed_samples=56, last_event={"loss": 1.0}, stopped_by="signal SIGTERM")
    assert state.state_dict() == {"iteration": 7, "consumed_samples": 56}
    resumed = LoopState()
    resumed.load_state_dict({**state.state_dict(), "rng": None, "seed": 1})   # a client state holds more keys
    assert (resumed.iteration, resumed.consumed_samples, resumed.last_event, resumed.stopped_by) == (7, 56, {}, None)


def test_the_checkpointer_restores_the_state_and_every_generator_it_saved(tmp_path):
    from zoo.training.loop import LoopState

    checkpointer = single_rank_checkpointer(tmp_path)
    payload = checkpointer.payload(LoopState(iteration=3, consumed_samples=12))
    assert {key: payload[key] for key in ("iteration", "consumed_samples", "zoo_model", "model_config",
                                          "tensor_parallel_size", "seq_length")} == {
        "iteration": 3, "consumed_samples": 12, "zoo_model": "gpt2-tiny", "model_config": {"n_layer": 2},
        "tensor_parallel_size": 1, "seq_length": 32}
    assert payload["param_names"] == [["weight"], ["bias"]] and payload["pipeline_model_parallel_size"] == 1
    expected = _draws()
    _draws()
    state = checkpointer.restore(payload)
    assert _draws() == expected
    assert (state.iteration, state.consumed_samples, state.stopped_by) == (3, 12, None)


def test_a_resharded_checkpoint_reseeds_the_tp_stream_and_a_new_schedule_is_warned_about(tmp_path, capsys):
    import deepspeed

    from zoo.parallel.random import TP_RNG_STATE_NAME
    from zoo.training.loop import LoopState

    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    kept = tracker.get_states()
    checkpointer = single_rank_checkpointer(tmp_path, is_writer=True)
    payload = checkpointer.payload(LoopState(iteration=4, consumed_samples=16))
    try:
        checkpointer.restore({**payload, "resharded_from": 2,
                              "lr_schedule": {**payload["lr_schedule"], "warmup_num_steps": 7}})
        assert TP_RNG_STATE_NAME in tracker.get_states()
    finally:
        tracker.reset()
        tracker.set_states(kept)
    assert capsys.readouterr().err.startswith("warning: ")


def test_saves_and_evaluations_happen_on_their_intervals_and_at_the_last_iteration(tmp_path):
    from zoo.training.validator import Validator

    def saves(**changes):
        return [it for it in range(1, 11) if single_rank_checkpointer(tmp_path, **changes).is_save_step(it)]

    def evaluations(**changes):
        config = run_config(str(tmp_path / "data"), str(tmp_path / "run"), 1, 1, 1, train_iters=10, **changes)
        return [it for it in range(1, 11) if Validator(None, None, config, None, None).is_evaluation_step(it)]

    assert saves(save_interval=4) == [4, 8, 10] and saves(save_interval=0) == [10]
    assert evaluations(eval_interval=4) == [4, 8, 10] and evaluations(eval_interval=0) == []


def test_a_resume_from_a_run_without_a_checkpoint_starts_at_iteration_0(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    state = single_rank_checkpointer(tmp_path, is_writer=True, load=str(tmp_path / "run")).resume()
    assert (state.iteration, state.consumed_samples) == (0, 0)
    assert f"--load {tmp_path / 'run'}: no checkpoint yet, starting from iteration 0" in capsys.readouterr().out
