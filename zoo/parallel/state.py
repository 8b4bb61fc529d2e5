"""The tp x cp x dp (x pp) rank grid, built once and passed explicitly (no module-level globals).

Ranks are laid out as DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model) lays them
out, and the groups are taken from that topology, so zoo's layers and DeepSpeed's pipeline engine see
one grid. With world size W, tensor-parallel size t and pipeline-parallel size p, rank r sits at

    tp_rank = r mod t,   dp_rank = (r div t) mod d,   pp_rank = r div (t d),   d = dp_size = W / (t p)

so the TP group of rank r is t consecutive ranks, its DP group the ranks t apart within its pipeline
stage, and its pipeline the ranks t d apart. TP groups are the ones that communicate every layer, so
they are the ranks that share a node (and its NVLink) under DeepSpeed's launcher; pipeline stages, which
exchange one activation per micro-batch, are the furthest apart. At p = 1 this is Megatron-LM's tp x dp
grid: tp_rank = r mod t, dp_rank = r div t.

Context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) of size c > 1 (pipeline size 1) splits each
sample's sequence over c ranks; they sit between the TP and the DP ranks, as in Megatron-Core's
tp-cp-dp order:

    tp_rank = r mod t,   cp_rank = (r div t) mod c,   dp_rank = r div (t c)

The grid is then DeepSpeed's general ``ProcessTopology`` with axes (pipe, data, context, model). The
context-parallel group of rank r is the c ranks t apart that hold the other parts of its samples; the
"sequence-data-parallel" group, the d c ranks of r's TP rank, is the one DeepSpeed's engine and ZeRO sum
gradients over (dividing by d alone), since every context rank saw other tokens of the same samples.

`ParallelState` also implements the duck-typed "mpu" interface that DeepSpeed's engine,
gradient clipping and activation checkpointing query, its sequence-parallel queries included. It
deliberately has no `initialize_sequence_parallel` attribute: DeepSpeed would then take the data-parallel
group to be the whole world.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from zoo.errors import UserError


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the tensor-parallel x data-parallel (x pipeline-parallel) grid.

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
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: Any = None
    topology: Any = None               # DeepSpeed's PipeModelDataParallelTopology of the grid (None: single)
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: Any = None               # the ranks holding the other parts of this rank's samples
    seq_dp_group: Any = None           # dp x cp: the ranks gradients are summed over (the DP group at cp = 1)

    # ------------------------------------------------------------------ construction
    @classmethod
    def initialize(cls, tp_size: int, timeout: timedelta | None = None, pp_size: int = 1,
                   cp_size: int = 1) -> ParallelState:
        """Build the grid for tensor-parallel size ``tp_size``, ``pp_size`` pipeline stages and context-parallel size
        ``cp_size`` over the whole world.

        ``timeout`` bounds every collective of the TP and DP groups (``--distributed-timeout-minutes``);
        None leaves torch's default for the backend (30 minutes on gloo, 10 on NCCL), whatever the
        world group was given. Collective: every rank must call it, in the same order as any other
        ``new_group`` call.
        """
        if not isinstance(tp_size, int) or tp_size < 1:
            raise UserError(f"tensor-parallel size {tp_size!r} is invalid; pass a positive integer.")
        if not isinstance(pp_size, int) or pp_size < 1:
            raise UserError(f"pipeline-parallel size {pp_size!r} is invalid; pass a positive integer.")
        if not isinstance(cp_size, int) or cp_size < 1:
            raise UserError(f"context-parallel size {cp_size!r} is invalid; pass a positive integer.")
        if cp_size > 1 and pp_size > 1:
            raise UserError(f"context-parallel size {cp_size} with {pp_size} pipeline stages is not supported: "
                             "DeepSpeed's pipeline engine sums gradients over the data-parallel group alone, not "
                             "over the context-parallel ranks; pass --pipeline-model-parallel-size 1 or "
                             "--context-parallel-size 1.")
        if not (dist.is_available() and dist.is_initialized()):
            if tp_size == 1 and pp_size == 1 and cp_size == 1:
                return cls.single()
            raise UserError(
                f"tensor-parallel size {tp_size} needs torch.distributed, which is not initialised; "
                "start the script with `deepspeed --num_gpus N` (or torchrun) and call "
                "deepspeed.init_distributed() before ParallelState.initialize."
            )
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # local: DeepSpeed costs seconds

        world_size = dist.get_world_size()
        rank = dist.get_rank()
        check_grid(tp_size, world_size, pp_size, cp_size)
        dp_size = world_size // (tp_size * pp_size * cp_size)
        if cp_size == 1:
            topology = PipeModelDataParallelTopology(num_pp=pp_size, num_mp=tp_size, num_dp=dp_size)
        else:
            from deepspeed.runtime.pipe.topology import ProcessTopology  # local: DeepSpeed costs seconds

            topology = ProcessTopology(axes=["pipe", "data", "context", "model"], dims=[pp_size, dp_size, cp_size,
                                                                                          tp_size])
        timeout_kwargs = {} if timeout is None else {"timeout": timeout}

        def own_group_of(rank_lists):
            """This rank's group among ``rank_lists``; new_group is collective over the whole world, so every rank
            creates every group, in the same order."""
            mine = None
            for ranks in rank_lists:
                group = dist.new_group(ranks, **timeout_kwargs)
                if rank in ranks:
                    mine = group
            return mine

        def own_group(axis: str):
            """This rank's group along ``axis`` of the topology."""
            return own_group_of(topology.get_axis_comm_lists(axis) or [[r] for r in range(world_size)])

        tp_group = own_group("model")
        dp_group = own_group("data")
        pp_group = own_group("pipe") if pp_size > 1 else None
        cp_group = seq_dp_group = None
        if cp_size > 1:
            cp_group = own_group("context")
            seq_dp_group = own_group_of([topology.filter_match(model=m) for m in range(tp_size)])
        coord = topology.get_coord(rank)
        return cls(
            tp_size=tp_size,
            tp_rank=coord.model,
            tp_group=tp_group,
            dp_size=dp_size,
            dp_rank=coord.data,
            dp_group=dp_group,
            world_size=world_size,
            rank=rank,
            timeout=timeout,
            pp_size=pp_size,
            pp_rank=coord.pipe,
            pp_group=pp_group,
            topology=topology,
            cp_size=cp_size,
            cp_rank=coord.context if cp_size > 1 else 0,
            cp_group=cp_group,
            seq_dp_group=seq_dp_group if cp_size > 1 else dp_group,
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

    def get_sequence_parallel_world_size(self) -> int:
        return self.cp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.cp_rank

    def get_sequence_parallel_group(self):
        return self.cp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.dp_size * self.cp_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.dp_rank * self.cp_size + self.cp_rank

    def get_sequence_data_parallel_group(self):
        return self.seq_dp_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.pp_size

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.pp_rank

    def __repr__(self) -> str:  # groups are opaque handles; keep the repr readable
        pipeline = f", pp={self.pp_rank}/{self.pp_size}" if self.pp_size > 1 else ""
        context = f", cp={self.cp_rank}/{self.cp_size}" if self.cp_size > 1 else ""
        return (f"ParallelState(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}{context}, "
                f"dp={self.dp_rank}/{self.dp_size}{pipeline})")


def check_grid(tp_size: int, world_size: int, pp_size: int = 1, cp_size: int = 1) -> None:
    """The one check of the rank grid: ``tp_size`` x ``pp_size`` x ``cp_size`` must divide ``world_size`` (one
    sentence if not)."""
    if cp_size > 1 and (tp_size < 1 or world_size % (tp_size * pp_size * cp_size) != 0):
        raise UserError(f"tensor-parallel size {tp_size} x context-parallel size {cp_size} = {tp_size * cp_size} "
                         f"does not divide the world size {world_size}; launch a multiple of {tp_size * cp_size} "
                         "processes or pass --tensor-parallel-size and --context-parallel-size whose product "
                         f"divides {world_size}.")
    if pp_size > 1 and (tp_size < 1 or world_size % (tp_size * pp_size) != 0):
        raise UserError(f"tensor-parallel size {tp_size} x pipeline-parallel size {pp_size} = {tp_size * pp_size} "
                         f"does not divide the world size {world_size}; launch a multiple of {tp_size * pp_size} "
                         "processes or pass --tensor-parallel-size and --pipeline-model-parallel-size whose product "
                         f"divides {world_size}.")
    if tp_size < 1 or world_size % tp_size != 0:
        fits = [t for t in range(1, world_size + 1) if world_size % t == 0]
        raise UserError(f"tensor-parallel size {tp_size} does not divide the world size {world_size}; pass "
                         f"--tensor-parallel-size one of {fits} or launch a multiple of {tp_size} processes.")


def as_state(parallel: ParallelState | None) -> ParallelState:
    """``parallel`` itself, or :meth:`ParallelState.single` for ``None`` (the public "single process" spelling).

    Call it once where a ``parallel`` argument enters (a constructor, a public function); below that point
    the code reads ``parallel.tp_size`` and friends directly, and skips collectives when ``tp_size == 1``.
    """
    return ParallelState.single() if parallel is None else parallel
