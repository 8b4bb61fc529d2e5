"""The planner's table of GPUs: each model's dense fp16/bf16 peak, its memory and whether it has bf16.

The one table of GPU peaks in zoo: the planner's time estimate, the fit check and the training log's MFU
(``launch/smoke.py`` too) read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from zoo.errors import UserError


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model: dense fp16/bf16 tensor-core peak (TFLOP/s, no sparsity), its memory in bytes, and whether it
    has bf16 at all (the V100 computes fp16 only)."""

    name: str
    peak_tflops: float
    memory_bytes: int
    bf16: bool = True


# The one table of GPU peaks in zoo (launch/smoke.py's MFU reads it too). Matched against device names by
# fragment, most specific first ("H100 PCIe" before "H100").
GPUS = (
    GpuSpec("H100 PCIe", 756.0, 80 * 10**9),
    GpuSpec("H100 NVL", 835.0, 94 * 10**9),
    GpuSpec("H100", 989.4, 80 * 10**9),      # SXM
    GpuSpec("H200", 989.4, 141 * 10**9),
    GpuSpec("A100", 312.0, 80 * 10**9),
    GpuSpec("V100", 125.0, 32 * 10**9, bf16=False),
)
CPU = "cpu"


def check_precision_on(spec: GpuSpec | None, dtype: str, source: str | None) -> None:
    """A run in bf16 planned on a GPU without bf16 (the V100) is one sentence naming the GPUs that have it."""
    if spec is not None and dtype == "bf16" and not spec.bf16:
        with_bf16 = ", ".join(gpu.name for gpu in GPUS if gpu.bf16)
        raise UserError(f"{source or 'the config'} trains in bf16, which the {spec.name} does not have; train in "
                         f"fp16 there (--fp16), or plan for a GPU with bf16 (--gpu one of {with_bf16}).")


def peak_tflops_of(device_name: str) -> float | None:
    """Dense peak of the first table row whose name is part of ``device_name`` (e.g. torch's
    "NVIDIA A100-SXM4-80GB"); None for an unknown device."""
    return next((gpu.peak_tflops for gpu in GPUS if gpu.name in device_name), None)


def gpu_spec(name: str) -> GpuSpec:
    """The table row named ``name`` (case-insensitive)."""
    for gpu in GPUS:
        if gpu.name.lower() == name.strip().lower():
            return gpu
    raise UserError(f"GPU {name!r} is not in the planner's table; pass --gpu one of "
                     f"{[gpu.name for gpu in GPUS] + [CPU]}.")


__all__ = ["CPU", "GPUS", "GpuSpec", "check_precision_on", "gpu_spec", "peak_tflops_of"]
