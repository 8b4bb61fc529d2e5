"""Joining a process group: under a launcher (:func:`join_process_group`, which the rank then does not
outlive), or as a world of one for ``python script.py`` (:func:`single_process_env`).

Joining refuses, in one sentence each, what would otherwise fail obscurely or silently: no launcher, a
rendezvous port another job holds, a CPU build of torch on a GPU machine. CPU ranks split the cores
(:func:`share_cpu_threads`), and a CLI's group is destroyed after it succeeded
(:func:`process_group_left_on_success`).
"""

from __future__ import annotations

import os
import socket
import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from zoo.distributed.extension_locks import take_over_dead_extension_locks
from zoo.distributed.local_rank import launcher_local_rank
from zoo.distributed.shared_memory import unlink_shared_memory_buffer
from zoo.errors import UserError
from zoo.operations.launcher_watch import watch_launchers
from zoo.operations.library_output import prints_dropped
from zoo.parallel.host_all_reduce import adopt_deepspeed_kernel, deepspeed_backend_exists


def share_cpu_threads() -> None:
    """On CPU, give each local rank its share of the cores (as torchrun does with OMP_NUM_THREADS=1);
    the deepspeed launcher leaves every rank at all cores, which oversubscribes them 2x at 2 ranks."""
    from deepspeed.accelerator import get_accelerator  # local: deepspeed's import cost, paid when joining

    if get_accelerator().device_name() != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


def visible_nvidia_gpus() -> int:
    """How many NVIDIA GPU device nodes this machine exposes (/dev/nvidia0, ...), whatever torch can use."""
    return sum(1 for path in Path("/dev").glob("nvidia[0-9]*") if path.name[6:].isdigit())


def check_accelerator_matches_machine(gpus: int | None = None) -> None:
    """Refuse to run on the CPU on a machine with GPUs, unless the user chose the CPU (DS_ACCELERATOR=cpu):
    a CPU build of torch on a GPU node would otherwise train, slowly and silently, on the host."""
    from deepspeed.accelerator import get_accelerator  # local: deepspeed's import cost, paid when joining

    gpus = visible_nvidia_gpus() if gpus is None else gpus
    if gpus and get_accelerator().device_name() == "cpu" and os.environ.get("DS_ACCELERATOR") != "cpu":
        raise UserError(f"this machine has {gpus} NVIDIA GPU(s) but torch {torch.__version__} cannot use them, so "
                         "DeepSpeed chose the CPU; install a CUDA build of torch (`make setup` uses the system's "
                         "torch on a GPU node), or set DS_ACCELERATOR=cpu to run on the CPU on purpose.")


def launched_distributed(environ: dict[str, str] | None = None) -> bool:
    """Started by a launcher (deepspeed, torchrun, mpirun): the process-group variables are set."""
    environ = os.environ if environ is None else environ
    return "RANK" in environ and "WORLD_SIZE" in environ


def join_process_group(local_rank: int | None = None, timeout: timedelta | None = None) -> str:
    """Join the launcher's process group (NCCL on GPUs, gloo on CPU), bind this rank's device at once
    (before anything seeds or allocates on it) and return its name. ``timeout`` bounds every collective
    of the group (DeepSpeed's default, 10 minutes or ``$DEEPSPEED_TIMEOUT``, when None): a rank that
    never arrives ends the job with the backend's timeout error instead of a hang.

    The device is ``local_rank`` (a ``--local_rank`` flag), by default the one the launcher named
    (:func:`bind_launcher_device`), so ranks started by mpirun or srun bind their own device before
    DeepSpeed's MPI discovery runs.

    Started without a launcher, or on a rendezvous port another job holds, it raises one sentence
    (:func:`check_launched`, :func:`master_port_named`). From here on the rank watches its launchers
    (:mod:`zoo.operations.launcher_watch`): it does not outlive them."""
    from deepspeed.accelerator import get_accelerator  # local: deepspeed's import cost, paid when joining

    check_launched()
    watch_launchers()
    check_accelerator_matches_machine()
    accelerator = get_accelerator()
    bind_launcher_device(accelerator, local_rank)
    with master_port_named():
        join_deepspeed(timeout)
    share_cpu_threads()
    if accelerator.device_name() == "cpu":
        unlink_shared_memory_buffer()
    return accelerator.current_device_name()


