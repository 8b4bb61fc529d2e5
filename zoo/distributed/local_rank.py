"""This rank's place on its node, read from whichever launcher started it.

Every launcher zoo accepts tells a process its local rank in its own variable; DeepSpeed's
``init_distributed`` sets ``LOCAL_RANK`` under MPI only once it has joined, which is too late to bind
the device a rank seeds and allocates on. :func:`launcher_local_rank` reads them all, in the order of
the launcher closest to the process (a deepspeed launcher inside an ``srun`` step sets ``LOCAL_RANK``
per process, while ``SLURM_LOCALID`` names the step's task), and is the one place zoo reads a local rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from zoo.errors import UserError

__all__ = ["LOCAL_RANK_VARIABLES", "launcher_local_rank", "local_rank_or_none"]

# (variable, the launchers that set it), closest launcher first.
LOCAL_RANK_VARIABLES = (
    ("LOCAL_RANK", "torchrun and the deepspeed launcher"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI's mpirun"),
    ("MV2_COMM_WORLD_LOCAL_RANK", "MVAPICH2's mpirun_rsh"),
    ("MPI_LOCALRANKID", "MPICH's and Intel MPI's Hydra"),
    ("PMI_LOCAL_RANK", "PMI-2 process managers"),
    ("PMIX_LOCAL_RANK", "PMIx process managers"),
    ("PALS_LOCAL_RANKID", "Cray PALS (aprun, mpiexec)"),
    ("SLURM_LOCALID", "srun"),
)

# What the launchers set for the world's size, to tell a world of one from a rank among many.
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE",
                        "SLURM_NTASKS")


def local_rank_or_none(environ: Mapping[str, str] | None = None) -> int | None:
    """The local rank the closest launcher set (:data:`LOCAL_RANK_VARIABLES`), or None when none did.
    A value that is not a non-negative integer is refused in one sentence."""
    environ = os.environ if environ is None else environ
    for name, _ in LOCAL_RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if not value:
            continue
        if not value.isdigit():
            raise UserError(f"{name}={environ[name]!r} is not a local rank (a non-negative integer); unset it or "
                             "let the launcher set it.")
        return int(value)
    return None


def world_size_of(environ: Mapping[str, str]) -> int:
    """The world's size as the launcher set it (1 when no launcher variable says)."""
    for name in WORLD_SIZE_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 1


def launcher_local_rank(environ: Mapping[str, str] | None = None, devices_on_node: int = 1) -> int:
    """This process's local rank: what its launcher set (:func:`local_rank_or_none`), else 0 where that is
    the only answer (a world of one, or a node with at most one device for this process).

    It cannot be known when several ranks run on a node with several devices and no launcher said which
    is whose: that raises one sentence instead of binding every rank to device 0."""
    environ = os.environ if environ is None else environ
    rank = local_rank_or_none(environ)
    if rank is not None:
        return rank
    if devices_on_node > 1 and world_size_of(environ) > 1:
        names = ", ".join(name for name, _ in LOCAL_RANK_VARIABLES)
        raise UserError(f"no launcher variable ({names}) tells this rank which of this node's {devices_on_node} "
                         "devices is its own; start it under deepspeed, torchrun, mpirun or srun, or set LOCAL_RANK "
                         "for each rank.")
    return 0
