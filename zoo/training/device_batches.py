"""Host batches on their way to the device: pinned where there is an accelerator to copy them to
(:func:`pin_memory_here`), copied without blocking the host (:func:`to_device`)."""

from __future__ import annotations

import torch


def pin_memory_here() -> bool:
    """Pinned host batches when there is an accelerator to copy them to (never on a CPU run)."""
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import

    return get_accelerator().device_name() != "cpu"


def to_device(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """The device copy of a host batch, queued without blocking the host (the source is pinned by the
    DataLoader on an accelerator; torch copies a pageable source synchronously)."""
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


__all__ = ["pin_memory_here", "to_device"]
