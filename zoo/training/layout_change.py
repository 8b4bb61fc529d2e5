"""Resuming a GPT-2 checkpoint at another (tp, pp) layout where either side has pipeline stages: P -> 1,
1 -> P, P -> P' and any tp (and, for ZeRO/BF16 runs, dp) change with them (a one-stage checkpoint at another
tp goes through the file resharder, :mod:`zoo.checkpoint.reshard`).

The checkpoint is read in its layout-free form (:class:`zoo.checkpoint.training_state.CheckpointTrainingState`:
per ``GPT2LMHeadModel`` name the fp32 master, Adam's ``exp_avg`` and ``exp_avg_sq``, the step), whatever
precision and optimizer wrote it: fp32, fp16 (FP16_Optimizer, FP16_UnfusedOptimizer), bf16 (BF16_Optimizer,
with ZeRO-1 or without) and ZeRO-1/2. For each parameter this rank holds, the checkpoint's TP shards of that
name are merged, the vocabulary re-padded for this tp and this rank's slice kept (its partition spec says
how), and the slice goes where the run's optimizer keeps it (:func:`optimizer_target`): the weight and the
torch optimizer's state (fp32), the fp32 copies and flat Adam buffers of the fp16 optimizers, or through
DeepSpeed's hp-fragment mapping (``safe_set_full_fp32_param``/``safe_set_full_optimizer_state``) into this dp
rank's partition of a ZeRO or BF16 optimizer. The low-precision weight is the master rounded, as DeepSpeed's
step leaves it. The LR schedule, DeepSpeed's step counters, the loss scaler (fp16 to fp16) and zoo's client
state come from the checkpoint's first rank.

Each rank reads only the files of the names it holds, memory-mapped, and holds its share plus the one merged
tensor it is slicing. A change of precision is refused in one sentence (:func:`check_precision`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint.safe_load import check_tag_files
from zoo.checkpoint.training_state import (
    LOSS_SCALER_KEYS,
    MOMENTS,
    CheckpointTrainingState,
    one_stage_names,
    param_names_by_group,
)
from zoo.distributed import raise_on_any_rank
from zoo.parallel.partition import partition_specs

__all__ = ["needs_layout_change", "load_at_new_layout", "param_names_by_group", "one_stage_names",
           "engine_precision", "check_precision"]


def needs_layout_change(source: tuple[int, int], ps) -> bool:
    """Whether a checkpoint of (tp, pp) ``source`` is resumed through this module by a run at ``ps``."""
    return source != (ps.tp_size, ps.pp_size) and (source[1] > 1 or ps.pp_size > 1)


def engine_precision(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def check_precision(source: str, target: str, where: str, keep: str | None = None) -> None:
    """The run trains in the precision the checkpoint was written in: masters and moments would carry over,
    but fp16's loss scaler has no counterpart in bf16/fp32 (it would be dropped) and a run turning fp16 on
    would restart its scale from the config's initial power, so a change is the user's explicit choice
    (export and --pretrained), never a side effect of a resume. ``keep``: how the caller keeps the checkpoint's
    precision (default: in the ds_config)."""
    if source == target:
        return
    scaler = ("its fp16 loss scaler would be dropped" if source == "fp16" else
              "the fp16 loss scaler would restart at the config's initial scale" if target == "fp16" else
              "the optimizer's master weights would change type")
    keep = keep or f"keep {source} in the ds_config"
    raise ValueError(f"{where} was written in {source} and this layout trains in {target}: {scaler}; {keep}, "
                     f"or export the checkpoint (launch/export.py) and start the "
                     f"{target} run with --pretrained.")


def local_slice(master: torch.Tensor, spec, param: torch.Tensor, ps) -> torch.Tensor:
    """This rank's fp32 slice of a merged tensor shaped like ``param``, the vocabulary re-padded for this tp."""
    if spec.vocab_rows is not None:
        master = spec.repad(master, param.shape[0] * ps.tp_size)
    return spec.shard(master, ps.tp_rank, ps.tp_size).to(param.device, torch.float32)


