"""The dict handed to ``deepspeed.initialize`` (:func:`deepspeed_dict`: the ds_config without zoo's keys, its
LR schedule tied to ``train_iters``) and the LR schedule a checkpoint records, with the warnings for a warm-up
cut to the run and for a resumed run whose schedule changed."""

from __future__ import annotations

from typing import Any

from zoo.config.deepspeed_overrides import accumulate_bf16_in_fp32
from zoo.config.run_config import RunConfig

# The top-level keys of a ds_config that are zoo's, not DeepSpeed's: the zoo block, and the effective settings a
# run's <save>/config.json carries beside it (zoo.training.effective_settings).
ZOO_TOP_LEVEL_KEYS = ("zoo", "effective")
SCHEDULES_OVER_TRAIN_ITERS = ("WarmupCosineLR", "WarmupDecayLR")


def deepspeed_dict(config: RunConfig, gas: int) -> dict[str, Any]:
    """The dict handed to deepspeed.initialize: the file's config, schedule length tied to train_iters
    (a warm-up longer than the run is cut to it; :func:`clipped_warmup_warning` says so), bf16 gradients
    accumulated in fp32 (:func:`zoo.config.deepspeed_overrides.accumulate_bf16_in_fp32`)."""
    ds = accumulate_bf16_in_fp32(config.ds_config)
    for key in ZOO_TOP_LEVEL_KEYS:
        ds.pop(key, None)
    ds["gradient_accumulation_steps"] = gas
    scheduler = ds.get("scheduler")
    if scheduler and scheduler.get("type") in SCHEDULES_OVER_TRAIN_ITERS:
        params = scheduler.setdefault("params", {})
        params["total_num_steps"] = config.train_iters
        params["warmup_num_steps"] = max(1, min(params.get("warmup_num_steps", 1), config.train_iters))
    return ds


def clipped_warmup_warning(config: RunConfig) -> str | None:
    """The warning to print (one sentence) when the ds_config's warm-up is longer than the run and is cut to it."""
    scheduler = config.ds_config.get("scheduler") or {}
    warmup = (scheduler.get("params") or {}).get("warmup_num_steps", 1)
    if scheduler.get("type") not in SCHEDULES_OVER_TRAIN_ITERS or warmup <= config.train_iters:
        return None
    return (f"the {scheduler['type']} warm-up of {warmup} steps in {config.ds_config_path} is longer than "
            f"train_iters {config.train_iters}, so it is cut to {config.train_iters} steps and the learning rate "
            f"never decays; pass --train-iters above {warmup} or lower warmup_num_steps.")


def lr_schedule(ds: dict[str, Any]) -> dict[str, Any] | None:
    """The LR schedule of a :func:`deepspeed_dict` result, as recorded in checkpoints: type and params."""
    scheduler = ds.get("scheduler")
    if not scheduler:
        return None
    return {"type": scheduler.get("type"), **dict(scheduler.get("params") or {})}


def schedule_change_warning(old: dict[str, Any] | None, new: dict[str, Any] | None, iteration: int) -> str | None:
    """The warning to print (one sentence) when a resumed run's LR schedule differs from the checkpoint's.

    Megatron's rule stays: this run's flags govern and the step count continues, so from ``iteration``
    on the learning rate follows the new schedule; the warning names both.
    """
    if old == new:
        return None
    return (f"the checkpoint at iteration {iteration} was trained with the LR schedule "
            f"{describe_schedule(old, new)} and this run continues with {describe_schedule(new, old)}, so the "
            f"learning rate follows the new schedule from iteration {iteration}; resume with the old --train-iters "
            "and scheduler settings to keep the old one.")


def describe_schedule(schedule: dict[str, Any] | None, other: dict[str, Any] | None) -> str:
    """``WarmupCosineLR(total_num_steps=3, warmup_num_steps=3)``: the type and the params that differ
    from ``other`` (all of them when the types differ)."""
    if schedule is None:
        return "none (a constant learning rate)"
    other = other or {}
    same_type = other.get("type") == schedule.get("type")
    shown = {k: v for k, v in schedule.items() if k != "type" and not (same_type and other.get(k) == v)}
    if same_type:
        shown.update({k: None for k in other if k not in schedule})
    return f"{schedule.get('type')}(" + ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) + ")"


__all__ = ["SCHEDULES_OVER_TRAIN_ITERS", "ZOO_TOP_LEVEL_KEYS", "clipped_warmup_warning", "deepspeed_dict", "describe_schedule",
           "lr_schedule", "schedule_change_warning"]
