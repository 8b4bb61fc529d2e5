"""Reshard a zoo DeepSpeed training checkpoint to another tensor-parallel degree.

A checkpoint written at tp = p holds one ``mp_rank_XX_model_states.pt`` per TP rank. Resuming it at
tp = q needs the same files laid out for q. :func:`reshard_checkpoint` writes them in one process
(``<checkpoints>/resharded/<tag>-tp<q>/``, atomically, with the umask's permissions; an existing
directory there is replaced only if it is such a copy); ``pretrain`` does it on rank 0 when the
checkpoint's tp differs from the run's and then lets DeepSpeed's ``load_checkpoint`` read the copy,
so the user passes the usual ``--load`` and nothing else.

Every sharded tensor goes through its master, by the partition spec its layer declares
(:mod:`zoo.parallel.partition`): the p shards are merged along the split dimension (respecting the
stride, the per-rank [q | k | v] blocks of the fused QKV),
the vocab padding of tp = p is cut and that of tp = q added (zero rows: padded rows are excluded from
the softmax and receive no gradient), and rank r of q takes its slice. Replicated tensors are copied
from rank 0. The same rule applies to the weights, to Adam's ``exp_avg``/``exp_avg_sq`` and to the fp32
master weights of fp16 training, whichever of DeepSpeed's non-ZeRO optimizer layouts holds them:

* fp32: the torch optimizer's state dict, one entry per parameter in
  :func:`zoo.models.families.param_groups` order;
* fp16 with an unfused optimizer (``FP16_UnfusedOptimizer``): the same inside
  ``optimizer_state_dict`` plus ``fp32_groups``, per-parameter fp32 masters;
* fp16 with a fused optimizer (``FP16_Optimizer``): one flat fp32 master and one flat Adam state per
  parameter group, split by the group's shapes, resharded, and flattened again at tp = q.

Carried over unchanged: Adam's step counts, the param groups' hyper-parameters, the loss scaler
(scale, window, last overflow, hysteresis counters), the LR scheduler state, DeepSpeed's
global_steps/global_samples/skipped_steps and zoo's client state (iteration, consumed samples, RNG
states, model config). The client state gains ``resharded_from`` so that ``pretrain`` re-seeds the
TP RNG tracker (its stream is per TP rank and has no counterpart at another tp).

ZeRO-1/2 and BF16_Optimizer checkpoints partition the optimizer state over data parallelism in separate
``*_optim_states.pt`` files; :mod:`zoo.checkpoint.zero_reshard` merges and re-partitions those for a new
tp x dp layout (``reshard_checkpoint(..., new_dp=...)``), through the same per-tensor rule.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from zoo.atomic import check_output_directory, staged_directory
from zoo.checkpoint.files import (
    MODEL_STATES,
    MODEL_STATES_RE,
    check_rank_files,
    model_states_path,
    read_model_states,
    tp_size_of_states,
)
from zoo.checkpoint.layout import check_layout, checked_layout_model, optimizer_groups, recover_config
from zoo.checkpoint.zero_reshard import (
    OPTIM_STATES_RE,
    check_reshardable_zero_config,
    partition_files,
    write_zero_resharded,
)
from zoo.parallel.partition import partition_specs

RESHARDED_SUBDIR = "resharded"
SOURCE_RECORD = "resharded_from.json"
# Raised whenever a change to the resharder makes earlier copies wrong, so that they are written again:
# 2 = ZeRO partitions give every optimizer group its own Adam step (copies of format 1 shared one).
RESHARD_FORMAT = 2
RESHARDED_KIND = "resharded checkpoint copy"


def resharded_directory(checkpoints: Path, tag: str, tp_size: int, dp_size: int | None = None) -> Path:
    """Where the tp = ``tp_size`` (x dp = ``dp_size``, for ZeRO checkpoints) copy of checkpoint ``tag``
    lives: a sibling of the tags, so it is found again (and reused) by every later resume at that layout."""
    suffix = f"-tp{tp_size}" if dp_size is None else f"-tp{tp_size}-dp{dp_size}"
    return Path(checkpoints) / RESHARDED_SUBDIR / f"{tag}{suffix}"


# --------------------------------------------------------------------------- tensors
class TensorResharder:
    """Merges one tensor's shards of tp = ``old_tp`` and slices them for tp = ``new_tp``, by the partition
    specs of the model's layout (the same at both degrees) and its local shapes at each."""

    def __init__(self, config, old_tp: int, new_tp: int, path: Path):
        self.old = checked_layout_model(config, old_tp, path)
        self.new = checked_layout_model(config, new_tp, path)
        self.old_tp, self.new_tp = old_tp, new_tp
        self.old_params = dict(self.old.named_parameters())
        self.new_params = dict(self.new.named_parameters())
        self.specs = partition_specs(self.new)

    def is_parameter_shaped(self, name: str, tensor: Any) -> bool:
        """``tensor`` (a state entry of parameter ``name``) has the parameter's local shape at old tp."""
        return torch.is_tensor(tensor) and tensor.dim() > 0 and tensor.shape == self.old_params[name].shape

    def reshard(self, name: str, shards: list[torch.Tensor], new_rank: int) -> torch.Tensor:
        """Rank ``new_rank``'s slice at new tp of the tensor whose old-tp shards are ``shards``."""
        spec = self.specs[name]
        if not spec.is_sharded:
            return shards[0].clone()
        master = spec.merge(shards)
        master = spec.repad(master, self.new_params[name].shape[0] * self.new_tp)   # the padding depends on tp
        local = spec.shard(master, new_rank, self.new_tp)
        return local.clone()   # own storage: torch.save of a view would write the whole master

    def reshard_entries(self, name: str, entries: list[dict[str, Any]], new_rank: int) -> dict[str, Any]:
        """A parameter's optimizer entry (``exp_avg``, ``exp_avg_sq``, ``step``, ...): parameter-shaped
        tensors resharded, everything else (step counts) taken from rank 0."""
        return {key: (self.reshard(name, [entry[key] for entry in entries], new_rank)
                      if self.is_parameter_shaped(name, value) else value)
                for key, value in entries[0].items()}