# --------------------------------------------------------------------------- where the run keeps its state
def _like(value: Any, step: Any) -> Any:
    """``step`` in the type the optimizer keeps its step in (torch's AdamW: a float tensor; FusedAdam: int)."""
    number = float(step.item()) if torch.is_tensor(step) else float(step)
    if torch.is_tensor(value):
        return torch.tensor(number, dtype=value.dtype, device=value.device)
    return int(number)


def fresh_step(inner, step: Any) -> Any:
    """``step`` as a new state entry of ``inner``: a float32 tensor for torch's optimizers, else a number."""
    scalar = torch.tensor(0.0) if isinstance(inner, torch.optim.Optimizer) and "torch.optim" in type(inner).__module__ \
        else 0
    return _like(scalar, step)


def set_steps(inner, step: Any) -> None:
    """Every step counter of torch optimizer ``inner`` (in its state entries and groups) set to ``step``."""
    for group in inner.param_groups:
        if "step" in group:
            group["step"] = _like(group["step"], step)
        for param in group["params"]:
            state = inner.state.get(param)
            if state is not None and "step" in state:
                state["step"] = _like(state["step"], step)


class TorchTarget:
    """fp32 without ZeRO: the weight is the master; Adam's state is the torch optimizer's, per parameter."""

    def __init__(self, optimizer):
        self.optimizer, self.inner = optimizer, optimizer

    def put(self, param, master: torch.Tensor, moments: dict[str, torch.Tensor], step: Any) -> None:
        param.copy_(master)
        state = self.optimizer.state[param]
        for key, value in moments.items():
            state[key] = value.clone()
        state["step"] = step.clone() if torch.is_tensor(step) else step


class UnfusedFp16Target:
    """FP16_UnfusedOptimizer: an fp32 copy per fp16 parameter, the torch optimizer's state keyed by the copy."""

    def __init__(self, optimizer):
        self.optimizer, self.inner = optimizer, optimizer.optimizer
        self.fp32_of = {id(low): high for lows, highs in zip(optimizer.fp16_groups, optimizer.fp32_groups)
                        for low, high in zip(lows, highs)}

    def put(self, param, master, moments, step) -> None:
        high = self.fp32_of[id(param)]
        high.data.copy_(master)
        param.copy_(master)
        state = self.inner.state[high]
        for key, value in moments.items():
            state[key] = value.clone()
        state["step"] = _like(state.get("step", step), step)


class FusedFp16Target:
    """FP16_Optimizer: one flat fp32 master and one flat Adam state per group, in the group's parameter order."""

    def __init__(self, optimizer):
        self.optimizer, self.inner = optimizer, optimizer.optimizer
        self.where = {}
        for g, group in enumerate(optimizer.fp16_groups):
            offset = 0
            for param in group:
                self.where[id(param)] = (g, offset)
                offset += param.numel()

    def put(self, param, master, moments, step) -> None:
        g, offset = self.where[id(param)]
        flat = self.optimizer.fp32_groups_flat[g]
        flat.data.narrow(0, offset, param.numel()).copy_(master.reshape(-1))
        param.copy_(master)
        state = self.inner.state[flat]
        for key, value in moments.items():
            state[key].narrow(0, offset, param.numel()).copy_(value.reshape(-1))


class PartitionedTarget:
    """ZeRO-1/2 and BF16_Optimizer: this dp rank's fragment of each parameter's fp32 master and moments.

    DeepSpeed maps each parameter to its fragment of the rank's flat fp32 partition (``_hp_mapping``: where the
    fragment starts in the parameter and in the partition; None outside this rank's partition); the partition
    is the one parameter of the wrapped optimizer's group, and Adam's state of it is flat alike. The master
    goes in through DeepSpeed's ``safe_set_full_fp32_param``; the moments are copied at the same addresses
    (DeepSpeed links its own moment views only at the first step)."""

    def __init__(self, optimizer):
        self.optimizer, self.inner = optimizer, optimizer.optimizer

    def put(self, param, master, moments, step) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        param.copy_(master)
        safe_set_full_fp32_param(param, master)
        mapping = param._hp_mapping
        if mapping is None:
            return
        hp, lp = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
        (partition,) = self.inner.param_groups[mapping.param_group_index]["params"]
        state = self.inner.state[partition]
        if not state:   # Adam builds its state at the first step: build it as Adam would
            state.update({key: torch.zeros_like(partition) for key in moments})
            state["step"] = fresh_step(self.inner, step)
        for key, value in moments.items():
            state[key].narrow(0, hp.start, hp.numel).copy_(value.reshape(-1).narrow(0, lp.start, lp.numel))


