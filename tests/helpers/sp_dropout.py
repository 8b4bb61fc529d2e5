"""Sequence parallelism with dropout on, the experiment that tests/test_sp_dropout.py checks and
benchmarks/bench_sp_dropout.py reports: gpt2-tiny trained with and without SP under two dropout seeds
from the same initial weights on the same batches, the per-step loss gaps, and faults to inject into
zoo's region dropout to show what the comparison can and cannot see."""

from __future__ import annotations

import contextlib
import gzip
import statistics
from typing import TYPE_CHECKING

from tests.helpers.corpora import WIKI_SAMPLE

if TYPE_CHECKING:
    import torch

SEEDS = (1, 2)
FAULTS = ("none", "same-mask", "no-sp-dropout")


def corpus_batches(steps: int, batch: int, seq: int) -> torch.Tensor:
    """(steps, batch, seq) token ids: the bundled Wikipedia sample, GPT-2 tokenized, documents joined
    by <|endoftext|>, cut into consecutive sequences."""
    import json

    import torch

    from zoo.data.tokenizers import load_gpt2_tokenizer

    tokenizer = load_gpt2_tokenizer()
    need = steps * batch * seq
    ids: list[int] = []
    with gzip.open(WIKI_SAMPLE, "rt") as src:
        for line in src:
            ids.extend(tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id])
            if len(ids) >= need:
                break
    if len(ids) < need:
        raise ValueError(f"the bundled corpus has {len(ids)} tokens, fewer than the {need} that "
                         f"--steps/--batch/--seq ask for; choose a smaller shape.")
    return torch.tensor(ids[:need]).view(steps, batch, seq)


@contextlib.contextmanager
def injected_fault(fault: str):
    """Patch zoo's region dropout for the duration: ``same-mask`` draws SP-region dropout from the
    default stream, identical on every TP rank (the bug of forgetting the TP-rank stream);
    ``no-sp-dropout`` skips dropout on SP regions (embedding and residual dropout)."""
    import zoo.models.gpt2.model as gpt2
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


def train_losses(parallel, batches, sequence_parallel: bool, seed: int, lr: float = 1e-3) -> list[float]:
    """Losses of len(batches) AdamW steps of gpt2-tiny with dropout 0.1 (initial weights: torch seed 0)."""
    import torch

    from zoo.models import GPT2LMHeadModel
    from zoo.models.gpt2.presets import gpt2_config
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
