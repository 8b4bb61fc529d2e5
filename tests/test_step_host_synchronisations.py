"""The training step's host synchronisations do not grow with the model (zoo.training.lean_step).

Each synchronisation of a step drains the accelerator's queue; DeepSpeed's own non-finite check of its fp16
optimizers takes one per gradient tensor (hundreds a step on a GPT-2 of 1.2B). The test counts the step's
tensor -> Python conversions (``.item()``, ``bool()``, ``float()``, ``int()``, ``__index__``, ``format``,
``.tolist()``, ``.numpy()``, ``.cpu()``, and ``torch.tensor`` of a list holding tensors), which are what makes the
host wait for the device on an accelerator, with a ``TorchFunctionMode`` over a whole iteration (two micro-batches
through zoo's backward, two ``engine.step()``), on a GPT-2 of 2 and of 8 layers built through zoo's
``setup_engine``: fp16 with FP16_Optimizer (DeepSpeed's fused Adam), fp16 with FP16_UnfusedOptimizer
(``torch_adam``), and bf16 as a ``tp*.json --bf16`` run configures it (a bf16 config that asks bf16 accumulation
runs the same two fp16 optimizers, in bf16, with the same check). Left out: torch Adam's ``.item()`` of its step counter, a
tensor torch keeps on the host (``capturable=False``), so it never waits for a device.

Each case also checks that the check still answers as DeepSpeed's: an inf in one gradient (of one TP rank at
tp = 2) skips the step on every rank and, in fp16, halves the loss scale.

fp16 on this CPU: DeepSpeed refuses it by a capability check although torch computes fp16 here; overriding the
check runs DeepSpeed's real fp16 optimizers (DESIGN.md, "fp16 on CPU").
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.spawn import spawn

CONVERSIONS = {"item", "__bool__", "__float__", "__int__", "__index__", "__format__", "tolist", "numpy", "cpu"}
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LAYERS = (2, 8)
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1}   # the first overflow halves S
PRECISIONS = {
    "fp16-fused": ({"fp16": FP16}, {}),
    "fp16-unfused": ({"fp16": FP16}, {"torch_adam": True}),
    "bf16": ({"bf16": {"enabled": True}}, {"torch_adam": True}),
}
# Conversions per iteration, seen: 4 (fp16-fused), 5 (fp16-unfused), 2 (bf16: BF16_Optimizer's norm check and
# clip) at 2 and 8 layers alike (the one check, and DeepSpeed's norm: one or two per parameter group, of which there
# are two). With DeepSpeed's own check and bf16 accumulation they are 32 -> 104, 33 -> 105 and 33 -> 105 from 2 to 8
# layers. The bound leaves room for a DeepSpeed that adds a conversion or two, never for one per tensor.
MOST_PER_ITERATION = 8


class HostConversions(TorchFunctionMode):
    """Counts tensor -> Python conversions (the module doc), except of the tensors in ``on_host``."""

    def __init__(self, on_host=()):
        super().__init__()
        self.on_host = {id(t) for t in on_host}
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if name in CONVERSIONS and not (torch.is_tensor(first) and id(first) in self.on_host):
            self.count += 1
        elif name in ("tensor", "as_tensor") and isinstance(first, (list, tuple)) and any(map(torch.is_tensor, first)):
            self.count += 1
        return func(*args, **(kwargs or {}))


def check_the_counter() -> None:
    """Each kind of conversion counts once; a host tensor named as such does not."""
    x, kept = torch.tensor(2.0), torch.tensor(3.0)
    kinds = [lambda: x.item(), lambda: bool(x), lambda: float(x), lambda: int(x), lambda: [0, 1, 2][x.long()],
             lambda: f"{x:.1f}", lambda: x.tolist(), lambda: x.numpy(), lambda: x.cpu(), lambda: torch.tensor([x])]
    for kind in kinds:
        with HostConversions() as counter:
            kind()
        assert counter.count == 1, kind
    with HostConversions([kept]) as counter:
        kept.item()
    assert counter.count == 0


def adam_step_counters(optimizer) -> list[torch.Tensor]:
    """The step counters of the torch optimizer inside DeepSpeed's wrapper(s)."""
    found = []
    while optimizer is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            found += [state["step"] for state in optimizer.state.values() if torch.is_tensor(state.get("step"))]
        optimizer = getattr(optimizer, "optimizer", None)
    return found


