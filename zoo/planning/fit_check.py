"""Does the run fit in this device's memory? The planner's answer, checked before anything is built.

The memory a rank may use is measured on the device the run will take (:func:`device_memory`): the free
memory of this rank's GPU where torch sees one (and DeepSpeed is not told to use the CPU), else the host's
available memory (``MemAvailable``) shared by the ranks of this node. :func:`check_fit` takes that figure as
an argument and refuses, in one sentence with the planner's numbers and what to change, a run whose
smallest possible footprint (:func:`zoo.planning.planner.plan` without the attention scores, which zoo's
fused attention does not keep) exceeds it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from zoo.errors import UserError
from zoo.planning.gpus import CPU, GPUS
from zoo.planning.plan_report import gb
from zoo.planning.planner import Plan, plan

__all__ = ["DeviceMemory", "check_fit", "device_memory", "host_available_bytes", "ranks_on_this_node"]

# What the launchers set for the number of ranks on this node (DeepSpeed's launcher, torchrun, mpirun).
LOCAL_SIZE_VARIABLES = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class DeviceMemory:
    """The bytes one rank may use, where they were measured (``where`` completes "more than ...": "the 70 GB
    free on GPU 3 (...)"), and the GPU's name (None on the CPU)."""

    bytes_per_rank: int
    where: str
    gpu_name: str | None = None


def ranks_on_this_node(environ: Mapping[str, str] | None = None) -> int:
    """How many ranks share this node, as the launcher says (1 when none says)."""
    environ = os.environ if environ is None else environ
    for name in LOCAL_SIZE_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def host_available_bytes(meminfo: str | os.PathLike = "/proc/meminfo") -> int:
    """The host's available memory: the kernel's ``MemAvailable`` estimate, else psutil's."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # local: only where /proc/meminfo is not there

    return int(psutil.virtual_memory().available)


def device_memory(local_rank: int, environ: Mapping[str, str] | None = None) -> DeviceMemory | None:
    """The memory this rank may use on the device the run will take: the free memory of GPU ``local_rank``
    where torch sees a CUDA device and ``DS_ACCELERATOR`` does not name another accelerator, the host's
    available memory divided by the ranks of this node where the run is on the CPU, None for other
    accelerators (not measured)."""
    environ = os.environ if environ is None else environ
    accelerator = environ.get("DS_ACCELERATOR", "").strip().lower()
    import torch  # local: the parser and --help run without torch

    if accelerator in ("", "cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(local_rank)
        name = torch.cuda.get_device_name(local_rank)
        return DeviceMemory(int(free), f"the {gb(free)} free on GPU {local_rank} ({name})", name)
    if accelerator not in ("", "cpu"):
        return None
    ranks = ranks_on_this_node(environ)
    available = host_available_bytes()
    shared = f", shared by its {ranks} ranks ({gb(available // ranks)} each)" if ranks > 1 else ""
    return DeviceMemory(available // ranks, f"this host's {gb(available)} available{shared}")


def planner_device(memory: DeviceMemory) -> str:
    """The planner's name for the measured device: its GPU table row (any row for a GPU it does not list:
    only the dropout masks' width, one byte on every GPU, depends on it here), or "cpu"."""
    if memory.gpu_name is None:
        return CPU
    return next((gpu.name for gpu in GPUS if gpu.name in memory.gpu_name), GPUS[0].name)


def check_fit(config, world_size: int, memory: DeviceMemory) -> Plan:
    """The planner's plan of ``config`` (a RunConfig) on ``world_size`` ranks with ``memory`` per rank; raises
    UserError (one sentence: the numbers and what to change) when even its smallest footprint does not fit."""
    p = plan(config, world_size, gpu=planner_device(memory), gpu_memory=memory.bytes_per_rank,
             with_deepspeed_estimate=False)
    needed = p.total - p.activations_attention_scores
    if needed > memory.bytes_per_rank:
        raise UserError(does_not_fit(p, needed, memory))
    return p


def does_not_fit(p: Plan, needed: int, memory: DeviceMemory) -> str:
    """The sentence of a run that cannot fit: the plan's bytes per rank, the memory, and the changes that
    shrink the larger part first."""
    activations = p.activations - p.activations_attention_scores
    layout = f"tp={p.tp} x pp={p.pp} x dp={p.dp}" + (f" x cp={p.cp}" if p.cp > 1 else "")
    return (f"{p.model} at {layout} needs at least {gb(needed)} per rank (model states {gb(p.model_states)}: "
            f"weights {gb(p.weights)}, gradients {gb(p.gradients)}, optimizer {gb(p.optimizer)} in {p.dtype} with "
            f"ZeRO stage {p.zero_stage}; activations {gb(activations)} at micro-batch {p.micro_batch} x "
            f"{p.seq_length} tokens with recompute {p.recompute}), more than {memory.where}; "
            f"{', '.join(changes_that_help(p, activations))}, or pass --skip-fit-check to start anyway.")


def changes_that_help(p: Plan, activations: int) -> list[str]:
    """What shrinks the footprint, the changes for the larger part (model states or activations) first."""
    states = ["raise --tensor-parallel-size or --pipeline-model-parallel-size (the model states divide by tp x pp)"]
    if p.dp * p.cp > 1 and p.zero_stage == 0:
        over = f"dp={p.dp}" if p.cp == 1 else f"dp x cp = {p.dp * p.cp}"
        states.append('enable ZeRO ("zero_optimization": {"stage": 1} in the ds_config divides the optimizer states '
                      f"by {over})")
    acts = []
    if p.recompute != "full":
        acts.append("pass --recompute-granularity full (each layer keeps only its input)")
    if p.micro_batch > 1:
        acts.append("pass a smaller --micro-batch-size (the activations scale with it)")
    first, second = (states, acts) if p.model_states >= activations else (acts, states)
    return first + second
