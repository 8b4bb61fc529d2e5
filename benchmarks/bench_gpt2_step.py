"""One AdamW training step of GPT-2 on CPU: zoo vs transformers at tp=1, and zoo at tp=2.

Prints three tables to stdout (progress goes to stderr); nothing is asserted:

1. the measured fp32 sgemm peak of one thread (the yardstick for "% of peak");
2. one training step (forward + backward + AdamW step + zero_grad), fp32, dropout 0, one process,
   one torch thread: zoo.models.GPT2LMHeadModel(parallel=None) vs transformers' GPT2LMHeadModel
   with SDPA attention;
3. zoo at tp=2: two processes with one thread each, gloo on loopback, the same global batch and
   model, and the strong-scaling efficiency t(tp=1) / (2 * t(tp=2)).

    .venv/bin/python benchmarks/bench_gpt2_step.py            # 6 layers, h=512, s=256, b=8
    .venv/bin/python benchmarks/bench_gpt2_step.py --quick    # tiny shape, a few seconds
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

ISSUE_CLAIM = "Megatron reports 82% for 2-way strong scaling on V100s"


def megatron_flops_per_step(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron's model FLOPs of one step, no recomputation (see zoo.training.metrics)."""
    from zoo.training.metrics import megatron_flops_per_iteration

    return megatron_flops_per_iteration(batch, seq, layers, hidden, vocab, recompute=False)


FLOPS_FORMULA = "F = 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))  [Narayanan et al. 2021, no recompute]"


# ---------------------------------------------------------------- measurement helpers
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sgemm_peak_gflops(n: int = 2048, repeats: int = 7) -> float:
    """Median GFLOP/s of an fp32 n x n @ n x n matmul on the current number of threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)                                           # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / statistics.median(times) / 1e9


def time_steps(step, steps: int, warmup: int, sync=lambda: None) -> list[float]:
    """Wall time of each of ``steps`` calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def make_step(model: torch.nn.Module, input_ids: torch.Tensor):
    """forward (loss with labels = inputs) + backward + AdamW step + zero_grad."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step():
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def batch_of(args) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)


# ---------------------------------------------------------------- the models
def zoo_model(args, parallel):
    from zoo.models.config import GPT2Config
    from zoo.models.gpt2 import GPT2LMHeadModel

    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config, parallel=parallel)


def hf_model(args):
    import transformers

    config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                                     n_layer=args.layers, n_head=args.heads,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa",
                                                     dtype=torch.float32)


def _tp_worker(rank: int, world_size: int, port: int, args, results) -> None:
    from zoo.parallel.state import ParallelState

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        parallel = ParallelState.initialize(world_size)
        step = make_step(zoo_model(args, parallel), batch_of(args))
        times = time_steps(step, args.steps, args.warmup, sync=dist.barrier)
        activation = torch.randn(args.batch, args.seq, args.hidden)     # what f and g all-reduce
        comm = time_steps(lambda: dist.all_reduce(activation), 10, 2, sync=dist.barrier)
        if rank == 0:
            results.put((times, comm))
    finally:
        dist.destroy_process_group()


def time_zoo_tp(args, tp: int) -> tuple[list[float], list[float]]:
    """Step times of zoo at tensor-parallel size ``tp`` (one thread per rank), and times of one
    all-reduce of a (batch, seq, hidden) fp32 activation over the same group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_tp_worker, args=(tp, port, args, results), nprocs=tp, join=True)
    return results.get()


