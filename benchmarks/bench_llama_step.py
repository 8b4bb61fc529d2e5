"""One Llama training step on CPU, zoo against its peers on the same model, same machine, one run.

    python benchmarks/bench_llama_step.py [--steps 3] [--layers 4] [--seq 128] [--batch 4]

Every peer trains the same transformers Llama checkpoint (random weights of one seed, written once to a
temporary directory) in fp32 with dropout off, on one batch of ``batch x seq`` tokens, with torch's AdamW
(lr 1e-4, weight decay 0.01), one torch thread per rank, under ``torchrun`` with gloo:

    zoo          LlamaForCausalLM.from_pretrained(dir, parallel=ParallelState.initialize(tp)), tp = 1, 2
    zoo-engine   the same model stepped as pretraining steps it (benchmarks/engine_path.py): the group joined as
                 zoo's jobs join, zoo's setup_engine (deepspeed.initialize) with the ds_config that
                 ``launch/pretrain.py --deepspeed_config ds_configs/llama_cpu_demo.json`` hands it (``--ds-config``;
                 torch's AdamW, clipping 1.0, micro-batch = the batch), one training-loop iteration per step (its
                 losses follow that config's learning-rate warm-up), tp = 1, 2
    *-compiled   with ``--compile``: zoo and zoo-engine again with the transformer blocks compiled
                 (zoo.models.compiled.compile_transformer_blocks); one line says so where this checkout lacks it
    zoo-unchunked, zoo-engine-stock
                 with ``--stock-step``: the "before" arm on this commit (benchmarks/engine_path.py): zoo with its
                 cross-entropy unchunked (every token in one chunk), and zoo-engine with that and DeepSpeed's stock
                 step (setup_engine without zoo's lighten_step); their "x zoo" is against zoo-unchunked
    hf           transformers' LlamaForCausalLM, tp = 1
    hf-tp        transformers' tensor-parallel model, from_pretrained(dir, distributed_config=
                 DistributedConfig(tp_plan="auto")) (DTensor), tp = 2
    ds-autotp    DeepSpeed AutoTP training: deepspeed.initialize(model=transformers' model, config=
                 ds_configs/llama_autotp_cpu.json, "tensor_parallel": {"autotp_size": 2}), tp = 2

A step is forward + backward + optimizer step (+ zero_grad), timed between barriers; the table gives the
median of ``--steps`` steps after one warm-up step, the best of ``--repeats`` launches per peer (launched
round robin: the machine may be shared). Tokens/s counts the batch's tokens once (every TP rank
works on the same tokens). "% peak" is the step's model FLOPs (6 N T + the attention's 12 L s^2 h b, N the
non-embedding parameters plus the LM head) over the measured single-thread sgemm rate x ranks. Strong-scaling
efficiency at tp = 2 is T(tp = 1) / (2 T(tp = 2)) against the same implementation's tp = 1 (zoo against zoo,
the transformers and DeepSpeed peers against transformers' own model). The first loss (before any update) and
the last show that every peer trains the same model; "x zoo" is the step time over zoo's model-only step at the
same tp (the engine path's cost); a second table splits each peer's step into forward, backward, optimizer
and data (zoo's phase clock, the host clock on CPU). A peer that cannot run here is listed with its own
error line. transformers' tensor-parallel loading needs ``accelerate``, which zoo does not depend on
(``pip install accelerate``, or put an installed copy on PYTHONPATH for the run). Timing only: nothing here is asserted, and the suite never runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DS_CONFIG = REPO / "ds_configs" / "llama_autotp_cpu.json"
ENGINE_DS_CONFIG = REPO / "ds_configs" / "llama_cpu_demo.json"
PEERS = (("zoo", 1), ("zoo", 2), ("zoo-engine", 1), ("zoo-engine", 2), ("hf", 1), ("hf-tp", 2), ("ds-autotp", 2))
COMPILED_PEERS = (("zoo-compiled", 1), ("zoo-compiled", 2), ("zoo-engine-compiled", 1), ("zoo-engine-compiled", 2))
STOCK_PEERS = (("zoo-unchunked", 1), ("zoo-unchunked", 2), ("zoo-engine-stock", 1), ("zoo-engine-stock", 2))
BASELINE = {"zoo": "zoo", "zoo-engine": "zoo-engine", "zoo-compiled": "zoo-compiled",
            "zoo-engine-compiled": "zoo-engine-compiled", "zoo-unchunked": "zoo-unchunked",
            "zoo-engine-stock": "zoo-engine-stock", "hf": "hf", "hf-tp": "hf", "ds-autotp": "hf"}
MODEL_ONLY = {"zoo-engine-stock": "zoo-unchunked"}   # the "x zoo" column's model-only peer (default: zoo)
RESULT_TAG = "BENCH_RESULT "
PHASES = ("forward", "backward", "optimizer", "data")

sys.path.insert(0, str(Path(__file__).resolve().parent))   # engine_path, beside this file


def shape(args) -> dict:
    """The benchmarked Llama: grouped-query attention (8 heads, 4 KV heads), SwiGLU, a 32k vocabulary."""
    return dict(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                max_position_embeddings=max(args.seq, 128), attention_dropout=0.0, bos_token_id=1, eos_token_id=2)


def write_checkpoint(args, directory: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape(args))).save_pretrained(directory)


def model_flops(args) -> float:
    """Training FLOPs of one step: 6 x (layer + LM-head parameters) x tokens + the attention scores and values."""
    h, i, layers, vocab = args.hidden, args.intermediate, args.layers, 32000
    kv = h // 2                                              # 4 of 8 heads' width for k and v each
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    tokens = args.batch * args.seq
    attention = 12 * layers * args.seq * h * tokens           # 3 x (QK^T and AV: 2 x 2 s h per token)
    return 6 * (layers * per_layer + vocab * h) * tokens + attention


def sgemm_rate() -> float:
    """FLOP/s of a 1024^3 fp32 matmul on one thread, the fastest of 10 (on a shared machine the fastest run is
    the one closest to the core's own rate)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    times = []
    for _ in range(10):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * 1024 ** 3 / min(times)


# ---------------------------------------------------------------------------- one peer, one rank
def build_engine_step(directory: str, args, ids):
    """The zoo-engine peer: zoo's Llama in an EngineStep (benchmarks/engine_path.py) at tp = the world."""
    from engine_path import EngineStep, compile_blocks, pretraining_ds_config

    from zoo.models import LlamaForCausalLM
    from zoo.training.startup import join

    world = int(os.environ["WORLD_SIZE"])
    parallel = join(world, 1234)
    model = LlamaForCausalLM.from_pretrained(directory, parallel=parallel).train()
    if args.worker.endswith("-compiled"):
        compile_blocks(model)
    ds_config, weight_decay = pretraining_ds_config(args.ds_config, args.batch, args.seq, world_size=world, tp=world)
    return EngineStep(model, ds_config, parallel, ids, weight_decay, stock=args.worker == "zoo-engine-stock")


def build(peer: str, directory: str, batch_size: int):
    """(model, optimizer step function, parallel state or None) of ``peer`` on this rank."""
    import torch
    import transformers

    if peer in ("zoo", "zoo-compiled", "zoo-unchunked"):
        from zoo.models import LlamaForCausalLM
        from zoo.parallel import ParallelState

        ps = ParallelState.initialize(int(os.environ["WORLD_SIZE"]))
        model = LlamaForCausalLM.from_pretrained(directory, parallel=ps).train()
        if peer == "zoo-compiled":
            from engine_path import compile_blocks

            compile_blocks(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        return model, optimizer, optimizer.step
    if peer == "hf":
        model = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="sdpa").train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        return model, optimizer, optimizer.step
    if peer == "hf-tp":
        from transformers.distributed import DistributedConfig

        model = transformers.LlamaForCausalLM.from_pretrained(
            directory, attn_implementation="sdpa", distributed_config=DistributedConfig(tp_plan="auto")).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        return model, optimizer, optimizer.step
    if peer == "ds-autotp":
        import deepspeed

        model = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="sdpa").train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        config = json.loads(DS_CONFIG.read_text())
        config["train_micro_batch_size_per_gpu"] = batch_size
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine, optimizer, engine.step
    raise ValueError(f"unknown peer {peer!r}; choose one of {sorted(BASELINE)}.")


