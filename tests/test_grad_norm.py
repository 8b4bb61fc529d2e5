"""zoo's gradient norm (zoo.training.grad_norm.global_grad_norm) sums fp32 squares per tensor and accumulates them
in float64: no float64 copy of a gradient is made (GPUs with slow fp64 would pay it on every element of every
step), fp64 gradients keep their precision, and S-scaled fp16 gradients (squares past fp16's 65,504) are exact.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

NORM_RTOL = 1e-6      # fp32 pairwise sums of a few thousand squares (seen: ~1e-8)
FP64_RTOL = 1e-12     # fp64 gradients summed in fp64: only summation order differs


class Float64Outputs(TorchDispatchMode):
    """Records the size of every float64 tensor an operation produces."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sizes += [t.numel() for t in tree_flatten(out)[0]
                       if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
        return out


def model_with_grads(dtype: torch.dtype, scale: float = 1.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48)).to(dtype)
    for param in model.parameters():
        param.grad = (torch.randn(param.shape, dtype=torch.float64) * scale).to(dtype)
    return model


def expected_norm(model: torch.nn.Module) -> float:
    return sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt().item()


def test_no_float64_copy_of_a_low_precision_gradient():
    from zoo.training.grad_norm import global_grad_norm

    for dtype, scale in ((torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.float16, 1e4)):   # 1e4: S-scaled, squares past 65,504
        model = model_with_grads(dtype, scale)
        with Float64Outputs() as seen:
            norm = global_grad_norm(model, None)
        # float64 only for the per-tensor sums (one element per gradient, stacked) and their total
        assert max(seen.sizes) <= len(list(model.parameters())), (dtype, seen.sizes)
        assert norm.dtype == torch.float64
        assert abs(norm.item() - expected_norm(model)) <= NORM_RTOL * expected_norm(model), (dtype, norm)


def test_fp64_gradients_keep_fp64_precision():
    from zoo.training.grad_norm import global_grad_norm

    model = model_with_grads(torch.float64)
    with torch.no_grad():
        model[0].weight.grad[0, 0] = 1.0          # a sum whose small terms fp32 would round away
        model[0].weight.grad[1:] *= 1e-5
    norm = global_grad_norm(model, None).item()
    assert abs(norm - expected_norm(model)) <= FP64_RTOL * expected_norm(model), norm
