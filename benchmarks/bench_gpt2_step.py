"""One AdamW training step of GPT-2 on CPU: zoo vs transformers at tp=1, zoo through DeepSpeed's engine as
pretraining steps it, and zoo at tp=2.

Prints the tables below to stdout (progress goes to stderr); nothing is asserted:

1. the measured fp32 sgemm peak of one thread (the yardstick for "% of peak");
2. one training step (forward + backward + AdamW step + zero_grad), fp32, dropout 0, one process,
   one torch thread: zoo.models.GPT2LMHeadModel(parallel=None) vs transformers' GPT2LMHeadModel
   with SDPA attention, and the engine path: the same model (built with a tp = 1 ParallelState, as
   pretraining builds it) stepped through ``deepspeed.initialize`` by zoo's ``setup_engine`` with the
   ds_config ``launch/pretrain.py --deepspeed_config DS_CONFIG`` would hand it (``--ds-config``, default
   ds_configs/cpu_demo.json: torch's AdamW, clipping 1.0; micro-batch = the batch, no accumulation), one
   iteration of the training loop's own step per call (benchmarks/engine_path.py); with ``--compile``
   each of these again with zoo's transformer blocks compiled (zoo.models.compiled.compile_transformer_blocks;
   one line says so where this checkout lacks it);
2b. where each step's time went: forward, backward, optimizer (the AdamW step; under the engine, engine.step
   with clipping) and data (the batch's device copy, engine only), from zoo's phase clock, model-only and
   engine side by side;
2c. with ``--stock-step``: the "before" arm on this commit beside zoo's step. Four arms, one call of each in turn
   per step (the order reversed every other step, so load elsewhere hits them alike): the model-only step and
   the engine path as above (zoo's step: ``lighten_step``, the chunked cross-entropy), and the same two with the
   cross-entropy unchunked (every token in one chunk), the engine built with DeepSpeed's stock step (no
   ``lighten_step``: its per-tensor overflow check on fp16 optimizers, its gradient all-reduce at dp = 1); both
   patched in benchmarks/engine_path.py, zoo unchanged. Each arm's engine / model-only ratio is against the
   model-only step with its own cross-entropy. ``--precision bf16`` (or fp16, which DeepSpeed refuses on a CPU)
   runs the engine arms in that precision (the pretraining ``--bf16`` flag; bf16 accumulates its gradients in
   fp32 in both arms); the model-only arms stay fp32;
3. zoo at tp=2: two processes with one thread each, gloo on loopback, the same global batch and
   model, with sequence parallelism off and on (Korthikanti et al. 2022: the f/g all-reduces become
   all-gather / reduce-scatter pairs and LayerNorm, dropout and residuals run on s/2 tokens per rank),
   and the strong-scaling efficiency t(tp=1) / (2 * t(tp=2));
4. with ``--repeats N`` (N > 1): the tp=1 and tp=2 measurements alternate N times (a fresh pair of
   tp=2 processes each time) and the efficiency of each round is printed, with its median and range:
   on a shared machine one round says little.

Host allocator. With glibc's defaults every tensor over 32 MiB is mmap'd on allocation and unmapped on free,
so each step page-faults its large activations in again (~50,000 faults per 200 MB logits buffer, several
times the cost of the arithmetic on it). A GPU run never pays this (PyTorch's CUDA caching allocator keeps
freed blocks). ``--host-allocator keep`` (the default) makes glibc behave the same way in every process
of both arms (``mallopt``: no mmap for large blocks, no trimming), so after the warm-up steps a step
takes no page faults; ``--host-allocator default`` measures glibc as it comes.

    .venv/bin/python benchmarks/bench_gpt2_step.py            # 6 layers, h=512, s=256, b=8
    .venv/bin/python benchmarks/bench_gpt2_step.py --quick    # tiny shape, a few seconds
    .venv/bin/python benchmarks/bench_gpt2_step.py --repeats 5 --skip-hf   # scaling, 5 rounds
    .venv/bin/python benchmarks/bench_gpt2_step.py --quick --skip-tp --compile   # model-only vs engine, eager and compiled
    .venv/bin/python benchmarks/bench_gpt2_step.py --skip-hf --skip-tp --stock-step --layers 2 --hidden 256 \
        --heads 4 --seq 128 --batch 4    # stock DeepSpeed step vs zoo's step, fp32 (--precision bf16: bf16)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # engine_path, beside this file
from engine_path import (  # noqa: E402
    EngineStep,
    compile_blocks,
    compile_missing,
    join_world_of_one,
    one_chunk_cross_entropy,
    pretraining_ds_config,
)

ISSUE_CLAIM = "Megatron reports 82% for 2-way strong scaling on V100s"


def megatron_flops_per_step(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron's model FLOPs of one step, no recomputation (see zoo.training.metrics)."""
    from zoo.planning.flops import megatron_flops_per_iteration

    return megatron_flops_per_iteration(batch, seq, layers, hidden, vocab, recompute=False)


