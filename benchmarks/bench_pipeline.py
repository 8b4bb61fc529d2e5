"""Pipeline stages on CPU: step time at pp = 1, 2, 4 for m = 4, 8, 16 micro-batches next to the planner's
bubble prediction, and each stage's model-state bytes next to the planner's.

Every configuration trains a GPT-2 (``--layers`` x ``--hidden``, fp32, dropout off) for a few steps through
DeepSpeed's pipeline engine (1F1B), tp = dp = 1, one gloo process per stage; pp = 1 is the same engine with
one stage, so the columns differ only by the pipeline. Printed per configuration:

* ``step s``: the median wall time of ``engine.train_batch`` over the timed steps (the slowest stage's);
* ``ideal s``: what P devices would take without a bubble, T(pp=1) / P, and ``planner s`` the planner's
  prediction with the bubble, T(pp=1) / P x (m + P - 1) / m (:func:`zoo.planning.pipeline_plan.bubble_fraction`);
  on a machine with fewer cores than P processes the stages share cores, which the planner does not model;
* per stage: the bytes of its parameters, gradients and Adam moments at the optimizer step (a step pre-hook;
  every storage counted once) against the planner's per-stage model states, and the process's peak RSS.

    .venv/bin/python benchmarks/bench_pipeline.py [--layers 8] [--hidden 256] [--seq 128] [--micro 2] [--steps 3]

Prints tables to stdout (DeepSpeed's log lines go to stderr); nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

PIPELINES = (1, 2, 4)
MICRO_BATCHES = (4, 8, 16)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_config(args):
    from zoo.models import gpt2_config

    return gpt2_config("gpt2-tiny", n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64,
                       n_positions=max(256, args.seq), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def state_bytes_of(module, optimizer) -> int:
    """Bytes of the stage's parameters, their gradients and the optimizer's state, each storage once."""
    seen, total = set(), 0
    tensors = [p for p in module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    for tensor in tensors:
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
    return total


def worker(rank, world, port, args, m, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed

        from zoo.models.families import param_groups
        from zoo.models.gpt2.pipeline import gpt2_pipeline_module
        from zoo.parallel import ParallelState, model_parallel_seed

        deepspeed.init_distributed(dist_backend="gloo")
        ps = ParallelState.initialize(1, pp_size=world)
        model_parallel_seed(1234, ps)
        module = gpt2_pipeline_module(model_config(args), ps, 1234, "uniform")
        ds = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": m,
              "train_batch_size": args.micro * m, "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
        engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=param_groups(module, 0.01), config=ds)
    measured = [0]

    def measure(optimizer, hook_args, hook_kwargs):   # gradients and moments are alive together here
        measured[0] = max(measured[0], state_bytes_of(module, optimizer))

    engine.optimizer.register_step_pre_hook(measure)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50257, (m, args.micro, args.seq), generator=generator)
    times = []
    for step in range(args.steps + 1):   # the first step builds the buffers and is not timed
        torch.distributed.barrier()
        start = time.perf_counter()
        engine.train_batch(iter([(micro, micro) for micro in ids]))
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        if step:
            times.append(elapsed.item())
    results.put((rank, statistics.median(times), measured[0],
                 resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    torch.distributed.barrier()


def run(args, pp: int, m: int) -> list[tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(rank, pp, port, args, m, results)) for rank in range(pp)]
    for proc in procs:
        proc.start()
    rows = sorted(results.get(timeout=1800) for _ in procs)
    for proc in procs:
        proc.join()
    return rows


def planned_stages(args, pp: int, m: int):
    """The planner's per-stage plan of the same run (fp32, CPU widths)."""
    from zoo.planning.planner import plan

    ds = {"train_batch_size": args.micro * m, "train_micro_batch_size_per_gpu": args.micro,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zoo": {"model": "gpt2-tiny", "seq_length": args.seq, "pipeline_model_parallel_size": pp,
                  "pipeline_partition_method": "uniform", "save": "unused",
                  "model_overrides": {"n_layer": args.layers, "n_embd": args.hidden, "n_head": args.hidden // 64,
                                      "n_positions": max(256, args.seq)}}}
    return plan(ds, pp, gpu="cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"GPT-2 {args.layers} layers x {args.hidden} hidden, seq {args.seq}, micro-batch {args.micro}, fp32, "
          f"{os.cpu_count()} CPU cores, median of {args.steps} steps")
    print(f"{'pp':>3} {'m':>4} {'step s':>8} {'ideal s':>8} {'planner s':>10} {'bubble':>7}   per stage: model states "
          "measured / planned (MB), peak RSS (MB)")
    base = {}
    for m in MICRO_BATCHES:
        for pp in PIPELINES:
            rows = run(args, pp, m)
            step = max(row[1] for row in rows)
            if pp == 1:
                base[m] = step
            p = planned_stages(args, pp, m)
            bubble = p.bubble_fraction
            ideal = base[m] / pp
            planned = [s["weights"] + s["gradients"] + s["optimizer"] for s in p.stages] if p.stages else \
                [p.weights + p.gradients + p.optimizer]
            stages = ", ".join(f"{row[2] / 1e6:.1f}/{plan_bytes / 1e6:.1f} ({row[3] / 1e6:.0f})"
                               for row, plan_bytes in zip(rows, planned))
            print(f"{pp:>3} {m:>4} {step:>8.3f} {ideal:>8.3f} {ideal / (1 - bubble):>10.3f} {100 * bubble:>6.1f}%   "
                  f"{stages}", flush=True)


if __name__ == "__main__":
    main()
