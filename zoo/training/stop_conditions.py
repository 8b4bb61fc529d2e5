"""When a run stops early, with a checkpoint: :class:`StopConditions` (Megatron's ``--exit-interval``,
``--exit-duration-in-mins``, SIGTERM/SIGUSR1/SIGINT and the launcher's exit), agreed by all ranks at an iteration
boundary with one all-reduce of three host integers on a gloo group (no accelerator synchronisation), at most
once per :data:`STOP_AGREEMENT_PERIOD_S` of training."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from zoo.distributed import agree_max
from zoo.operations.launcher_watch import CHECK_INTERVAL_S
from zoo.operations.stop_requests import StopRequests

OWN_REASON_GRACE_S = 2 * CHECK_INTERVAL_S   # how long a rank waits to see for itself a stop another rank saw
# How often, at most, the ranks agree on a stop: a world-wide collective costs every rank a chain of messages
# through the whole world (docs/design-notes.md), so short iterations share one; a stop asked for waits at most
# this much longer (and one iteration) for its checkpoint.
STOP_AGREEMENT_PERIOD_S = 2.0


@dataclass
class StopConditions:
    """When a run stops early, with a checkpoint (Megatron's flags).

    * ``exit_interval``: after every iteration that is a multiple of it (a job script can pass the same
      flag on every allocation);
    * ``exit_duration_minutes``: before that much wall time since ``started``: the run stops once the
      time left is less than its slowest iteration plus its last save (a first save is estimated as
      one iteration);
    * ``signals``: SIGTERM and SIGUSR1 (what SLURM and Kubernetes send before killing a job, and
      DeepSpeed's launcher forwards to every rank) only set a flag here; the loop stops at the next
      iteration boundary. So does a first SIGINT (Ctrl-C reaches every process of the foreground group);
      a second SIGINT raises KeyboardInterrupt, the immediate stop without checkpoint;
    * the launcher's exit (:mod:`zoo.operations.launcher_watch`: the ``deepspeed`` runner or the per-node launcher
      killed, even with SIGKILL) is the same stop, for the reason "the exit of the launcher (pid N, ...)".

    Both are recorded by ``requests`` (:class:`zoo.operations.stop_requests.StopRequests`; by default this
    object's own, installed while the loop runs); ``received`` holds the reasons this rank saw, first first
    ("signal SIGTERM", ...). A request recorded before the loop (a run installs its requests at its start)
    stops the run at its first iteration boundary.

    Ranks agree with one all-reduce (MAX) of host integers on a gloo group, so a signal or a clock that
    reaches one rank stops every rank at the same iteration, and the agreement never synchronises the
    accelerator. They agree at the first iteration, then every n iterations, n the number of iterations at
    the slowest rank's recent pace that fit in ``agreement_period_s`` (at least 1; the n is agreed with
    the flags, so every rank agrees at the same iterations). ``--exit-duration-in-mins`` counts the n
    iterations to the next agreement, and ``--exit-interval`` needs no agreement (every rank counts the
    same iterations). Without a process group every call decides at once.
    """

    exit_interval: int = 0
    exit_duration_minutes: float | None = None
    handle_signals: bool = True
    started: float = field(default_factory=time.monotonic)
    slowest_iteration_s: float = 0.0
    last_save_s: float = 0.0
    group: Any = None
    agreement_period_s: float = STOP_AGREEMENT_PERIOD_S
    requests: StopRequests | None = None                # None: this object's own, handling signals as told
    _installed_here: bool = False
    _next_agreement: int = 0                            # the first iteration at which the ranks agree next
    _last_agreement: tuple[int, float] | None = None    # (iteration, time.monotonic()) of the last agreement

    def __post_init__(self) -> None:
        if self.requests is None:
            self.requests = StopRequests(self.handle_signals)

    @property
    def received(self) -> list[str]:
        """The reasons this rank saw, first first ("signal SIGTERM", ...)."""
        return self.requests.received

    def install(self) -> None:
        """Record the signals and the launcher watch's reason (:class:`zoo.operations.stop_requests.StopRequests`),
        unless they are recorded already (a run installs its requests from its start to its end)."""
        self._installed_here = self.requests.install()

    def uninstall(self) -> None:
        """Undo what :meth:`install` did (nothing, where the requests were installed before it)."""
        if self._installed_here:
            self.requests.uninstall()
            self._installed_here = False

    def out_of_time(self, iterations: int = 1) -> bool:
        """Whether ``iterations`` more (the slowest so far) and a save would pass ``--exit-duration-in-mins``."""
        if self.exit_duration_minutes is None:
            return False
        needed = iterations * self.slowest_iteration_s + (self.last_save_s or self.slowest_iteration_s)
        return time.monotonic() - self.started + needed >= self.exit_duration_minutes * 60

    def agreement_due(self, iteration: int) -> bool:
        """Whether the ranks agree on a stop after ``iteration`` (always, without a process group)."""
        return iteration >= self._next_agreement or not (dist.is_available() and dist.is_initialized())

    def iterations_per_agreement(self, iteration: int) -> int:
        """How many iterations at this rank's pace since the last agreement fit in ``agreement_period_s``
        (1 at the first agreement, whose pace includes the set-up)."""
        if self._last_agreement is None:
            return 1
        since_iteration, since = self._last_agreement
        pace = (time.monotonic() - since) / max(iteration - since_iteration, 1)
        return max(1, int(self.agreement_period_s / max(pace, 1e-6)))

    def await_own_reason(self) -> None:
        """A stop another rank asked for is usually one this rank sees too (the same launcher's exit, polled
        every second by each rank's watch; a signal to the whole job): wait up to two polls for it, so that
        every rank names the real cause, before settling for "a signal on another rank"."""
        deadline = time.monotonic() + OWN_REASON_GRACE_S
        while not self.received and time.monotonic() < deadline:
            time.sleep(0.05)

    def reason(self, iteration: int) -> str | None:
        """Why every rank stops after ``iteration`` (None: go on). Collective over ``group`` at the
        iterations :meth:`agreement_due` names, the same on every rank."""
        if self.agreement_due(iteration):
            proposed = self.iterations_per_agreement(iteration)
            signalled, late, fewest = agree_max([bool(self.received), self.out_of_time(proposed), -proposed],
                                                self.group)
            self._next_agreement, self._last_agreement = iteration - fewest, (iteration, time.monotonic())
            if signalled:
                self.await_own_reason()
                return self.received[0] if self.received else "a signal on another rank"
            if late:
                return f"--exit-duration-in-mins {self.exit_duration_minutes:g}"
        if self.exit_interval and iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval}"
        return None


__all__ = ["OWN_REASON_GRACE_S", "STOP_AGREEMENT_PERIOD_S", "StopConditions"]
