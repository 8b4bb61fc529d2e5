"""Megatron's training flags applied to the DeepSpeed part of a ds_config.

``--lr``, ``--min-lr``, ``--lr-warmup-iters``, ``--micro-batch-size``, ``--global-batch-size``, ``--fp16``,
``--bf16``, ``--clip-grad`` and ``--weight-decay`` (or the zoo-block keys of the same names) name values
that DeepSpeed reads from its own blocks. The rule is the one of every zoo setting: a flag overrides the
zoo block, which overrides the ds_config's own value; an unset one leaves the file's value.

The schedule stays consistent with the learning rates it is given. DeepSpeed's WarmupCosineLR holds its
floor and its warm-up start as ratios of the optimizer's lr (``cos_min_ratio``, ``warmup_min_ratio``):
they are rewritten so that the floor is ``--min-lr`` (or, without it, the file's floor, cos_min_ratio x
the file's lr) and the warm-up starts where the file's did. WarmupDecayLR and WarmupLR name absolute
rates (``warmup_max_lr``, ``warmup_min_lr``; WarmupDecayLR decays back to ``warmup_min_lr``, so
``--min-lr`` is both its floor and its warm-up start). ``--lr-warmup-iters`` is the ``warmup_num_steps``
of all three. A schedule zoo cannot rewrite this way (OneCycle, LRRangeTest, none at all) refuses the
flags it cannot honour in one sentence. The batch flags drop a file's ``gradient_accumulation_steps``:
it follows from micro x accumulation x dp = global, checked once the world size is known
(:func:`zoo.config.validation.validate_for_world`).

bf16 sums the micro-batches' gradients in fp32, within a rank and over the data-parallel ranks
(:func:`accumulate_bf16_in_fp32`): DeepSpeed sums them in the model's dtype unless ``data_types.grad_accum_dtype``
and ``communication_data_type`` say otherwise, and a bf16 sum of tens of micro-batches (8 bits of mantissa) loses
the small ones, where Megatron always accumulates and reduces bf16 gradients in fp32.

Applying the overrides twice gives the same ds_config, so a config that was resolved once may be resolved
again (the planner does).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from zoo.errors import UserError

__all__ = ["OVERRIDE_FIELDS", "apply_overrides", "overridden_ds_config", "precision_flags_given", "accumulate_bf16_in_fp32",
           "bf16_accumulation_warning", "gradient_accumulation_dtype", "gradient_reduction_dtype"]

OVERRIDE_FIELDS = ("lr", "min_lr", "lr_warmup_iters", "micro_batch_size", "global_batch_size", "fp16", "bf16",
                   "clip_grad", "weight_decay")
WARMUP_SCHEDULES = ("WarmupCosineLR", "WarmupDecayLR", "WarmupLR")
DEEPSPEED_DEFAULT_COS_MIN_RATIO = 0.0001   # WarmupCosineLR's default floor, a ratio of the lr
FP32_NAMES = ("fp32", "float32", "float")   # DeepSpeed's names of float32 in data_types.grad_accum_dtype


def apply_overrides(config):
    """``config`` (a RunConfig) with its ``ds_config`` rewritten by the override fields it sets."""
    values = {name: getattr(config, name) for name in OVERRIDE_FIELDS}
    config.ds_config = overridden_ds_config(config.ds_config, values, config.ds_config_path)
    return config


def precision_flags_given(args) -> bool:
    """Whether ``--fp16`` or ``--bf16`` is on the command line: the precision is then the flag's alone, and the
    zoo block's fp16/bf16 keys are not read (a flag's --fp16 over a block's bf16 is a choice, not a clash)."""
    return bool(getattr(args, "fp16", None) or getattr(args, "bf16", None))


