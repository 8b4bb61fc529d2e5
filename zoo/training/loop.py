"""The one training loop of pretraining and finetuning, in the style of torchtitan's trainer.

The skeleton owns what every job shares, each step a small function:

* :func:`join` (process group, this rank's device set at once, the tp x dp grid, the seeds) and
  :func:`setup_engine` (``deepspeed.initialize`` with zoo's parameter groups and mpu);
* :meth:`TrainingLoop.train_step`: the iteration's micro-batches copied to the device without
  blocking (:func:`to_device`), forward, backward, step; the metrics are summed on the device, and each
  phase is timed without a synchronisation (:mod:`zoo.training.phase_clock`: device events, or the host clock
  on a CPU);
* :class:`LogWindow`: the sums of a log interval, brought to the host once per interval (one
  all-reduce over the DP ranks and one synchronisation, never per micro-step), with the phases' milliseconds
  per iteration (``forward_ms``, ``backward_ms``, ``optimizer_ms``, ``data_ms``; a pipeline run's
  ``train_batch_ms``, ``data_ms``) added to every log event;
* :meth:`TrainingLoop.maybe_evaluate`, :meth:`TrainingLoop.maybe_save`;
* :class:`StopConditions`: ``--exit-interval``, ``--exit-duration-in-mins`` and SIGTERM/SIGUSR1, agreed
  by all ranks at an iteration boundary with one all-reduce of three host integers on a gloo group (no
  accelerator synchronisation), at most once per :data:`STOP_AGREEMENT_PERIOD_S` of training;
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

import re
import signal
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from tqdm import tqdm

from zoo.config.deepspeed_overrides import accumulate_bf16_in_fp32, bf16_accumulation_warning
from zoo.distributed import (
    agree_max,
    describe_duration,
    is_collective_failure,
    join_process_group,
    loop_run_number,
    ranks_that_did_not_arrive,
)
from zoo.models.families import param_groups
from zoo.operations.cuda_arch import fit_cuda_arch_list_for_deepspeed
from zoo.operations.launcher_watch import CHECK_INTERVAL_S, current_watch
from zoo.operations.stop_report import report_stop
from zoo.parallel import ParallelState, model_parallel_seed
from zoo.training.engine import announce_fused_adam_build, refresh_fp32_master_weights
from zoo.training.lean_step import lighten_step
from zoo.training.loss_scaling import backward
from zoo.training.phase_clock import PhaseClock, timing_event_class

__all__ = ["LoopState", "StopConditions", "TrainingLoop", "LogWindow", "join", "setup_engine", "engine_ds_config",
           "to_device", "pin_memory_here", "Validates", "Saves"]


OWN_REASON_GRACE_S = 2 * CHECK_INTERVAL_S   # how long a rank waits to see for itself a stop another rank saw
# How often, at most, the ranks agree on a stop: a world-wide collective costs every rank a chain of messages
# through the whole world (docs/design-notes.md), so short iterations share one; a stop asked for waits at most
# this much longer (and one iteration) for its checkpoint.
STOP_AGREEMENT_PERIOD_S = 2.0


# ----------------------------------------------------------------------------------------------- setup

def join(tensor_parallel_size: int | None, seed: int, timeout_minutes: float | None = None,
         pipeline_parallel_size: int = 1) -> ParallelState:
    """Join the launcher's process group, set this rank's accelerator device right away (before the
    TP RNG tracker is seeded on it), share the CPU cores, build the tp x dp (x pp) grid and seed it.

    ``tensor_parallel_size`` None means the whole world. ``timeout_minutes``
    (``--distributed-timeout-minutes``) bounds every collective of the world, TP and DP groups; None is
    DeepSpeed's default (10 minutes, or ``$DEEPSPEED_TIMEOUT``) for all three. Returns the ParallelState,
    whose ``timeout`` the loop's roll call waits."""
    from deepspeed.constants import default_pg_timeout  # local: DeepSpeed costs seconds to import

    timeout = None if timeout_minutes is None else timedelta(minutes=timeout_minutes)
    join_process_group(timeout=timeout)   # the device of the launcher's local rank (zoo.distributed.local_rank)
    parallel = ParallelState.initialize(tensor_parallel_size or dist.get_world_size(), timeout=timeout or default_pg_timeout,
                                  pp_size=pipeline_parallel_size)
    model_parallel_seed(seed, parallel)
    return parallel


def setup_engine(model: torch.nn.Module, ds_config: dict[str, Any], parallel, weight_decay: float,
                 refresh_masters: bool):
    """The DeepSpeed engine of ``model`` (AdamW groups without decay on biases and norms, zoo's mpu), in training
    mode (a model from ``from_pretrained`` arrives in eval mode and DeepSpeed's engine keeps its module's mode;
    only the pipeline engine's ``train_batch`` sets it), bf16 gradients accumulated in fp32
    (:func:`zoo.config.deepspeed_overrides.accumulate_bf16_in_fp32`), its step lightened
    (:func:`zoo.training.lean_step.lighten_step`); ``refresh_masters`` copies weights loaded before
    ``initialize`` into fp16/bf16 master weights."""
    import deepspeed  # local: DeepSpeed costs seconds to import

    fit_cuda_arch_list_for_deepspeed()
    announce_fused_adam_build(ds_config, dist.get_rank() == 0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, weight_decay),
                                           config=engine_ds_config(ds_config), mpu=parallel)
    lighten_step(engine)
    if refresh_masters:
        refresh_fp32_master_weights(engine)
    engine.train()
    return engine


