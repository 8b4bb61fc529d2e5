"""The vocab-parallel cross-entropy on one rank's logits shard: time and fp32 bytes, chunked against unchunked.

One rank's work at tp = p is its (batch, seq, 50,304 / p) shard of GPT-2's padded logits; the collectives
(O(batch * seq) scalars) are left out, so this runs in one process. Per variant and logits dtype: forward and
backward milliseconds (median of ``--repeats`` runs, the variants interleaved so that load on a shared machine
hits them alike), the peak bytes of fp32 tensors alive at once inside forward + backward and the bytes saved
for backward besides the logits (both measured in one extra, untimed run by tests/helpers/tensor_bytes.py),
against the whole logits in fp32.

Variants: ``chunked (CPU default)`` (zoo's default here, ``CPU_CHUNK_BYTES``), ``chunked (accelerator
default)`` (chunks of ``CHUNK_BYTES``, what a GPU gets), ``one chunk`` (zoo with every token in one
chunk), ``torch`` (F.cross_entropy on the logits upcast to fp32, at the widest shard only: a yardstick, with no
vocab parallelism), and with ``--against REV`` zoo's zoo/parallel/cross_entropy.py at git revision REV.

    .venv/bin/python benchmarks/bench_cross_entropy.py                        # (8, 256, 50304 / tp), tp 1 2 4
    .venv/bin/python benchmarks/bench_cross_entropy.py --against 3bf445d      # and the unchunked loss before
    .venv/bin/python benchmarks/bench_cross_entropy.py --quick                # (2, 64, ...), a smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.helpers.tensor_bytes import LiveTensorBytes, saved_tensor_bytes  # noqa: E402
from zoo.parallel import cross_entropy as zoo_ce  # noqa: E402

PADDED_VOCAB, VOCAB = 50304, 50257


def module_at(rev: str):
    """zoo/parallel/cross_entropy.py as it was at git revision ``rev``, imported as its own module."""
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:zoo/parallel/cross_entropy.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"cross_entropy_{rev}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"cross_entropy_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants(width: int, vocab: int, against) -> dict:
    """{name: loss(logits, targets) -> per-token loss} for a shard ``width`` wide holding ``vocab`` real columns."""
    accelerator_chunk = zoo_ce.default_chunk_tokens(width, torch.float32, "cuda")
    found = {
        "chunked (CPU default)": lambda x, t: zoo_ce.vocab_parallel_cross_entropy(x, t, vocab_size=vocab),
        "chunked (accelerator default)": lambda x, t: zoo_ce.vocab_parallel_cross_entropy(
            x, t, vocab_size=vocab, chunk_tokens=accelerator_chunk),
        "one chunk": lambda x, t: zoo_ce.vocab_parallel_cross_entropy(x, t, vocab_size=vocab, chunk_tokens=t.numel()),
    }
    if against is not None:
        found[f"at {against[0]}"] = lambda x, t: against[1].vocab_parallel_cross_entropy(x, t, vocab_size=vocab)
    if width == PADDED_VOCAB:
        found["torch"] = lambda x, t: F.cross_entropy(x[..., :vocab].float().flatten(0, -2), t.flatten(),
                                                      reduction="none").view(t.shape)
    return found


def timed(loss_fn, logits, targets) -> tuple[float, float]:
    x = logits.detach().requires_grad_()
    start = time.perf_counter()
    loss = loss_fn(x, targets)
    middle = time.perf_counter()
    loss.sum().backward()
    return middle - start, time.perf_counter() - middle


def measured_bytes(loss_fn, logits, targets) -> tuple[int, int]:
    x = logits.detach().requires_grad_()
    with LiveTensorBytes({torch.float32}) as live, saved_tensor_bytes(x) as saved:
        loss_fn(x, targets).sum().backward()
    return live.peak, sum(nbytes for _, nbytes in saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", metavar="REV", help="also time zoo's loss at this git revision")
    parser.add_argument("--quick", action="store_true", help="batch 2, seq 64, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.repeats = 2, 64, 3
    torch.set_num_threads(args.threads)
    against = (args.against, module_at(args.against)) if args.against else None

    print(f"cross-entropy of one rank's (batch {args.batch}, seq {args.seq}, {PADDED_VOCAB:,} / tp) logits shard, "
          f"{args.threads} thread(s), median of {args.repeats}; chunk budgets: CPU {zoo_ce.CPU_CHUNK_BYTES // 2**20} MiB, "
          f"accelerator {zoo_ce.CHUNK_BYTES // 2**20} MiB")
    print("| tp | dtype | variant | forward ms | backward ms | total ms | peak fp32 MB alive | saved MB | whole fp32 MB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for tp in args.tp:
        width = PADDED_VOCAB // tp
        vocab = min(VOCAB - (tp - 1) * width, width)   # the last rank: the one holding the padding
        targets = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
        targets[:, -1] = -100
        for dtype_name in args.dtypes:
            logits = (torch.randn(args.batch, args.seq, width, generator=gen) * 2).to(getattr(torch, dtype_name))
            found = variants(width, vocab, against)
            times = {name: [] for name in found}
            for _ in range(args.repeats):
                for name, fn in found.items():
                    times[name].append(timed(fn, logits, targets))
            whole = logits.numel() * 4 / 1e6
            for name, fn in found.items():
                forward = statistics.median(f for f, _ in times[name]) * 1e3
                backward = statistics.median(b for _, b in times[name]) * 1e3
                peak, saved = measured_bytes(fn, logits, targets)
                print(f"| {tp} | {dtype_name} | {name} | {forward:.0f} | {backward:.0f} | {forward + backward:.0f} | "
                      f"{peak / 1e6:.1f} | {saved / 1e6:.1f} | {whole:.1f} |", flush=True)


if __name__ == "__main__":
    main()
