"""Pipeline runs of every precision whose checkpoints change layout, as tests/test_layout_change_precisions.py
and tests/test_offline_reshard.py configure them, and what a rank's DeepSpeed optimizer holds after a load."""

from __future__ import annotations

import torch

from tests.helpers.pretraining import run_config
from tests.helpers.random_corpus import MODEL

ITERS, SAVED_AT = 4, 2
INITIAL_SCALE_POWER = 8
KEYS = ("master", "exp_avg", "exp_avg_sq")


def precision_run_config(data, save, tp, pp, precision, load=None):
    """The random-corpus GPT-2 (dropout off) at tp x pp, micro-batches of 2 in a global batch of 8, ``ITERS``
    iterations with a checkpoint at ``SAVED_AT``, in ``precision``: "bf16" (BF16_Optimizer with ZeRO-1 and fp32
    gradient accumulation), "fp16u" (FP16_UnfusedOptimizer, torch's AdamW) or "fp16f" (FP16_Optimizer, fused
    Adam), fp16 with a dynamic loss scale from 2**``INITIAL_SCALE_POWER``."""
    cfg = run_config(data, save, tp, 2, 8, train_iters=ITERS, model_overrides=dict(MODEL), save_interval=SAVED_AT,
                     load=load, data_workers=0, pipeline_model_parallel_size=pp)
    if precision == "bf16":
        cfg.ds_config.update(bf16={"enabled": True}, zero_optimization={"stage": 1},
                             data_types={"grad_accum_dtype": "fp32"})
    else:   # the scale doubles every 2 good steps (at iteration 3): when, the carried scaler decides
        cfg.ds_config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": INITIAL_SCALE_POWER,
                                 "loss_scale_window": 2, "hysteresis": 1}
        cfg.ds_config["optimizer"]["params"]["torch_adam"] = precision == "fp16u"
    return cfg


def engine_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's fp32 master and Adam moments of every parameter, {key: {``GPT2LMHeadModel`` name: tensor}}, as
    DeepSpeed's optimizer holds them (read through DeepSpeed's own accessors where it has them)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from zoo.checkpoint.layout_change import one_stage_names

    names = one_stage_names(engine.module)
    by_id = {id(p): names[n] for n, p in engine.module.named_parameters()}
    optimizer = engine.optimizer
    out: dict[str, dict[str, torch.Tensor]] = {key: {} for key in KEYS}
    if hasattr(optimizer, "fp32_groups_flat") and hasattr(optimizer, "fp16_groups"):   # FP16_Optimizer
        for lows, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat):
            state, offset = optimizer.optimizer.state[flat], 0
            for low in lows:
                for key, source in (("master", flat), ("exp_avg", state["exp_avg"]),
                                    ("exp_avg_sq", state["exp_avg_sq"])):
                    out[key][by_id[id(low)]] = source.narrow(0, offset, low.numel()).view(low.shape).clone()
                offset += low.numel()
        return out
    if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):        # FP16_UnfusedOptimizer
        for lows, highs in zip(optimizer.fp16_groups, optimizer.fp32_groups):
            for low, high in zip(lows, highs):
                state = optimizer.optimizer.state[high]
                out["master"][by_id[id(low)]] = high.detach().clone()
                for key in KEYS[1:]:
                    out[key][by_id[id(low)]] = state[key].clone()
        return out
    optimizer._lazy_init_hp_params_optimizer_state()   # DeepSpeed links its moment views at the first step
    for param in engine.module.parameters():                                           # BF16_Optimizer
        out["master"][by_id[id(param)]] = safe_get_full_fp32_param(param).clone()
        for key in KEYS[1:]:
            out[key][by_id[id(param)]] = safe_get_full_optimizer_state(param, key).clone()
    return out
