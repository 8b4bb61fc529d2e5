"""The one training loop of pretraining and finetuning, in the style of torchtitan's trainer.

The skeleton owns what every job shares, each step a small function or object in a module of its own:

* :func:`zoo.training.startup.join` (process group, this rank's device set at once, the tp x dp grid, the
  seeds) and :func:`zoo.training.startup.setup_engine` (``deepspeed.initialize`` with zoo's parameter groups
  and mpu);
* :meth:`TrainingLoop.train_step`: the iteration's micro-batches copied to the device without
  blocking (:func:`zoo.training.device_batches.to_device`), forward, backward, step; the metrics are summed on
  the device, and each phase is timed without a synchronisation (:mod:`zoo.training.phase_clock`: device
  events, or the host clock on a CPU);
* :class:`zoo.training.log_window.LogWindow`: the sums of a log interval, brought to the host once per
  interval (one all-reduce over the DP ranks and one synchronisation, never per micro-step), with the phases'
  milliseconds per iteration (``forward_ms``, ``backward_ms``, ``optimizer_ms``, ``data_ms``; a pipeline run's
  ``train_batch_ms``, ``data_ms``) added to every log event;
* :meth:`TrainingLoop.maybe_evaluate`, :meth:`TrainingLoop.maybe_save`;
* :class:`zoo.training.stop_conditions.StopConditions`: ``--exit-interval``, ``--exit-duration-in-mins`` and
  SIGTERM/SIGUSR1, agreed by all ranks at an iteration boundary with one all-reduce of three host integers on
  a gloo group (no accelerator synchronisation), at most once per
  :data:`zoo.training.stop_conditions.STOP_AGREEMENT_PERIOD_S` of training;
* a collective of an iteration that fails because a peer never came (``--distributed-timeout-minutes``)
  or went away ends the run with one sentence naming the ranks that did not arrive
  (:func:`zoo.distributed.ranks_that_did_not_arrive`, a roll call through the store that costs nothing
  until something failed).

What a job adds plugs in as objects: a :class:`zoo.training.loop_tasks.TrainTask` (the micro-batches of an
iteration, the forward and its metrics, the log event), a validator (``is_evaluation_step`` and
``evaluate``, e.g. :class:`zoo.training.validator.Validator`) and a checkpointer (``is_save_step`` and
``save``, :class:`zoo.training.checkpointer.Checkpointer`). The end-of-run summary stays with the caller,
which gets the final :class:`LoopState` back.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from tqdm import tqdm

from zoo.distributed import (
    describe_duration,
    is_collective_failure,
    loop_run_number,
    ranks_that_did_not_arrive,
)
from zoo.operations.stop_report import report_stop
from zoo.training.device_batches import to_device
from zoo.training.log_window import LogWindow, RunHealth
from zoo.training.loss_scaling import backward
from zoo.training.phase_clock import timing_event_class
from zoo.training.stop_conditions import StopConditions

__all__ = ["LoopState", "Saves", "TrainingLoop", "Validates", "shows_progress_bar"]


@dataclass
class LoopState:
    """Where a run is: its iteration and the samples it consumed (what a checkpoint keeps, through
    :meth:`state_dict` and :meth:`load_state_dict`), the last log event, and why it stopped early."""

    iteration: int = 0
    consumed_samples: int = 0
    last_event: dict[str, Any] = field(default_factory=dict)
    stopped_by: str | None = None     # why the run stopped before its last iteration

    def state_dict(self) -> dict[str, int]:
        """The loop's share of a checkpoint's client state; :meth:`load_state_dict` reads it back."""
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (a checkpoint's client state may hold more keys)."""
        self.iteration, self.consumed_samples = state["iteration"], state["consumed_samples"]


class Validates(Protocol):
    """The loop's validator: which iterations evaluate, and the evaluation (collective over every rank;
    ``write`` shows a line on the writer's console without breaking the progress bar)."""

    def is_evaluation_step(self, iteration: int) -> bool: ...

    def evaluate(self, state: LoopState, write) -> None: ...


class Saves(Protocol):
    """The loop's checkpointer: which iterations save (an early stop always does), and the save."""

    def is_save_step(self, iteration: int) -> bool: ...

    def save(self, state: LoopState) -> None: ...


