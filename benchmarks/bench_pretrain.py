"""Pretraining pipeline throughput on this machine (printed, never asserted):

1. preprocessing the bundled Wikipedia sample with the GPT-2 BPE at 1 vs 2 worker processes;
2. training tokens/s and TFLOPs per device of the CPU demo shape (ds_configs/cpu_demo.json) at
   tp = 1 (one rank) vs tp = 2 (two ranks), through the real `deepspeed` launcher.

    .venv/bin/python benchmarks/bench_pretrain.py [--iters 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def preprocessing_rows(workers_list) -> list[list[str]]:
    from zoo.data import preprocess
    from zoo.data.preprocess import BUNDLED_CORPUS

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in workers_list:
            summary = preprocess([str(BUNDLED_CORPUS)], f"{tmp}/w{workers}", workers=workers, progress=False)
            rows.append([str(workers), str(summary.documents), str(summary.tokens), f"{summary.seconds:.2f}",
                         f"{summary.docs_per_s:.1f}", f"{summary.tokens_per_s:,.0f}"])
    return rows


def training_row(ranks: int, iters: int) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "launch/pretrain.py",
               "--deepspeed_config", "ds_configs/cpu_demo.json", "--tensor-parallel-size", str(ranks),
               "--train-iters", str(iters), "--eval-interval", "0", "--log-interval", "1", "--save", tmp]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1", GLOO_SOCKET_IFNAME="lo"))
        events = [json.loads(line) for line in Path(tmp, "metrics.jsonl").read_text().splitlines()]
    steady = [e for e in events if "split" not in e][3:]  # drop warm-up iterations
    tokens = statistics.median(e["tokens_per_s"] for e in steady)
    tflops = statistics.median(e["tflops"] for e in steady)
    return [f"tp={ranks}", str(ranks), f"{tokens:,.0f}", f"{1000 * tflops:.1f}"], tokens


def print_table(title, headers, rows) -> None:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=30, help="training iterations per run (median of the last)")
    args = parser.parse_args()
    print_table("1. preprocessing the bundled corpus (GPT-2 BPE)",
                ["workers", "documents", "tokens", "seconds", "docs/s", "tokens/s"], preprocessing_rows([1, 2]))
    tp1, tokens1 = training_row(1, args.iters)
    tp2, tokens2 = training_row(2, args.iters)
    print_table("2. training the CPU demo shape (gpt2-tiny, seq 128, global batch 8, fp32), deepspeed launcher",
                ["layout", "ranks", "tokens/s (median)", "GFLOP/s per rank"], [tp1, tp2])
    print(f"tp=2 / tp=1 throughput: {tokens2 / tokens1:.2f}x. Both use all {os.cpu_count()} cores: tp=1 is one rank "
          "with every core's thread, tp=2 two ranks of one thread each (zoo shares the cores between local ranks).")


if __name__ == "__main__":
    main()
