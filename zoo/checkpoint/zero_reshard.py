"""Reshard a ZeRO-1/2 (or BF16_Optimizer) checkpoint of zoo to another tp x dp layout.

DeepSpeed's ZeRO stages 1 and 2 and its BF16_Optimizer keep the optimizer state in one file per
(dp rank, tp rank): ``[bf16_]zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt``. For each optimizer
group (zoo's :func:`zoo.models.families.param_groups` order, recorded as ``param_shapes`` in the
model-states files) the group's parameters are flattened in order, padded to a multiple of
2 x dp, and dp rank d owns the d-th equal slice: its fp32 master weights
(``single_partition_of_fp32_groups``, the padding stripped) and its Adam moments
(``base_optimizer_state``, padded). DeepSpeed itself refuses to load such a checkpoint at another dp
("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
supported") and zoo's non-ZeRO resharder cannot read it.

How: for every old TP rank, the dp slices of each group are concatenated (padding cut) and split by
``param_shapes`` into per-parameter tensors (fp32 master, exp_avg, exp_avg_sq); each parameter is then
resharded along its TP dimension by :class:`zoo.checkpoint.reshard.TensorResharder` (fused-QKV stride,
vocab padding cut and re-added), regrouped in the new layout's parameter order, flattened, padded and
sliced for the new dp exactly as DeepSpeed lays a fresh run out; each group's scalar state (Adam's step
tensor) is its own copy in every group of every file (:func:`own_copies`). The files written are an
ordinary checkpoint of the new layout, so the run loads them with its usual ds_config (no ``load_universal``).

Why not DeepSpeed's universal checkpoint (``ds_to_universal`` + ``"checkpoint": {"load_universal": true}``):
loading one needs ``load_universal`` in the ds_config before ``deepspeed.initialize`` and model-states
files at the new tp (DeepSpeed still reads ``mp_rank_XX_model_states.pt`` of the new rank), needs the
model to publish per-pattern universal-checkpoint info (including the per-rank [q|k|v] stride of zoo's
fused QKV as sub-parameter shapes), and converts through one file per parameter and state. zoo already
knows every parameter's partition dim, stride and vocab rows (the same table the export and the non-ZeRO
resharder use), so one pass over the partition files gives the new layout directly, through the same
``--load`` and ``checkpoint_to_load`` as the non-ZeRO case.

Layouts it cannot convert are refused in one sentence before anything is written: ZeRO stage 3, a
checkpoint written with ``zero_optimization.parameter_alignment`` (per-parameter padding), partition
files missing for a (dp, tp) rank, or a model that cannot be laid out at the new tp.

Memory: the partition files are memory-mapped; the old checkpoint's fp32 state (master and two
moments, merged per TP rank) and one new TP rank's merged state are held while its dp partitions are
written: about 3 + 3/tp_new fp32 copies of the model, in the one process that reshards.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint.files import MODEL_STATES, first_line, model_states_path
from zoo.checkpoint.layout import optimizer_groups
from zoo.checkpoint.safe_load import UnsafeCheckpointError, safe_torch_load

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
        raise ValueError(f"{tag_dir} mixes bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files; keep the files of "
                         "one checkpoint only.")
    dp = max(int(m.group(2)) for m in found) + 1
    tp = max(int(m.group(3)) for m in found) + 1
    files = PartitionFiles(prefixes.pop(), dp, tp)
    for d in range(dp):
        for t in range(tp):
            if not files.path(tag_dir, d, t).is_file():
                raise FileNotFoundError(f"{files.path(tag_dir, d, t)} is missing from a checkpoint partitioned over "
                                        f"dp={dp} x tp={tp}; copy every *_optim_states.pt of the tag.")
    return files


def read_partition(path: Path) -> dict[str, Any]:
    """One (dp, tp) rank's optimizer partition, memory-mapped."""
    try:
        states = safe_torch_load(path)   # weights-only, with DeepSpeed's loss scaler and enum types allowed
    except UnsafeCheckpointError as err:
        raise ValueError(str(err)) from None   # a plain ValueError: ranks agree on it by its type name
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        raise ValueError(f"{path} cannot be read as a torch checkpoint ({first_line(err)}); it is truncated, "
                         "re-save it.") from None
    optimizer = states.get(OPTIMIZER) if isinstance(states, dict) else None
    if not isinstance(optimizer, dict) or not {FP32, BASE, PADDINGS} <= optimizer.keys():
        raise ValueError(f"{path} is not a DeepSpeed ZeRO stage 1/2 or BF16 optimizer partition (ZeRO stage 3 "
                         "checkpoints cannot be resharded); resume it at its own layout.")
    check_reshardable_zero_config(states, path)
    if any(any(group) for group in optimizer.get(ALIGNMENT_PADDINGS) or []):
        raise ValueError(f"{path} was written with zero_optimization.parameter_alignment (per-parameter padding), "
                         "which zoo cannot reshard; resume it at its own layout.")
    return states


