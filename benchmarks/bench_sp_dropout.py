"""Sequence parallelism with dropout on: do 20 training steps with and without SP follow each other
within the noise of two seeds?

With dropout on, SP changes which masks are drawn (the embedding and residual dropouts act on each
rank's own s/p tokens and draw from the TP-rank stream, not the shared default stream), so the loss
curves cannot be equal, only statistically alike. The yardstick is the seed-to-seed noise of the
same setting: two dropout seeds, same initial weights, same batches.

Setup: tp = 2 (two CPU processes, gloo, tests/spawn.py), gpt2-tiny (2 layers, h = 128, 4 heads, GPT-2
vocabulary padded to 51,200), embd/resid/attn dropout 0.1, fp32; sequences of 64 tokens of the bundled
Wikipedia sample (GPT-2 tokenizer), batch 8, a new batch each step, the same batches in every run;
torch AdamW lr 1e-3, weight decay 0.01, no schedule, no clipping. Initial weights from torch seed 0
(TP-invariant initialisation, so all four runs start identical); ``zoo.parallel.model_parallel_seed``
with the dropout seed (1 or 2) seeds both dropout streams.

Per step: gap_SP = |loss_SP - loss_noSP| (same seed), gap_seed = |loss_seed1 - loss_seed2| (same SP
setting). Printed: the per-step table, then max and mean of each gap and their ratios.

    .venv/bin/python benchmarks/bench_sp_dropout.py
    .venv/bin/python benchmarks/bench_sp_dropout.py --fault same-mask     # SP dropout: one mask on every rank
    .venv/bin/python benchmarks/bench_sp_dropout.py --fault no-sp-dropout  # SP regions drop nothing

``--fault`` patches the model in the worker processes to show what the comparison can and cannot see.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.helpers.sp_dropout import FAULTS, SEEDS, corpus_batches, gaps, summary, worker  # noqa: E402


# ---------------------------------------------------------------- the runs (tests/helpers/sp_dropout.py holds them)
def measure(steps: int = 20, batch: int = 8, seq: int = 64, tp: int = 2, fault: str = "none") -> dict:
    """Spawn ``tp`` CPU ranks and return rank 0's runs (the loss is the same on every TP rank)."""
    from tests.spawn import spawn

    runs = spawn(worker, tp, corpus_batches(steps, batch, seq), fault)
    assert all(r == runs[0] for r in runs), "TP ranks disagree on the loss"
    return runs[0]


# ---------------------------------------------------------------- the report
def print_report(runs: dict, args) -> None:
    s1, s2 = SEEDS
    per_step = gaps(runs)
    columns = {f"noSP s{s1}": runs[(False, s1)], f"noSP s{s2}": runs[(False, s2)],
               f"SP s{s1}": runs[(True, s1)], f"SP s{s2}": runs[(True, s2)], **per_step}
    headers = ["step", *columns]
    rows = [[str(i + 1)] + [f"{col[i]:.4f}" for col in columns.values()] for i in range(len(runs[(False, s1)]))]
    widths = [max(len(h), *(len(r[j]) for r in rows)) for j, h in enumerate(headers)]
    print(f"gpt2-tiny, tp={args.tp}, dropout 0.1, batch {args.batch} x {args.seq} tokens of the bundled corpus, "
          f"AdamW lr 1e-3, {args.steps} steps; dropout seeds {s1} and {s2}, same initial weights"
          + ("" if args.fault == "none" else f"; FAULT INJECTED: {args.fault}"))
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    s = summary(runs)
    print(f"\nSP vs no SP (same seed), {2 * args.steps} step pairs: max {s['sp_max']:.4f}, mean {s['sp_mean']:.4f}")
    print(f"seed {s1} vs seed {s2} (same setting), {2 * args.steps} step pairs: max {s['seed_max']:.4f}, "
          f"mean {s['seed_mean']:.4f}")
    print(f"ratio SP gap / seed gap: max {s['sp_max'] / s['seed_max']:.2f}x, mean {s['sp_mean'] / s['seed_mean']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    args = parser.parse_args()
    print_report(measure(args.steps, args.batch, args.seq, args.tp, args.fault), args)


if __name__ == "__main__":
    main()
