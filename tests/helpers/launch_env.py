"""The environment a launcher gives the one rank of a world of one, for scripts run as subprocesses."""

from __future__ import annotations

import os


def one_rank_env(port: int) -> dict:
    """This process's environment plus what torchrun/DeepSpeed set for rank 0 of a world of 1 (rendezvous
    on 127.0.0.1:``port``, gloo over loopback, one OpenMP thread)."""
    return dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
