"""Writing a DeepSpeed training checkpoint of a zoo run: every rank's files, then the ``latest`` pointer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from zoo.atomic import write_text_atomic

__all__ = ["save_checkpoint"]


def save_checkpoint(engine, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
    """DeepSpeed checkpoint under ``directory/tag``; ``latest`` is replaced atomically only after every
    rank has finished writing, so a crash mid-save leaves the previous checkpoint as ``latest``."""
    engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        write_text_atomic(directory / "latest", tag, fsync=True)
    dist.barrier()
