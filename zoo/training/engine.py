"""What zoo hands to ``deepspeed.initialize`` and what it checks on the engine afterwards.

* The optimizer's parameter groups come from :func:`zoo.models.families.param_groups`.
* :func:`refresh_fp32_master_weights`: the known mixed-precision pitfall. DeepSpeed's fp16/bf16
  optimizers (FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer, ZeRO) keep fp32 master copies
  made from the module's weights at ``deepspeed.initialize``; weights loaded into the module after
  that (``engine.module.load_state_dict``, ``from_pretrained`` into the live module) are silently
  overwritten by the stale masters at the first ``step``. Call it after any such load.
* :func:`fp32_master_weight_error`: how far the masters are from the module's weights (for asserts).
* :func:`announce_fused_adam_build`: a first run on a GPU JIT-compiles DeepSpeed's FusedAdam for tens of
  seconds to minutes without a word; the writer says so on one line before ``deepspeed.initialize``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# DeepSpeed's optimizer types it builds as FusedAdam on an accelerator (its runtime/config names, lower-cased)
FUSED_ADAM_TYPES = ("adam", "adamw")


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


def builds_fused_adam(ds_config: dict[str, Any], device: str, prebuilt: bool, cached: bool) -> bool:
    """Whether ``deepspeed.initialize`` on ``device`` will JIT-compile FusedAdam for ``ds_config``: an
    Adam/AdamW optimizer DeepSpeed builds itself (no ``torch_adam``, no optimizer offload, which takes
    CPUAdam), on an accelerator other than the CPU, with the op neither installed prebuilt nor cached."""
    optimizer = ds_config.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() not in FUSED_ADAM_TYPES or device == "cpu":
        return False
    if (optimizer.get("params") or {}).get("torch_adam"):
        return False
    offload = (ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if offload.get("device") not in (None, "none"):
        return False
    return not prebuilt and not cached


def announce_fused_adam_build(ds_config: dict[str, Any], is_writer: bool) -> None:
    """On the writer, one line before a ``deepspeed.initialize`` that will JIT-compile FusedAdam (see
    :func:`builds_fused_adam`), so a first GPU run does not sit silent for the build."""
    if not is_writer:
        return
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import
    from deepspeed.git_version_info import installed_ops  # local: DeepSpeed's import cost
    from torch.utils.cpp_extension import _get_build_directory  # local: only a GPU run asks

    device = get_accelerator().device_name()
    if device == "cpu":
        return
    directory = _get_build_directory("fused_adam", verbose=False)
    if builds_fused_adam(ds_config, device, bool(installed_ops.get("fused_adam")),
                         os.path.isfile(os.path.join(directory, "fused_adam.so"))):
        print(f"DeepSpeed is compiling its FusedAdam kernel for this GPU (once: about 40 s on 16 cores, minutes on "
              f"a few); later runs load it from {directory}.", flush=True)
