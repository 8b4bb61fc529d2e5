"""Reading the optimizer state of a ZeRO-1/2 (or BF16_Optimizer) checkpoint of zoo, per parameter.

DeepSpeed's ZeRO stages 1 and 2 and its BF16_Optimizer keep the optimizer state in one file per
(dp rank, tp rank): ``[bf16_]zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt``. For each optimizer
group (zoo's :func:`zoo.models.families.param_groups` order, recorded by name as ``param_names`` in the
model-states files) the group's parameters are flattened in order, padded to a multiple of
2 x dp, and dp rank d owns the d-th equal slice: its fp32 master weights
(``single_partition_of_fp32_groups``, the padding stripped) and its Adam moments
(``base_optimizer_state``, padded). DeepSpeed itself refuses to load such a checkpoint at another dp
("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
supported").

:class:`PartitionedState` reads one model-parallel rank's files per parameter: a parameter's fp32 master or
moment is cut out of the one or two partitions that hold it, memory-mapped, without assembling its group.
:mod:`zoo.checkpoint.training_state` builds the layout-free form of the whole checkpoint from it, and the
ranks of a run at another layout fill their engines from that (:mod:`zoo.checkpoint.layout_change`).

Layouts it cannot read are refused in one sentence: ZeRO stage 3, a checkpoint written with
``zero_optimization.parameter_alignment`` (per-parameter padding), ``round_robin_gradients`` or
``elastic_checkpoint``, partition files missing for a (dp, tp) rank.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint.files import first_line
from zoo.checkpoint.safe_load import UnsafeCheckpointError, safe_torch_load
from zoo.errors import MissingInput, UserError

OPTIM_STATES_RE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
OPTIM_STATES = "{prefix}zero_pp_rank_{dp}_mp_rank_{tp:02d}_optim_states.pt"
ALIGNMENT_FACTOR = 2   # DeepSpeed's nccl_start_alignment_factor: groups are padded to a multiple of 2 x dp
OPTIMIZER = "optimizer_state_dict"
FP32 = "single_partition_of_fp32_groups"
BASE = "base_optimizer_state"
PADDINGS = "group_paddings"
ALIGNMENT_PADDINGS = "param_alignment_paddings"
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class PartitionFiles:
    """The optimizer partition files of one checkpoint tag: their name prefix, dp and tp degrees."""
    prefix: str   # "" for ZeRO-1/2, "bf16_" when written with bf16 enabled
    dp_size: int
    tp_size: int

    def path(self, tag_dir: Path, dp_rank: int, tp_rank: int) -> Path:
        return Path(tag_dir) / OPTIM_STATES.format(prefix=self.prefix, dp=dp_rank, tp=tp_rank)


def partition_files(tag_dir: Path) -> PartitionFiles | None:
    """The ZeRO/BF16 partition files of ``tag_dir`` (None when the optimizer state is in the model-states
    files), checked complete: every (dp, tp) pair of one prefix, nothing else."""
    found = [m for p in Path(tag_dir).iterdir() if (m := OPTIM_STATES_RE.fullmatch(p.name))]
    if not found:
        return None
    prefixes = {m.group(1) or "" for m in found}
    if len(prefixes) > 1:
        raise UserError(f"{tag_dir} mixes bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files; keep the files of "
                         "one checkpoint only.")
    dp = max(int(m.group(2)) for m in found) + 1
    tp = max(int(m.group(3)) for m in found) + 1
    files = PartitionFiles(prefixes.pop(), dp, tp)
    for d in range(dp):
        for t in range(tp):
            if not files.path(tag_dir, d, t).is_file():
                raise MissingInput(f"{files.path(tag_dir, d, t)} is missing from a checkpoint partitioned over "
                                        f"dp={dp} x tp={tp}; copy every *_optim_states.pt of the tag.")
    return files


def read_partition(path: Path) -> dict[str, Any]:
    """One (dp, tp) rank's optimizer partition, memory-mapped."""
    try:
        states = safe_torch_load(path)   # weights-only, with DeepSpeed's loss scaler and enum types allowed
    except UnsafeCheckpointError as err:
        raise UserError(str(err)) from None   # a user error: ranks agree on it by its kind
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        raise UserError(f"{path} cannot be read as a torch checkpoint ({first_line(err)}); it is truncated, "
                         "re-save it.") from None
    optimizer = states.get(OPTIMIZER) if isinstance(states, dict) else None
    if not isinstance(optimizer, dict) or not {FP32, BASE, PADDINGS} <= optimizer.keys():
        raise UserError(f"{path} is not a DeepSpeed ZeRO stage 1/2 or BF16 optimizer partition (ZeRO stage 3 "
                         "checkpoints cannot be resharded); resume it at its own layout.")
    check_reshardable_zero_config(states, path)
    if any(any(group) for group in optimizer.get(ALIGNMENT_PADDINGS) or []):
        raise UserError(f"{path} was written with zero_optimization.parameter_alignment (per-parameter padding), "
                         "which zoo cannot reshard; resume it at its own layout.")
    return states


REFUSED_ZERO_OPTIONS = ("round_robin_gradients", "elastic_checkpoint")


