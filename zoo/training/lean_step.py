"""DeepSpeed's optimizer step without host work that is not the model's, set on one engine instance.

DeepSpeed's engine stays the one that trains (its optimizers, loss scaler, clipping and checkpoints); after
``deepspeed.initialize`` :func:`lighten_step` changes two things on the engine and its optimizer object, never on
DeepSpeed's classes:

* **One host synchronisation for the non-finite check.** DeepSpeed's fp16 optimizers (FP16_Optimizer with a fused
  Adam, FP16_UnfusedOptimizer otherwise; the same two run bf16 when accumulation is in bf16) ask their
  ``CheckOverflow`` object before each step whether any gradient holds an inf or a NaN. Its ``has_overflow``
  converts each tensor's answer to a Python bool, one host synchronisation per parameter tensor (hundreds a step).
  :class:`FusedNonFiniteCheck` replaces that object on the optimizer: one max-|x| reduction per dtype over all the
  gradients (``torch._foreach_norm`` with ord inf, in which inf and NaN propagate), the same MAX all-reduces over
  the same groups as DeepSpeed's check (a group of one rank is skipped: its MAX is the identity), and one
  conversion. The answer is DeepSpeed's: an fp16 overflow still skips the step and lowers the loss scale.
  BF16_Optimizer and ZeRO check a norm or a flat partition on the device already and are left as they are.
* **No gradient all-reduce without data parallelism.** The engine all-reduces the gradients at every accumulation
  boundary (a flatten, an all-reduce, a copy back) even when the data-parallel group is one rank, where averaging
  over it is the identity. At dp = 1 :func:`reduce_gradients_only_with_data_parallelism` turns that reduction off
  (``enable_backward_allreduce``, or ``pipeline_enable_backward_allreduce`` of the pipeline engine, whose tied-weight
  all-reduce over the stages stays). It leaves ZeRO optimizers alone, whose reduction also moves the gradients into
  the partitions their step reads; BF16_Optimizer accumulates its fp32 gradients before that flag is read, so it
  steps on the same gradients. The reduction also gives a zero gradient to a parameter that received none;
  DeepSpeed's fp16/bf16 optimizers do that themselves, and for fp32 training a step pre-hook does it, so
  weight decay and Adam's moments move such a parameter at dp = 1 as they do at dp = 2.

Each DeepSpeed attribute this relies on is checked when it is set up: a DeepSpeed version without one raises
RuntimeError naming it, rather than silently keeping the slow step.
"""

from __future__ import annotations

import torch

__all__ = ["lighten_step", "fuse_non_finite_check", "reduce_gradients_only_with_data_parallelism",
           "FusedNonFiniteCheck", "any_non_finite"]

CHECKED_OPTIMIZERS = ("FP16_Optimizer", "FP16_UnfusedOptimizer")   # DeepSpeed's optimizers with a CheckOverflow
CHECKER_ATTRIBUTES = ("params", "mpu", "deepspeed", "has_moe_params", "zero_reduce_scatter")
ENGINE_ATTRIBUTES = ("enable_backward_allreduce", "dp_world_size", "seq_dp_world_size", "has_moe_layers")


def lighten_step(engine) -> None:
    """Both changes of the module doc on ``engine`` (a DeepSpeed engine or pipeline engine)."""
    reduce_gradients_only_with_data_parallelism(engine)
    fuse_non_finite_check(engine)


# ------------------------------------------------------------------------------------ the non-finite check

def any_non_finite(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """A 0-dim bool tensor, on the tensors' device (``device`` when there are none): whether any element of
    ``tensors`` is inf or NaN. One reduction per dtype and no host synchronisation: the largest |x| of each
    tensor (inf and NaN propagate through it, and it is exact in every dtype), stacked and tested."""
    by_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.is_sparse:   # only the stored entries of a sparse gradient can be non-finite
            tensor = tensor._values()
        if tensor.numel():     # an empty tensor holds nothing non-finite (and has no max)
            by_dtype.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    flags = [torch.stack(torch._foreach_norm(group, float("inf"))).isfinite().all().logical_not()
             for group in by_dtype.values()]
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=device)
    return flags[0] if len(flags) == 1 else torch.stack([flag.to(flags[0].device) for flag in flags]).any()


