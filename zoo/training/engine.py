"""What zoo hands to ``deepspeed.initialize`` and what it checks on the engine afterwards.

* The optimizer's parameter groups come from :func:`zoo.models.families.param_groups`.
* :func:`refresh_fp32_master_weights`: the known mixed-precision pitfall. DeepSpeed's fp16/bf16
  optimizers (FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer, ZeRO) keep fp32 master copies
  made from the module's weights at ``deepspeed.initialize``; weights loaded into the module after
  that (``engine.module.load_state_dict``, ``from_pretrained`` into the live module) are silently
  overwritten by the stale masters at the first ``step``. Call it after any such load.
* :func:`fp32_master_weight_error`: how far the masters are from the module's weights (for asserts).
"""

from __future__ import annotations

import torch


def refresh_fp32_master_weights(engine) -> bool:
    """Copy the module's (fp16/bf16) weights into the optimizer's fp32 master weights.

    Every DeepSpeed mixed-precision optimizer exposes ``refresh_fp32_params`` for this; fp32 training
    has no masters and nothing happens. Returns whether masters were refreshed.
    """
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if refresh is None or not _uses_master_weights(engine):
        return False
    with torch.no_grad():
        refresh()
    return True


def fp32_master_weight_error(engine) -> float | None:
    """Largest |master - weight| over the parameters whose fp32 masters this rank holds whole
    (FP16_Optimizer's flat groups, FP16_UnfusedOptimizer's per-parameter copies); ``None`` when the
    optimizer keeps no such masters (fp32 training, or partitioned masters of BF16/ZeRO)."""
    optimizer = engine.optimizer
    pairs = _master_pairs(optimizer)
    if pairs is None:
        return None
    worst = 0.0
    for weight, master in pairs:
        worst = max(worst, (master.detach().float() - weight.detach().float()).abs().max().item())
    return worst


def _uses_master_weights(engine) -> bool:
    return bool(engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization())


def _master_pairs(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    fp16_groups = getattr(optimizer, "fp16_groups", None)
    if fp16_groups is None:
        return None
    if getattr(optimizer, "fp32_groups", None) is not None and not hasattr(optimizer, "fp32_groups_flat"):
        return [(w, m) for weights, masters in zip(fp16_groups, optimizer.fp32_groups)
                for w, m in zip(weights, masters)]
    flats = getattr(optimizer, "fp32_groups_flat", None)
    if flats is None:
        return None
    pairs = []
    for weights, flat in zip(fp16_groups, flats):
        offset = 0
        for weight in weights:
            pairs.append((weight, flat.narrow(0, offset, weight.numel()).view_as(weight)))
            offset += weight.numel()
    return pairs
