"""Global gradient L2 norm of a tensor-parallel model: ||g|| = sqrt(sum over TP ranks of the sharded
parameters' squared norms + the replicated parameters' squared norm counted once), summed over the
pipeline stages where there are several (the last stage's copy of the tied word embedding, which
DeepSpeed marks ``ds_pipe_replicated``, counted once)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zoo.parallel.layers import is_tensor_parallel
from zoo.parallel.state import as_state


def global_grad_norm(model: torch.nn.Module, parallel) -> torch.Tensor:
    """Collective over the TP group (and the pipeline's stages). Gradients are assumed already averaged over
    data parallelism.

    Returns a float64 scalar on the gradients' device: the squared norms are summed there and nothing
    is copied to the host, so the caller decides when to synchronise (once per log interval)."""
    sharded, replicated = [], []
    for param in model.parameters():
        if param.grad is None or getattr(param, "ds_pipe_replicated", False):
            continue
        squared = param.grad.detach().double().pow(2).sum()
        (sharded if is_tensor_parallel(param) else replicated).append(squared)
    device = next(model.parameters()).device
    sharded_sum = torch.stack(sharded).sum() if sharded else torch.zeros((), dtype=torch.float64, device=device)
    replicated_sum = (torch.stack(replicated).sum() if replicated
                      else torch.zeros((), dtype=torch.float64, device=device))
    if as_state(parallel).tp_size > 1:
        dist.all_reduce(sharded_sum, group=parallel.tp_group)
    total = sharded_sum + replicated_sum
    if as_state(parallel).pp_size > 1:
        dist.all_reduce(total, group=parallel.pp_group)
    return total.sqrt()


def current_loss_scale(optimizer) -> float:
    """The dynamic (or static) fp16 loss scale of a DeepSpeed optimizer; 1.0 in fp32/bf16."""
    for holder in (getattr(optimizer, "loss_scale_config", None), getattr(optimizer, "loss_scaler", None), optimizer):
        scale = getattr(holder, "cur_scale", None)
        if scale is not None:
            return float(scale)
    return 1.0


def deepspeed_reports_true_norm(engine) -> bool:
    """Whether ``engine.get_global_grad_norm()`` is the unscaled norm of the last step. ZeRO keeps it in
    every precision (and moves the gradients off the module, where zoo could not count them); fp32 without
    ZeRO keeps none; FP16_UnfusedOptimizer (fp16 with ``torch_adam`` or a non-fused optimizer) keeps it
    still multiplied by the loss scale (deepspeedai/DeepSpeed#8588, open); FP16_Optimizer and
    BF16_Optimizer divide it out."""
    if engine.zero_optimization():
        return True
    if not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        return False
    return type(engine.optimizer).__name__ != "FP16_UnfusedOptimizer"   # decided once: its scale may grow from 1


def let_deepspeed_count_every_tp_rank(engine) -> None:
    """Tag the gradients of tensor-parallel parameters as model-parallel, so that the clipping norm of
    DeepSpeed's FP16_UnfusedOptimizer (fp16, or bf16, at ZeRO stage 0 with a non-fused optimizer such as
    ``torch_adam``) is the norm over every TP rank.

    That optimizer measures the norm on the gradient tensors, not on the parameters, and DeepSpeed counts a
    tensor on TP ranks other than 0 only when it carries the model-parallel attribute: untagged, every TP
    rank but 0 is left out and the clip coefficient comes from a norm that is too small (4.77 instead of
    6.08 at tp=2). Tagged, the optimizer counts the sharded gradients on every rank and the replicated
    ones on TP rank 0 only, which is :func:`global_grad_norm`. Call it after each backward (a backward may
    make new gradient tensors); other optimizers read the parameters' own tags and are left alone."""
    if type(engine.optimizer).__name__ != "FP16_UnfusedOptimizer":
        return
    for param in engine.module.parameters():
        if param.grad is not None and is_tensor_parallel(param):
            param.grad.tensor_model_parallel = True


def unscaled_grad_norm(engine, parallel) -> torch.Tensor:
    """zoo's own norm of the module's gradients after backward (before the step unscales them), divided by
    the loss scale they carry (1 outside fp16). A device tensor, as :func:`global_grad_norm`."""
    return global_grad_norm(engine.module, parallel) / current_loss_scale(engine.optimizer)