class FusedNonFiniteCheck:
    """Stands in for the ``CheckOverflow`` object of one DeepSpeed fp16 optimizer (see the module doc).

    ``has_overflow(params)`` and ``check(param_groups=None)`` answer as DeepSpeed's do, with one host
    synchronisation; every other attribute (the legacy fused paths' ``check_using_norm``) is the original's."""

    def __init__(self, checker):
        self.checker = checker

    def __getattr__(self, name):
        return getattr(self.checker, name)

    def check(self, param_groups=None) -> bool:
        params = self.checker.params if param_groups is None else [p for group in param_groups for p in group]
        return self.has_overflow(params)

    def has_overflow(self, params, has_moe_params=None) -> bool:
        from deepspeed import comm as dist  # local: DeepSpeed costs seconds to import
        from deepspeed.accelerator import get_accelerator

        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device if grads else get_accelerator().current_device_name()
        flag = any_non_finite(grads, device).to(torch.uint8).reshape(1)
        for group in self.agreement_groups():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())   # the one host synchronisation of the check

    def agreement_groups(self) -> list:
        """The groups DeepSpeed's check agrees over, of more than one rank: the model-parallel group (each of
        its ranks holds other gradients), and where the engine does not all-reduce the gradients over the data
        parallel group (and so each DP rank holds its own), that group too (the world without an mpu)."""
        from deepspeed import comm as dist  # local: DeepSpeed costs seconds to import

        checker, engine = self.checker, self.checker.deepspeed
        groups = []
        if checker.mpu is not None:
            if engine is not None and not engine_reduces_gradients(engine):
                groups.append(checker.mpu.get_data_parallel_group())
            groups.append(checker.mpu.get_model_parallel_group())
        elif engine is not None and engine.enable_backward_allreduce is False:
            groups.append(dist.get_world_group())
        return [group for group in groups if dist.get_world_size(group=group) > 1]


def engine_reduces_gradients(engine) -> bool:
    """Whether ``engine`` all-reduces the gradients over its data-parallel group (the pipeline engine's own flag
    where it has one)."""
    if hasattr(engine, "pipeline_enable_backward_allreduce"):
        return bool(engine.pipeline_enable_backward_allreduce)
    return bool(engine.enable_backward_allreduce)


def fuse_non_finite_check(engine) -> bool:
    """Give ``engine``'s optimizer a :class:`FusedNonFiniteCheck` where it is one of DeepSpeed's fp16 optimizers
    (either precision); returns whether it did. Models with MoE experts keep DeepSpeed's check (it also agrees
    over the expert groups). Raises RuntimeError when such an optimizer lacks what the check relies on."""
    optimizer = engine.optimizer
    if type(optimizer).__name__ not in CHECKED_OPTIMIZERS:
        return False
    checker = getattr(optimizer, "overflow_checker", None)
    if isinstance(checker, FusedNonFiniteCheck):
        return True
    missing = [name for name in CHECKER_ATTRIBUTES if not hasattr(checker, name)]
    if checker is None or missing:
        raise RuntimeError(_missing(f"{type(optimizer).__name__}.overflow_checker", missing or ["overflow_checker"]))
    if checker.has_moe_params or checker.zero_reduce_scatter:
        return False
    optimizer.overflow_checker = FusedNonFiniteCheck(checker)
    return True


# ------------------------------------------------------------------------ the all-reduce at dp = 1

def reduce_gradients_only_with_data_parallelism(engine) -> bool:
    """Turn off ``engine``'s gradient all-reduce where its data-parallel group is one rank and its optimizer is not a
    ZeRO one (see the module doc); returns whether it did. Raises RuntimeError when the engine lacks an attribute
    this relies on."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # local: DeepSpeed costs seconds to import

    missing = [name for name in ENGINE_ATTRIBUTES if not hasattr(engine, name)]
    if missing:
        raise RuntimeError(_missing("the DeepSpeed engine", missing))
    if engine.dp_world_size > 1 or engine.seq_dp_world_size > 1 or engine.has_moe_layers:
        return False
    if engine.zero_optimization() and not isinstance(engine.optimizer, BF16_Optimizer):
        return False
    if hasattr(engine, "pipeline_enable_backward_allreduce"):
        engine.pipeline_enable_backward_allreduce = False
    else:
        engine.enable_backward_allreduce = False
    if not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        engine.optimizer.register_step_pre_hook(ZeroGradientsForUnusedParameters(engine.module))
    return True


class ZeroGradientsForUnusedParameters:
    """Optimizer step pre-hook of fp32 training at dp = 1: a zero gradient for every trainable, non-empty parameter
    of ``module`` that received none, as DeepSpeed's gradient reduction gives it at dp > 1."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, optimizer, args, kwargs) -> None:
        for param in self.module.parameters():
            if param.requires_grad and param.grad is None and param.numel():
                param.grad = torch.zeros_like(param)


def _missing(owner: str, names: list[str]) -> str:
    import deepspeed  # local: DeepSpeed costs seconds to import

    return (f"{owner} of DeepSpeed {deepspeed.__version__} has no {', '.join(names)}, which zoo's lean step relies "
            "on (zoo/training/lean_step.py); use the DeepSpeed version zoo pins, or adapt that module.")