def overridden_ds_config(ds_config: dict[str, Any], values: dict[str, Any], path: str | None) -> dict[str, Any]:
    """A copy of ``ds_config`` with the set ``values`` (of :data:`OVERRIDE_FIELDS`; None: unset) written into
    the DeepSpeed entries they name. Raises UserError with one sentence for a value out of range, a flag
    the file's scheduler cannot take, or a floor above the peak."""
    check_values(values)
    ds = copy.deepcopy(ds_config)
    override_batch(ds, values)
    override_precision(ds, values)
    if values.get("clip_grad") is not None:
        ds["gradient_clipping"] = float(values["clip_grad"])
    if values.get("weight_decay") is not None:
        optimizer_params(ds)["weight_decay"] = float(values["weight_decay"])
    override_schedule(ds, values, path)
    return accumulate_bf16_in_fp32(ds)


def check_values(values: dict[str, Any]) -> None:
    """Each set value in its range: rates and decay non-negative numbers (lr positive), batch sizes positive
    integers, the warm-up a non-negative integer, fp16 and bf16 not both on."""
    for name, lowest in (("lr", "positive"), ("min_lr", "non-negative"), ("clip_grad", "non-negative"),
                         ("weight_decay", "non-negative")):
        value = values.get(name)
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (lowest == "positive" and value == 0):
            raise UserError(f"{name} = {value} must be a {lowest} finite number; fix the --{flag(name)} flag or "
                             "the zoo block.")
    for name, least in (("micro_batch_size", 1), ("global_batch_size", 1), ("lr_warmup_iters", 0)):
        value = values.get(name)
        if value is not None and value < least:
            raise UserError(f"{name} = {value} must be an integer of at least {least}; fix the --{flag(name)} flag "
                             "or the zoo block.")
    if values.get("fp16") and values.get("bf16"):
        raise UserError("fp16 and bf16 are both asked for; pass one of --fp16 (loss-scaled, where bf16 is not "
                         "supported) and --bf16.")


def flag(name: str) -> str:
    return name.replace("_", "-")


def optimizer_params(ds: dict[str, Any]) -> dict[str, Any]:
    optimizer = ds.setdefault("optimizer", {})
    params = optimizer.get("params")
    if not isinstance(params, dict):
        params = optimizer["params"] = {}
    return params


def override_batch(ds: dict[str, Any], values: dict[str, Any]) -> None:
    """``micro_batch_size`` and ``global_batch_size`` into DeepSpeed's batch keys; the file's accumulation
    steps go, since they follow from the two and dp."""
    changed = False
    for name, key in (("micro_batch_size", "train_micro_batch_size_per_gpu"), ("global_batch_size", "train_batch_size")):
        if values.get(name) is not None:
            changed = changed or ds.get(key) != values[name]
            ds[key] = int(values[name])
    if changed:
        ds.pop("gradient_accumulation_steps", None)


def override_precision(ds: dict[str, Any], values: dict[str, Any]) -> None:
    """``fp16``/``bf16`` True enable that block (the file's other settings in it kept, e.g. the loss scale) and
    disable the other; False disables that block."""
    for name, other in (("fp16", "bf16"), ("bf16", "fp16")):
        choice = values.get(name)
        if choice is None:
            continue
        block = ds.get(name) if isinstance(ds.get(name), dict) else {}
        if choice or block:
            ds[name] = {**block, "enabled": bool(choice)}
        if choice and isinstance(ds.get(other), dict):
            ds[other] = {**ds[other], "enabled": False}