def check_reshardable_zero_config(states: dict[str, Any], path: Path) -> None:
    """The ZeRO options recorded in a checkpoint (DeepSpeed keeps the run's ``ds_config`` in its model-states
    and partition files) lay the partitions out as :class:`PartitionedState` reads them: ``round_robin_gradients``
    reorders each group's parameters across ranks and ``elastic_checkpoint`` saves the optimizer state per
    parameter instead of per partition, so such checkpoints are refused rather than read wrongly."""
    config = states.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    if not isinstance(zero, dict):
        return
    enabled = [option for option in REFUSED_ZERO_OPTIONS if zero.get(option)]
    if enabled:
        raise UserError(f"{path} was written with zero_optimization.{enabled[0]}: true, whose partitions zoo cannot "
                         "reshard; resume it at the tp x dp layout it was written with (or export it with "
                         "launch/export.py).")


# --------------------------------------------------------------------------- reading one rank's dp partitions
class PartitionedState:
    """One model-parallel rank's optimizer state in its dp partition files, read per parameter.

    ``groups`` are the rank's optimizer groups as (parameter name, local shape) in partition order. Group g
    is the concatenation of its parameters, padded to ``dp x size`` and cut into dp equal slices, so a
    parameter at [offset, offset + numel) of the group lies in the partitions ``offset // size`` to
    ``(offset + numel - 1) // size``: :meth:`tensor` opens only those files (lazily, memory-mapped, each
    once) and copies only the parameter's elements; the whole group is never assembled. The layout is
    checked against DeepSpeed's (:func:`partition_bounds`) from the first partition's sizes and paddings.
    ``opened`` is told the path of each file as it is opened."""

    def __init__(self, paths: list[Path], groups: list[list[tuple[str, torch.Size]]],
                 opened: Callable[[Path], None] = lambda path: None):
        self.paths, self.groups, self.opened = paths, groups, opened
        self._partitions: dict[int, dict[str, Any]] = {}
        self.where: dict[str, tuple[int, int, torch.Size]] = {}
        for g, group in enumerate(groups):
            offset = 0
            for name, shape in group:
                self.where[name] = (g, offset, shape)
                offset += shape.numel()

    def partition(self, dp_rank: int) -> dict[str, Any]:
        if dp_rank not in self._partitions:
            self.opened(self.paths[dp_rank])
            self._partitions[dp_rank] = read_partition(self.paths[dp_rank])[OPTIMIZER]
        return self._partitions[dp_rank]

    def base_state(self, dp_rank: int, g: int) -> dict[str, Any]:
        optimizer = self.partition(dp_rank)
        return optimizer[BASE]["state"][optimizer[BASE]["param_groups"][g]["params"][0]]

    def partition_size(self, g: int) -> int:
        """Elements per dp partition of group ``g``, checked against the group's parameters."""
        size = self.base_state(0, g)["exp_avg"].numel()
        total = sum(shape.numel() for _, shape in self.groups[g])
        expected, paddings = partition_bounds(total, len(self.paths))
        if size != expected or self.partition(0)[PADDINGS][g] != paddings[0]:
            raise UserError(f"the optimizer partitions {self.paths[0].name}... hold {size * len(self.paths)} "
                             f"elements of group {g} but its parameters have {total}; the files are not one "
                             "checkpoint, re-save it.")
        return size

    def tensor(self, name: str, key: str, rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, int]:
        """(Parameter ``name``'s fp32 ``key`` ("master", "exp_avg" or "exp_avg_sq") shaped like the parameter, or
        only its indices ``rows`` = [first, stop) of dimension 0; the bytes copied for it): a view of the mapped
        file, or, where those elements straddle two partitions, a copy of just them (copied bytes = their size)."""
        g, offset, shape = self.where[name]
        size = self.partition_size(g)
        row = shape.numel() // shape[0] if len(shape) else 1
        first, stop = rows if rows is not None else (0, shape[0] if len(shape) else 1)
        if rows is not None:
            shape = torch.Size((stop - first, *shape[1:]))
        lo, hi = offset + first * row, offset + stop * row
        if hi <= lo:
            return torch.zeros(shape), 0
        pieces = []
        for dp_rank in range(lo // size, (hi - 1) // size + 1):
            flat = (self.partition(dp_rank)[FP32][g] if key == "master" else self.base_state(dp_rank, g)[key])
            start = max(lo, dp_rank * size) - dp_rank * size
            stop_at = min(hi, (dp_rank + 1) * size) - dp_rank * size
            pieces.append(flat.reshape(-1).narrow(0, start, stop_at - start))
        if len(pieces) == 1:
            return pieces[0].view(shape), 0
        copy = torch.cat(pieces).view(shape)
        return copy, copy.nbytes

    def scalars(self, g: int) -> dict[str, Any]:
        """Group ``g``'s non-tensor-shaped Adam state (its step), from the first partition."""
        return {key: value for key, value in self.base_state(0, g).items() if key not in MOMENTS}

    def step(self, name: str) -> Any:
        return self.scalars(self.where[name][0]).get("step")


def partition_bounds(total: int, dp_size: int) -> tuple[int, list[int]]:
    """(partition size, padding of each dp rank) of a group of ``total`` elements, as DeepSpeed lays it out."""
    alignment = ALIGNMENT_FACTOR * dp_size
    size = math.ceil(total / alignment) * alignment // dp_size
    paddings = [min(size, max(0, (rank + 1) * size - total)) for rank in range(dp_size)]
    return size, paddings
