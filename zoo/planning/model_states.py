"""Parameters and model-state bytes per rank: the exact parameter count (the model built on the meta device at
the config's tp degree, vocab padding included, nothing allocated) and the weights, gradients and optimizer
state of mixed-precision training with Adam (Rajbhandari et al. 2020, "ZeRO", section 3.1), under ZeRO stages 1
and 2 what DeepSpeed 0.19's optimizer holds at the peak of its step (measured; DeepSpeed's own estimate is
:func:`deepspeed_estimate`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zoo.errors import UserError

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class ParameterCount:
    total: int        # the whole model, padded vocabulary included (tied embeddings counted once)
    per_rank: int     # TP-sharded parameters / tp + replicated ones
    largest_layer_per_rank: int = 0   # the most parameters one module holds itself, on one TP rank


def count_parameters(model_config, tp: int) -> ParameterCount:
    """Exact counts of the model built on the meta device at tensor-parallel size ``tp`` (nothing allocated).

    The model is built as TP rank 0 of a grid with no process groups: on the meta device no layer
    communicates, and every TP rank holds the same number of parameters (the vocabulary is padded to a
    multiple of 128 tp).
    """
    # local: torch import cost; the planner's arithmetic and plan --help run without torch
    import torch

    from zoo.models.families import build_model  # local: torch and transformers import cost
    from zoo.parallel.layers import is_tensor_parallel  # local: torch import cost
    from zoo.parallel.state import ParallelState  # local: torch import cost

    grid = ParallelState(tp_size=tp, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp, rank=0)
    with torch.device("meta"):
        model = build_model(model_config, grid)
    sharded = sum(p.numel() for p in model.parameters() if is_tensor_parallel(p))
    replicated = sum(p.numel() for p in model.parameters() if not is_tensor_parallel(p))
    largest = max((sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()), default=0)
    return ParameterCount(total=sharded * tp + replicated, per_rank=sharded + replicated, largest_layer_per_rank=largest)



def zero_stage_of(ds_config: Mapping[str, Any]) -> int:
    """The ZeRO stage the DeepSpeed config enables (0 when it has no ``zero_optimization`` block)."""
    block = ds_config.get("zero_optimization") or {}
    stage = block.get("stage", 0) if isinstance(block, dict) else 0
    if stage not in (0, 1, 2, 3):
        raise UserError(f"zero_optimization.stage {stage!r} is not a ZeRO stage; use 0, 1, 2 or 3.")
    return stage


def accumulates_in_fp32(ds_config: Mapping[str, Any]) -> bool:
    """Whether the ds_config asks DeepSpeed to accumulate gradients in fp32 (``data_types.grad_accum_dtype``)."""
    return str((ds_config.get("data_types") or {}).get("grad_accum_dtype", "")).lower() in ("fp32", "float32", "float")


def state_bytes(params_per_rank: int, dtype: str, zero_stage: int, dp: int,
                fp32_grad_accumulation: bool = False) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per rank for Adam, at the peak of the optimizer step.

    bf16 at ZeRO stage 1 with ``data_types.grad_accum_dtype`` fp32 (``fp32_grad_accumulation``) runs
    DeepSpeed 0.19's BF16_Optimizer instead of its ZeRO optimizer: 2-byte weights, the module's bf16
    gradients plus a whole (unpartitioned) fp32 gradient buffer they are accumulated into, 6 bytes a
    parameter, and the fp32 master partition and moments, 12/dp: 8 + 12/dp bytes a parameter.

    Without ZeRO: fp16/bf16 (mixed precision) keeps 2-byte weights and gradients, and an fp32 master copy
    plus two fp32 Adam moments, 12 bytes a parameter (ZeRO's 16 bytes a parameter, Rajbhandari et al.
    2020, section 3.1); fp32 keeps 4-byte weights and gradients and 8 bytes of moments. DeepSpeed's fp16
    optimizer also builds fp32 gradients for a moment during its step, after the activations are freed;
    that transient is not counted.

    ZeRO stages 1 and 2, as DeepSpeed 0.19's stage-1/2 optimizer holds them (measured by
    ``benchmarks/bench_zero_states.py``, every live tensor at dp = 2 and 4, with and without gradient
    accumulation): the weights stay whole; the gradients are reduced during backward into this rank's
    partition at stage 1 as at stage 2, ``value``/dp bytes a parameter; the step turns that partition into
    an fp32 gradient partition (4/dp: a cast in mixed precision, a flat copy in fp32) that lives beside
    the fp32 master partition (4/dp, kept in fp32 training too) and the moments (8/dp). Mixed precision:
    2 + 18/dp bytes a parameter, DeepSpeed's own estimator's figure; fp32: 4 + 20/dp. The fp32 gradient
    partition is counted with the gradients, so the total with activations is an upper bound by that
    much (it lives only during the step). Stage 3 divides the weights too (its gathered-layer buffers are
    not counted; not measured).
    """
    value = DTYPE_BYTES[dtype]
    weights = value * params_per_rank
    if dtype == "bf16" and zero_stage == 1 and fp32_grad_accumulation:
        return weights, (value + 4) * params_per_rank, -(-12 * params_per_rank // dp)
    if zero_stage == 0:
        gradients = value * params_per_rank
        optimizer = (12 if value == 2 else 8) * params_per_rank
        return weights, gradients, optimizer
    gradients = -(-(value + 4) * params_per_rank // dp)      # the reduced partition and its fp32 form
    optimizer = -(-12 * params_per_rank // dp)               # fp32 master partition and two moments
    if zero_stage >= 3:
        weights = -(-weights // dp)
    return weights, gradients, optimizer


def deepspeed_estimate(params_per_rank: int, largest_layer_per_rank: int, zero_stage: int, dp: int) -> int | None:
    """DeepSpeed's own estimate of the model-state bytes per rank (no offload), or None at stage 0, for
    which it has none: ``estimate_zero2_model_states_mem_needs`` at stages 1 and 2 (DeepSpeed has no
    stage-1 estimator; its stage-1 optimizer is the stage-2 one), ``estimate_zero3_model_states_mem_needs``
    at stage 3. Its estimators know no tensor parallelism: they are given this TP rank's parameters over
    the dp ranks. DeepSpeed's start-up log lines go to stderr, so that ``--json`` stays one JSON object."""
    if zero_stage == 0:
        return None
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.zero import stage3, stage_1_and_2  # local: DeepSpeed costs seconds to import
    if zero_stage < 3:
        return int(stage_1_and_2.estimate_zero2_model_states_mem_needs(params_per_rank, num_gpus_per_node=dp,
                                                                       cpu_offload=False)[1])
    return int(stage3.estimate_zero3_model_states_mem_needs(params_per_rank, largest_layer_per_rank,
                                                            num_gpus_per_node=dp, cpu_offload=False,
                                                            cpu_offload_params=False)[1])


__all__ = ["DTYPE_BYTES", "ParameterCount", "accumulates_in_fp32", "count_parameters", "deepspeed_estimate",
           "state_bytes", "zero_stage_of"]