def override_schedule(ds: dict[str, Any], values: dict[str, Any], path: str | None) -> None:
    """The optimizer's lr and the scheduler's rates and warm-up, kept consistent (see the module docstring)."""
    lr, min_lr, warmup = values.get("lr"), values.get("min_lr"), values.get("lr_warmup_iters")
    if lr is None and min_lr is None and warmup is None:
        return
    scheduler = ds.get("scheduler") if isinstance(ds.get("scheduler"), dict) else None
    kind = scheduler.get("type") if scheduler else None
    if kind not in WARMUP_SCHEDULES and (min_lr is not None or warmup is not None):
        asked = "--min-lr" if min_lr is not None else "--lr-warmup-iters"
        has = f"a {kind} scheduler" if scheduler else "no scheduler block"
        raise UserError(f"{asked} sets a warm-up/decay schedule, and DeepSpeed config {path} has {has}; add a "
                         "\"scheduler\": {\"type\": \"WarmupCosineLR\", ...} block, or drop the flag.")
    if kind is not None and kind not in WARMUP_SCHEDULES:
        raise UserError(f"--lr cannot be carried into the {kind} scheduler of DeepSpeed config {path}, whose own "
                         f"parameters set its learning rates; set them there, or use one of {list(WARMUP_SCHEDULES)}.")
    params = optimizer_params(ds)
    old_peak = params.get("lr")
    peak = float(lr) if lr is not None else old_peak
    if lr is not None:
        params["lr"] = peak
    if scheduler is None:
        return
    sched = scheduler.get("params") if isinstance(scheduler.get("params"), dict) else {}
    scheduler["params"] = sched
    if warmup is not None:
        sched["warmup_num_steps"] = int(warmup)
    if kind == "WarmupCosineLR":
        rewrite_cosine_ratios(sched, old_peak, peak, min_lr, path)
        return
    if lr is not None:
        sched["warmup_max_lr"] = peak
    if min_lr is not None and kind == "WarmupLR":
        raise UserError(f"--min-lr sets where the learning rate decays to, and the WarmupLR scheduler of DeepSpeed "
                         f"config {path} never decays; use WarmupDecayLR or WarmupCosineLR, or drop --min-lr.")
    if min_lr is not None:
        sched["warmup_min_lr"] = float(min_lr)
    top = sched.get("warmup_max_lr", peak)
    if top is not None and sched.get("warmup_min_lr", 0.0) > top:
        raise UserError(f"the {kind} schedule of DeepSpeed config {path} would go from warmup_min_lr "
                         f"{sched['warmup_min_lr']:g} up to a lower peak {top:g}; pass a --min-lr below the peak "
                         "(or a higher --lr).")


def rewrite_cosine_ratios(sched: dict[str, Any], old_peak: float | None, peak: float | None, min_lr: float | None,
                          path: str | None) -> None:
    """WarmupCosineLR's ``cos_min_ratio`` and ``warmup_min_ratio`` for the new ``peak``: the floor is ``min_lr``
    or the file's absolute floor, the warm-up starts at the file's absolute start."""
    if peak is None or (old_peak is None and min_lr is None):
        if min_lr is not None:
            raise UserError(f"--min-lr is a fraction of the optimizer's lr under WarmupCosineLR, and DeepSpeed "
                             f"config {path} gives no lr; add \"lr\" to the optimizer's params or pass --lr.")
        return
    reference = old_peak if old_peak is not None else peak
    floor = float(min_lr) if min_lr is not None else sched.get("cos_min_ratio", DEEPSPEED_DEFAULT_COS_MIN_RATIO) * reference
    start = sched.get("warmup_min_ratio", 0.0) * reference
    if floor > peak:
        raise UserError(f"the WarmupCosineLR schedule of DeepSpeed config {path} would decay from lr {peak:g} up to "
                         f"a floor of {floor:g}; pass a --min-lr below {peak:g} (or a higher --lr).")
    if start > peak:
        raise UserError(f"the WarmupCosineLR warm-up of DeepSpeed config {path} starts at {start:g} "
                         f"(warmup_min_ratio x its lr), above the new lr {peak:g}; pass a higher --lr or lower "
                         "warmup_min_ratio.")
    sched["cos_min_ratio"] = floor / peak
    if "warmup_min_ratio" in sched:
        sched["warmup_min_ratio"] = start / peak


# ------------------------------------------------------------------------------- bf16 gradient accumulation

def bf16_enabled(ds: dict[str, Any]) -> bool:
    return bool((ds.get("bf16") or {}).get("enabled")) if isinstance(ds.get("bf16"), dict) else False


