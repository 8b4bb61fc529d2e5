"""Pipeline stages that start from the one-stage model's weights: each stage draws its entries' random
init as the one-stage model draws them, whatever stage it is and whatever tp it runs at.

A family's one-stage model draws its parameters from the seed entry by entry, in the order of its pipeline
entries (GPT-2: wte, wpe, layer 0, 1, ...; Llama: embed_tokens, layer 0, 1, ...). A stage builds only
its own entries, so :class:`InitReplay` builds and drops the entries before each one it builds, which
consumes their draws. Every entry calls :func:`announce` at the start of its construction with its index.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zoo.parallel.state import ParallelState

__all__ = ["InitReplay", "announce"]


class InitReplay:
    """Replays the one-stage draw order for a family's pipeline entries.

    ``entry_class(index, config)`` is the module class of entry ``index`` (built as
    ``cls(config, parallel, index, replay)``); ``draw_index(index)`` is the position whose draws entry
    ``index`` repeats (the identity, or for a head tied to the embedding the embedding's position).
    :meth:`before` reseeds the default generators where the draw order restarts (a first build, a position
    at or below the last one built: DeepSpeed's counting pass before the real build, a second module, a tied
    head) and builds and drops the entries between the last one built and this one."""

    def __init__(self, config: Any, parallel: ParallelState, seed: int,
                 entry_class: Callable[[int, Any], type[nn.Module]],
                 draw_index: Callable[[int], int] = lambda index: index):
        self.config, self.parallel, self.seed = config, parallel, seed
        self.entry_class, self.draw_index = entry_class, draw_index
        self.next_index: int | None = None
        self.replaying = False

    def before(self, index: int) -> None:
        if self.replaying:
            return
        target = self.draw_index(index)
        if self.next_index is None or target < self.next_index:
            self.reseed()
            self.next_index = 0
        with self.replay():
            for skipped in range(self.next_index, target):
                self.entry_class(skipped, self.config)(self.config, self.parallel, skipped, self)   # drawn, dropped
        self.next_index = target + 1

    def reseed(self) -> None:
        from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import

        torch.manual_seed(self.seed)
        get_accelerator().manual_seed(self.seed)

    @contextlib.contextmanager
    def replay(self):
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False


def announce(replay: InitReplay | None, index: int) -> None:
    """Entry ``index`` is about to draw its parameters (no-op without a replay)."""
    if replay is not None:
        replay.before(index)
