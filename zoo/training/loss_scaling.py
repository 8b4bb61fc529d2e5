"""The fp16 loss scale, applied exactly once, whatever the DeepSpeed version does in ``engine.backward``.

Dynamic loss scaling multiplies the loss by S before backward and divides the gradients by S in the
optimizer step. DeepSpeed 0.19's ``engine.backward`` multiplies only for ZeRO optimizers; with fp16 at
ZeRO stage 0 (FP16_Optimizer / FP16_UnfusedOptimizer: every ``ds_configs/tp*.json`` without ``_zero1``)
the loss reaches ``backward()`` unscaled while ``step()`` still divides by S. The update is then S times
too small (65,536 at ``initial_scale_power`` 16, where Adam's epsilon dominates), gradient clipping never
fires, fp16 gradients underflow, and ``get_global_grad_norm()`` reports the norm divided by S
(deepspeedai/DeepSpeed#8393, open): a gpt2-medium fp16 run on a GPU logs grad norms of about 3e-4.

:func:`backward` hooks the loss zoo hands to ``engine.backward``. The hook sees d(backward root)/d(loss):
S/g when DeepSpeed scaled the loss (g = gradient accumulation steps), 1/g when it did not; only in the
second case does it multiply by S. So the gradients reach the optimizer scaled by S once, on a DeepSpeed
that has the bug and on one that has the fix, with no host synchronisation (the choice is made on the
device). bf16, fp32 and ZeRO engines never get the hook. The loss must be fp32 (zoo's losses are): an
fp16 loss cannot carry S = 65,536 back, whoever applies it.

With pipeline stages DeepSpeed's pipeline engine computes the loss on the last stage and calls its own
``backward`` on it, so zoo hooks the loss where it is made: :func:`scale_pipeline_losses_once` wraps the
stage module's ``loss_fn`` (:class:`LossScaledOnce`), whose losses get the same hook. The scaled gradient
then travels back through every stage.

What zoo cannot change: on a step where the dynamic scale grows (once per ``loss_scale_window`` good
steps), DeepSpeed's fp16 optimizers update the scale before they unscale, so that step's gradients are
divided by 2S (and its logged norm halved), as in every DeepSpeed version that scales the loss itself.
"""

from __future__ import annotations

import sys

import torch

from zoo.training.grad_norm import current_loss_scale, let_deepspeed_count_every_tp_rank

_NOTED = "_zoo_noted_unscaled_fp16_backward"


def scale_deepspeed_leaves_out(engine) -> float | None:
    """The loss scale S if this engine's backward may leave it out (fp16 without ZeRO), else None."""
    if not engine.fp16_enabled() or engine.zero_optimization():
        return None
    scale = current_loss_scale(engine.optimizer)
    return scale if scale != 1.0 else None


def backward(engine, loss: torch.Tensor):
    """``engine.backward(loss)`` with the fp16 loss scale applied exactly once (see the module doc), and the
    gradients tagged so that DeepSpeed's clipping norm counts every TP rank
    (:func:`zoo.training.grad_norm.let_deepspeed_count_every_tp_rank`)."""
    result = _backward_scaled_once(engine, loss)
    let_deepspeed_count_every_tp_rank(engine)
    return result


def _backward_scaled_once(engine, loss: torch.Tensor):
    handle = hook_scale_once(engine, loss)
    try:
        return engine.backward(loss)
    finally:
        if handle is not None:
            handle.remove()


def hook_scale_once(engine, loss: torch.Tensor):
    """Register on ``loss`` the hook that multiplies the gradient reaching it by S only where DeepSpeed's backward
    left S out (see the module doc); returns its handle, or None where there is nothing to apply (bf16, fp32,
    ZeRO, a scale of 1, a loss without a graph). The first time the hook runs it notes, once, that zoo applied
    the scale (the one host synchronisation)."""
    scale = scale_deepspeed_leaves_out(engine)
    if scale is None or not loss.requires_grad:
        return None
    accumulation = engine.gradient_accumulation_steps()

    def apply_scale_once(grad: torch.Tensor) -> torch.Tensor:
        unscaled = ((grad * accumulation) - 1.0).abs() < 1e-3       # 1/g: DeepSpeed left the scale out
        note_once(engine, unscaled)
        return torch.where(unscaled, grad * scale, grad)

    return loss.register_hook(apply_scale_once)


class LossScaledOnce:
    """A pipeline module's ``loss_fn`` whose training losses carry the fp16 loss scale exactly once.

    DeepSpeed's pipeline engine computes each micro-batch's loss on the last stage with the module's
    ``loss_fn`` and runs its own ``backward`` on it, out of zoo's reach; this wrapper hooks every loss that has
    a graph as :func:`backward` does (:func:`hook_scale_once`). The scaled gradient then travels back through
    the stages, so every stage's gradients carry S once. Losses computed without a graph (``eval_batch``)
    are returned untouched."""

    def __init__(self, engine, loss_fn):
        self.engine, self.loss_fn = engine, loss_fn

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        loss = self.loss_fn(*args, **kwargs)
        hook_scale_once(self.engine, loss)
        return loss


def scale_pipeline_losses_once(engine) -> None:
    """Wrap the loss function of a DeepSpeed pipeline engine's module in :class:`LossScaledOnce` where the engine
    is fp16 without ZeRO (the optimizers that divide by a scale DeepSpeed's backward may leave out)."""
    module = engine.module
    if not engine.fp16_enabled() or engine.zero_optimization() or module.loss_fn is None:
        return
    if not isinstance(module.loss_fn, LossScaledOnce):
        module.loss_fn = LossScaledOnce(engine, module.loss_fn)


def note_once(engine, unscaled: torch.Tensor) -> None:
    """One line, from the first backward only, when zoo applied the scale; written by one rank of the stage that
    computes the loss (rank 0 without stages)."""
    if getattr(engine, _NOTED, False):
        return
    setattr(engine, _NOTED, True)
    if bool(unscaled.item()) and writes_notes(engine):
        import deepspeed  # local: deepspeed is loaded by the engine here; importing this module does not load it

        print(f"note: DeepSpeed {deepspeed.__version__} does not apply the fp16 loss scale in engine.backward at "
              f"ZeRO stage 0 (deepspeedai/DeepSpeed#8393); zoo applies it.", file=sys.stderr, flush=True)


def writes_notes(engine) -> bool:
    """Rank 0, or with pipeline stages the first DP and TP rank of the last stage (the ranks that hold a loss)."""
    if not hasattr(engine, "is_last_stage"):
        return engine.global_rank == 0
    grid = engine.grid
    return engine.is_last_stage() and grid.get_data_parallel_rank() == 0 and grid.get_slice_parallel_rank() == 0