REFUSED_ZERO_OPTIONS = ("round_robin_gradients", "elastic_checkpoint")


def check_reshardable_zero_config(states: dict[str, Any], path: Path) -> None:
    """The ZeRO options recorded in a checkpoint (DeepSpeed keeps the run's ``ds_config`` in its model-states
    and partition files) lay the partitions out as zoo's resharder reads them: ``round_robin_gradients``
    reorders each group's parameters across ranks and ``elastic_checkpoint`` saves the optimizer state per
    parameter instead of per partition, so such checkpoints are refused rather than resharded wrongly."""
    config = states.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    if not isinstance(zero, dict):
        return
    enabled = [option for option in REFUSED_ZERO_OPTIONS if zero.get(option)]
    if enabled:
        raise ValueError(f"{path} was written with zero_optimization.{enabled[0]}: true, whose partitions zoo cannot "
                         "reshard; resume it at the tp x dp layout it was written with (or export it with "
                         "launch/export.py).")


def group_layout(param_shapes: list[dict[str, torch.Size]]) -> list[list[tuple[str, torch.Size]]]:
    return [[(name, torch.Size(shape)) for name, shape in group.items()] for group in param_shapes]


# --------------------------------------------------------------------------- reading one rank's dp partitions
class PartitionedState:
    """One model-parallel rank's optimizer state in its dp partition files, read per parameter.

    ``groups`` are the rank's optimizer groups as (parameter name, local shape) in partition order. Group g
    is the concatenation of its parameters, padded to ``dp x size`` and cut into dp equal slices, so a
    parameter at [offset, offset + numel) of the group lies in the partitions ``offset // size`` to
    ``(offset + numel - 1) // size``: :meth:`tensor` opens only those files (lazily, memory-mapped, each
    once) and copies only the parameter's elements; the whole group is never assembled. The layout is
    checked against DeepSpeed's (:func:`partition_bounds`) from the first partition's sizes and paddings."""

    def __init__(self, paths: list[Path], groups: list[list[tuple[str, torch.Size]]]):
        self.paths, self.groups = paths, groups
        self._partitions: dict[int, dict[str, Any]] = {}
        self.where: dict[str, tuple[int, int, torch.Size]] = {}
        for g, group in enumerate(groups):
            offset = 0
            for name, shape in group:
                self.where[name] = (g, offset, shape)
                offset += shape.numel()

    def partition(self, dp_rank: int) -> dict[str, Any]:
        if dp_rank not in self._partitions:
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
            raise ValueError(f"the optimizer partitions {self.paths[0].name}... hold {size * len(self.paths)} "
                             f"elements of group {g} but its parameters have {total}; the files are not one "
                             "checkpoint, re-save it.")
        return size

    def tensor(self, name: str, key: str) -> torch.Tensor:
        """Parameter ``name``'s fp32 ``key`` ("master", "exp_avg" or "exp_avg_sq"), shaped like the parameter."""
        g, offset, shape = self.where[name]
        size = self.partition_size(g)
        lo, hi = offset, offset + shape.numel()
        pieces = []
        for dp_rank in range(lo // size, (hi - 1) // size + 1):
            flat = (self.partition(dp_rank)[FP32][g] if key == "master" else self.base_state(dp_rank, g)[key])
            start = max(lo, dp_rank * size) - dp_rank * size
            stop = min(hi, (dp_rank + 1) * size) - dp_rank * size
            pieces.append(flat.reshape(-1).narrow(0, start, stop - start))
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).view(shape)

    def scalars(self, g: int) -> dict[str, Any]:
        """Group ``g``'s non-tensor-shaped Adam state (its step), from the first partition."""
        return {key: value for key, value in self.base_state(0, g).items() if key not in MOMENTS}

    def step(self, name: str) -> Any:
        return self.scalars(self.where[name][0]).get("step")


