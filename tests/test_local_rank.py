"""A rank binds the device its launcher named, whichever launcher started it.

Each launcher's environment is reproduced as the launcher sets it (DESIGN.md, "Simulating a cluster"):
deepspeed/torchrun ``LOCAL_RANK``, mpirun ``OMPI_COMM_WORLD_LOCAL_RANK``, MVAPICH2, MPICH/Intel MPI's
Hydra, srun's ``SLURM_LOCALID``, and the nested cases (a deepspeed launcher inside an srun step, mpirun
inside an sbatch script, whose batch step sets ``SLURM_LOCALID=0``). The training loop's ``join`` runs in a
spawned rank whose DeepSpeed accelerator reports a GPU and records ``set_device``; the process group is the
harness's gloo group.
"""

from __future__ import annotations

import os

import pytest

from tests.spawn import spawn
from zoo.distributed import launcher_local_rank

# (the environment a launcher gives a rank, the local rank it names)
LAUNCHERS = {
    "deepspeed": ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5"}, 5),
    "mpirun (Open MPI)": ({"OMPI_COMM_WORLD_RANK": "11", "OMPI_COMM_WORLD_SIZE": "16",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 3),
    "MVAPICH2": ({"MV2_COMM_WORLD_RANK": "10", "MV2_COMM_WORLD_SIZE": "16", "MV2_COMM_WORLD_LOCAL_RANK": "2"}, 2),
    "Hydra (MPICH, Intel MPI)": ({"PMI_RANK": "14", "PMI_SIZE": "16", "MPI_LOCALRANKID": "6"}, 6),
    "PMIx": ({"PMIX_RANK": "9", "PMIX_LOCAL_RANK": "1"}, 1),
    "srun": ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, 1),
    "deepspeed inside srun": ({"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "RANK": "12", "WORLD_SIZE": "16",
                               "LOCAL_RANK": "4"}, 4),
    "mpirun inside sbatch": ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "OMPI_COMM_WORLD_RANK": "15",
                              "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "7"}, 7),
}
LAUNCHER_VARIABLES = {name for env, _ in LAUNCHERS.values() for name in env} - {"RANK", "WORLD_SIZE"}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_each_launcher_names_the_local_rank(launcher):
    environ, expected = LAUNCHERS[launcher]
    assert launcher_local_rank(environ, devices_on_node=8) == expected


def test_a_world_of_one_or_one_device_per_rank_is_local_rank_0():
    assert launcher_local_rank({}, devices_on_node=8) == 0
    assert launcher_local_rank({"RANK": "3", "WORLD_SIZE": "8"}, devices_on_node=1) == 0


def test_an_unknowable_local_rank_is_one_sentence():
    with pytest.raises(ValueError) as caught:
        launcher_local_rank({"RANK": "3", "WORLD_SIZE": "8"}, devices_on_node=8)
    message = str(caught.value)
    assert message.count(". ") == 0 and message.endswith(".")
    assert "which of this node's 8 devices" in message and "set LOCAL_RANK" in message
    with pytest.raises(ValueError, match="SLURM_LOCALID='x' is not a local rank"):
        launcher_local_rank({"SLURM_LOCALID": "x"})


class RecordingAccelerator:
    """DeepSpeed's CPU accelerator, reporting itself as a node of 8 GPUs and recording ``set_device``."""

    def __init__(self, real):
        self.real = real
        self.bound: list[int] = []

    def device_name(self, device_index=None):
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device_count(self):
        return 8

    def set_device(self, index):
        self.bound.append(index)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _bind_under_each_launcher(rank, world_size):
    import deepspeed.accelerator

    from zoo.training.startup import join

    original = deepspeed.accelerator.get_accelerator
    real = original()
    harness = {name: os.environ.pop(name) for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    bound = {}
    try:
        for launcher, (environ, _) in LAUNCHERS.items():
            recorder = RecordingAccelerator(real)
            deepspeed.accelerator.get_accelerator = lambda recorder=recorder: recorder
            os.environ.update({k: v for k, v in environ.items() if k not in ("RANK", "WORLD_SIZE")})
            try:
                join(1, 1234)
            finally:
                for name in LAUNCHER_VARIABLES:
                    os.environ.pop(name, None)
            bound[launcher] = recorder.bound
    finally:
        deepspeed.accelerator.get_accelerator = original
        os.environ.update(harness)
    return bound


def test_join_binds_the_device_each_launcher_named():
    """The loop's join binds the device before DeepSpeed's init_distributed (which sets LOCAL_RANK only under
    MPI discovery), so the launcher's own variable must decide it."""
    bound = spawn(_bind_under_each_launcher, 1)[0]
    assert bound == {launcher: [expected] for launcher, (_, expected) in LAUNCHERS.items()}
