"""Bytes of tensors as torch makes them, for memory claims that hold on any device: the peak of the live
tensors that ops create (a TorchDispatchMode that follows each new storage until it is freed) and the
tensors saved for backward (saved_tensors_hooks).

What is seen: every op's outputs, in forward and in backward (the autograd engine runs a CPU graph's
backward in the calling thread, under the same mode). What is not: a kernel's internal scratch that never
becomes an op's output.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Within the block, ``now`` and ``peak`` are the bytes of the storages of a dtype in ``dtypes`` that ops
    allocated inside the block and that are still alive. A storage an op only views or writes into (one of
    its inputs, an ``out=`` argument) is not new, so tensors made before the block never count."""

    def __init__(self, dtypes):
        super().__init__()
        self.dtypes = frozenset(dtypes)
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype in self.dtypes:
                storage = t.untyped_storage()
                if storage._cdata not in inputs and storage._cdata not in self.live:
                    self._allocated(storage)
        return out

    def _allocated(self, storage) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        self.live[key] = nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


@contextlib.contextmanager
def saved_tensor_bytes(*existing: torch.Tensor):
    """Within the block, the yielded list receives (dtype, bytes) of each storage saved for backward, once
    per storage, leaving out those of ``existing`` (e.g. the function's input, which is saved by reference)."""
    skip = {t.untyped_storage()._cdata for t in existing}
    seen: set[int] = set()
    record: list[tuple[torch.dtype, int]] = []

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in skip and storage._cdata not in seen:
            seen.add(storage._cdata)
            record.append((t.dtype, storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield record