# --------------------------------------------------------------------------- optimizer layouts
def torch_state_by_name(state_dict: dict[str, Any], groups: list[list[str]], path: Path,
                        shapes: dict[str, torch.Size]) -> dict[str, dict[str, Any]]:
    """A torch optimizer state dict as ``{parameter name: its state entry}``.

    One index per parameter (fp32 and the unfused fp16 optimizer), or one per group when the optimizer
    steps flat group buffers (the fused fp16 optimizer): then every parameter-sized piece of the flat
    tensors is cut out (views, no copies) and per-group scalars are repeated for each parameter.
    """
    indices = [list(group["params"]) for group in state_dict["param_groups"]]
    names = [name for group in groups for name in group]
    if [len(g) for g in indices] == [len(g) for g in groups]:
        flat_indices = [i for group in indices for i in group]
        return {name: dict(state_dict["state"].get(index, {})) for name, index in zip(names, flat_indices)}
    if [len(g) for g in indices] == [1] * len(groups):
        by_name = {}
        for group, (index,) in zip(groups, indices):
            entry = state_dict["state"].get(index, {})
            for key, value in entry.items():
                pieces = split_flat(value, group, shapes) if _is_flat_of(value, group, shapes) else None
                for name in group:
                    by_name.setdefault(name, {})[key] = value if pieces is None else pieces[name]
            for name in group:
                by_name.setdefault(name, {})
        return by_name
    raise ValueError(f"the optimizer state in {path} has groups of {[len(g) for g in indices]} parameters but zoo's "
                     f"model has {[len(g) for g in groups]}; the checkpoint was not written by this version of "
                     "zoo's pretrain and cannot be resharded.")


