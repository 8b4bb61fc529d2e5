"""On one host's CPU ranks, the TP sums go through DeepSpeed's shared-memory kernel when DeepSpeed joined
the group (zoo.parallel.host_all_reduce): the same values as gloo, bit for bit at two ranks, and none of
the activation-sized all-reduces left on gloo. Where the kernel would be wrong (a dtype it skips, a group
smaller than the world, 2 GiB or more, a group joined again after the kernel was set up for an earlier
one: a hang, seen) the sum stays on torch.distributed."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.checks import record_collectives
from tests.spawn import free_port, spawn
from zoo.distributed import join_deepspeed
from zoo.models import GPT2LMHeadModel, gpt2_config
from zoo.parallel import ParallelState, model_parallel_seed
from zoo.parallel.host_all_reduce import _deepspeed_kernel_level, shared_memory_all_reduce_applies

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    with record_collectives() as calls:
        output = model(input_ids=ids, labels=ids, gather_output=True)
        output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    summed = [numel for name, numel, op in calls if name == "all_reduce" and op == "SUM"]
    return output.logits.detach(), output.loss.detach(), grads, summed


def _kernel_worker(rank, world_size):
    os.environ["LOCAL_SIZE"] = str(world_size)         # as the deepspeed launcher sets it
    join_deepspeed(dist_backend="gloo")                 # adopts the harness's group, builds the kernel
    ps = ParallelState.initialize(world_size)
    out = {"kernel level": _deepspeed_kernel_level(),
           "applies fp32": shared_memory_all_reduce_applies(torch.zeros(4), ps.tp_group),
           "applies fp64": shared_memory_all_reduce_applies(torch.zeros(4, dtype=torch.float64), ps.tp_group),
           "applies strided": shared_memory_all_reduce_applies(torch.zeros(4, 2).t(), ps.tp_group),
           "applies 2 GiB": shared_memory_all_reduce_applies(torch.empty(2 ** 29), ps.tp_group),   # never touched
           "applies rank-1 group": shared_memory_all_reduce_applies(
               torch.zeros(4), dist.new_group([rank], use_local_synchronization=True))}
    model_parallel_seed(3, ps)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", **NO_DROPOUT), parallel=ps)
    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    kernel = _step(model, ids)
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()                          # joined again: the kernel was set up for the old group
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port[0]}", rank=rank, world_size=world_size)
    join_deepspeed(dist_backend="gloo")
    ps = ParallelState.initialize(world_size)
    model_parallel_seed(3, ps)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", **NO_DROPOUT), parallel=ps)   # the same weights
    out["applies after joining again"] = shared_memory_all_reduce_applies(torch.zeros(4), ps.tp_group)
    gloo = _step(model, ids)
    out["logits equal"] = torch.equal(kernel[0], gloo[0])
    out["loss equal"] = torch.equal(kernel[1], gloo[1])
    out["grads equal"] = [name for name in gloo[2] if not torch.equal(kernel[2][name], gloo[2][name])] == []
    out["gloo sums with the kernel"], out["gloo sums without"] = kernel[3], gloo[3]
    out["activation numel"] = 2 * 32 * model.config.n_embd
    return out


def test_the_shared_memory_kernel_gives_gloos_sums_and_takes_the_activation_all_reduces():
    outs = spawn(_kernel_worker, 2)
    for out in outs:
        assert not out["applies fp64"] and not out["applies strided"] and not out["applies 2 GiB"], out
        assert not out["applies rank-1 group"] and not out["applies after joining again"], out
        assert out["gloo sums without"].count(out["activation numel"]) >= 4, out   # g forward, f backward, per layer
    if any(out["kernel level"] < 1 for out in outs):
        for out in outs:              # the guard keeps every sum on gloo
            assert not out["applies fp32"] and out["gloo sums with the kernel"] == out["gloo sums without"], out
        pytest.skip("DeepSpeed's shared-memory kernel is not built here (or the CPU lacks AVX2): both runs sum "
                    "on gloo, so comparing their values could not fail")
    for out in outs:
        assert out["applies fp32"] and out["activation numel"] not in out["gloo sums with the kernel"], out
        assert out["logits equal"] and out["loss equal"] and out["grads equal"], out