def optimizer_target(engine):
    """Where ``engine``'s optimizer keeps the fp32 master and Adam's state of a parameter."""
    optimizer = engine.optimizer
    if engine.zero_optimization_stage() >= 3:
        raise ValueError("this run uses ZeRO stage 3, whose partitioned parameters zoo does not fill from a "
                         "checkpoint of another layout; resume with zero_optimization stage 0, 1 or 2.")
    if any(hasattr(param, "_hp_mapping") for param in engine.module.parameters()):
        return PartitionedTarget(optimizer)
    if hasattr(optimizer, "fp32_groups_flat") and hasattr(optimizer, "fp16_groups"):
        return FusedFp16Target(optimizer)
    if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
        return UnfusedFp16Target(optimizer)
    return TorchTarget(optimizer)


def set_loss_scaler(optimizer, saved: dict[str, Any] | None) -> None:
    """The fp16 optimizer's dynamic loss scaler as the checkpoint left it (scale, iteration, last overflow)."""
    config = getattr(optimizer, "loss_scale_config", None)
    if not saved or config is None:
        return
    for key in LOSS_SCALER_KEYS:
        if key in saved:
            setattr(config, key, saved[key])


# --------------------------------------------------------------------------- the move
@torch.no_grad()
def load_at_new_layout(engine, tag_dir: Path, source: tuple[int, int], ps, load: str) -> dict[str, Any]:
    """Fill the engine's module and optimizer state from a checkpoint written at (tp, pp) ``source``; returns its
    client state (marked ``resharded_from``: the source layout and precision, the seconds the move took and the
    peak bytes this rank held for it). Collective: every rank reads the files of its own names; a failure
    anywhere is raised on every rank."""
    started = time.perf_counter()
    raise_on_any_rank(lambda: check_tag_files(tag_dir, ps.rank, ps.world_size))
    names = one_stage_names(engine.module)
    state = raise_on_any_rank(lambda: CheckpointTrainingState(tag_dir, *source, wanted=set(names.values())))
    raise_on_any_rank(lambda: check_precision(state.precision, engine_precision(engine), f"--load {load}"))
    target = raise_on_any_rank(lambda: optimizer_target(engine))
    peak = [0]

    def fill() -> None:
        specs = partition_specs(engine.module)
        for local_name, param in engine.module.named_parameters():
            name, spec = names[local_name], specs[local_name]
            pieces = {}
            for key in ("master",) + MOMENTS:   # one merged tensor at a time, then this rank's slice of it
                merged = state.master(name, spec, key)
                pieces[key] = local_slice(merged, spec, param, ps)
                peak[0] = max(peak[0], merged.nbytes + sum(piece.nbytes for piece in pieces.values()))
                del merged
            master = pieces.pop("master")
            target.put(param, master, pieces, state.step(name))
        set_steps(target.inner, state.step(next(iter(names.values()))))

    raise_on_any_rank(fill)
    first = state.first
    # The schedule-driven values of each group (the lr; betas under a cycle schedule) are the checkpoint's:
    # the scheduler sets them only at its next step, after this iteration's update.
    for group, saved in zip(target.inner.param_groups, state.optimizer_groups()):
        group.update({key: saved[key] for key in ("lr", "betas") if key in saved})
    set_loss_scaler(engine.optimizer, state.loss_scaler())
    if engine.lr_scheduler is not None and first.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(first["lr_scheduler"])
    engine.global_steps, engine.global_samples = first["global_steps"], first["global_samples"]
    engine.skipped_steps = first.get("skipped_steps", 0)
    client = {key: value for key, value in first.items() if key not in ("module", "optimizer")}
    client["resharded_from"] = {"tensor_parallel_size": source[0], "pipeline_model_parallel_size": source[1],
                                "data_parallel_size": state.dp_size, "precision": state.precision,
                                "layout": state.describe(), "seconds": time.perf_counter() - started,
                                "peak_bytes": peak[0]}
    return client