FLOPS_FORMULA = "F = 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))  [Narayanan et al. 2021, no recompute]"


# ---------------------------------------------------------------- measurement helpers
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def keep_freed_host_memory() -> bool:
    """Ask glibc to keep freed memory in the process (like a caching allocator): serve large blocks from the
    heap instead of mmap (M_MMAP_MAX = 0) and trim it only beyond 2 GiB free (M_TRIM_THRESHOLD = 2^31 - 1).
    Returns False where the C library has no ``mallopt`` (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2 ** 31 - 1))


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


def make_step(model: torch.nn.Module, input_ids: torch.Tensor, clocks: list | None = None):
    """forward (loss with labels = inputs) + backward + AdamW step + zero_grad; with ``clocks``, each phase is
    charged to the PhaseClock ``clocks[0]`` (forward, backward, optimizer: the step and zero_grad)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step():
        clock = clocks[0] if clocks else None
        if clock is not None:
            clock.start()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        if clock is not None:
            clock.lap("forward")
        loss.backward()
        if clock is not None:
            clock.lap("backward")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if clock is not None:
            clock.lap("optimizer")

    return step


def time_model_only(model: torch.nn.Module, args) -> tuple[list[float], dict[str, float]]:
    """Step times of ``model``'s bare step (:func:`make_step`) and its phases' milliseconds per timed step."""
    from zoo.training.phase_clock import PhaseClock

    clocks = [PhaseClock()]
    step = make_step(model, batch_of(args), clocks)
    for _ in range(args.warmup):
        step()
    clocks[0] = PhaseClock()
    times = time_steps(step, args.steps, 0)
    return times, {phase: total / len(times) for phase, total in clocks[0].totals_ms().items()}


def batch_of(args) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)


# ---------------------------------------------------------------- the models
def zoo_model(args, parallel, sequence_parallel: bool = False):
    from zoo.models.gpt2.config import GPT2Config
    from zoo.models.gpt2.model import GPT2LMHeadModel

    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, sequence_parallel=sequence_parallel)
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


def join_deepspeed_on_this_host(rank: int, world_size: int, port: int) -> None:
    """What zoo's jobs do under the deepspeed launcher: DeepSpeed joins the group with every rank on this
    host (``LOCAL_SIZE``), so the TP sums go through its shared-memory kernel (zoo.parallel.host_all_reduce);
    the kernel's workspace names are unlinked at once, as zoo's join does."""
    from zoo.distributed import join_deepspeed, unlink_shared_memory_buffer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    join_deepspeed(dist_backend="gloo", verbose=False)
    unlink_shared_memory_buffer()


