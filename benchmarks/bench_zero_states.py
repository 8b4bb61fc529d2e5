"""Bytes per parameter that DeepSpeed's ZeRO stage 1 and 2 optimizer really holds, against two formulas.

zoo's planner (zoo.planning.model_states.state_bytes) and DeepSpeed's own estimator
(``deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs``) disagree about ZeRO's
model states. This script runs two real training steps of a small GPT-2 at dp=2 on CPU (gloo, bf16, the
torch Adam) per ZeRO stage and takes, on every rank, an inventory of every live tensor (all tensors the
garbage collector knows of, de-duplicated by storage) at three points of the second step:

* ``after backward``: the gradients are reduced, before ``engine.step()``;
* ``in step``: inside the wrapped Adam's ``step`` (a pre-step hook), when the fp32 master partition, its
  fp32 gradient and both Adam moments are alive together: the step's peak of model states;
* ``after step``: ``engine.step()`` returned.

Each storage is named by what holds it: the module's parameters, their ``.grad``, the Adam moments, the
fp32 master partition and its ``.grad``, or the ZeRO optimizer attribute that holds it (e.g.
``averaged_gradients``, ``ipg_buffer``); the rest is "other" (the batch, the model's buffers, DeepSpeed's
communication buffers). Bucket-sized buffers (``ipg_buffer``, ...) do not grow with the model and are
set small here (``--bucket``); they are printed, and left out of the per-parameter figure.

    .venv/bin/python benchmarks/bench_zero_states.py [--layers 4] [--hidden 256] [--bucket 1000000]

Prints a table to stdout (DeepSpeed's log lines go to stderr); nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import sys
from collections import defaultdict

import torch
import torch.multiprocessing as mp

BUCKET_ATTRIBUTES = ("ipg_buffer", "ipg_bucket", "extra_large_param_to_reduce")
POINTS = ("after backward", "in step", "after step")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tensors_in(value, depth: int = 0):
    """The tensors in ``value`` and in the lists, tuples and dicts it holds (4 levels deep)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth + 1)


def storage_key(tensor: torch.Tensor) -> tuple[int, int] | None:
    storage = tensor.untyped_storage()
    if tensor.device.type == "meta" or storage.nbytes() == 0:
        return None
    return storage.data_ptr(), storage.nbytes()


def inventory(engine) -> dict[str, int]:
    """Bytes of every live tensor storage, by the first holder that names it."""
    zero = engine.optimizer
    basic = zero.optimizer
    named: list[tuple[str, torch.Tensor]] = []
    named += [("module weights", p) for p in engine.module.parameters()]
    named += [("module param.grad", p.grad) for p in engine.module.parameters() if p.grad is not None]
    named += [("fp32 master partition", t) for t in tensors_in(zero.single_partition_of_fp32_groups)]
    named += [("fp32 gradient partition", t.grad) for t in zero.single_partition_of_fp32_groups if t.grad is not None]
    named += [("Adam moments", t) for state in basic.state.values() for t in tensors_in(state) if t.numel() > 1]
    for name, value in sorted(vars(zero).items()):
        label = f"bucket: {name}" if name in BUCKET_ATTRIBUTES else f"zero.{name}"
        named += [(label, t) for t in tensors_in(value)]
    sizes: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for label, tensor in named:
        key = storage_key(tensor)
        if key is None or key[0] in seen:
            continue
        seen.add(key[0])
        sizes[label] += key[1]
    gc.collect()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            key = storage_key(obj)
            if key is not None and key[0] not in seen:
                seen.add(key[0])
                sizes["other"] += key[1]
    return dict(sizes)


def model_states(sizes: dict[str, int]) -> int:
    """The bytes that grow with the model: all but the buckets and the unnamed rest."""
    return sum(n for label, n in sizes.items() if not label.startswith("bucket") and label != "other")


