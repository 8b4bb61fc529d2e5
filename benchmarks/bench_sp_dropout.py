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
import contextlib
import gzip
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SEEDS = (1, 2)
FAULTS = ("none", "same-mask", "no-sp-dropout")


# ---------------------------------------------------------------- data
def corpus_batches(steps: int, batch: int, seq: int) -> torch.Tensor:
    """(steps, batch, seq) token ids: the bundled Wikipedia sample, GPT-2 tokenized, documents joined
    by <|endoftext|>, cut into consecutive sequences."""
    import json

    import torch

    from zoo.data.tokenizers import load_gpt2_tokenizer

    tokenizer = load_gpt2_tokenizer()
    need = steps * batch * seq
    ids: list[int] = []
    with gzip.open(REPO / "zoo" / "assets" / "corpora" / "wiki-sample.jsonl.gz", "rt") as src:
        for line in src:
            ids.extend(tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id])
            if len(ids) >= need:
                break
    if len(ids) < need:
        raise ValueError(f"the bundled corpus has {len(ids)} tokens, fewer than the {need} that "
                         f"--steps/--batch/--seq ask for; choose a smaller shape.")
    return torch.tensor(ids[:need]).view(steps, batch, seq)


# ---------------------------------------------------------------- faults (what the check can see)
@contextlib.contextmanager
def injected_fault(fault: str):
    """Patch zoo's region dropout for the duration: ``same-mask`` draws SP-region dropout from the
    default stream, identical on every TP rank (the bug of forgetting the TP-rank stream);
    ``no-sp-dropout`` skips dropout on SP regions (embedding and residual dropout)."""
    import zoo.models.gpt2 as gpt2
    import zoo.models.transformer as transformer

    saved = (transformer.region_rng, transformer.region_dropout, gpt2.region_dropout)
    real_dropout = transformer.region_dropout
    if fault == "same-mask":
        transformer.region_rng = lambda parallel, sequence_parallel: contextlib.nullcontext()
    elif fault == "no-sp-dropout":
        def skipping(dropout, x, parallel, sequence_parallel):
            return x if sequence_parallel else real_dropout(dropout, x, parallel, sequence_parallel)

        transformer.region_dropout = gpt2.region_dropout = skipping
    try:
        yield
    finally:
        transformer.region_rng, transformer.region_dropout, gpt2.region_dropout = saved


# ---------------------------------------------------------------- one run
def train_losses(parallel, batches, sequence_parallel: bool, seed: int, lr: float = 1e-3) -> list[float]:
    """Losses of len(batches) AdamW steps of gpt2-tiny with dropout 0.1 (initial weights: torch seed 0)."""
    import torch

    from zoo.models import GPT2LMHeadModel
    from zoo.models.presets import gpt2_config
    from zoo.parallel import model_parallel_seed

    config = gpt2_config("gpt2-tiny", n_positions=batches.shape[-1], resid_pdrop=0.1, embd_pdrop=0.1,
                         attn_pdrop=0.1, sequence_parallel=sequence_parallel)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config, parallel=parallel).train()
    model_parallel_seed(seed, parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def worker(rank: int, world_size: int, batches, fault: str = "none") -> dict:
    """Every (SP, seed) run on this rank: {(sp, seed): losses}."""
    from zoo.parallel import ParallelState

    parallel = ParallelState.initialize(world_size)
    runs = {}
    for sp in (False, True):
        with injected_fault(fault):
            for seed in SEEDS:
                runs[(sp, seed)] = train_losses(parallel, batches, sp, seed)
    return runs


def measure(steps: int = 20, batch: int = 8, seq: int = 64, tp: int = 2, fault: str = "none") -> dict:
    """Spawn ``tp`` CPU ranks and return rank 0's runs (the loss is the same on every TP rank)."""
    from tests.spawn import spawn

    runs = spawn(worker, tp, corpus_batches(steps, batch, seq), fault)
    assert all(r == runs[0] for r in runs), "TP ranks disagree on the loss"
    return runs[0]


# ---------------------------------------------------------------- the comparison
def gaps(runs: dict) -> dict[str, list[float]]:
    """Per-step |SP - noSP| for each seed and |seed1 - seed2| for each SP setting."""
    s1, s2 = SEEDS
    out = {f"|SP-noSP| s{s}": [abs(a - b) for a, b in zip(runs[(True, s)], runs[(False, s)])] for s in SEEDS}
    out.update({f"|s{s1}-s{s2}| {name}": [abs(a - b) for a, b in zip(runs[(sp, s1)], runs[(sp, s2)])]
                for sp, name in ((False, "noSP"), (True, "SP"))})
    return out


def summary(runs: dict) -> dict[str, float]:
    """max and mean over steps (and over both seeds / both settings) of the SP gap and the seed gap."""
    per_step = gaps(runs)
    sp_gap = [g for k, v in per_step.items() if k.startswith("|SP") for g in v]
    seed_gap = [g for k, v in per_step.items() if not k.startswith("|SP") for g in v]
    return {"sp_max": max(sp_gap), "sp_mean": statistics.fmean(sp_gap),
            "seed_max": max(seed_gap), "seed_mean": statistics.fmean(seed_gap)}


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
    # Through the package name, so the forkserver workers can import the worker function.
    from benchmarks.bench_sp_dropout import measure as measure_in_package

    print_report(measure_in_package(args.steps, args.batch, args.seq, args.tp, args.fault), args)


if __name__ == "__main__":
    main()