def bind_launcher_device(accelerator, local_rank: int | None = None) -> int:
    """Bind ``accelerator``'s device ``local_rank`` (None: the launcher's, :func:`launcher_local_rank`) on a
    device other than the CPU, and return that local rank. ``LOCAL_RANK`` is set to it when no launcher set
    it, so DeepSpeed (its engine and pipeline module read ``LOCAL_RANK``) binds the same device, and
    ``init_distributed`` under srun with ``RANK``/``WORLD_SIZE`` exported needs no MPI discovery."""
    on_cpu = accelerator.device_name() == "cpu"
    if local_rank is None:
        local_rank = launcher_local_rank(devices_on_node=1 if on_cpu else accelerator.device_count())
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    if not on_cpu:
        accelerator.set_device(local_rank)
    return local_rank


def check_launched(environ: dict[str, str] | None = None, script: str | None = None) -> None:
    """Refuse to join without a launcher: with neither a launcher's variables (RANK, WORLD_SIZE) nor MPI's
    (mpirun, which DeepSpeed discovers through mpi4py), DeepSpeed would fail on a missing mpi4py."""
    environ = os.environ if environ is None else environ
    if launched_distributed(environ) or any(name.startswith(("OMPI_COMM_WORLD_", "PMI_")) for name in environ):
        return
    script = script or (sys.argv[0] if sys.argv and sys.argv[0] else "the script")
    raise UserError(f"{script} was started without a launcher (RANK and WORLD_SIZE are not set); run it under "
                     f"deepspeed, e.g. `deepspeed --num_gpus 2 {script} ...` (or torchrun, or zoo's `python "
                     f"launch/run.py --num_gpus 2 {script} ...`); see the README.")


def master_port_in_use(err: BaseException) -> bool:
    """Whether ``err`` is the store's "address already in use" on the rendezvous port."""
    text = str(err)
    return isinstance(err, RuntimeError) and ("EADDRINUSE" in text or "address already in use" in text.lower())


@contextmanager
def master_port_named(environ: dict[str, str] | None = None):
    """Around joining: the rendezvous port already taken (another job on this host listens on it) becomes
    one sentence naming the port and the launcher's flag, instead of the store's traceback."""
    environ = os.environ if environ is None else environ
    try:
        yield
    except RuntimeError as err:
        if not master_port_in_use(err):
            raise
        port = environ.get("MASTER_PORT", "29500")
        other = int(port) + 1 if port.isdigit() else 29501
        raise UserError(f"port {port} on {environ.get('MASTER_ADDR', 'this host')} (MASTER_PORT) is already in "
                         f"use, probably by another job; pass another port to the launcher, e.g. `deepspeed "
                         f"--master_port {other} ...` (torchrun: --master-port).") from None


@contextmanager
def process_group_left_on_success():
    """Around a CLI's work: destroys the default process group on the way out if this block created it and
    the work succeeded (torch warns at exit about a group never destroyed). A group the caller made (the
    test harness's) is left alone, and after a failure nothing is torn down, where another rank may still
    wait in a collective."""
    existed = dist.is_available() and dist.is_initialized()
    yield
    if not existed and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def join_deepspeed(timeout: timedelta | None = None, **init_kwargs) -> None:
    """``deepspeed.init_distributed`` (adopting a group that exists), then whether DeepSpeed's CPU
    shared-memory kernel serves this group's TP sums (``zoo.parallel.host_all_reduce``). First, a build lock
    of DeepSpeed's JIT-compiled ops left by a killed builder is removed
    (:func:`zoo.distributed.extension_locks.take_over_dead_extension_locks`): DeepSpeed loads its CPU
    all-reduce op in ``init_distributed`` and would wait on such a lock forever."""
    import deepspeed  # local: deepspeed's import cost, paid when joining

    take_over_dead_extension_locks()
    created_now = not deepspeed_backend_exists()
    if timeout is not None:
        init_kwargs["timeout"] = timeout
    with prints_dropped():   # a CPU rank's loading of DeepSpeed's all-reduce kernel is printed as a build
        deepspeed.init_distributed(**init_kwargs)
    adopt_deepspeed_kernel(created_now)


def single_device() -> str:
    """The device of a process that runs alone (no process group)."""
    from deepspeed.accelerator import get_accelerator  # local: deepspeed's import cost, paid when used

    return get_accelerator().current_device_name()


def single_process_env() -> None:
    """Let ``python script.py`` (e.g. under ``wandb agent``) run as a world of one: without a launcher's
    variables, set the ones ``torch.distributed`` reads, on a free loopback port."""
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
