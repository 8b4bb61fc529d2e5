"""What a log interval of the training loop gathers: :class:`LogWindow`, the sums of the interval kept on the
device and brought to the host once (one all-reduce over the DP ranks and one synchronisation, never per
micro-step), with the phases' milliseconds per iteration; and :class:`RunHealth`, the fields Megatron's log line
carries beside the loss (MFU against the planner's peak of the device, memory, skipped and NaN iterations)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zoo.training.phase_clock import PhaseClock


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
    """The planner's dense peak of ``device`` (:data:`zoo.planning.gpus.GPUS`), None off CUDA."""
    from zoo.planning.gpus import peak_tflops_of  # local: the one table of GPU peaks

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


__all__ = ["LogWindow", "RunHealth", "device_peak_tflops", "memory_fields", "mfu_percent"]