def rank_worker(rank: int, world: int, port: int, stage: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    torch.set_num_threads(1)
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed

        from zoo.models import GPT2LMHeadModel, gpt2_config
        from zoo.models.families import param_groups
        from zoo.parallel import ParallelState, model_parallel_seed

        deepspeed.init_distributed(dist_backend="gloo")
        ps = ParallelState.initialize(1)
        model_parallel_seed(0, ps)
        model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", n_layer=args.layers, n_embd=args.hidden, n_head=4,
                                            vocab_size=args.vocab,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), parallel=ps)
        params = sum(p.numel() for p in model.parameters())
        config = {"train_batch_size": 2 * world * args.accumulation, "train_micro_batch_size_per_gpu": 2,
                  "steps_per_print": 10 ** 9, "bf16": {"enabled": args.dtype == "bf16"}, "gradient_clipping": 1.0,
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket,
                                        "allgather_bucket_size": args.bucket},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.01),
                                               config=config, mpu=ps)
        seen: dict[str, dict[str, int]] = {}
        step = {"n": 0}

        def in_step(optimizer, *_):       # once per parameter group: keep the fullest
            if step["n"] == 1:
                sizes = inventory(engine)
                if model_states(sizes) >= model_states(seen.get("in step", {})):
                    seen["in step"] = sizes

        engine.optimizer.optimizer.register_step_pre_hook(in_step)
        ids = torch.randint(0, args.vocab, (2, 64), generator=torch.Generator().manual_seed(rank))
        for n in range(2):
            step["n"] = n
            for _ in range(args.accumulation):
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                if n == 1:
                    seen["after backward"] = inventory(engine)   # the last micro-batch's is kept
                engine.step()
        seen["after step"] = inventory(engine)
    results.put((rank, type(engine.optimizer).__name__, params, seen))


def measure(stage: int, args) -> tuple[str, int, dict[str, dict[str, int]]]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=rank_worker, args=(rank, args.dp, port, stage, args, results))
             for rank in range(args.dp)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise SystemExit(f"a rank of the ZeRO-{stage} run failed (exit {proc.exitcode}); see stderr")
    outcomes = sorted((results.get() for _ in procs), key=lambda outcome: outcome[0])
    return outcomes


def deepspeed_zero2_estimate(params: int, dp: int) -> int:
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    return estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=dp, cpu_offload=False)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024,
                        help="small, so that no one parameter (the embedding) dominates a partition")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (processes)")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--bucket", type=int, default=1_000_000, help="reduce/allgather bucket size (elements)")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from zoo.planning.model_states import state_bytes

    dp = args.dp
    print(f"GPT-2 ({args.layers} layers, hidden {args.hidden}, vocab {args.vocab}), {args.dtype}, torch Adam, dp={dp}, "
          f"{args.accumulation} micro-batch(es) per step, buckets {args.bucket:,} elements; live tensor storages in bytes per parameter (by holder: rank 0)")
    for stage in (1, 2):
        outcomes = measure(stage, args)
        _, optimizer_name, params, seen = outcomes[0]
        labels = sorted({label for sizes in seen.values() for label in sizes})
        print(f"\nZeRO stage {stage} ({optimizer_name}), {params:,} parameters")
        print(f"  {'holder':34}" + "".join(f"{point:>16}" for point in POINTS))
        for label in labels:
            print(f"  {label:34}" + "".join(f"{seen[point].get(label, 0) / params:16.3f}" for point in POINTS))
        for rank, _, _, rank_seen in outcomes:
            print(f"  {f'model states, rank {rank}':34}"
                  + "".join(f"{model_states(rank_seen[point]) / params:16.3f}" for point in POINTS))
        zoo = sum(state_bytes(params, args.dtype, stage, dp)) / params
        print(f"  zoo's planner (state_bytes):      {zoo:.3f}")
        print(f"  DeepSpeed's zero2 estimator:      {deepspeed_zero2_estimate(params, dp) / params:.3f}"
              + ("" if stage == 2 else "   (DeepSpeed has no stage-1 estimator; the zero2 one, for reference)"))


if __name__ == "__main__":
    main()