def torch_state_from_names(template: dict[str, Any], by_name: dict[str, dict[str, Any]],
                           groups: list[list[str]], flat: bool) -> dict[str, Any]:
    """Inverse of :func:`torch_state_by_name` for the new layout; hyper-parameters from ``template``."""
    state: dict[int, dict[str, Any]] = {}
    param_groups = []
    index = 0
    for group, template_group in zip(groups, template["param_groups"]):
        if flat:
            first = by_name[group[0]]
            entry = {key: (flatten([by_name[name][key] for name in group]) if _is_piece(value) else value)
                     for key, value in first.items()}
            if entry:
                state[index] = entry
            param_groups.append({**template_group, "params": [index]})
            index += 1
            continue
        ids = []
        for name in group:
            if by_name[name]:
                state[index] = by_name[name]
            ids.append(index)
            index += 1
        param_groups.append({**template_group, "params": ids})
    return {"state": state, "param_groups": param_groups}


def _is_flat_of(value: Any, group: list[str], shapes: dict[str, torch.Size]) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == sum(shapes[n].numel() for n in group) \
        and value.numel() > 1


def _is_piece(value: Any) -> bool:
    return torch.is_tensor(value) and value.dim() > 0


def split_flat(flat: torch.Tensor, names: list[str], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """A flat buffer of the parameters ``names`` (concatenated in order) as views of their shapes."""
    pieces, offset = {}, 0
    for name in names:
        numel = shapes[name].numel()
        pieces[name] = flat.narrow(0, offset, numel).view(shapes[name])
        offset += numel
    return pieces


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def optimizer_kind(optimizer: dict[str, Any]) -> str:
    """Which of DeepSpeed's non-ZeRO optimizer layouts a model-states file's ``optimizer`` holds: "torch"
    (fp32), "fp16_unfused" (FP16_UnfusedOptimizer) or "fp16_fused" (FP16_Optimizer)."""
    if "fp32_groups_flat" in optimizer:
        return "fp16_fused"
    if "fp32_groups" in optimizer:
        return "fp16_unfused"
    return "torch"


def optimizer_state_by_name(optimizer: dict[str, Any], groups: list[list[str]], shapes: dict[str, torch.Size],
                            path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, torch.Tensor] | None]:
    """(Adam state per parameter name, fp32 master per parameter name or None for fp32 runs, whose masters are
    the weights) of one rank's non-ZeRO optimizer state; ``groups`` are its parameters by name in group order,
    ``shapes`` their local shapes. Tensors are views of ``optimizer``'s (memory-mapped) tensors."""
    kind = optimizer_kind(optimizer)
    inner = optimizer if kind == "torch" else optimizer.get("optimizer_state_dict")
    try:
        state = torch_state_by_name(inner, groups, path, shapes)
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"the optimizer state in {path} is not a torch or DeepSpeed fp16 optimizer state dict; "
                         "it cannot be resharded.") from None
    masters = None
    if kind == "fp16_unfused":
        masters = {name: tensor for group, tensors in zip(groups, optimizer["fp32_groups"])
                   for name, tensor in zip(group, tensors)}
    elif kind == "fp16_fused":
        masters = {}
        for group, flat in zip(groups, optimizer["fp32_groups_flat"]):
            masters.update(split_flat(flat, group, shapes))
    return state, masters


