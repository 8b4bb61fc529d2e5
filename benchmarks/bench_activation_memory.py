"""Per-rank activation memory and step time of one GPT-2 training step: tp = 1, 2, 4, sequence
parallelism off/on, recomputation none/selective/full (Korthikanti et al. 2022). Nothing is asserted.

"Activation memory" is what the step keeps for backward at the end of the forward: the bytes of
every distinct tensor storage autograd saved (``torch.autograd.graph.saved_tensors_hooks``) plus the
inputs DeepSpeed's activation checkpointing keeps, parameters excluded. It is measured exactly and
on any device, which is what the paper's formulas count; it leaves out the transient working set of
the layer being recomputed under full recomputation (the planner's ``activation_bytes`` adds one
layer for it; the "predicted" column here does not). On an accelerator the table also gives the
measured peak allocation minus the memory held before the step (weights, gradients, optimizer).

The prediction is ``zoo.planning.activations`` (L x layer_activation_bytes + output_activation_bytes), with
the value and mask widths of the run (fp32 on CPU: 4-byte values, 4-byte dropout masks).

    .venv/bin/python benchmarks/bench_activation_memory.py            # h=256, s=256, b=2, L=2, ~1 min
    .venv/bin/python benchmarks/bench_activation_memory.py --quick

Step times at tp = 4 on a 2-core machine measure contention, not scaling.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = [(sp, recompute) for sp in (False, True) for recompute in (None, "selective", "full")]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SavedActivations:
    """Context manager: the distinct non-parameter storages autograd saves for backward inside it, and the
    inputs DeepSpeed's checkpoint keeps (it stores them on ctx, out of the hooks' sight)."""

    def __init__(self, model: torch.nn.Module):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def add(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.param_ptrs:
                self.storages[storage.data_ptr()] = storage.nbytes()

    def __enter__(self):
        import deepspeed

        def pack(tensor):
            self.add(tensor)
            return tensor

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        self.real_checkpoint = deepspeed.checkpointing.checkpoint

        def checkpoint(function, *args, **kwargs):
            for arg in args:
                self.add(arg)
            return self.real_checkpoint(function, *args, **kwargs)

        deepspeed.checkpointing.checkpoint = checkpoint
        return self

    def __exit__(self, *exc):
        import deepspeed

        deepspeed.checkpointing.checkpoint = self.real_checkpoint
        self.hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def predicted_bytes(args, tp: int, sp: bool, recompute, value_bytes: int, mask_bytes: int) -> float | None:
    try:
        from zoo.planning.activations import layer_activation_bytes, output_activation_bytes
    except ImportError:
        return None
    widths = {"value_bytes": value_bytes, "mask_bytes": mask_bytes}
    sp = sp and tp > 1
    layers = args.layers * layer_activation_bytes(args.seq, args.batch, args.hidden, args.heads, tp, sp,
                                                  recompute or "none", **widths)
    return layers + output_activation_bytes(args.seq, args.batch, args.hidden, args.vocab, tp, sp, **widths)


def measure(args, ps, sp: bool, recompute) -> dict:
    from deepspeed.accelerator import get_accelerator

    from zoo.models import GPT2Config, GPT2LMHeadModel
    from zoo.parallel import model_parallel_seed

    accelerator = get_accelerator()
    device = torch.device(accelerator.device_name())
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                        n_head=args.heads, sequence_parallel=sp, recompute_granularity=recompute)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config, parallel=ps).to(device).train()
    model_parallel_seed(1234, ps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)

    def step(record: SavedActivations | None = None):
        if record is None:
            loss = model(ids, labels=ids).loss
        else:
            with record:
                loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    step()                                                       # warm-up; grads and optimizer state exist now
    record = SavedActivations(model)
    on_accelerator = device.type != "cpu"
    if on_accelerator:
        accelerator.synchronize()
        accelerator.reset_peak_memory_stats()
        before = accelerator.memory_allocated()
    step(record)
    peak = accelerator.max_memory_allocated() - before if on_accelerator else None
    times = []
    for _ in range(args.repeats):
        if on_accelerator:
            accelerator.synchronize()
        start = time.perf_counter()
        step()
        if on_accelerator:
            accelerator.synchronize()
        times.append(time.perf_counter() - start)
    return {"saved": record.total, "peak": peak, "step_s": statistics.median(times)}


def _worker(rank, world_size, port, args, queue):
    import traceback

    from zoo.parallel import ParallelState

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        ps = ParallelState.initialize(world_size)
        modes = MODES if world_size > 1 else [m for m in MODES if not m[0]]
        results = {mode: measure(args, ps, *mode) for mode in modes}
        if rank == 0:
            queue.put(results)
    except BaseException:  # noqa: BLE001 - the parent must not wait for a result that never comes
        queue.put(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_tp(args, tp: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, tp, port, args, queue)) for r in range(tp)]
    for proc in procs:
        proc.start()
    results = queue.get(timeout=3600)
    for proc in procs:
        proc.join(timeout=None if isinstance(results, dict) else 5)
        if proc.is_alive():
            proc.kill()
    if not isinstance(results, dict):
        raise RuntimeError(f"a tp={tp} rank failed:\n{results}")
    return results


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:8.2f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--quick", action="store_true", help="h=64, s=64, one repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.seq, args.repeats = 64, 4, 64, 1
    by_tp = {}
    for tp in args.tp:
        log(f"tp={tp} ...")
        by_tp[tp] = run_tp(args, tp)
    on_accelerator = any(r["peak"] is not None for res in by_tp.values() for r in res.values())
    value_bytes = 4                                               # fp32 runs
    mask_bytes = 1 if on_accelerator else 4                       # bool masks on CUDA, dtype masks on CPU
    print(f"GPT-2 one training step: L={args.layers} h={args.hidden} a={args.heads} s={args.seq} b={args.batch} "
          f"V={args.vocab}, fp32, dropout 0.1; per-rank activation memory kept for backward (MiB)")
    header = f"{'tp':>3} {'SP':>4} {'recompute':>10} {'measured':>9} {'predicted':>9} {'vs tp=1':>8}"
    header += f" {'peak-static':>11}" if on_accelerator else ""
    print(header + f" {'step ms':>8}")
    base = by_tp.get(1, {}).get((False, None), {}).get("saved")
    for tp, results in by_tp.items():
        for (sp, recompute), r in results.items():
            predicted = predicted_bytes(args, tp, sp, recompute, value_bytes, mask_bytes)
            ratio = f"{r['saved'] / base:8.2f}" if base else "       -"
            line = (f"{tp:>3} {'on' if sp else 'off':>4} {recompute or 'none':>10} {mib(r['saved']):>9} "
                    f"{mib(predicted):>9} {ratio}")
            line += f" {mib(r['peak']):>11}" if on_accelerator else ""
            print(line + f" {r['step_s'] * 1e3:8.1f}")
    if predicted_bytes(args, 1, False, None, value_bytes, mask_bytes) is None:
        print("(zoo.planning.activations not found: no prediction)")


if __name__ == "__main__":
    main()
