"""The tensor-parallel sum of one host's CPU ranks through DeepSpeed's shared-memory all-reduce.

gloo sums over loopback TCP. Between two ranks of this 2-core machine it takes 4.4 ms for 4 MiB of fp32
(the activation of the GPT-2 step benchmark), against 0.94 ms for DeepSpeed's shared-memory kernel
(``deepspeed/ops/csrc/cpu/comm/shm.cpp``, which DeepSpeed's CPU inference uses), with bitwise the same
sums. The kernel is used only where it is exact and safe:

- DeepSpeed joined the process group (``deepspeed.init_distributed``, as every zoo job does): its
  communication backend built the kernel and gave it its workspaces;
- every rank of the job is on this host (``LOCAL_SIZE`` equals the world size, as the deepspeed
  launcher sets it): the kernel has no workspace otherwise;
- the group is the whole world: the kernel sums over all ranks, whatever group it is handed;
- a contiguous CPU tensor, float32 on a CPU with AVX2, or bf16/fp16 with AVX-512BW (DeepSpeed's own
  guard): the kernel silently returns any other dtype unreduced.

Everything else (NCCL on GPUs, dp > 1, several hosts, the spawn harness of the tests, which never sets
``LOCAL_SIZE``) goes to ``torch.distributed.all_reduce``, looked up at call time so the tests can
count the calls.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

_KERNEL_LEVEL_NEEDED = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}


def _deepspeed_kernel_level() -> int:
    """DeepSpeed's vector level of its initialised shared-memory kernel (0: none in this process)."""
    comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(comm, "cdb", None)
    if backend is None or getattr(backend, "shm_comm_op", None) is None:
        return 0
    if not (hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")):
        return 0
    return int(getattr(backend, "shm_vector_kernel_level", 0) or 0)


def shared_memory_all_reduce_applies(tensor: torch.Tensor, group) -> bool:
    """Whether the TP sum of ``tensor`` over ``group`` may go through DeepSpeed's kernel (module doc).
    Every rank reaches the same answer: each condition is the same on all of them."""
    needed = _KERNEL_LEVEL_NEEDED.get(tensor.dtype)
    if needed is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    world = dist.get_world_size()
    if world < 2 or dist.get_world_size(group) != world or os.environ.get("LOCAL_SIZE") != str(world):
        return False
    return _deepspeed_kernel_level() >= needed


def tp_all_reduce_(tensor: torch.Tensor, group) -> None:
    """Sum ``tensor`` over ``group`` in place."""
    if shared_memory_all_reduce_applies(tensor, group):
        torch.ops.deepspeed.inference_all_reduce_(tensor)
    else:
        dist.all_reduce(tensor, group=group)


class _Done:
    """The handle of a sum that already happened."""

    def wait(self) -> None:
        return None


def start_tp_all_reduce_(tensor: torch.Tensor, group):
    """Start summing ``tensor`` over ``group`` in place; returns a handle whose ``wait()`` ends it. The
    shared-memory kernel is synchronous, and at 1/5 of gloo's time it costs less done at once than gloo
    does overlapped with the caller's next GEMM."""
    if shared_memory_all_reduce_applies(tensor, group):
        torch.ops.deepspeed.inference_all_reduce_(tensor)
        return _Done()
    return dist.all_reduce(tensor, group=group, async_op=True)
