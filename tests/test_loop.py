"""The one training loop (zoo.training.loop): no host-device synchronisation from zoo's code between
log events, and the stop conditions' pure parts.

The sync test counts, during pretraining iterations at tp = 2, every ``.item()``, ``.cpu()``,
``.tolist()``, ``.numpy()``, ``float()`` and ``int()`` that zoo's own code calls on a floating-point
tensor (metrics, losses, grad norms: what lives on the accelerator on a GPU), outside the log window
and the checkpoint save. The per-iteration agreements (stop flags, a bad sample on one rank) are integer
flags all-reduced on a gloo group (``zoo.distributed.host_group``): host memory on every backend, so
they are not synchronisation points and are not counted.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.pretraining import run_config
from tests.spawn import spawn
from zoo.distributed import (
    WAIT_MARGIN,
    first_rank_timeout,
    ranks_that_did_not_arrive,
    run_on_first_rank,
)
from zoo.errors import UserError
from zoo.training.loop import TrainingLoop
from zoo.training.pretrain import pretrain
from zoo.training.stop_conditions import StopConditions

ZOO = str(Path(__file__).resolve().parent.parent / "zoo")
SYNC_METHODS = ("item", "cpu", "tolist", "numpy", "__float__", "__int__")


class SyncCounter:
    """Counts zoo's host copies of floating tensors while ``counting`` is on, per phase."""

    def __init__(self):
        self.counting = False
        self.calls: list[str] = []

    def install(self, monkeypatch_setattr) -> None:
        for name in SYNC_METHODS:
            real = getattr(torch.Tensor, name)

            def counted(tensor, *args, _real=real, _name=name, **kwargs):
                if self.counting and tensor.is_floating_point():
                    caller = sys._getframe(1)
                    if caller.f_code.co_filename.startswith(ZOO):
                        self.calls.append(f"{_name} in {caller.f_code.co_filename}:{caller.f_lineno}")
                return _real(tensor, *args, **kwargs)

            monkeypatch_setattr(torch.Tensor, name, counted)


def _sync_worker(rank, world_size, data_path, save):
    counter = SyncCounter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
    counter.install(setattr)
    per_iteration: list[list[str]] = []

    def paused(method):
        def run(self, *args):
            counter.counting = False
            try:
                return method(self, *args)
            finally:
                counter.counting = True
        return run

    real_step = TrainingLoop.train_step
    real_log, real_save = TrainingLoop.log_window, TrainingLoop.maybe_save

    def counted_step(self, state):
        per_iteration.append(counter.calls)
        counter.calls = []
        return real_step(self, state)

    real_run = TrainingLoop.run

    def counted_run(self, state):
        counter.counting = True
        try:
            return real_run(self, state)
        finally:
            counter.counting = False
            per_iteration.append(counter.calls)

    TrainingLoop.train_step, TrainingLoop.run = counted_step, counted_run
    TrainingLoop.log_window, TrainingLoop.maybe_save = paused(real_log), paused(real_save)
    try:
        result = pretrain(run_config(data_path, save, 2, 2, 4, train_iters=4, log_interval=4))
    finally:
        TrainingLoop.train_step, TrainingLoop.run = real_step, real_run
        TrainingLoop.log_window, TrainingLoop.maybe_save = real_log, real_save
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
    return per_iteration[1:], result


def test_no_host_sync_between_log_events(corpus_prefix, tmp_path):
    """Four iterations of 2 micro-steps each, one log event at the end: zoo copies nothing from the
    device to the host in any of them (the metrics are summed on the device, the fp32 grad norm stays
    a device tensor, batches go to the device without blocking)."""
    for per_iteration, result in spawn(_sync_worker, 2, corpus_prefix, str(tmp_path / "run")):
        assert len(per_iteration) == 4, per_iteration
        assert per_iteration == [[]] * 4, per_iteration
        assert result["iteration"] == 4 and isinstance(result["grad_norm"], float), result