def engine_ds_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The ds_config an engine is built from: bf16 gradients accumulated in fp32
    (:func:`zoo.config.deepspeed_overrides.accumulate_bf16_in_fp32`); where the config asks bf16 accumulation
    explicitly it is kept, and rank 0 says once what that costs."""
    ds_config = accumulate_bf16_in_fp32(ds_config)
    warning = bf16_accumulation_warning(ds_config)
    if warning and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return ds_config


def pin_memory_here() -> bool:
    """Pinned host batches when there is an accelerator to copy them to (never on a CPU run)."""
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import

    return get_accelerator().device_name() != "cpu"


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """The device copy of a host batch, queued without blocking the host (the source is pinned by the
    DataLoader on an accelerator; torch copies a pageable source synchronously)."""
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


# ----------------------------------------------------------------------------------------------- state

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


# ------------------------------------------------------------------------------------------ log window

class LogWindow:
    """Metric sums of the iterations since the last log event, kept on the device.

    Each iteration adds its micro-batch sums divided by its micro-step count (one device add, no
    host copy); :meth:`means` is the one all-reduce over the DP group and the one synchronisation of
    the interval. ``clock`` times the iterations' phases (:class:`zoo.training.phase_clock.PhaseClock`, device
    events where ``timing_events`` is an event class, else the host clock), read by :meth:`phase_ms` after
    that synchronisation."""

    def __init__(self, timing_events: Any = None):
        self.clock = PhaseClock(timing_events)
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0
        self.seconds = 0.0
        self.grad_norm: torch.Tensor | float | None = None
        self.not_finite: list[torch.Tensor] = []   # per iteration: 1 where this rank's loss was NaN/inf
        self.nan_iterations = 0                    # set by means(): such iterations on any DP rank

    def add(self, iteration_sums: dict[str, torch.Tensor], micro_steps: int, seconds: float) -> None:
        for key, value in iteration_sums.items():
            mean = value.double() / micro_steps
            self.sums[key] = self.sums[key] + mean if key in self.sums else mean
        if "loss" in iteration_sums:   # a device flag: no synchronisation
            self.not_finite.append((~torch.isfinite(iteration_sums["loss"].double())).double().reshape(()))
        self.steps += 1
        self.seconds += seconds

    def means(self, parallel, device) -> dict[str, float]:
        """Window means over iterations and DP ranks (fp64, one all-reduce), as Python floats. The same
        all-reduce sums the per-iteration NaN/inf flags over the DP ranks, so ``nan_iterations`` counts the
        window's iterations whose loss was not finite on any DP rank."""
        if not self.sums:
            return {}
        stacked = torch.stack(list(self.sums.values()) + self.not_finite).to(device)
        if parallel.dp_size > 1:
            dist.all_reduce(stacked, group=parallel.dp_group)
        values = stacked.tolist()
        self.nan_iterations = sum(1 for flag in values[len(self.sums):] if flag > 0)
        return dict(zip(self.sums, (value / (parallel.dp_size * self.steps) for value in values[:len(self.sums)])))

    @property
    def step_time(self) -> float:
        return self.seconds / max(self.steps, 1)

    def phase_ms(self) -> dict[str, float]:
        """``<phase>_ms``: each phase's milliseconds per iteration over the window (after :meth:`means`). Their
        sum is at most ``step_time`` (the phases are disjoint intervals inside the iterations; the window's time
        also holds its synchronisation and the loop's bookkeeping)."""
        return {f"{phase}_ms": total / max(self.steps, 1) for phase, total in self.clock.totals_ms().items()}


# ------------------------------------------------------------------------------------- what a log adds

def mfu_percent(tflops_per_device: float, peak_tflops: float | None) -> float | None:
    """Model-FLOPs utilisation in percent of the device's dense fp16/bf16 peak (the planner's table, as
    Megatron counts it); None without a known peak (a CPU, a GPU the table lacks)."""
    return None if not peak_tflops else 100.0 * tflops_per_device / peak_tflops


def device_peak_tflops(device: torch.device) -> float | None:
    """The planner's dense peak of ``device`` (:data:`zoo.planning.planner.GPUS`), None off CUDA."""
    from zoo.planning.planner import peak_tflops_of  # local: the one table of GPU peaks

    if device.type != "cuda":
        return None
    return peak_tflops_of(torch.cuda.get_device_name(device))