class OptimizerResharder:
    """Reads a rank's DeepSpeed (non-ZeRO) optimizer state by parameter name and writes it back for
    the new layout; the kind (fp32 torch, fp16 unfused, fp16 fused) is recognised from its keys."""

    def __init__(self, tensors: TensorResharder):
        self.tensors = tensors
        self.old_groups = optimizer_groups(tensors.old)
        self.new_groups = optimizer_groups(tensors.new)
        self.old_shapes = {name: p.shape for name, p in tensors.old.named_parameters()}

    def by_name(self, optimizer: dict[str, Any], path: Path) -> tuple[dict[str, dict[str, Any]], dict | None]:
        """(Adam state per parameter name, fp32 master per parameter name or None)."""
        state, masters = optimizer_state_by_name(optimizer, self.old_groups, self.old_shapes, path)
        for name, entry in state.items():
            for key, value in entry.items():
                if _is_piece(value) and not self.tensors.is_parameter_shaped(name, value):
                    raise ValueError(f"the optimizer state {key!r} of {name} in {path} has shape {tuple(value.shape)}, "
                                     f"not the parameter's {tuple(self.old_shapes[name])}; the checkpoint's "
                                     "optimizer does not follow zoo's parameter order and cannot be resharded.")
        return state, masters

    def reshard(self, optimizers: list[dict[str, Any]], paths: list[Path], new_rank: int) -> dict[str, Any]:
        """Rank ``new_rank``'s optimizer state at the new tp from every old rank's."""
        kind = optimizer_kind(optimizers[0])
        read = [self.by_name(optimizer, path) for optimizer, path in zip(optimizers, paths)]
        state = {name: self.tensors.reshard_entries(name, [r[0][name] for r in read], new_rank)
                 for group in self.new_groups for name in group}
        template = optimizers[0] if kind == "torch" else optimizers[0]["optimizer_state_dict"]
        inner = torch_state_from_names(template, state, self.new_groups, flat=kind == "fp16_fused")
        if kind == "torch":
            return inner
        masters = {name: self.tensors.reshard(name, [r[1][name] for r in read], new_rank)
                   for group in self.new_groups for name in group}
        out = {key: value for key, value in optimizers[0].items()
               if key not in ("optimizer_state_dict", "fp32_groups", "fp32_groups_flat")}
        out["optimizer_state_dict"] = inner
        if kind == "fp16_unfused":
            out["fp32_groups"] = [[masters[name] for name in group] for group in self.new_groups]
        else:
            out["fp32_groups_flat"] = [flatten([masters[name] for name in group]) for group in self.new_groups]
        return out


# --------------------------------------------------------------------------- the whole checkpoint
def reshard_checkpoint(tag_dir: str | Path, new_tp: int, out: str | Path, new_dp: int | None = None) -> Path:
    """Write the checkpoint of ``tag_dir`` (any tp) laid out for ``new_tp`` into ``out``, atomically.

    A ZeRO/BF16 checkpoint (optimizer partitions over dp) also needs the new ``new_dp``. One process,
    whatever the number of processes that wrote or will read it. Peak memory (non-ZeRO) is one new
    rank's state plus one master tensor at a time: the old files are memory-mapped.
    """
    tag_dir, out = Path(tag_dir), Path(out)
    check_output_directory(out, is_resharded_copy, RESHARDED_KIND)
    first_path = model_states_path(tag_dir, 0)
    first = read_model_states(first_path)
    old_tp = tp_size_of_states(first, first_path)
    check_rank_files(tag_dir, old_tp)
    partitions = partition_files(tag_dir)
    if partitions is not None and new_dp is None:
        raise ValueError(f"{tag_dir} keeps its optimizer state in ZeRO/BF16 partitions over dp={partitions.dp_size}; "
                         "pass the new data-parallel degree (new_dp) to reshard it.")
    if partitions is not None:
        check_reshardable_zero_config(first, first_path)
    if partitions is not None and partitions.tp_size != old_tp:
        raise ValueError(f"{tag_dir} holds optimizer partitions of tp={partitions.tp_size} but model states of "
                         f"tp={old_tp}; the tag mixes files of two checkpoints, re-save it.")
    config, _ = recover_config(first, old_tp, first_path)
    tensors = TensorResharder(config, old_tp, new_tp, first_path)
    paths = [model_states_path(tag_dir, rank) for rank in range(old_tp)]
    sources = [first] + [read_model_states(path) for path in paths[1:]]
    for states, path in zip(sources, paths):
        if (recorded := tp_size_of_states(states, path)) != old_tp:
            raise ValueError(f"{path} records tensor_parallel_size={recorded} but rank 0 records {old_tp}; the "
                             "tag mixes files of two checkpoints, re-save it.")
        check_layout(tensors.old, states["module"], path)
    optimizers = OptimizerResharder(tensors) if isinstance(first.get("optimizer"), dict) else None

    with staged_directory(out, is_resharded_copy, RESHARDED_KIND) as staging:
        if partitions is not None:
            write_zero_resharded(tag_dir, partitions, tensors, sources, new_dp, staging,
                                 lambda rank: new_rank_states(sources, paths, tensors, None, rank, tag_dir))
            (staging / SOURCE_RECORD).write_text(json.dumps(source_record(tag_dir, old_tp, new_tp, new_dp),
                                                            indent=2) + "\n")
            return out
        for rank in range(new_tp):
            states = new_rank_states(sources, paths, tensors, optimizers, rank, tag_dir)
            torch.save(states, staging / MODEL_STATES.format(rank))
            del states
        (staging / SOURCE_RECORD).write_text(json.dumps(source_record(tag_dir, old_tp, new_tp), indent=2) + "\n")
    return out