def iteration(engine, ids, rank, world_size, poison: bool = False) -> None:
    """Two micro-batches through zoo's backward and two ``engine.step()``; ``poison``: the second micro-batch's
    gradients non-finite (one rank alone: all of them; at tp = 2 one element of rank 0's first gradient)."""
    from zoo.training.loss_scaling import backward

    for micro_step in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        poisoned = poison and micro_step == 1
        backward(engine, loss * float("inf") if poisoned and world_size == 1 else loss)
        if poisoned and world_size > 1 and rank == 0:
            next(p for p in engine.module.parameters() if p.grad is not None).grad.view(-1)[0] = float("inf")
        engine.step()


def _conversions_per_iteration(rank, world_size, precision):
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from zoo.models import GPT2LMHeadModel, gpt2_config
    from zoo.parallel import ParallelState, model_parallel_seed
    from zoo.training.grad_norm import current_loss_scale
    from zoo.training.startup import setup_engine

    gc.freeze()   # DeepSpeed's BF16_Optimizer runs gc.collect() nine times as it starts: over a frozen heap it is quick
    check_the_counter()
    get_accelerator().is_fp16_supported = lambda: True   # see the module doc
    deepspeed.init_distributed()
    parallel = ParallelState.initialize(world_size)
    blocks, adam = PRECISIONS[precision]
    out = {}
    for layers in LAYERS:
        model_parallel_seed(0, parallel)
        model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", n_layer=layers, vocab_size=512, **NO_DROPOUT),
                                parallel=parallel)
        config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                  "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **adam}},
                  **blocks}
        engine = setup_engine(model, config, parallel, weight_decay=0.01, refresh_masters=False)
        ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))

        iteration(engine, ids, rank, world_size)   # the first step builds Adam's state and DeepSpeed's norm masks
        with HostConversions(adam_step_counters(engine.optimizer)) as counter:
            iteration(engine, ids, rank, world_size)
        scale, skipped = current_loss_scale(engine.optimizer), engine.skipped_steps
        iteration(engine, ids, rank, world_size, poison=True)
        out[layers] = {"conversions": counter.count, "optimizer": type(engine.optimizer).__name__,
                       "skipped": engine.skipped_steps - skipped, "scale ratio": current_loss_scale(engine.optimizer) / scale}
    return out


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_host_synchronisations_per_iteration_do_not_grow_with_the_layers(precision):
    (out,) = spawn(_conversions_per_iteration, 1, precision)
    counts = {layers: out[layers]["conversions"] for layers in LAYERS}
    assert counts[2] == counts[8] <= MOST_PER_ITERATION, out
    expected = {"fp16-fused": "FP16_Optimizer", "bf16": "BF16_Optimizer"}.get(precision, "FP16_UnfusedOptimizer")
    for layers in LAYERS:
        assert out[layers]["optimizer"] == expected, out
        assert out[layers]["skipped"] == 1, out     # the inf is found: the step is skipped
        assert out[layers]["scale ratio"] == (0.5 if precision.startswith("fp16") else 1.0), out


def test_an_inf_on_one_tp_rank_skips_the_step_on_both_with_one_check_at_tp2():
    """tp = 2: the check agrees over the TP group (an inf in rank 0's gradient skips rank 1's step too, and both
    halve the scale), and its conversions do not grow with the layers either."""
    for out in spawn(_conversions_per_iteration, 2, "fp16-unfused"):
        assert out[2]["conversions"] == out[8]["conversions"] <= MOST_PER_ITERATION, out
        assert all(out[layers]["skipped"] == 1 and out[layers]["scale ratio"] == 0.5 for layers in LAYERS), out