def memory_fields(device: torch.device) -> dict[str, float]:
    """This rank's memory in GB (10^9 bytes, as the planner prints): allocated and reserved by the caching
    allocator (DeepSpeed's accelerator) on an accelerator; the process's resident set on a CPU."""
    if device.type == "cpu":
        import psutil  # local: a DeepSpeed dependency, needed only here

        return {"rss_gb": psutil.Process().memory_info().rss / 1e9}
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import

    accelerator = get_accelerator()
    return {"mem_allocated_gb": accelerator.memory_allocated(device) / 1e9,
            "mem_reserved_gb": accelerator.memory_reserved(device) / 1e9,
            "mem_max_allocated_gb": accelerator.max_memory_allocated(device) / 1e9}


class RunHealth:
    """The fields Megatron's log line carries beside the loss, added to every training log event: MFU
    (``mfu_pct``, where the device has a peak), this rank's memory (:func:`memory_fields`), the window's
    iterations skipped by fp16 loss scaling (``skipped_iterations``: DeepSpeed's ``skipped_steps`` since the
    last log) and those whose loss was NaN/inf on any DP rank (``nan_iterations``)."""

    def __init__(self, engine):
        self.engine = engine
        self.device = torch.device(getattr(engine, "device", "cpu"))
        self.peak_tflops = device_peak_tflops(self.device)
        self.skipped_before = self.skipped_steps()

    def skipped_steps(self) -> int:
        return int(getattr(self.engine, "skipped_steps", 0) or 0)

    def fields(self, event: dict[str, Any], window: LogWindow) -> dict[str, Any]:
        skipped = self.skipped_steps()
        fields: dict[str, Any] = {"skipped_iterations": skipped - self.skipped_before,
                                  "nan_iterations": window.nan_iterations, **memory_fields(self.device)}
        self.skipped_before = skipped
        mfu = mfu_percent(event["tflops"], self.peak_tflops) if "tflops" in event else None
        if mfu is not None:
            fields["mfu_pct"] = mfu
        return fields


# --------------------------------------------------------------------------------- known library noise

# Messages of the libraries zoo drives that say nothing about a zoo run, each with why it is harmless.
# DeepSpeed's WarmupLR/WarmupCosineLR ask for the learning rate while they are built, before their first
# step; they answer 0 and DeepSpeed's first step sets the real rate (the log's lr column shows it).
DEEPSPEED_SCHEDULER_NOTE = "Attempting to get learning rate from scheduler before it has started"
# DeepSpeed's pipeline engine moves activations and tied weights between stages with c10d broadcasts (its
# point-to-point on gloo, its tied-weight sync), some on tensors that require grad, and torch warns that
# c10d::broadcast_ has no autograd kernel. The gradients cross stages by the engine's own sends and its
# tied-weight all-reduce, never through the broadcast's autograd: tests/test_pipeline.py checks a tp x pp
# step's gradients in float64 against a single process to 1e-9.
C10D_BROADCAST_AUTOGRAD = "c10d::broadcast_: an autograd kernel was not registered to the Autograd key(s)"


class _DropMessage:
    """A logging filter that drops the records whose message contains ``text``."""

    def __init__(self, text: str):
        self.text = text

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


@contextmanager
def library_noise_silenced():
    """Within the block: DeepSpeed's scheduler note and torch's c10d::broadcast_ autograd warning of
    pipeline runs are not printed (each is harmless for zoo, see the comments above); every other warning
    and log record goes through as before. Restored on exit."""
    import logging

    loggers = [(logging.getLogger("DeepSpeed"), _DropMessage(DEEPSPEED_SCHEDULER_NOTE))]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(C10D_BROADCAST_AUTOGRAD), category=UserWarning)
        for logger, drop in loggers:
            logger.addFilter(drop)
        try:
            yield
        finally:
            for logger, drop in loggers:
                logger.removeFilter(drop)


def shows_progress_bar(stream) -> bool:
    """A progress bar redraws itself with carriage returns: only a terminal shows that as a bar, a
    redirected log would hold every redraw, so the bar is drawn only on a terminal."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


# -------------------------------------------------------------------------------------------- stopping

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

    ``received`` holds the reasons this rank saw, first first ("signal SIGTERM", ...).

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
    received: list[str] = field(default_factory=list)
    slowest_iteration_s: float = 0.0
    last_save_s: float = 0.0
    group: Any = None
    agreement_period_s: float = STOP_AGREEMENT_PERIOD_S
    _previous_handlers: dict[int, Any] = field(default_factory=dict)
    _next_agreement: int = 0                            # the first iteration at which the ranks agree next
    _last_agreement: tuple[int, float] | None = None    # (iteration, time.monotonic()) of the last agreement

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def install(self) -> None:
        watch = current_watch()
        if watch is not None:
            watch.listen(self.received.append)
        if not self.handle_signals:
            return
        for signum in self.SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        watch = current_watch()
        if watch is not None:
            watch.listen(None)
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum, frame) -> None:
        reason = f"signal {signal.Signals(signum).name}"
        if signum == signal.SIGINT and reason in self.received:
            raise KeyboardInterrupt
        self.received.append(reason)

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
