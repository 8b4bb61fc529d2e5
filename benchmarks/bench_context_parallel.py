"""Context parallelism (DeepSpeed-Ulysses) against data parallelism on CPU: one Llama training step, same tokens.

    python benchmarks/bench_context_parallel.py [--seq 2048 8192] [--steps 3] [--vocab 4096] [--layers 2]

Two gloo ranks on loopback (tests/spawn.py), one torch thread each, fp32, dropout off, the llama-tiny shape
(hidden 128, intermediate 352, 4 heads / 2 KV heads, 2 layers) with a ``--vocab`` of 4096 by default (the
preset's 50,257 makes the LM head and loss most of the step and hides the attention), built from one seed:

    C = 1   ParallelState.initialize(1): tp1 x dp2. Rank r takes sequence r of a (2, S) batch whole: one
            forward + backward per rank.
    C = 2   ParallelState.initialize(1, cp_size=2): tp1 x cp2. The two ranks share each sequence (rank j holds
            tokens [j S/2, (j+1) S/2), zoo.parallel.context.context_shard) and take the same two sequences one
            after the other: two forward + backward micro-steps, gradients accumulating.

So a "step" is the same 2 S tokens in both rows: the table compares the same work split by sequence (C = 1) or
within each sequence (C = 2). A step is the model only: forward (loss with labels) + backward, after
zero_grad(set_to_none=True), timed between barriers; no optimizer and no gradient all-reduce (both layouts
would sum the same gradient bytes once a step, over dp or over the context ranks). The table gives the median of
``--steps`` steps after one warm-up step, rank 0's clock (the barriers make the ranks' step times equal):

    ms/step          the median step
    tokens/s         2 S / that step, both ranks together
    all-to-all       time spent inside ``deepspeed.comm.all_to_all_single`` per step, the mean of the two ranks
                     (deepspeed/sequence/layer.py calls it through the module, ``dist.all_to_all_single`` with
                     ``import deepspeed.comm as dist``, so replacing the module's attribute sees every call:
                     Q, K, V and the output forward, their gradients backward), and its share of the step. It
                     includes waiting for the other rank to arrive, so it is an upper bound of the transfer
    saved / rank     bytes autograd saves for backward in one micro-step's forward on one rank (each storage
                     once, parameters left out; tests/helpers/tensor_bytes.py): the activations the layout keeps
    peak RSS / rank  the most resident memory of a rank over the timed steps (VmHWM after resetting it through
                     /proc/self/clear_refs once the model is built), the larger of the two ranks; it includes
                     the interpreter, torch and DeepSpeed. "n/a" where the kernel refuses the reset

Timing only: nothing is asserted, and the suite never runs it.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))          # tests.spawn, tests.helpers, zoo from a checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PRESET = "llama-tiny"
MIB = 2 ** 20


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where that is refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class AllToAllClock:
    """Wraps ``deepspeed.comm.all_to_all_single`` (the function object Ulysses' layer looks up at each call) with
    a host clock: ``seconds`` and ``calls`` since the last ``reset``."""

    def __init__(self):
        import deepspeed.comm as ds_comm

        self.module, self.original = ds_comm, ds_comm.all_to_all_single
        self.seconds, self.calls = 0.0, 0

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        ds_comm.all_to_all_single = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def worker(rank: int, world_size: int, cp: int, seq: int, vocab: int, layers: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from tests.helpers.tensor_bytes import saved_tensor_bytes
    from zoo.models import LlamaForCausalLM
    from zoo.models.llama.presets import llama_config
    from zoo.parallel import ParallelState
    from zoo.parallel.context import context_shard

    torch.set_num_threads(1)
    ps = ParallelState.initialize(1, cp_size=cp)
    torch.manual_seed(0)
    config = llama_config(PRESET, vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=seq,
                          attention_dropout=0.0)
    model = LlamaForCausalLM(config, parallel=ps).train()
    clock = AllToAllClock()
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))       # (2, S)
    sequences = [{"input_ids": ids[i:i + 1], "labels": ids[i:i + 1].clone()} for i in range(2)]
    # C = 1: this rank's sequence whole; C = 2: this rank's half of each of the two sequences
    micro = [sequences[rank]] if cp == 1 else [context_shard(s, ps) for s in sequences]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for batch in micro:
            model(**batch).loss.backward()

    rss_reset = reset_peak_rss()
    times, a2a_seconds, a2a_calls = [], [], []
    for _ in range(steps + 1):
        clock.reset()
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        a2a_seconds.append(clock.seconds)
        a2a_calls.append(clock.calls)
    peak = peak_rss_bytes() if rss_reset else None

    params = list(model.parameters())
    with saved_tensor_bytes(*params) as record:
        loss = model(**micro[0]).loss
    loss.backward()
    saved = sum(nbytes for _, nbytes in record)
    return {"step_s": statistics.median(times[1:]), "times": times[1:],
            "a2a_s": statistics.median(a2a_seconds[1:]), "a2a_calls": a2a_calls[-1],
            "saved": saved, "peak_rss": peak, "loss": loss.item()}


def fmt_mib(nbytes) -> str:
    return "n/a" if nbytes is None else f"{nbytes / MIB:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192], help="sequence lengths S")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median), after one warm-up step")
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary (the preset's is 50257)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    args = parser.parse_args()

    from tests.spawn import spawn

    rows = []
    for seq in args.seq:
        results = {}
        for cp in (1, 2):
            print(f"S = {seq}, C = {cp} ...", file=sys.stderr, flush=True)
            start = time.perf_counter()
            ranks = spawn(worker, 2, cp, seq, args.vocab, args.layers, args.steps, timeout=args.timeout)
            print(f"  {time.perf_counter() - start:.0f} s; step times {[f'{t:.3f}' for t in ranks[0]['times']]}",
                  file=sys.stderr, flush=True)
            results[cp] = ranks
        base = 2 * seq / results[1][0]["step_s"]
        for cp in (1, 2):
            ranks = results[cp]
            step_s = ranks[0]["step_s"]
            a2a_s = statistics.fmean(r["a2a_s"] for r in ranks)
            tokens_s = 2 * seq / step_s
            layout = "tp1 x dp2, 1 sequence per rank" if cp == 1 else "tp1 x cp2, 2 micro-steps of 1 shared sequence"
            peaks = [r["peak_rss"] for r in ranks]
            rows.append([f"{seq:,}", f"{cp} ({layout})", f"{step_s * 1e3:,.0f}", f"{tokens_s:,.0f}",
                         f"{tokens_s / base:.2f}", f"{a2a_s * 1e3:,.1f}", f"{100 * a2a_s / step_s:.1f} %",
                         str(ranks[0]["a2a_calls"]), fmt_mib(max(r["saved"] for r in ranks)),
                         fmt_mib(None if None in peaks else max(peaks))])

    print(f"\nLlama ({PRESET} shape, vocab {args.vocab}, {args.layers} layers), fp32, 2 gloo ranks x 1 thread; a step "
          f"is 2 x S tokens (forward + backward), median of {args.steps} after 1 warm-up\n")
    header = ["S", "C", "ms/step", "tokens/s", "x C=1", "all-to-all ms/step", "all-to-all share",
              "all-to-all calls/step", "saved / rank MiB", "peak RSS / rank MiB"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
