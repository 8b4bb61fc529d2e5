"""Global gradient L2 norm of a tensor-parallel model: ||g|| = sqrt(sum over TP ranks of the sharded
parameters' squared norms + the replicated parameters' squared norm counted once)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zoo.parallel.layers import is_tensor_parallel


def global_grad_norm(model: torch.nn.Module, parallel) -> float:
    """Collective over the TP group. Gradients are assumed already averaged over data parallelism."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        if param.grad is None:
            continue
        squared = param.grad.detach().double().pow(2).sum().cpu()
        if is_tensor_parallel(param):
            sharded += squared
        else:
            replicated += squared
    if parallel is not None and parallel.tp_size > 1:
        sharded = sharded.to(next(model.parameters()).device)
        dist.all_reduce(sharded, group=parallel.tp_group)
        sharded = sharded.cpu()
    return float((sharded + replicated).sqrt())


def current_loss_scale(optimizer) -> float:
    """The dynamic (or static) fp16 loss scale of a DeepSpeed optimizer; 1.0 in fp32/bf16."""
    for holder in (getattr(optimizer, "loss_scale_config", None), getattr(optimizer, "loss_scaler", None), optimizer):
        scale = getattr(holder, "cur_scale", None)
        if scale is not None:
            return float(scale)
    return 1.0