def merged_tp_rank(partitions: list[dict[str, Any]], groups: list[list[tuple[str, torch.Size]]],
                   paths: list[Path]) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict[str, Any]]]:
    """({state: {parameter name: tensor}} for 'master', 'exp_avg', 'exp_avg_sq'; each group's scalars,
    such as Adam's step) of one TP rank, from its dp partitions (already read: ``partitions``)."""
    state = PartitionedState(paths, groups)
    state._partitions = {d: partition[OPTIMIZER] for d, partition in enumerate(partitions)}
    by_state = {key: {name: state.tensor(name, key) for group in groups for name, _ in group}
                for key in ("master",) + MOMENTS}
    return by_state, [state.scalars(g) for g in range(len(groups))]


# --------------------------------------------------------------------------- partitioning for the new dp
def partition_bounds(total: int, dp_size: int) -> tuple[int, list[int]]:
    """(partition size, padding of each dp rank) of a group of ``total`` elements, as DeepSpeed lays it out."""
    alignment = ALIGNMENT_FACTOR * dp_size
    size = math.ceil(total / alignment) * alignment // dp_size
    paddings = [min(size, max(0, (rank + 1) * size - total)) for rank in range(dp_size)]
    return size, paddings


def slice_mappings(group: list[tuple[str, torch.Size]], start: int, size: int) -> OrderedDict:
    """DeepSpeed's ``param_slice_mappings`` of one group's partition [start, start + size)."""
    from deepspeed.utils.tensor_fragment import fragment_address  # local: DeepSpeed import ~1.5 s

    mappings, offset = OrderedDict(), 0
    for name, shape in group:
        lo, hi = max(offset, start), min(offset + shape.numel(), start + size)
        if lo < hi:
            mappings[name] = fragment_address(numel=hi - lo, start=lo - start)
        offset += shape.numel()
    return mappings


def new_partitions(template: dict[str, Any], merged: dict[str, dict[str, torch.Tensor]],
                   scalars: list[dict[str, Any]], groups: list[list[tuple[str, torch.Size]]],
                   dp_size: int) -> list[dict[str, Any]]:
    """The ``dp_size`` partition files of one new TP rank, from its merged per-parameter state and each
    group's scalars (``scalars[g]``)."""
    flats = {key: [torch.cat([by_name[name].reshape(-1) for name, _ in group]) for group in groups]
             for key, by_name in merged.items()}
    bounds = [partition_bounds(flat.numel(), dp_size) for flat in flats["master"]]
    template_optimizer = template[OPTIMIZER]
    out = []
    for rank in range(dp_size):
        fp32, state, mappings = [], {}, []
        for g, (group, (size, paddings)) in enumerate(zip(groups, bounds)):
            start, keep = rank * size, size - paddings[rank]
            fp32.append(flats["master"][g].narrow(0, start, keep).clone())
            entry = own_copies(scalars[g])
            for key in MOMENTS:
                moment = flats[key][g].new_zeros(size)
                moment[:keep] = flats[key][g].narrow(0, start, keep)
                entry[key] = moment
            state[g] = entry
            mappings.append(slice_mappings(group, start, size))
        base_groups = [{**group, "params": [g]} for g, group in enumerate(template_optimizer[BASE]["param_groups"])]
        optimizer = {**template_optimizer, FP32: fp32, BASE: {"state": state, "param_groups": base_groups},
                     PADDINGS: [paddings[rank] for _, paddings in bounds],
                     "partition_count": [dp_size] * len(groups), "param_slice_mappings": mappings}
        if ALIGNMENT_PADDINGS in template_optimizer:
            optimizer[ALIGNMENT_PADDINGS] = [[0] * len(group) for group in groups]
        out.append({**template, OPTIMIZER: optimizer})
    return out


