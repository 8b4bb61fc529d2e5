"""The tensor-parallel sum of one host's CPU ranks through DeepSpeed's shared-memory all-reduce.

gloo sums over loopback TCP. Between two ranks of this 2-core machine it takes 4.4 ms for 4 MiB of fp32
(the activation of the GPT-2 step benchmark), against 0.94 ms for DeepSpeed's shared-memory kernel
(``deepspeed/ops/csrc/cpu/comm/shm.cpp``, which DeepSpeed's CPU inference uses), with bitwise the same
sums. The kernel is used only where it is exact and safe:

- DeepSpeed's backend was created when zoo joined this very group (:func:`adopt_deepspeed_kernel`,
  called by ``zoo.distributed.join_process_group``): the kernel is set up once per process, for the
  world of that moment, and outlives the group;
- every rank of the job was on this host then (``LOCAL_SIZE`` equal to the world size, as the deepspeed
  launcher sets it; the kernel has no workspace otherwise), with at least one core per rank (the kernel
  waits for its peers by spinning, with no timeout: a rank that dies leaves the others spinning, where
  gloo would end the job at its timeout);
- fewer than 2 GiB (the kernel counts bytes in an int);
- the group is the whole world: the kernel sums over all ranks, whatever group it is handed;
- a contiguous CPU tensor, float32 on a CPU with AVX2, or bf16/fp16 with AVX-512BW (DeepSpeed's own
  guard): the kernel silently returns any other dtype unreduced.

Everything else (NCCL on GPUs, dp > 1, several hosts, the spawn harness of the tests, which never sets
``LOCAL_SIZE``) goes to ``torch.distributed.all_reduce``, looked up at call time so the tests can
count the calls.

Inside a region ``torch.compile`` traces (a compiled transformer block, :mod:`zoo.models.compiled`) the sum is
torch's functional all-reduce (``torch.distributed._functional_collectives``), which Dynamo records in the graph
as ``_c10d_functional.all_reduce`` plus a ``wait_tensor`` on any backend (NCCL, gloo): the process-group call's
``async_op=True`` and ``Work.wait()`` would each break the graph, and the shared-memory kernel is not traced.
The compiler then schedules the wait, so the overlap written by hand below is its business there.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

_KERNEL_LEVEL_NEEDED = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}
_KERNEL_MAX_BYTES = 2 ** 31 - 1      # the kernel counts bytes in an int: larger tensors come back unreduced
_ADOPTED = "_zoo_shared_memory_world"


def _deepspeed_backend():
    comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(comm, "cdb", None)


def _deepspeed_kernel_level() -> int:
    """DeepSpeed's vector level of its initialised shared-memory kernel (0: none in this process)."""
    backend = _deepspeed_backend()
    if backend is None or getattr(backend, "shm_comm_op", None) is None:
        return 0
    if not (hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")):
        return 0
    return int(getattr(backend, "shm_vector_kernel_level", 0) or 0)


def deepspeed_backend_exists() -> bool:
    return _deepspeed_backend() is not None


def adopt_deepspeed_kernel(backend_created_now: bool) -> bool:
    """Right after ``deepspeed.init_distributed``: remember this world's group on DeepSpeed's backend if
    its kernel was set up for it, and return whether it was. The kernel is set up once per process, when
    DeepSpeed creates its backend, for the world and ``LOCAL_SIZE`` of that moment, and it survives
    ``destroy_process_group``: a backend made earlier (a group destroyed and joined again) is never
    adopted, and the sums stay on torch.distributed. The kernel also waits for its peers by spinning,
    with no timeout: it is not adopted when the host has fewer cores than ranks."""
    backend = _deepspeed_backend()
    if backend is None:
        return False
    world = dist.get_world_size()
    usable = (backend_created_now and world >= 2 and os.environ.get("LOCAL_SIZE") == str(world)
              and world <= (os.cpu_count() or 1) and _deepspeed_kernel_level() >= 1)
    setattr(backend, _ADOPTED, dist.group.WORLD if usable else None)
    return usable


def shared_memory_all_reduce_applies(tensor: torch.Tensor, group) -> bool:
    """Whether the TP sum of ``tensor`` over ``group`` may go through DeepSpeed's kernel (module doc).
    Every rank reaches the same answer: the adopted group and the tensor's properties are the same on
    all of them."""
    needed = _KERNEL_LEVEL_NEEDED.get(tensor.dtype)
    if needed is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    if tensor.numel() * tensor.element_size() > _KERNEL_MAX_BYTES:
        return False
    backend = _deepspeed_backend()
    if backend is None or getattr(backend, _ADOPTED, None) is not dist.group.WORLD:
        return False
    if dist.get_world_size(group) != dist.get_world_size():
        return False
    return _deepspeed_kernel_level() >= needed


def tp_all_reduce_(tensor: torch.Tensor, group) -> None:
    """Sum ``tensor`` over ``group`` in place."""
    if torch.compiler.is_compiling():
        tensor.copy_(funcol.all_reduce(tensor, "sum", group))
        return
    if shared_memory_all_reduce_applies(tensor, group):
        torch.ops.deepspeed.inference_all_reduce_(tensor)
    else:
        dist.all_reduce(tensor, group=group)


class Done:
    """The handle of a sum that already happened."""

    def wait(self) -> None:
        return None


def start_tp_all_reduce_(tensor: torch.Tensor, group):
    """Start summing ``tensor`` over ``group`` in place; returns a handle whose ``wait()`` ends it. The
    shared-memory kernel is synchronous, and at 1/5 of gloo's time it costs less done at once than gloo
    does overlapped with the caller's next GEMM. Under ``torch.compile`` the sum is issued at once (functional,
    see the module docstring) and the handle is already done."""
    if torch.compiler.is_compiling():
        tp_all_reduce_(tensor, group)
        return Done()
    if shared_memory_all_reduce_applies(tensor, group):
        torch.ops.deepspeed.inference_all_reduce_(tensor)
        return Done()
    return dist.all_reduce(tensor, group=group, async_op=True)