def shows_progress_bar(stream) -> bool:
    """A progress bar redraws itself with carriage returns: only a terminal shows that as a bar, a
    redirected log would hold every redraw, so the bar is drawn only on a terminal."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


# ------------------------------------------------------------------------------------------------ loop

class TrainingLoop:
    """``run(state)`` trains from ``state`` until ``task.total_iterations`` or an agreed stop.

    ``task`` (:class:`zoo.training.loop_tasks.TrainTask`) gives the batches, the forward and the log events,
    which go to ``logger`` (a :class:`zoo.training.metrics.MetricsLogger`); ``validator`` and
    ``checkpointer`` are optional (None: no evaluation, no checkpoint); ``stop`` None trains to the end."""

    def __init__(self, engine, parallel, task, logger=None, validator: Validates | None = None,
                 checkpointer: Saves | None = None, stop: StopConditions | None = None,
                 progress_desc: str = "train", is_writer: bool = False):
        self.engine = engine
        self.parallel = parallel
        self.task = task
        self.logger = logger
        self.validator = validator
        self.checkpointer = checkpointer
        self.stop = stop
        self.progress_desc = progress_desc
        self.is_writer = is_writer
        self.timing_events = timing_event_class(torch.device(getattr(engine, "device", "cpu")))
        self.window = LogWindow(self.timing_events)
        self.progress = None
        self.health = RunHealth(engine)

    # one iteration ------------------------------------------------------------------------------
    def train_step(self, state: LoopState) -> tuple[dict[str, torch.Tensor], int]:
        """Forward, backward and step over the iteration's micro-batches; returns the metric sums over
        them, on the device, and their count. The task's own grad norm of the iteration (a device tensor,
        or None where DeepSpeed's is used) is taken before the last step.

        The window's clock charges each part to a phase (:data:`zoo.training.phase_clock.STEP_PHASES`): the
        wait for the batches and their device copies to ``data``, then per micro-batch ``forward``,
        ``backward`` and ``optimizer`` (``engine.step()``, with the grad norm before the last one). A task that
        runs the iteration itself (``train_iteration``, DeepSpeed's pipeline schedule) is one ``train_batch``
        phase after ``data``: its forwards, backwards and step interleave inside the engine."""
        engine, task, clock = self.engine, self.task, self.window.clock
        clock.start()
        batches = task.micro_batches(state)
        clock.lap("data")
        run_iteration = getattr(task, "train_iteration", None)
        if run_iteration is not None:   # the task's engine runs the micro-batches and the step itself
            sums, count = run_iteration(engine, batches)
            clock.lap("train_batch")
            self.window.grad_norm = task.own_grad_norm(engine)
            return sums, count
        sums: dict[str, torch.Tensor] = {}
        for micro_step, batch in enumerate(batches):
            on_device = to_device(batch, engine.device)
            clock.lap("data")
            output, metrics = task.forward(engine, on_device)
            clock.lap("forward")
            backward(engine, output.loss)
            clock.lap("backward")
            if micro_step == len(batches) - 1:
                self.window.grad_norm = task.own_grad_norm(engine)
            engine.step()
            clock.lap("optimizer")
            for key, value in metrics.items():
                sums[key] = sums[key] + value if key in sums else value
        return sums, len(batches)

    # after an iteration -------------------------------------------------------------------------
    def is_log_step(self, state: LoopState) -> bool:
        return (state.iteration % self.task.log_interval == 0 or state.iteration == self.task.total_iterations
                or state.stopped_by is not None)

    def log_window(self, state: LoopState) -> None:
        """The window's event (the task's, from the means over the window's micro-batches and the DP
        ranks): logged, shown on the writer's console and kept as ``state.last_event``."""
        start = time.perf_counter()
        means = self.window.means(self.parallel, self.engine.device)
        self.window.seconds += time.perf_counter() - start   # the interval's one synchronisation
        event = self.task.log_event(state, means, self.window)
        event.update(self.window.phase_ms())
        event.update(self.health.fields(event, self.window))
        self.logger.log(event)
        self.write(self.task.log_line(event))
        state.last_event = event
        self.window = LogWindow(self.timing_events)

    def maybe_evaluate(self, state: LoopState) -> None:
        if self.validator is not None and self.validator.is_evaluation_step(state.iteration):
            self.validator.evaluate(state, self.write)

    def maybe_save(self, state: LoopState) -> None:
        """The save of a save step, and of an early stop; after the stop's save (its ``latest`` written),
        every rank tells zoo's launcher of its node that the run stopped with a checkpoint (:mod:`zoo.operations.stop_report`)."""
        if self.checkpointer is None:
            return
        if self.checkpointer.is_save_step(state.iteration) or state.stopped_by is not None:
            start = time.perf_counter()
            self.checkpointer.save(state)
            if self.stop is not None:
                self.stop.last_save_s = time.perf_counter() - start
            if state.stopped_by is not None:      # every rank: each node's launcher hears it
                try:
                    report_stop(state.stopped_by, state.iteration)
                except OSError as err:       # the checkpoint is saved; only the launcher's report is missing
                    print(f"warning: the checkpoint of iteration {state.iteration} is saved, but the stop report "
                          f"for zoo's launcher could not be written ({err}); the launcher returns the runner's "
                          f"exit code instead of 75", file=sys.stderr, flush=True)

    def check_stop(self, state: LoopState) -> None:
        if self.stop is not None and state.iteration < self.task.total_iterations:
            state.stopped_by = self.stop.reason(state.iteration)

    # the skeleton -------------------------------------------------------------------------------
    def run(self, state: LoopState) -> LoopState:
        run_number = loop_run_number()
        total = self.task.total_iterations
        self.progress = tqdm(total=total, initial=state.iteration,
                             disable=not (self.is_writer and shows_progress_bar(sys.stdout)),
                             desc=self.progress_desc, unit="it", dynamic_ncols=True, file=sys.stdout)
        if self.stop is not None:
            self.stop.install()
        try:
            while state.iteration < total and state.stopped_by is None:
                start = time.perf_counter()
                with self.late_ranks_named(run_number, f"iteration {state.iteration + 1}"):
                    sums, micro_steps = self.train_step(state)
                state.iteration += 1
                state.consumed_samples += self.task.samples_per_iteration
                seconds = time.perf_counter() - start
                self.window.add(sums, micro_steps, seconds)
                if self.stop is not None:
                    self.stop.slowest_iteration_s = max(self.stop.slowest_iteration_s, seconds)
                self.progress.update(1)
                with self.late_ranks_named(run_number, f"the end of iteration {state.iteration}"):
                    self.check_stop(state)
                    if self.is_log_step(state):
                        self.log_window(state)
                    self.maybe_evaluate(state)
                    self.maybe_save(state)
        finally:
            if self.stop is not None:
                self.stop.uninstall()
            self.progress.close()
        return state

    @contextmanager
    def late_ranks_named(self, run_number: int | None, point: str):
        """A collective in the block that failed because a peer never came or went away ends the run with
        one sentence naming the ranks that did not arrive at ``point`` (after a roll call of at most the
        process-group timeout); any other error, or a failure every rank answers the roll call after,
        goes on unchanged."""
        try:
            yield
        except RuntimeError as err:
            error = self.late_rank_error(err, run_number, point)
            if error is err:
                raise
            raise error from err

    def late_rank_error(self, err: RuntimeError, run_number: int | None, point: str) -> RuntimeError:
        from deepspeed.constants import default_pg_timeout  # local: DeepSpeed costs seconds to import

        if run_number is None or not is_collective_failure(err):
            return err
        timeout = getattr(self.parallel, "timeout", None) or default_pg_timeout
        missing = ranks_that_did_not_arrive(f"run{run_number}", timeout)
        if not missing:
            return err
        who = (f"rank {missing[0]}" if len(missing) == 1
               else "ranks " + ", ".join(str(r) for r in missing[:-1]) + f" and {missing[-1]}")
        they, logs = ("it", "its log") if len(missing) == 1 else ("they", "their logs")
        return RuntimeError(f"{who} did not reach {point} within {describe_duration(timeout)} "
                            f"(--distributed-timeout-minutes); {they} may have died or hung: see {logs}.")

    def write(self, line: str) -> None:
        """A line on the writer's stdout that does not break the progress bar."""
        if self.is_writer:
            (self.progress.write if self.progress is not None else print)(line)