# ----------------------------------------------------------------------------- stop conditions (pure)
def test_exit_interval_stops_on_its_multiples_and_time_budget_counts_the_save():
    stop = StopConditions(exit_interval=3, handle_signals=False)
    assert [stop.reason(it) for it in (1, 2, 3, 6)] == [None, None, "--exit-interval 3", "--exit-interval 3"]
    late = StopConditions(exit_duration_minutes=1.0, started=time.monotonic() - 50, handle_signals=False)
    assert late.reason(1) is None
    late.slowest_iteration_s, late.last_save_s = 5.0, 6.0   # 50 s gone + 5 + 6 >= 60: stop before the minute
    assert late.reason(1) == "--exit-duration-in-mins 1"


def test_signal_is_a_flag_until_the_iteration_boundary():
    stop = StopConditions()
    before = signal.getsignal(signal.SIGUSR1)
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.reason(7) == "signal SIGUSR1"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


# ----------------------------------------------------------------------------- rank-0-only work
def _first_rank_worker(rank, world_size):
    def work():
        return f"done by {dist.get_rank()}"

    def fails():
        raise UserError("the export failed on rank 0.")

    done = run_on_first_rank(work, work_bytes=10 ** 9)
    try:
        run_on_first_rank(fails, work_bytes=0)
        failure = None
    except ValueError as err:
        failure = str(err)
    return done, failure


def test_rank_zero_work_is_waited_for_with_a_timeout_sized_from_the_work():
    """The others wait on a host group whose timeout fits the bytes (116 GB: hours, not DeepSpeed's 10
    minutes); rank 0's result stays on rank 0 and its failure reaches every rank as the same sentence."""
    assert first_rank_timeout(0) == WAIT_MARGIN
    assert first_rank_timeout(116 * 10 ** 9) > timedelta(hours=3)
    ranks = spawn(_first_rank_worker, 2)
    assert ranks == [("done by 0", "the export failed on rank 0."), (None, "the export failed on rank 0.")]


# ----------------------------------------------------------------------------- --distributed-timeout-minutes
def _late_rank_worker(rank, world_size, data_path, save):
    real_check = TrainingLoop.check_stop

    def rank_1_stalls(self, state):
        if state.iteration == 2 and dist.get_rank() == 1:
            time.sleep(60)
        return real_check(self, state)

    TrainingLoop.check_stop = rank_1_stalls
    try:
        pretrain(run_config(data_path, save, 1, 1, 2, train_iters=3, distributed_timeout_minutes=0.05))
    finally:
        TrainingLoop.check_stop = real_check


def test_a_rank_that_never_arrives_ends_the_job_with_a_sentence_naming_it(corpus_prefix, tmp_path):
    """Rank 1 stalls before the stop agreement of iteration 2; rank 0 gives up after
    --distributed-timeout-minutes (3 s), calls the roll and names rank 1, instead of waiting forever."""
    with pytest.raises(AssertionError, match=r"(?s)rank 0 failed:.*RuntimeError: rank 1 did not reach the end of "
                                             r"iteration 2 within 3 s \(--distributed-timeout-minutes\); it may "
                                             r"have died or hung: see its log\.") as failed:
        spawn(_late_rank_worker, 2, corpus_prefix, str(tmp_path / "run"), timeout=60)
    assert "rank 1 failed" not in str(failed.value)


def _roll_call_worker(rank, world_size):
    if rank == 1:
        return None   # never answers
    return ranks_that_did_not_arrive("test", timedelta(seconds=1))


def test_the_roll_call_names_the_ranks_that_never_answer_on_every_rank():
    """Through the store, not a process group (a gloo group that timed out has closed its connections):
    rank 2 names rank 1 as well as rank 0 does."""
    assert spawn(_roll_call_worker, 3) == [[1], None, [1]]


# ----------------------------------------------------------------------------- ds_configs
def test_every_gpu_config_turns_the_throughput_timer_off():
    """DeepSpeed's throughput timer synchronises the accelerator every step; every fp16/bf16 config
    (the GPU ones, ZeRO variants included) turns it off."""
    configs = sorted((Path(__file__).resolve().parent.parent / "ds_configs").glob("*.json"))
    gpu = {path.name: json.loads(path.read_text()) for path in configs}
    gpu = {name: c for name, c in gpu.items()
           if c.get("fp16", {}).get("enabled") or c.get("bf16", {}).get("enabled")}
    assert any(name.endswith("_zero1.json") for name in gpu), sorted(gpu)
    assert {name: c.get("timers") for name, c in gpu.items()
            if c.get("timers") != {"throughput": {"enabled": False}}} == {}