def own_copies(scalars: dict[str, Any]) -> dict[str, Any]:
    """``scalars`` with every tensor cloned. torch's AdamW keeps ``step`` as a tensor it increments in place,
    and torch.save / torch.load keep one tensor shared: a step tensor shared by a file's two groups would
    be incremented once per group per iteration after the resume, so the second group would use the wrong
    bias correction (measured: 2e-5 in the loss and 4e-4 to 2e-3 in the grad norm from the second iteration
    after a new-layout resume)."""
    return {key: value.clone() if torch.is_tensor(value) else value for key, value in scalars.items()}


# --------------------------------------------------------------------------- the whole tag
def write_zero_resharded(tag_dir: Path, files: PartitionFiles, tensors, model_states: list[dict[str, Any]],
                         new_dp: int, staging: Path, new_model_states) -> None:
    """Write every new (tp, dp) rank's model-states and partition files into ``staging``.

    ``tensors`` is the :class:`~zoo.checkpoint.reshard.TensorResharder` of old -> new tp;
    ``new_model_states(rank)`` gives new TP rank ``rank``'s model-states dict (module resharded).
    """
    old_groups = group_layout(model_states[0]["param_shapes"])
    new_groups = new_group_layout(tensors.new)
    check_group_names(old_groups, new_groups, tag_dir)
    merged_old, scalars = [], []
    for t in range(files.tp_size):
        paths = [files.path(tag_dir, d, t) for d in range(files.dp_size)]
        partitions = [read_partition(path) for path in paths]
        if t == 0:
            template = partitions[0]
        groups = group_layout(model_states[t]["param_shapes"])
        by_state, scalars = merged_tp_rank(partitions, groups, paths)
        merged_old.append(by_state)
    for rank in range(tensors.new_tp):
        merged = {key: {name: tensors.reshard(name, [old[key][name] for old in merged_old], rank)
                        for group in new_groups for name, _ in group} for key in merged_old[0]}
        for d, partition in enumerate(new_partitions(template, merged, scalars, new_groups, new_dp)):
            torch.save(partition, staging / OPTIM_STATES.format(prefix=files.prefix, dp=d, tp=rank))
        del merged
        states = new_model_states(rank)
        states["param_shapes"] = [OrderedDict(group) for group in new_groups]
        states["dp_world_size"] = new_dp
        torch.save(states, staging / MODEL_STATES.format(rank))


def new_group_layout(layout: torch.nn.Module) -> list[list[tuple[str, torch.Size]]]:
    """(name, shape) of every parameter per optimizer group, in the order DeepSpeed's partitions hold them."""
    shapes = {name: param.shape for name, param in layout.named_parameters()}
    return [[(name, shapes[name]) for name in group] for group in optimizer_groups(layout)]


def check_group_names(old: list[list[tuple[str, torch.Size]]], new: list[list[tuple[str, torch.Size]]],
                      tag_dir: Path) -> None:
    if [[name for name, _ in group] for group in old] != [[name for name, _ in group] for group in new]:
        raise ValueError(f"the optimizer groups recorded in {model_states_path(tag_dir, 0)} (param_shapes) are not "
                         "zoo's parameter groups of this model; the checkpoint was not written by this version of zoo's "
                         "pretrain and cannot be resharded.")
