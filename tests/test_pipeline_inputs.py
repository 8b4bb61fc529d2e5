"""The pipeline engine's micro-batches reach it on the engine's device (zoo.training.pipeline.stage_pairs): from
the host to an accelerator through pinned memory without blocking, every copy queued before the 1F1B schedule
starts (DeepSpeed's own load of a host tensor is a blocking copy per micro-batch). This machine has no
accelerator: the "meta" device stands in for one, and the pinning is DeepSpeed's accelerator's, recorded.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class TensorMoves(TorchFunctionMode):
    """Records the keyword arguments of every ``Tensor.to``."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            self.calls.append(dict(kwargs or {}))
        return func(*args, **(kwargs or {}))


def micro_batches(count: int = 3) -> list[dict[str, torch.Tensor]]:
    ids = torch.arange(count * 8).view(count, 2, 4)
    return [{"input_ids": micro, "labels": micro + 1} for micro in ids]


def test_micro_batches_reach_an_accelerator_pinned_and_without_blocking(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    from zoo.training.pipeline import stage_pairs

    pinned = []

    def pin_memory(tensor, *args, **kwargs):
        pinned.append(tensor)
        return tensor

    monkeypatch.setattr(get_accelerator(), "pin_memory", pin_memory)
    batches = micro_batches()
    with TensorMoves() as moves:
        pairs = list(stage_pairs(batches, torch.device("meta")))
    assert len(pairs) == len(batches)
    assert all(t.device.type == "meta" for pair in pairs for t in pair)
    assert [tuple(t.shape) for pair in pairs for t in pair] == [(2, 4)] * 2 * len(batches)
    assert len(pinned) == 2 * len(batches)                              # inputs and labels of every micro-batch
    assert len(moves.calls) == 2 * len(batches) and all(call.get("non_blocking") for call in moves.calls)


def test_micro_batches_already_on_the_device_are_handed_on_as_they_are():
    from zoo.training.pipeline import stage_pairs

    batches = micro_batches()
    pairs = list(stage_pairs(batches, torch.device("cpu")))
    for (inputs, labels), batch in zip(pairs, batches):
        assert inputs is batch["input_ids"] and labels is batch["labels"]
