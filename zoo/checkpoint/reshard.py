"""Reading the optimizer state of a non-ZeRO zoo DeepSpeed checkpoint by parameter name.

DeepSpeed (without ZeRO) keeps a rank's optimizer state in its ``mp_rank_XX_model_states.pt``, in one of three
layouts, which :func:`optimizer_state_by_name` reads as ``{parameter name: Adam's state}`` plus the fp32 masters:

* fp32: the torch optimizer's state dict, one entry per parameter in
  :func:`zoo.models.families.param_groups` order; the masters are the weights themselves;
* fp16 with an unfused optimizer (``FP16_UnfusedOptimizer``): the same inside
  ``optimizer_state_dict`` plus ``fp32_groups``, per-parameter fp32 masters;
* fp16 with a fused optimizer (``FP16_Optimizer``): one flat fp32 master and one flat Adam state per
  parameter group, cut into per-parameter views by the group's shapes.

Every tensor handed out is a view of the (memory-mapped) file's tensors. :mod:`zoo.checkpoint.training_state`
builds the layout-free form of a checkpoint from this, and :mod:`zoo.checkpoint.layout_change` moves it into a run
at another layout on that run's ranks.

:data:`RESHARDED_SUBDIR` and :data:`SOURCE_RECORD` name the resharded copies a one-process resharder wrote under
``<checkpoints>/resharded/``: a run's ``--overwrite`` still recognises and removes them
(:mod:`zoo.training.run_directory`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zoo.errors import UserError

RESHARDED_SUBDIR = "resharded"
SOURCE_RECORD = "resharded_from.json"


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
    raise UserError(f"the optimizer state in {path} has groups of {[len(g) for g in indices]} parameters but zoo's "
                     f"model has {[len(g) for g in groups]}; the checkpoint was not written by this version of "
                     "zoo's pretrain and cannot be resharded.")


def _is_flat_of(value: Any, group: list[str], shapes: dict[str, torch.Size]) -> bool:
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == sum(shapes[n].numel() for n in group) \
        and value.numel() > 1


def split_flat(flat: torch.Tensor, names: list[str], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """A flat buffer of the parameters ``names`` (concatenated in order) as views of their shapes."""
    pieces, offset = {}, 0
    for name in names:
        numel = shapes[name].numel()
        pieces[name] = flat.narrow(0, offset, numel).view(shapes[name])
        offset += numel
    return pieces


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
        raise UserError(f"the optimizer state in {path} is not a torch or DeepSpeed fp16 optimizer state dict; "
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