def new_rank_states(sources: list[dict[str, Any]], paths: list[Path], tensors: TensorResharder,
                    optimizers: OptimizerResharder | None, rank: int, tag_dir: Path) -> dict[str, Any]:
    """The complete model-states dict of new TP rank ``rank``."""
    old_tp, new_tp = tensors.old_tp, tensors.new_tp
    # Non-tensor state (RNG, counters) from the old rank whose position matches: TP ranks of a group
    # hold the same default-generator states, so any choice is exact for them.
    states = dict(sources[rank * old_tp // new_tp])
    states["module"] = {name: tensors.reshard(name, [s["module"][name] for s in sources], rank)
                        for name in sources[0]["module"]}
    if optimizers is not None:
        states["optimizer"] = optimizers.reshard([s["optimizer"] for s in sources], paths, rank)
    states["mp_world_size"] = new_tp
    states["tensor_parallel_size"] = new_tp
    if isinstance(states.get("checkpoint_parallel_dimensions"), dict):
        states["checkpoint_parallel_dimensions"] = {**states["checkpoint_parallel_dimensions"], "tp_degree": new_tp}
    states["resharded_from"] = {"tensor_parallel_size": old_tp, "tag_dir": str(tag_dir)}
    return states


def source_record(tag_dir: Path, old_tp: int, new_tp: int, new_dp: int | None = None) -> dict[str, Any]:
    """What a resharded copy was made from (the source files' sizes and modification times) and by which
    version of the resharder (:data:`RESHARD_FORMAT`): a copy whose record differs is written again."""
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(tag_dir.iterdir()) if p.is_file()}
    record = {"source": str(tag_dir.resolve()), "from_tp": old_tp, "to_tp": new_tp, "files": files,
              "format": RESHARD_FORMAT}
    if new_dp is not None:
        record["to_dp"] = new_dp
    return record


def is_resharded_copy(directory: Path) -> bool:
    """``directory`` is a copy :func:`reshard_checkpoint` wrote: its :data:`SOURCE_RECORD` and model-states
    files, nothing else. Only such a directory may be replaced by a new copy."""
    record = Path(directory) / SOURCE_RECORD
    try:
        saved = json.loads(record.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(saved, dict) or not {"source", "from_tp", "to_tp"} <= saved.keys():
        return False
    others = [entry for entry in Path(directory).iterdir() if entry.name != SOURCE_RECORD]
    return all(entry.is_file() and (MODEL_STATES_RE.fullmatch(entry.name) or OPTIM_STATES_RE.fullmatch(entry.name))
               for entry in others)


def is_current(out: Path, tag_dir: Path, new_tp: int, new_dp: int | None = None) -> bool:
    """``out`` is a finished resharded copy of the present files of ``tag_dir`` at ``new_tp`` (x ``new_dp``)."""
    record = out / SOURCE_RECORD
    if not record.is_file():
        return False
    try:
        saved = json.loads(record.read_text())
    except json.JSONDecodeError:
        return False
    current = source_record(tag_dir, saved.get("from_tp", 0), new_tp, new_dp)
    return saved == current and all(model_states_path(out, r).is_file() for r in range(new_tp))


def ensure_resharded(tag_dir: str | Path, new_tp: int, out: str | Path, new_dp: int | None = None) -> Path:
    """:func:`reshard_checkpoint` unless ``out`` already holds a current copy."""
    tag_dir, out = Path(tag_dir), Path(out)
    if is_current(out, tag_dir, new_tp, new_dp):
        return out
    return reshard_checkpoint(tag_dir, new_tp, out, new_dp)