def _tp_worker(rank: int, world_size: int, port: int, args, results) -> None:
    from zoo.parallel.host_all_reduce import tp_all_reduce_
    from zoo.parallel.state import ParallelState

    torch.set_num_threads(1)
    if args.host_allocator == "keep":
        keep_freed_host_memory()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        if args.tp_all_reduce == "deepspeed-shm":
            join_deepspeed_on_this_host(rank, world_size, port)
        parallel = ParallelState.initialize(world_size)
        times = {}
        for sp in (False, True):     # one model at a time: the default shape's AdamW state is large
            step = make_step(zoo_model(args, parallel, sequence_parallel=sp), batch_of(args))
            times[sp] = time_steps(step, args.steps, args.warmup, sync=dist.barrier)
            del step
        activation = torch.randn(args.batch, args.seq, args.hidden)     # what f and g all-reduce
        comm = time_steps(lambda: tp_all_reduce_(activation, parallel.tp_group), 10, 2, sync=dist.barrier)
        if rank == 0:
            results.put((times, comm))
    finally:
        dist.destroy_process_group()


def time_zoo_tp(args, tp: int) -> tuple[dict[bool, list[float]], list[float]]:
    """Step times of zoo at tensor-parallel size ``tp`` (one thread per rank), {sequence_parallel:
    times} for SP off and on, and times of one all-reduce of a (batch, seq, hidden) fp32 activation
    over the same group."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_tp_worker, args=(tp, port, args, results), nprocs=tp, join=True)
    return results.get()


def time_engine(args, parallel, compiled: bool) -> tuple[list[float], dict[str, float]]:
    """Step times of the engine path (module doc, table 2) and its phases' milliseconds per step."""
    ds_config, weight_decay = pretraining_ds_config(args.ds_config, args.batch, args.seq, precision=args.precision)
    model = zoo_model(args, parallel)
    if compiled:
        compile_blocks(model)
    step = EngineStep(model, ds_config, parallel, batch_of(args), weight_decay)
    for _ in range(args.warmup):
        step()
    step.reset_phases()
    times = time_steps(step, args.steps, 0)
    return times, step.phase_ms()


def time_stock_and_zoo(args, parallel) -> dict[tuple[str, bool], tuple[list[float], dict[str, float]]]:
    """Table 2c (``--stock-step``, module doc): {arm key: (step times, phases' ms per step)} of the model-only step
    and the engine path, each with zoo's step and with the stock one, timed in turn step by step."""
    from zoo.training.phase_clock import PhaseClock

    ds_config, weight_decay = pretraining_ds_config(args.ds_config, args.batch, args.seq, precision=args.precision)
    clocks = {"model": [PhaseClock()], "model-stock": [PhaseClock()]}
    plain = make_step(zoo_model(args, None), batch_of(args), clocks["model"])
    unchunked = make_step(zoo_model(args, None), batch_of(args), clocks["model-stock"])

    def model_stock():
        with one_chunk_cross_entropy():
            unchunked()

    engines = {"engine": EngineStep(zoo_model(args, parallel), ds_config, parallel, batch_of(args), weight_decay),
               "engine-stock": EngineStep(zoo_model(args, parallel), ds_config, parallel, batch_of(args), weight_decay,
                                          stock=True)}
    steps = {"model": plain, "model-stock": model_stock, **engines}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    for name in clocks:
        clocks[name][0] = PhaseClock()
    for engine in engines.values():
        engine.reset_phases()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.steps):
        for name in (list(steps) if i % 2 == 0 else list(reversed(steps))):
            times[name].append(time_steps(steps[name], 1, 0)[0])
    phases = {name: {phase: total / args.steps for phase, total in clocks[name][0].totals_ms().items()}
              for name in clocks}
    phases.update({name: engine.phase_ms() for name, engine in engines.items()})
    return {(name, False): (times[name], phases[name]) for name in steps}