def explicit_accumulation_dtype(ds: dict[str, Any]) -> str | None:
    """The ds_config's own ``data_types.grad_accum_dtype``, lower-case (None where it names none)."""
    data_types = ds.get("data_types")
    value = data_types.get("grad_accum_dtype") if isinstance(data_types, dict) else None
    return None if value is None else str(value).lower()


def accumulate_bf16_in_fp32(ds: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``ds`` in which a bf16 run sums its micro-batches' gradients in fp32 (other runs: unchanged).

    bf16 without ``data_types.grad_accum_dtype`` gets ``"fp32"``; an explicit value is the user's choice and is
    kept (:func:`bf16_accumulation_warning` names a bf16 one). Where the run then accumulates in fp32:

    * at ZeRO stage 0 it gets stage 1: DeepSpeed 0.19 builds its fp32-accumulating BF16_Optimizer for bf16 with
      fp32 accumulation at stage 1 (with or without pipeline stages) and refuses the mix at stage 0 ("unsupported
      mix"). That optimizer keeps a whole fp32 gradient buffer beside the bf16 gradients (4 bytes a parameter,
      which the planner counts) and partitions the fp32 master weights and Adam's moments over the data-parallel
      ranks; ZeRO stages 2 and 3 keep their own fp32 gradient partition;
    * without a ``communication_data_type`` it gets ``"fp32"``: the data-parallel all-reduce (or reduce-scatter)
      sums the ranks' micro-batches too, and DeepSpeed's bf16 default would cast the fp32 sums to bf16 for it
      (twice the bytes on the wire, as Megatron's bf16 reduction).

    Idempotent."""
    ds = copy.deepcopy(ds)
    if not bf16_enabled(ds):
        return ds
    if explicit_accumulation_dtype(ds) is None:
        data_types = ds.get("data_types") if isinstance(ds.get("data_types"), dict) else {}
        ds["data_types"] = {**data_types, "grad_accum_dtype": "fp32"}
    if explicit_accumulation_dtype(ds) in FP32_NAMES:
        zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
        if zero.get("stage", 0) == 0:
            ds["zero_optimization"] = {**zero, "stage": 1}
        ds.setdefault("communication_data_type", "fp32")
    return ds


def gradient_accumulation_dtype(ds: dict[str, Any]) -> str:
    """The dtype DeepSpeed sums micro-batches' gradients in under ``ds``: ``data_types.grad_accum_dtype`` where it
    names one, else the model's (fp16, bf16 or fp32)."""
    explicit = explicit_accumulation_dtype(ds)
    if explicit is not None:
        return "fp32" if explicit in FP32_NAMES else explicit
    for name in ("fp16", "bf16"):
        if isinstance(ds.get(name), dict) and ds[name].get("enabled"):
            return name
    return "fp32"


def gradient_reduction_dtype(ds: dict[str, Any]) -> str:
    """The dtype DeepSpeed all-reduces gradients over the data-parallel ranks in under ``ds``:
    ``communication_data_type`` where it names one, else the model's."""
    explicit = ds.get("communication_data_type")
    if explicit is not None:
        return str(explicit).lower()
    for name in ("fp16", "bf16"):
        if isinstance(ds.get(name), dict) and ds[name].get("enabled"):
            return name
    return "fp32"


def bf16_accumulation_warning(ds: dict[str, Any], path: str | None = None) -> str | None:
    """The warning to print once (one sentence) when a bf16 run asks to accumulate its gradients in bf16."""
    if not bf16_enabled(ds) or gradient_accumulation_dtype(ds) != "bf16":
        return None
    where = f"DeepSpeed config {path}" if path else "the DeepSpeed config"
    return (f"{where} sets data_types.grad_accum_dtype {ds['data_types']['grad_accum_dtype']!r}, so "
            "the micro-batches' gradients are summed in bf16 (8 bits of mantissa), which loses small ones; remove it "
            "to accumulate in fp32.")
