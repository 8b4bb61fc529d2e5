"""Where an iteration's time went: every training log event carries the phases' milliseconds per iteration
(forward, backward, optimizer and data wait; a pipeline run's train_batch and data wait), in metrics.jsonl and
on the console line, without DeepSpeed's timers.

The run-level check is consistency only (no time is asserted): the phases are non-negative and add up to no
more than the iteration's time (float64 sums of the same host clock, compared with a 1e-9 relative margin for
their rounding). The device-event path (what a GPU takes) is checked on CPU with an event class that records
what is asked of it: events are recorded on the step's path and read only when the window asks for its totals.
"""

from __future__ import annotations

import contextlib
import io

from tests.helpers.pretraining import run_config, train_events
from tests.spawn import spawn
from zoo.training.phase_clock import PhaseClock

STEP_FIELDS = ("forward_ms", "backward_ms", "optimizer_ms", "data_ms")
PIPELINE_FIELDS = ("train_batch_ms", "data_ms")


def _runs_worker(rank, world_size, data_path, root):
    from zoo.training.pretrain import pretrain

    outputs = []
    for name, changes in (("dp2", {"train_iters": 4, "log_interval": 2}),
                          ("pp2", {"train_iters": 2, "pipeline_model_parallel_size": 2})):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            pretrain(run_config(data_path, f"{root}/{name}", 1, 2, 4, **changes))
        outputs.append(out.getvalue())
    return outputs


def test_log_events_and_lines_show_where_the_iteration_went(corpus_prefix, tmp_path):
    """dp = 2 (the loop's own step, 2 micro-batches per rank, a window of 2 iterations) and pp = 2 (DeepSpeed's
    pipeline schedule, one train_batch phase)."""
    console = spawn(_runs_worker, 2, corpus_prefix, str(tmp_path))[0]
    for name, fields, absent, out in (("dp2", STEP_FIELDS, PIPELINE_FIELDS[:1], console[0]),
                                      ("pp2", PIPELINE_FIELDS, STEP_FIELDS[:3], console[1])):
        events = train_events(tmp_path / name)
        assert events, name
        for event in events:
            assert all(key in event for key in fields), (name, event)
            assert not any(key in event for key in absent), (name, event)
            phases = [event[key] for key in fields]
            assert min(phases) >= 0.0, (name, event)
            assert sum(phases) <= 1e3 * event["step_time_s"] * (1 + 1e-9), (name, event)
            line = next(line for line in out.splitlines() if line.startswith(f"iteration {event['iteration']:>7d}/"))
            shown = ", ".join(f"{key[:-3]} {event[key]:.1f}" for key in fields)
            assert f"iteration {1e3 * event['step_time_s']:.1f} ms: {shown}" in line, (name, line)
    assert [e["iteration"] for e in train_events(tmp_path / "dp2")] == [2, 4]


class RecordedEvent:
    """A device event as the clock uses one, timed by a counter instead of a device; ``log`` records every call."""

    log: list[str] = []
    ticks = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.at = None

    def record(self):
        RecordedEvent.ticks += 1
        self.at = RecordedEvent.ticks
        RecordedEvent.log.append("record")

    def synchronize(self):
        RecordedEvent.log.append("synchronize")

    def elapsed_time(self, end) -> float:
        RecordedEvent.log.append("elapsed_time")
        return float(end.at - self.at)


def test_device_events_are_recorded_per_phase_and_read_only_for_the_totals():
    RecordedEvent.log, RecordedEvent.ticks = [], 0
    clock = PhaseClock(RecordedEvent)
    for _ in range(2):                                   # two iterations of 2 micro-batches
        clock.start()
        clock.lap("data")
        for _ in range(2):
            for phase in ("data", "forward", "backward", "optimizer"):
                clock.lap(phase)
    assert set(RecordedEvent.log) == {"record"} and len(RecordedEvent.log) == 2 * (2 + 2 * 4)
    totals = clock.totals_ms()
    assert totals == {"data": 6.0, "forward": 4.0, "backward": 4.0, "optimizer": 4.0}   # the gap between chains is no phase's
    assert RecordedEvent.log.count("synchronize") == 1
    assert clock.totals_ms() == totals                    # read once; asking again reads nothing new
    assert RecordedEvent.log.count("elapsed_time") == 18
