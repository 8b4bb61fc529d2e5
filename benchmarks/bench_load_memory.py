"""Per-rank memory of loading a transformers-layout checkpoint at tp = 4 (``from_pretrained``).

Every rank reads only its own slices (``safe_open(...).get_slice``) into a model built on the meta
device, so its peak should be about (sharded parameters / tp) + replicated ones, well under the full
model. Loading a rank needs no process group, so each rank is measured alone in a fresh process:
peak RSS growth during the load (high-water mark VmHWM, reset just before, minus RSS before), next to
the bytes of the parameters it ends up holding and the full model's bytes. A tp = 1 load is the
reference. RSS also counts the pages of the memory-mapped safetensors file a rank touches: a
column slice of a row-major tensor touches all of that tensor's pages (reclaimable page cache, not
allocations), so the figure is an upper bound on what the rank allocates.

Prints one table; nothing is asserted (tests/test_reshard.py asserts a generous bound on a smaller model).

    .venv/bin/python benchmarks/bench_load_memory.py                 # GPT-2 8 x 512, ~200 MB fp32
    .venv/bin/python benchmarks/bench_load_memory.py --layers 2 --hidden 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Set this process's RSS high-water mark (VmHWM) to its current RSS (Linux, clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def peak_rss_bytes() -> int:
    """VmHWM: the RSS high-water mark of this process image (``ru_maxrss`` would also count the parent's
    RSS at fork, which Linux carries across exec)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line; this benchmark needs Linux.")


def measure(directory: str, tp: int, rank: int) -> dict:
    """Load rank ``rank`` of tp = ``tp`` from ``directory`` in this process; memory figures in bytes."""
    import torch

    from zoo.checkpoint.layout import layout_only_state
    from zoo.models import GPT2LMHeadModel
    from zoo.parallel import is_tensor_parallel

    torch.set_num_threads(1)
    parallel = layout_only_state(tp, rank) if tp > 1 else None
    reset_peak_rss()
    before = current_rss_bytes()
    model = GPT2LMHeadModel.from_pretrained(directory, parallel=parallel)
    peak = peak_rss_bytes()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    sharded = sum(p.numel() * p.element_size() for p in model.parameters() if is_tensor_parallel(p))
    return {"tp": tp, "rank": rank, "peak_growth": max(peak - before, 0), "held": held, "sharded": sharded}


def measure_in_fresh_process(directory: Path, tp: int, rank: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--measure", str(directory), str(tp), str(rank)],
                          cwd=REPO, capture_output=True, text=True, check=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_checkpoint(directory: Path, layers: int, hidden: int) -> None:
    """A random zoo GPT-2 saved in transformers' layout."""
    import torch

    from zoo.models import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=8, n_positions=256)
    GPT2LMHeadModel(config).save_pretrained(directory)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--measure", nargs=3, metavar=("DIR", "TP", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        directory, tp, rank = args.measure
        print(json.dumps(measure(directory, int(tp), int(rank))))
        return

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "hf"
        write_checkpoint(directory, args.layers, args.hidden)
        rows = [measure_in_fresh_process(directory, 1, 0)]
        rows += [measure_in_fresh_process(directory, args.tp, rank) for rank in range(args.tp)]
    full = rows[0]["held"]   # the whole model, as a tp = 1 load holds it
    mib = 2 ** 20
    print(f"GPT-2 {args.layers} layers x {args.hidden} hidden: full model {full / mib:.1f} MiB (fp32)")
    print(f"{'tp':>3} {'rank':>4} {'held MiB':>9} {'peak RSS growth MiB':>20} {'peak / full':>11}")
    for row in rows:
        print(f"{row['tp']:>3} {row['rank']:>4} {row['held'] / mib:>9.1f} {row['peak_growth'] / mib:>20.1f} "
              f"{row['peak_growth'] / full:>11.2f}")


if __name__ == "__main__":
    main()
