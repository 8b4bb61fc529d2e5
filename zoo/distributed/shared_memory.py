"""The shared-memory workspaces of DeepSpeed's CPU all-reduce, which DeepSpeed never removes."""

from __future__ import annotations

import os

import torch.distributed as dist

SHM_BUFFER_DIR = "/dev/shm"


def shared_memory_buffer_path(rank: int) -> str:
    """Where DeepSpeed's CPU shared-memory all-reduce (``deepspeed/ops/csrc/cpu/comm/shm.cpp``) keeps the
    workspace of ``rank`` of this job: named after the user, ``MASTER_ADDR`` and ``MASTER_PORT``."""
    return (f"{SHM_BUFFER_DIR}/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def unlink_shared_memory_buffer() -> None:
    """Collective on CPU, right after joining: remove the name of this rank's shared-memory workspace.

    DeepSpeed creates one ~66 MB workspace per rank in ``/dev/shm`` when all ranks share a host and never
    removes it, so every CPU job leaves its workspaces in memory until the machine reboots (a few hundred
    runs fill a 24 GB tmpfs). Once every rank has mapped every peer's workspace (the barrier: DeepSpeed
    opens them all during initialisation and never again), each rank unlinks its own name; the mappings
    stay valid, and the kernel frees the memory when the last process exits, also after a crash."""
    if not dist.is_initialized():
        return
    dist.barrier()
    try:
        os.unlink(shared_memory_buffer_path(dist.get_rank()))
    except FileNotFoundError:          # DeepSpeed's op not built, or the ranks span several hosts
        pass
