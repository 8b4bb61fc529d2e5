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
    scale = scale_deepspeed_leaves_out(engine)
    if scale is None or not loss.requires_grad:
        return engine.backward(loss)
    accumulation = engine.gradient_accumulation_steps()
    applied = []

    def apply_scale_once(grad: torch.Tensor) -> torch.Tensor:
        unscaled = ((grad * accumulation) - 1.0).abs() < 1e-3       # 1/g: DeepSpeed left the scale out
        applied.append(unscaled)
        return torch.where(unscaled, grad * scale, grad)

    handle = loss.register_hook(apply_scale_once)
    try:
        result = engine.backward(loss)
    finally:
        handle.remove()
    note_once(engine, applied)
    return result


def note_once(engine, applied: list[torch.Tensor]) -> None:
    """One line, on the first backward only (the one host synchronisation), when zoo applied the scale."""
    if getattr(engine, _NOTED, False) or not applied:
        return
    setattr(engine, _NOTED, True)
    if bool(applied[0].item()) and engine.global_rank == 0:
        import deepspeed  # local: deepspeed is loaded by the engine here; importing this module does not load it

        print(f"note: DeepSpeed {deepspeed.__version__} does not apply the fp16 loss scale in engine.backward at "
              f"ZeRO stage 0 (deepspeedai/DeepSpeed#8393); zoo applies it.", file=sys.stderr, flush=True)