def run_engine_worker(directory: str, args) -> None:
    """The zoo-engine peers: one training-loop iteration per step, timed between barriers like the others."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    ids = torch.randint(0, 32000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    step = build_engine_step(directory, args, ids)
    times, losses = [], []
    for index in range(args.steps + 1):
        if index == 1:
            step.reset_phases()       # the phases of the timed steps only
        dist.barrier()
        start = time.perf_counter()
        loss = step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    if dist.get_rank() == 0:
        print(RESULT_TAG + json.dumps({"step_s": statistics.median(times[1:]), "losses": losses,
                                       "phases_ms": step.phase_ms(), "mean_step_s": statistics.fmean(times[1:])}),
              flush=True)
    dist.destroy_process_group()


def run_worker(peer: str, directory: str, args) -> None:
    import torch
    import torch.distributed as dist

    if peer.startswith("zoo-engine"):
        run_engine_worker(directory, args)
        return
    torch.set_num_threads(1)
    if not dist.is_initialized() and peer != "hf-tp":       # transformers' TP joins the group itself
        dist.init_process_group("gloo")
    model, optimizer, step = build(peer, directory, args.batch)
    ids = torch.randint(0, 32000, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    from engine_path import one_chunk_cross_entropy

    from zoo.training.phase_clock import PhaseClock

    times, losses, clock = [], [], PhaseClock()
    for index in range(args.steps + 1):
        if index == 1:
            clock = PhaseClock()        # the phases of the timed steps only
        dist.barrier()
        start = time.perf_counter()
        clock.start()
        with one_chunk_cross_entropy() if peer == "zoo-unchunked" else contextlib.nullcontext():
            loss = model(ids, labels=ids).loss
        clock.lap("forward")
        if peer == "ds-autotp":
            model.backward(loss)
        else:
            loss.backward()
        clock.lap("backward")
        step()
        if peer != "ds-autotp":
            optimizer.zero_grad(set_to_none=True)
        clock.lap("optimizer")
        dist.barrier()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    if dist.get_rank() == 0:
        phases = {name: total / args.steps for name, total in clock.totals_ms().items()}
        print(RESULT_TAG + json.dumps({"step_s": statistics.median(times[1:]), "losses": losses, "phases_ms": phases,
                                       "mean_step_s": statistics.fmean(times[1:])}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the driver
def run_peer(peer: str, tp: int, directory: str, args) -> dict:
    """Launch one peer under torchrun; its result, or its own last error line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
               __file__, "--worker", peer, "--dir", directory, "--steps", str(args.steps), "--layers", str(args.layers),
               "--seq", str(args.seq), "--batch", str(args.batch), "--hidden", str(args.hidden),
               "--intermediate", str(args.intermediate), "--ds-config", str(args.ds_config)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return {"error": last_error_line(done.stderr + done.stdout)}


