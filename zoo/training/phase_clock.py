"""Where an iteration's time goes: the phases of the training step (data wait, forward, backward, optimizer),
timed without a host synchronisation on the step's path.

A :class:`PhaseClock` marks the boundaries of one timeline: :meth:`PhaseClock.start` opens an iteration's
chain, each :meth:`PhaseClock.lap` closes the interval since the previous mark and charges it to a phase.
Consecutive intervals never overlap, so the phases of an iteration add up to no more than its time; what the
clock leaves uncharged (the loop's own bookkeeping between iterations) is the rest.

* On an accelerator a mark is a device event (DeepSpeed's accelerator ``Event(enable_timing=True)``) recorded
  on the current stream. Recording queues the event and returns; the events are read only by
  :meth:`PhaseClock.totals_ms`, which the log window calls after its own synchronisation, so the step gains no
  synchronisation. The intervals are then device time: ``data`` is how long the device waited for the host to
  hand it the iteration's batches (zero when the host fetched them while the device was still busy) plus their
  copies, and the compute phases are the device's time for the work queued in them.
* On a CPU (DeepSpeed's CPU accelerator has no events: its ``Event`` is None) a mark is the host's
  ``time.perf_counter()``, which there is the device's own time, and intervals are summed as they close.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["PhaseClock", "timing_event_class", "STEP_PHASES", "PIPELINE_PHASES"]

# The phases of a step the loop runs itself (forward/backward/step per micro-batch), in the order a log line
# shows them; "optimizer" is engine.step() (and the task's grad norm taken just before the last one).
STEP_PHASES = ("forward", "backward", "optimizer", "data")
# The phases of a step DeepSpeed's pipeline engine schedules itself: its train_batch interleaves every
# micro-batch's forward, backward and sends with the step, so it is one phase (with the batches' device copies).
PIPELINE_PHASES = ("train_batch", "data")


def timing_event_class(device) -> Any:
    """The device event class that times ``device``'s work (DeepSpeed's accelerator's ``Event``), or None where
    the host clock is the device's (a CPU)."""
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import

    if getattr(device, "type", str(device)) == "cpu":
        return None
    return get_accelerator().Event


class PhaseClock:
    """Milliseconds per phase since the clock was made, on one timeline (see the module doc).

    ``event_class`` None: host clock; else a device event class taking ``enable_timing``."""

    def __init__(self, event_class: Any = None):
        self.event_class = event_class
        self.totals: dict[str, float] = {}
        self.pending: list[tuple[str | None, Any]] = []   # device events not read yet: (phase, event)
        self.last: float | None = None                    # host clock: the previous mark

    def _mark(self) -> Any:
        if self.event_class is None:
            return time.perf_counter()
        event = self.event_class(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        """Open a chain: the next :meth:`lap` charges the time from here; nothing before it is charged."""
        if self.event_class is None:
            self.last = time.perf_counter()
        else:
            self.pending.append((None, self._mark()))

    def lap(self, phase: str) -> None:
        """Charge the time since the previous mark of the chain to ``phase``."""
        if self.event_class is None:
            now = time.perf_counter()
            self.totals[phase] = self.totals.get(phase, 0.0) + 1e3 * (now - self.last)
            self.last = now
        else:
            self.pending.append((phase, self._mark()))

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds charged to each phase so far. With device events this reads them: call it after the
        device reached the last one (the log window's synchronisation); waiting on the last event then returns
        at once."""
        if self.pending:
            self.pending[-1][1].synchronize()
            for (_, before), (phase, after) in zip(self.pending, self.pending[1:]):
                if phase is not None:
                    self.totals[phase] = self.totals.get(phase, 0.0) + before.elapsed_time(after)
            self.pending = []
        return dict(self.totals)