def phase_rows(arms: list[tuple[str, list[float], dict[str, float]]], model_only_s: float) -> list[list[str]]:
    """Table 2b: per arm its mean step, its phases (means), the rest, and its median against the model-only
    step's median."""
    rows = []
    for name, times, phases in arms:
        mean, median = statistics.fmean(times), statistics.median(times)
        shown = [phases.get(p, 0.0) for p in ("forward", "backward", "optimizer", "data")]
        rows.append([name, f"{mean * 1e3:.1f}", *(f"{ms:.1f}" for ms in shown), f"{mean * 1e3 - sum(shown):.1f}",
                     f"{(median - model_only_s) * 1e3:+.1f}", f"{median / model_only_s:.2f}x"])
    return rows


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
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first (3: the host heap reaches its steady size, see --host-allocator)")
    parser.add_argument("--host-allocator", choices=("keep", "default"), default="keep",
                        help="keep: glibc keeps freed memory (no per-step page faults, as on a GPU); default: as glibc comes")
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternate the tp=1 and tp=2 timings this many times (table 4: per-round efficiency)")
    parser.add_argument("--skip-hf", action="store_true", help="do not time transformers (table 2: zoo only)")
    parser.add_argument("--tp-all-reduce", choices=("deepspeed-shm", "gloo"), default="deepspeed-shm",
                        help="the tp=2 ranks join DeepSpeed on one host as zoo's jobs do, so TP sums use its "
                             "shared-memory kernel (default), or stay on gloo")
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke shape: 2 layers, h=128, 4 heads, s=64, b=2, 5 steps, 1 warm-up")
    parser.add_argument("--ds-config", default=str(Path(__file__).resolve().parent.parent / "ds_configs" / "cpu_demo.json"),
                        help="the pretraining ds_config of the engine path (table 2)")
    parser.add_argument("--skip-engine", action="store_true", help="do not time the engine path (tables 2 and 2b)")
    parser.add_argument("--skip-tp", action="store_true", help="do not time tp=2 (tables 3 and 4)")
    parser.add_argument("--compile", action="store_true",
                        help="also time zoo's steps with the transformer blocks compiled (zoo.models.compiled)")
    parser.add_argument("--stock-step", action="store_true",
                        help="also time the model-only and engine steps with the unchunked cross-entropy and DeepSpeed's "
                             "stock step (no lighten_step), in turn with zoo's (table 2c)")
    parser.add_argument("--precision", choices=("bf16", "fp16"), default=None,
                        help="the engine path's precision, as pretraining's --bf16/--fp16 (default: the ds_config's)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be at least 1")
    if args.stock_step and args.skip_engine:
        parser.error("--stock-step compares engine steps; drop --skip-engine")
    if args.quick:
        args.layers, args.hidden, args.heads, args.seq, args.batch = 2, 128, 4, 64, 2
        args.steps, args.warmup = 5, 1

    torch.set_num_threads(1)
    if args.host_allocator == "keep" and not keep_freed_host_memory():
        parser.error("--host-allocator keep needs glibc's mallopt, which this C library lacks; pass --host-allocator default")
    tokens = args.batch * args.seq
    flops = megatron_flops_per_step(args.batch, args.seq, args.layers, args.hidden, args.vocab)
    print(f"GPT-2 step benchmark: layers={args.layers} hidden={args.hidden} heads={args.heads} "
          f"seq={args.seq} batch={args.batch} vocab={args.vocab}; fp32, dropout 0, AdamW; "
          f"median of {args.steps} steps after {args.warmup} warm-up; host allocator: {args.host_allocator}; "
          f"tp sums: {args.tp_all_reduce}; engine path: {args.precision or 'the ds_config precision'}")
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
    missing = compile_missing() if args.compile else None
    if missing:
        print(missing)
    compiled_arms = (False, True) if args.compile and not missing else (False,)
    parallel = None if args.skip_engine else join_world_of_one()
    rounds = []     # (tp=1 times, {sp: tp=2 times}, all-reduce times), tp=1 and tp=2 alternating
    arms = {}       # (name, compiled) -> model-only or engine step times of the middle round
    paired = args.stock_step and parallel is not None
    for r in range(args.repeats):
        middle = r == args.repeats // 2
        if middle and paired:
            log(f"round {r + 1}/{args.repeats}: timing zoo, tp=1, and the engine path, zoo's step and the stock "
                "step in turn ...")
            arms.update(time_stock_and_zoo(args, parallel))
            zoo_times = arms[("model", False)][0]
        else:
            log(f"round {r + 1}/{args.repeats}: timing zoo, tp=1 ...")
            zoo_times, zoo_phases = time_model_only(zoo_model(args, None), args)
        if middle:
            if not paired:
                arms[("model", False)] = (zoo_times, zoo_phases)
            for compiled in compiled_arms:
                if compiled:
                    log("timing zoo, tp=1, compiled blocks ...")
                    model = zoo_model(args, None)
                    compile_blocks(model)
                    arms[("model", True)] = time_model_only(model, args)
                if parallel is not None and (compiled or not paired):
                    log(f"timing zoo through deepspeed.initialize ({Path(args.ds_config).name}"
                        f"{', compiled blocks' if compiled else ''}) ...")
                    arms[("engine", compiled)] = time_engine(args, parallel, compiled)
        if not args.skip_tp:
            log(f"round {r + 1}/{args.repeats}: timing zoo, tp=2, SP off then on (2 processes, gloo) ...")
            rounds.append((zoo_times, *time_zoo_tp(args, 2)))
        else:
            rounds.append((zoo_times, None, None))
    zoo_times, tp_times, comm_times = rounds[len(rounds) // 2]     # tables 2 and 3 show the middle round
    zoo_row, t_zoo = row("zoo GPT2LMHeadModel (parallel=None)", zoo_times, 1)
    engine_name = f"zoo, deepspeed.initialize ({Path(args.ds_config).name}{', ' + args.precision if args.precision else ''})"
    names = {("model", False): "zoo GPT2LMHeadModel (parallel=None)",
             ("model", True): "zoo GPT2LMHeadModel (parallel=None), compiled",
             ("model-stock", False): "zoo GPT2LMHeadModel (parallel=None), unchunked cross-entropy",
             ("engine", False): engine_name,
             ("engine", True): f"{engine_name}, compiled",
             ("engine-stock", False): f"{engine_name}, stock DeepSpeed step, unchunked cross-entropy"}
    zoo_rows = [zoo_row] + [row(names[key], arms[key][0], 1)[0] for key in names if key in arms and key != ("model", False)]
    engine_notes = []
    if ("engine", False) in arms:
        t_engine = statistics.median(arms[("engine", False)][0])
        engine_notes.append(f"engine path / model-only step time: {t_engine / t_zoo:.2f}x "
                            "(the same model and batch; the engine adds clipping, its step bookkeeping and zoo's loop)")
    if ("engine-stock", False) in arms:
        t_stock = statistics.median(arms[("engine-stock", False)][0])
        t_unchunked = statistics.median(arms[("model-stock", False)][0])
        engine_notes.append(f"stock step: engine / model-only (both unchunked) {t_stock / t_unchunked:.2f}x; "
                            f"stock engine / zoo's engine {t_stock / t_engine:.2f}x; unchunked / chunked model-only "
                            f"{t_unchunked / t_zoo:.2f}x (medians of steps timed in turn)")
        pairs = [stock / zoo for stock, zoo in zip(arms[("engine-stock", False)][0], arms[("engine", False)][0])]
        engine_notes.append(f"stock engine / zoo's engine, step by step (the two calls of one step): median "
                            f"{statistics.median(pairs):.3f}x [{min(pairs):.3f} - {max(pairs):.3f}] over {len(pairs)} steps")
    if args.skip_hf:
        print_table("2. one training step, single process, 1 thread", headers, zoo_rows,
                    ["transformers not timed (--skip-hf)", *engine_notes, peak_note])
    else:
        log("timing transformers ...")
        hf_row, t_hf = row("transformers GPT2LMHeadModel (sdpa)",
                           time_steps(make_step(hf_model(args), batch_of(args)), args.steps, args.warmup), 1)
        print_table("2. one training step, single process, 1 thread", headers, zoo_rows + [hf_row],
                    [f"zoo / transformers throughput: {t_hf / t_zoo:.2f}x", *engine_notes, peak_note])
    phased = [(names[key], *arms[key]) for key in names if key in arms]
    if any(key[0] == "engine" for key in arms):
        print_table("2b. where the step's time went (ms per step; zoo's phase clock: the host clock on CPU)",
                    ["arm", "step (mean)", "forward", "backward", "optimizer", "data", "rest",
                     "median - model-only", "ratio"],
                    phase_rows(phased, t_zoo),
                    ["step and phases: means over the timed steps; optimizer: the AdamW step and zero_grad (model-only), "
                     "engine.step() with clipping (engine); rest: the step minus its phases; median - model-only and "
                     "ratio: against zoo GPT2LMHeadModel (parallel=None), eager"])
    if args.skip_tp:
        return

    tp_row, t_tp2 = row("zoo GPT2LMHeadModel tp=2", tp_times[False], 2)
    sp_row, t_sp2 = row("zoo GPT2LMHeadModel tp=2, sequence parallel", tp_times[True], 2)
    n_reduce = 4 * args.layers + 2     # per layer 2 g forward + 2 f backward; embedding g, LM-head f
    t_comm = statistics.median(comm_times)
    round_note = "" if args.repeats == 1 else f" (round {len(rounds) // 2 + 1} of {args.repeats}; all rounds in table 4)"
    print_table("3. zoo tensor parallel, same global batch and model" + round_note, headers,
                [zoo_row, tp_row, sp_row],
                [f"strong-scaling efficiency t(tp=1) / (2 * t(tp=2)): SP off {100 * t_zoo / (2 * t_tp2):.0f}%, "
                 f"SP on {100 * t_zoo / (2 * t_sp2):.0f}% (from the minimum step times: "
                 f"{100 * min(zoo_times) / (2 * min(tp_times[False])):.0f}%, "
                 f"{100 * min(zoo_times) / (2 * min(tp_times[True])):.0f}%)",
                 f"{'gloo' if args.tp_all_reduce == 'gloo' else 'shared-memory'} all-reduce of one ({args.batch}, {args.seq}, {args.hidden}) fp32 activation: "
                 f"{t_comm * 1e3:.1f} ms; {n_reduce} per step (4 l + 2) = {n_reduce * t_comm * 1e3:.0f} ms, "
                 f"{100 * n_reduce * t_comm / t_tp2:.0f}% of the tp=2 step (SP moves the same volume as "
                 "all-gathers / reduce-scatters, plus 2 re-gathers per layer in backward)",
                 peak_note,
                 f"for comparison, the issue states: \"{ISSUE_CLAIM}\" (the issue's claim, not checked "
                 "here; Megatron-LM's published scaling studies grow the model with the GPU count, "
                 "i.e. weak scaling)"])
    if args.repeats > 1:
        print_rounds(rounds)


def efficiency(t1: list[float], t2: list[float]) -> float:
    return 100 * statistics.median(t1) / (2 * statistics.median(t2))


def print_rounds(rounds) -> None:
    """Table 4: per round the median step times and the efficiency with SP off and on, then the median
    and range of the efficiencies over the rounds."""
    rows, effs = [], {False: [], True: []}
    for i, (t1, t2, _) in enumerate(rounds):
        e = {sp: efficiency(t1, t2[sp]) for sp in (False, True)}
        for sp in e:
            effs[sp].append(e[sp])
        rows.append([str(i + 1), f"{statistics.median(t1) * 1e3:.1f}", f"{statistics.median(t2[False]) * 1e3:.1f}",
                     f"{statistics.median(t2[True]) * 1e3:.1f}", f"{e[False]:.1f}%", f"{e[True]:.1f}%"])
    notes = [f"efficiency, median over {len(rounds)} rounds [min - max]: SP off {statistics.median(effs[False]):.1f}% "
             f"[{min(effs[False]):.1f} - {max(effs[False]):.1f}], SP on {statistics.median(effs[True]):.1f}% "
             f"[{min(effs[True]):.1f} - {max(effs[True]):.1f}]",
             "each round: tp=1 timed, then tp=2 SP off, then tp=2 SP on (fresh processes); median step of each"]
    print_table("4. strong scaling per round, t(tp=1) / (2 * t(tp=2))",
                ["round", "tp=1 ms", "tp=2 ms", "tp=2 SP ms", "eff. SP off", "eff. SP on"], rows, notes)

if __name__ == "__main__":
    main()
