"""Model-parallel RNG (Shoeybi et al. 2019, section 3, "dropout").

Two random streams per rank:

* the default torch/accelerator generator, seeded with ``seed + 100 * pp_rank`` on every rank: dropout
  outside tensor-parallel regions (embeddings, residuals) acts on replicated activations and must draw
  the same mask on every TP rank of a group;
* DeepSpeed's model-parallel RNG tracker (``deepspeed.checkpointing``), seeded with
  ``seed + 100 * pp_rank + 2718 + tp_rank``: dropout inside TP regions (attention probabilities of this
  rank's heads) acts on different data on every TP rank and must draw independent masks.

The pipeline stage's offset (Megatron's ``100 * pp_rank``) gives every stage its own streams; with one
stage it is 0. Both seeds come from :func:`rank_seeds`, at the start of a run and after a resume at another
layout (:func:`seed_after_layout_change`), so no two stages or TP ranks ever share a TP stream. Weight init does not draw from these streams on a pipeline stage: the stage replays the
init sequence of the whole model from the run's seed (:mod:`zoo.models.gpt2.pipeline`).

Under sequence parallelism (Korthikanti et al. 2022) the regions between the TP GEMMs hold each
rank's own s/p tokens, so their dropout (embedding, residual) is a TP-region dropout too: it draws
from the tracker (:func:`region_rng`), masks differing per rank as the tokens do.

DeepSpeed's activation checkpointing saves and restores both streams, so recomputed dropout masks
equal the original ones.
"""

from __future__ import annotations

import contextlib

import torch

from zoo.errors import UserError
from zoo.parallel.state import ParallelState, as_state

# The tracker state name DeepSpeed's activation checkpointing expects.
TP_RNG_STATE_NAME = "model-parallel-rng"
TP_SEED_OFFSET = 2718
PP_SEED_STRIDE = 100


def _tracker():
    import deepspeed  # local: DeepSpeed costs seconds to import; zoo.parallel is used without it (eval, export)

    return deepspeed.checkpointing.get_cuda_rng_tracker()


# A run resumed at another layout draws streams of its own, apart from the run's first ones by this much per
# iteration (a prime, so that no iteration's seeds meet another stage's: 7919 k = 100 s has no solution with
# s < 7919 stages).
LAYOUT_CHANGE_SEED_STRIDE = 7919


def rank_seeds(seed: int, parallel: ParallelState | None) -> tuple[int, int]:
    """(default stream seed, TP tracker seed) of this rank: ``seed + 100 * pp_rank``, and that + 2718 +
    tp_rank. Every stage has its own pair, and every TP rank of a stage its own tracker seed; the TP ranks
    of a stage share the default seed. The one place the seeds of a rank are derived."""
    parallel = as_state(parallel)
    stage_seed = seed + PP_SEED_STRIDE * parallel.pp_rank
    return stage_seed, stage_seed + TP_SEED_OFFSET + parallel.tp_rank


def seed_after_layout_change(seed: int, iteration: int) -> int:
    """The run seed a run resumed at another (tp, pp) layout after ``iteration`` seeds with
    (:func:`model_parallel_seed`): the checkpoint holds no stream for this rank's new place in the grid, so
    every rank starts fresh streams, derived as at the start (:func:`rank_seeds`) but apart from the run's
    first ones and from a resume after any other iteration."""
    return seed + LAYOUT_CHANGE_SEED_STRIDE * (iteration + 1)


def model_parallel_seed(seed: int, parallel: ParallelState | None) -> None:
    """Seed the default generator (torch's and the accelerator's) and the TP tracker with this rank's
    :func:`rank_seeds` of ``seed``."""
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import

    default_seed, tp_seed = rank_seeds(seed, parallel)
    torch.manual_seed(default_seed)
    get_accelerator().manual_seed(default_seed)
    tracker = _tracker()
    tracker.reset()
    tracker.add(TP_RNG_STATE_NAME, tp_seed)


def tp_rng_fork(parallel: ParallelState | None):
    """Context manager: draw from the TP-rank-specific stream inside it.

    Raises if tp > 1 and :func:`model_parallel_seed` was never called, because dropout in a TP
    region would then draw identical masks on all ranks.
    """
    tracker = _tracker()
    if TP_RNG_STATE_NAME in tracker.get_states():
        return tracker.fork(TP_RNG_STATE_NAME)
    if as_state(parallel).tp_size > 1:
        raise UserError("dropout inside a tensor-parallel region needs the model-parallel RNG; call "
                         "zoo.parallel.model_parallel_seed(seed, parallel) after building the ParallelState.")
    return contextlib.nullcontext()


# Not traced by torch.compile (DeepSpeed's tracker sets the generator's state, which a graph cannot hold): a
# compiled region breaks at the call and runs it eagerly. torch._disable_dynamo, as DeepSpeed's checkpoint uses,
# imports torch._dynamo at the first call rather than when zoo.parallel is imported (seconds on a small CPU).
@torch._disable_dynamo
def in_tp_stream(parallel: ParallelState | None, function, *args, **kwargs):
    """``function(*args, **kwargs)`` drawing from the TP-rank stream (:func:`tp_rng_fork`), always eagerly."""
    with tp_rng_fork(parallel):
        return function(*args, **kwargs)


def region_rng(parallel: ParallelState | None, sequence_parallel: bool):
    """Context manager for dropout on the activations between the TP GEMMs: the TP-rank stream when
    sequence parallelism is in use (each rank holds other tokens), else the default stream (the
    activations are replicated and every rank must draw the same mask)."""
    if sequence_parallel and as_state(parallel).tp_size > 1:
        return tp_rng_fork(parallel)
    return contextlib.nullcontext()
