"""What a job does before its first iteration: :func:`join` (the launcher's process group, this rank's
device set at once, the tp x dp (x pp) grid, the seeds) and :func:`setup_engine` (``deepspeed.initialize`` with
zoo's parameter groups and mpu, from the ds_config of :func:`engine_ds_config`)."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zoo.config.deepspeed_overrides import accumulate_bf16_in_fp32, bf16_accumulation_warning
from zoo.distributed import join_process_group
from zoo.models.families import param_groups
from zoo.operations.cuda_arch import fit_cuda_arch_list_for_deepspeed
from zoo.parallel import ParallelState, model_parallel_seed
from zoo.training.engine import announce_fused_adam_build, refresh_fp32_master_weights
from zoo.training.lean_step import lighten_step


def join(tensor_parallel_size: int | None, seed: int, timeout_minutes: float | None = None,
         pipeline_parallel_size: int = 1, context_parallel_size: int = 1) -> ParallelState:
    """Join the launcher's process group, set this rank's accelerator device right away (before the
    TP RNG tracker is seeded on it), share the CPU cores, build the tp x cp x dp (x pp) grid and seed it.

    ``tensor_parallel_size`` None means the whole world. ``timeout_minutes``
    (``--distributed-timeout-minutes``) bounds every collective of the world, TP and DP groups; None is
    DeepSpeed's default (10 minutes, or ``$DEEPSPEED_TIMEOUT``) for all three. Returns the ParallelState,
    whose ``timeout`` the loop's roll call waits."""
    from deepspeed.constants import default_pg_timeout  # local: DeepSpeed costs seconds to import

    timeout = None if timeout_minutes is None else timedelta(minutes=timeout_minutes)
    join_process_group(timeout=timeout)   # the device of the launcher's local rank (zoo.distributed.local_rank)
    parallel = ParallelState.initialize(tensor_parallel_size or dist.get_world_size(), timeout=timeout or default_pg_timeout,
                                  pp_size=pipeline_parallel_size, cp_size=context_parallel_size)
    model_parallel_seed(seed, parallel)
    return parallel


def setup_engine(model: torch.nn.Module, ds_config: dict[str, Any], parallel, weight_decay: float,
                 refresh_masters: bool):
    """The DeepSpeed engine of ``model`` (AdamW groups without decay on biases and norms, zoo's mpu), in training
    mode (a model from ``from_pretrained`` arrives in eval mode and DeepSpeed's engine keeps its module's mode;
    only the pipeline engine's ``train_batch`` sets it), bf16 gradients accumulated in fp32
    (:func:`zoo.config.deepspeed_overrides.accumulate_bf16_in_fp32`), its step lightened
    (:func:`zoo.training.lean_step.lighten_step`); ``refresh_masters`` copies weights loaded before
    ``initialize`` into fp16/bf16 master weights."""
    import deepspeed  # local: DeepSpeed costs seconds to import

    fit_cuda_arch_list_for_deepspeed()
    announce_fused_adam_build(ds_config, dist.get_rank() == 0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, weight_decay),
                                           config=engine_ds_config(ds_config), mpu=parallel)
    lighten_step(engine)
    if refresh_masters:
        refresh_fp32_master_weights(engine)
    engine.train()
    return engine


def engine_ds_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The ds_config an engine is built from: bf16 gradients accumulated in fp32
    (:func:`zoo.config.deepspeed_overrides.accumulate_bf16_in_fp32`); where the config asks bf16 accumulation
    explicitly it is kept, and rank 0 says once what that costs."""
    ds_config = accumulate_bf16_in_fp32(ds_config)
    warning = bf16_accumulation_warning(ds_config)
    if warning and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return ds_config


__all__ = ["engine_ds_config", "join", "setup_engine"]