def last_error_line(output: str) -> str:
    """A failed rank's own exception line ("[rank0]: ValueError: ..."), else the last exception line of any
    process (torchrun's ChildFailedError only when nothing else names one)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    exception = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b.*:")
    errors = [line for line in lines if exception.match(line) and "ChildFailedError" not in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def table(results: dict, args, peak: float) -> str:
    tokens, flops = args.batch * args.seq, model_flops(args)
    rows = ["| peer | tp | step (s) | tokens/s | % sgemm peak | tp=2 scaling | x zoo | first loss | last loss |",
            "|---|---|---|---|---|---|---|---|---|"]
    for (peer, tp), result in results.items():
        if "error" in result:
            rows.append(f"| {peer} | {tp} | cannot run here: {result['error']} | | | | | | |")
            continue
        step = result["step_s"]
        base = results.get((BASELINE[peer], 1), {})
        scaling = f"{base['step_s'] / (tp * step):.0%}" if tp > 1 and "step_s" in base else ""
        zoo = results.get((MODEL_ONLY.get(peer, "zoo"), tp), {})
        versus = f"{step / zoo['step_s']:.2f}" if "step_s" in zoo else ""
        rows.append(f"| {peer} | {tp} | {step:.3f} | {tokens / step:,.0f} | {flops / step / (peak * tp):.0%} | "
                    f"{scaling} | {versus} | {result['losses'][0]:.6f} | {result['losses'][-1]:.6f} |")
    return "\n".join(rows)


def phase_table(results: dict) -> str:
    """Where each peer's step went (ms per step on rank 0, means over the timed steps; optimizer: the step and
    zero_grad, or engine.step() with clipping; data: the engine's batch copy; rest: the step minus them)."""
    rows = ["| peer | tp | step (ms, mean) | " + " | ".join(PHASES) + " | rest |",
            "|---|---|---|" + "---|" * (len(PHASES) + 1)]
    for (peer, tp), result in results.items():
        if "phases_ms" not in result:
            continue
        phases = [result["phases_ms"].get(name, 0.0) for name in PHASES]
        mean = 1e3 * result["mean_step_s"]
        rows.append(f"| {peer} | {tp} | {mean:.1f} | " + " | ".join(f"{ms:.1f}" for ms in phases)
                    + f" | {mean - sum(phases):.1f} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="launches per peer; the fastest is reported")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--peers", default=None,
                        help="comma-separated peer:tp pairs (default: every peer; with --compile also the compiled ones, with "
                             "--stock-step the stock ones)")
    parser.add_argument("--ds-config", default=str(ENGINE_DS_CONFIG), help="the pretraining ds_config of zoo-engine")
    parser.add_argument("--compile", action="store_true",
                        help="also time zoo and zoo-engine with the transformer blocks compiled (zoo.models.compiled)")
    parser.add_argument("--stock-step", action="store_true",
                        help="also time zoo-unchunked and zoo-engine-stock (the unchunked cross-entropy, DeepSpeed's "
                             "stock step)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.dir, args)
        return
    from engine_path import compile_missing

    missing = compile_missing() if args.compile else None
    if missing:
        print(missing, flush=True)
    default = PEERS + (COMPILED_PEERS if args.compile and not missing else ()) + (STOCK_PEERS if args.stock_step else ())
    peers = ([(name, int(tp)) for name, tp in (item.split(":") for item in args.peers.split(","))] if args.peers
             else list(default))
    if missing:
        peers = [(name, tp) for name, tp in peers if not name.endswith("-compiled")]
    peak = sgemm_rate()
    with tempfile.TemporaryDirectory(prefix="bench-llama-") as directory:
        write_checkpoint(args, directory)
        results: dict = {}
        for _ in range(args.repeats):          # round robin, so a burst of load elsewhere hits every peer alike
            for peer, tp in peers:
                result = run_peer(peer, tp, directory, args)
                print(f"{peer} tp={tp}: {result}", file=sys.stderr, flush=True)
                best = results.get((peer, tp))
                if best is None or "error" in best or result.get("step_s", float("inf")) < best["step_s"]:
                    results[(peer, tp)] = result
    print(f"Llama {args.layers} layers, hidden {args.hidden}, 8 heads / 4 KV heads, intermediate "
          f"{args.intermediate}, vocab 32000; batch {args.batch} x seq {args.seq}, fp32, AdamW, 1 thread per rank; "
          f"sgemm peak {peak / 1e9:.1f} GFLOP/s per thread; model FLOPs/step {model_flops(args) / 1e9:.1f} G; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(table(results, args, peak))
    if phases := phase_table(results):
        print()
        print(phases)


if __name__ == "__main__":
    main()
