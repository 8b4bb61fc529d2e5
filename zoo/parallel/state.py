"""The tp x dp rank grid, built once and passed explicitly (no module-level globals).

Ranks are laid out with tensor-parallel groups of consecutive ranks, as in Megatron-LM:
with world size W and tensor-parallel size t, rank r sits at

    tp_rank = r mod t,   dp_rank = r div t,   dp_size = W / t

so the TP group of rank r is {t*(r div t), ..., t*(r div t) + t - 1} and its DP group is
{r mod t, r mod t + t, ...}. TP groups are the ones that communicate every layer, so they are
the ranks that share a node (and its NVLink) under DeepSpeed's launcher.

`ParallelState` also implements the duck-typed "mpu" interface that DeepSpeed's engine,
gradient clipping and activation checkpointing query. It deliberately has no
`initialize_sequence_parallel` attribute: DeepSpeed would mistake it for an Ulysses mpu.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the tensor-parallel x data-parallel grid.

    Build it with :meth:`initialize` after ``torch.distributed`` (or ``deepspeed.init_distributed``)
    is up, or with :meth:`single` for a single process. :meth:`initialize` always creates real
    groups, also of one rank (``group=None`` would mean the whole world to torch.distributed and to
    DeepSpeed); only :meth:`single` has ``None`` groups, and nothing communicates there.
    """

    tp_size: int
    tp_rank: int
    tp_group: Any
    dp_size: int
    dp_rank: int
    dp_group: Any
    world_size: int
    rank: int
    timeout: timedelta | None = None   # of the TP and DP groups (torch's backend default when None)

    # ------------------------------------------------------------------ construction
    @classmethod
    def initialize(cls, tp_size: int, timeout: timedelta | None = None) -> ParallelState:
        """Build the grid for tensor-parallel size ``tp_size`` over the whole world.

        ``timeout`` bounds every collective of the TP and DP groups (``--distributed-timeout-minutes``);
        None leaves torch's default for the backend (30 minutes on gloo, 10 on NCCL), whatever the
        world group was given. Collective: every rank must call it, in the same order as any other
        ``new_group`` call.
        """
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor-parallel size {tp_size!r} is invalid; pass a positive integer.")
        if not (dist.is_available() and dist.is_initialized()):
            if tp_size == 1:
                return cls.single()
            raise ValueError(
                f"tensor-parallel size {tp_size} needs torch.distributed, which is not initialised; "
                "start the script with `deepspeed --num_gpus N` (or torchrun) and call "
                "deepspeed.init_distributed() before ParallelState.initialize."
            )
        world_size = dist.get_world_size()
        rank = dist.get_rank()
        check_grid(tp_size, world_size)
        dp_size = world_size // tp_size

        tp_group = None
        dp_group = None
        timeout_kwargs = {} if timeout is None else {"timeout": timeout}
        # new_group is collective over the whole world: every rank creates every group.
        for first in range(0, world_size, tp_size):
            ranks = list(range(first, first + tp_size))
            group = dist.new_group(ranks, **timeout_kwargs)
            if rank in ranks:
                tp_group = group
        for offset in range(tp_size):
            ranks = list(range(offset, world_size, tp_size))
            group = dist.new_group(ranks, **timeout_kwargs)
            if rank in ranks:
                dp_group = group

        return cls(
            tp_size=tp_size,
            tp_rank=rank % tp_size,
            tp_group=tp_group,
            dp_size=dp_size,
            dp_rank=rank // tp_size,
            dp_group=dp_group,
            world_size=world_size,
            rank=rank,
            timeout=timeout,
        )

    @classmethod
    def single(cls) -> ParallelState:
        """The trivial grid of one process: tp = dp = 1, no process groups."""
        return cls(tp_size=1, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                   world_size=1, rank=0)

    # ------------------------------------------------------------------ DeepSpeed mpu duck type
    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_model_parallel_group(self):
        return self.tp_group

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def __repr__(self) -> str:  # groups are opaque handles; keep the repr readable
        return (f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"dp={self.dp_rank}/{self.dp_size})")


def check_grid(tp_size: int, world_size: int) -> None:
    """The one check of the rank grid: ``tp_size`` must divide ``world_size`` (one sentence if not)."""
    if tp_size < 1 or world_size % tp_size != 0:
        fits = [t for t in range(1, world_size + 1) if world_size % t == 0]
        raise ValueError(f"tensor-parallel size {tp_size} does not divide the world size {world_size}; pass "
                         f"--tensor-parallel-size one of {fits} or launch a multiple of {tp_size} processes.")


def as_state(parallel: ParallelState | None) -> ParallelState:
    """``parallel`` itself, or :meth:`ParallelState.single` for ``None`` (the public "single process" spelling).

    Call it once where a ``parallel`` argument enters (a constructor, a public function); below that point
    the code reads ``parallel.tp_size`` and friends directly, and skips collectives when ``tp_size == 1``.
    """
    return ParallelState.single() if parallel is None else parallel