# ---------------------------------------------------------------- output
def print_table(title: str, headers: list[str], rows: list[list[str]], notes: list[str] = ()) -> None:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}")
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths))))
    print(line)
    for row in rows:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for note in notes:
        print(f"  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=7, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke shape: 2 layers, h=128, 4 heads, s=64, b=2, 5 steps, 1 warm-up")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.heads, args.seq, args.batch = 2, 128, 4, 64, 2
        args.steps, args.warmup = 5, 1

    torch.set_num_threads(1)
    tokens = args.batch * args.seq
    flops = megatron_flops_per_step(args.batch, args.seq, args.layers, args.hidden, args.vocab)
    print(f"GPT-2 step benchmark: layers={args.layers} hidden={args.hidden} heads={args.heads} "
          f"seq={args.seq} batch={args.batch} vocab={args.vocab}; fp32, dropout 0, AdamW; "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"torch {torch.__version__}, {os.cpu_count()} logical CPUs")
    print(FLOPS_FORMULA)
    print(f"  = {flops / 1e9:.1f} GFLOP per step (B={args.batch}, s={args.seq}, l={args.layers}, "
          f"h={args.hidden}, V={args.vocab})")

    log("measuring sgemm peak (1 thread) ...")
    peak = sgemm_peak_gflops()
    print_table("1. fp32 sgemm peak, 1 thread", ["matmul", "GFLOP/s"],
                [["2048 x 2048 @ 2048 x 2048 (median of 7)", f"{peak:.1f}"]])

    def row(name: str, times: list[float], procs: int) -> tuple[list[str], float]:
        log(f"{name}: step times (ms) " + " ".join(f"{x * 1e3:.0f}" for x in times))
        t = statistics.median(times)
        gflops = flops / t / 1e9
        return [name, f"{procs} x 1", f"{t * 1e3:.1f}", f"{min(times) * 1e3:.1f}", f"{tokens / t:.0f}",
                f"{gflops:.1f}", f"{100 * gflops / (procs * peak):.0f}%"], t

    headers = ["model", "procs x threads", "ms/step", "min ms", "tokens/s", "GFLOP/s", "% of peak"]
    peak_note = "% of peak = achieved GFLOP/s / (threads x measured 1-thread sgemm peak)"
    log("timing zoo, tp=1 ...")
    zoo_times = time_steps(make_step(zoo_model(args, None), batch_of(args)), args.steps, args.warmup)
    zoo_row, t_zoo = row("zoo GPT2LMHeadModel (parallel=None)", zoo_times, 1)
    log("timing transformers ...")
    hf_row, t_hf = row("transformers GPT2LMHeadModel (sdpa)",
                       time_steps(make_step(hf_model(args), batch_of(args)), args.steps, args.warmup), 1)
    print_table("2. one training step, single process, 1 thread", headers, [zoo_row, hf_row],
                [f"zoo / transformers throughput: {t_hf / t_zoo:.2f}x", peak_note])

    log("timing zoo, tp=2 (2 processes, gloo) ...")
    tp_times, comm_times = time_zoo_tp(args, 2)
    tp_row, t_tp2 = row("zoo GPT2LMHeadModel tp=2", tp_times, 2)
    n_reduce = 4 * args.layers + 2     # per layer 2 g forward + 2 f backward; embedding g, LM-head f
    t_comm = statistics.median(comm_times)
    print_table("3. zoo tensor parallel, same global batch and model", headers, [zoo_row, tp_row],
                [f"strong-scaling efficiency t(tp=1) / (2 * t(tp=2)) = {100 * t_zoo / (2 * t_tp2):.0f}% "
                 f"(from the minimum step times: {100 * min(zoo_times) / (2 * min(tp_times)):.0f}%)",
                 f"gloo all-reduce of one ({args.batch}, {args.seq}, {args.hidden}) fp32 activation: "
                 f"{t_comm * 1e3:.1f} ms; {n_reduce} per step (4 l + 2) = {n_reduce * t_comm * 1e3:.0f} ms, "
                 f"{100 * n_reduce * t_comm / t_tp2:.0f}% of the tp=2 step",
                 peak_note,
                 f"for comparison, the issue states: \"{ISSUE_CLAIM}\" (the issue's claim, not checked "
                 "here; Megatron-LM's published scaling studies grow the model with the GPU count, "
                 "i.e. weak scaling)"])


if __name__ == "__main__":
    main()
