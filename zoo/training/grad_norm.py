"""Global gradient L2 norm of a tensor-parallel model: ||g|| = sqrt(sum over TP ranks of the sharded
parameters' squared norms + the replicated parameters' squared norm counted once), summed over the
pipeline stages where there are several (the last stage's copy of the tied word embedding, which
DeepSpeed marks ``ds_pipe_replicated``, counted once)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zoo.parallel.layers import is_tensor_parallel
from zoo.parallel.state import as_state

PIPE_REPLICATED = "ds_pipe_replicated"   # DeepSpeed's mark on a stage's copy of a tied parameter
TP_TAG = "tensor_model_parallel"


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """||grad||^2 as a float64 scalar: the squares summed over the tensor in fp32 (fp64 gradients stay fp64), from
    one fp32 copy of the tensor and no float64 one, which GPUs with slow fp64 would pay on every element. torch's
    fp32 sum reduces pairwise (cascaded on CPUs, a tree on GPUs): ~1e-7 relative for a tensor of millions of
    elements. The float64 result keeps the sum over many tensors as exact."""
    grad = grad.detach()
    if grad.dtype == torch.float64:
        return grad.square().sum()
    return grad.to(torch.float32, copy=True).square_().sum().double()


def global_grad_norm(model: torch.nn.Module, parallel) -> torch.Tensor:
    """Collective over the TP group (and the pipeline's stages). Gradients are assumed already averaged over
    data parallelism.

    Returns a float64 scalar on the gradients' device: the per-tensor squared norms (:func:`squared_norm`)
    are summed there in float64 and nothing is copied to the host, so the caller decides when to synchronise
    (once per log interval)."""
    sharded, replicated = [], []
    for param in model.parameters():
        if param.grad is None or getattr(param, PIPE_REPLICATED, False):
            continue
        (sharded if is_tensor_parallel(param) else replicated).append(squared_norm(param.grad))
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
    """Tag the gradients as their parameters are tagged (:func:`tag_gradient`), so that the clipping norm of
    DeepSpeed's FP16_UnfusedOptimizer (fp16, or bf16, at ZeRO stage 0 with a non-fused optimizer such as
    ``torch_adam``) is the norm over every TP rank and pipeline stage.

    That optimizer measures the norm on the gradient tensors, not on the parameters, and DeepSpeed counts a
    tensor on TP ranks other than 0 only when it carries the model-parallel attribute, and skips a pipeline
    stage's copy of a tied parameter only when it carries ``ds_pipe_replicated``: untagged, every TP rank but
    0 is left out (4.77 instead of 6.08 at tp=2) and the tied embedding is counted on two stages. Tagged, the
    optimizer counts the sharded gradients on every rank, the replicated ones on TP rank 0 only and a tied
    parameter on one stage, which is :func:`global_grad_norm`. Call it after each backward (a backward may
    make new gradient tensors); other optimizers read the parameters' own tags and are left alone."""
    if not reads_tags_off_gradients(engine):
        return
    for param in engine.module.parameters():
        if param.grad is not None:
            tag_gradient(param)


def keep_gradients_tagged(engine) -> None:
    """:func:`let_deepspeed_count_every_tp_rank` for an engine that runs its backward itself (DeepSpeed's pipeline
    engine): every parameter tags its gradient each time autograd accumulates into it, before any step."""
    if not reads_tags_off_gradients(engine):
        return
    for param in engine.module.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(tag_gradient)


def reads_tags_off_gradients(engine) -> bool:
    return type(engine.optimizer).__name__ == "FP16_UnfusedOptimizer"


def tag_gradient(param: torch.Tensor) -> None:
    """Give ``param.grad`` the tensor-parallel and pipeline-replicated marks ``param`` carries."""
    if is_tensor_parallel(param):
        setattr(param.grad, TP_TAG, True)
    if getattr(param, PIPE_REPLICATED, False):
        setattr(param.grad, PIPE_REPLICATED, True)


def unscaled_grad_norm(engine, parallel) -> torch.Tensor:
    """zoo's own norm of the module's gradients after backward (before the step unscales them), divided by
    the loss scale they carry (1 outside fp16). A device tensor, as :func:`global_grad_norm`."""
    return global_grad_norm(engine.module, parallel) / current_loss_scale(engine.optimizer)
