"""Process-group helpers every layer above the parallel primitives shares.

* Joining: :func:`join_process_group` (under a launcher, which the rank then does not outlive),
  :func:`single_process_env` (a world of one for ``python script.py``), :func:`share_cpu_threads` (CPU
  ranks split the cores).
* Data parallelism: :func:`dp_block` (this DP rank's contiguous block of items) and the DP sums and
  means (:func:`dp_sum`, :func:`means_over_dp`), one all-reduce each.
* Host-side agreement: :func:`host_group` (a gloo group next to NCCL, so that small flags agreed every
  iteration never synchronise the accelerator), :func:`agree_max`, and :func:`run_on_first_rank` for
  work only rank 0 does while the others wait (its wait gets a timeout sized from the work).
* Roll call: :func:`ranks_that_did_not_arrive`, after a collective failed (timed out, or its connection
  closed), names the ranks that never came, through the launcher's key-value store.
* Agreement: :func:`raise_on_any_rank`. A rank that raises while its peers go on into a collective
  leaves them hung, or dying with a transport error ("Connection closed by peer") that names neither
  the problem nor the fix. The rule: run the step that may fail (reading a file, a batch, a writability
  check) on every rank, then agree on the outcome before any collective that would hang::

      batches = raise_on_any_rank(lambda: [batch_or_raise(next(loader)) for k in range(gas)])

  Each rank runs ``fn``; one all-reduce of a failure flag follows (the common, successful case costs
  that one scalar collective). When any rank failed, the failures are gathered and every rank raises
  the first failing rank's error: a user error (ValueError, FileNotFoundError) as the same type with
  the same sentence on every rank, anything else unchanged on the rank that raised it and as a
  RuntimeError naming that rank and its error on the others.
"""

from __future__ import annotations

import os
import socket
import sys
from contextlib import contextmanager
from datetime import timedelta
from collections.abc import Sequence
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from zoo.parallel.state import ParallelState, as_state

T = TypeVar("T")

USER_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


# ---------------------------------------------------------------------------------------------- joining

def share_cpu_threads() -> None:
    """On CPU, give each local rank its share of the cores (as torchrun does with OMP_NUM_THREADS=1);
    the deepspeed launcher leaves every rank at all cores, which oversubscribes them 2x at 2 ranks."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return
    local_ranks = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


def visible_nvidia_gpus() -> int:
    """How many NVIDIA GPU device nodes this machine exposes (/dev/nvidia0, ...), whatever torch can use."""
    from pathlib import Path

    return sum(1 for path in Path("/dev").glob("nvidia[0-9]*") if path.name[6:].isdigit())


def check_accelerator_matches_machine(gpus: int | None = None) -> None:
    """Refuse to run on the CPU on a machine with GPUs, unless the user chose the CPU (DS_ACCELERATOR=cpu):
    a CPU build of torch on a GPU node would otherwise train, slowly and silently, on the host."""
    from deepspeed.accelerator import get_accelerator

    gpus = visible_nvidia_gpus() if gpus is None else gpus
    if gpus and get_accelerator().device_name() == "cpu" and os.environ.get("DS_ACCELERATOR") != "cpu":
        raise ValueError(f"this machine has {gpus} NVIDIA GPU(s) but torch {torch.__version__} cannot use them, so "
                         "DeepSpeed chose the CPU; install a CUDA build of torch (`make setup` uses the system's "
                         "torch on a GPU node), or set DS_ACCELERATOR=cpu to run on the CPU on purpose.")


def launched_distributed(environ: dict[str, str] | None = None) -> bool:
    """Started by a launcher (deepspeed, torchrun, mpirun): the process-group variables are set."""
    environ = os.environ if environ is None else environ
    return "RANK" in environ and "WORLD_SIZE" in environ


def join_process_group(local_rank: int, timeout: timedelta | None = None) -> str:
    """Join the launcher's process group (NCCL on GPUs, gloo on CPU), bind this rank's device at once
    (before anything seeds or allocates on it) and return its name. ``timeout`` bounds every collective
    of the group (DeepSpeed's default, 10 minutes or ``$DEEPSPEED_TIMEOUT``, when None): a rank that
    never arrives ends the job with the backend's timeout error instead of a hang.

    Started without a launcher, or on a rendezvous port another job holds, it raises one sentence
    (:func:`check_launched`, :func:`master_port_named`). From here on the rank watches its launchers
    (:mod:`zoo.launcher_watch`): it does not outlive them."""
    from deepspeed.accelerator import get_accelerator

    from zoo.launcher_watch import watch_launchers

    check_launched()
    watch_launchers()
    check_accelerator_matches_machine()
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    with master_port_named():
        join_deepspeed(timeout)
    share_cpu_threads()
    if accelerator.device_name() == "cpu":
        unlink_shared_memory_buffer()
    return accelerator.current_device_name()


def check_launched(environ: dict[str, str] | None = None, script: str | None = None) -> None:
    """Refuse to join without a launcher: with neither a launcher's variables (RANK, WORLD_SIZE) nor MPI's
    (mpirun, which DeepSpeed discovers through mpi4py), DeepSpeed would fail on a missing mpi4py."""
    environ = os.environ if environ is None else environ
    if launched_distributed(environ) or any(name.startswith(("OMPI_COMM_WORLD_", "PMI_")) for name in environ):
        return
    script = script or (sys.argv[0] if sys.argv and sys.argv[0] else "the script")
    raise ValueError(f"{script} was started without a launcher (RANK and WORLD_SIZE are not set); run it under "
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
        raise ValueError(f"port {port} on {environ.get('MASTER_ADDR', 'this host')} (MASTER_PORT) is already in "
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
    shared-memory kernel serves this group's TP sums (``zoo.parallel.host_all_reduce``)."""
    import deepspeed

    from zoo.parallel.host_all_reduce import adopt_deepspeed_kernel, deepspeed_backend_exists

    created_now = not deepspeed_backend_exists()
    if timeout is not None:
        init_kwargs["timeout"] = timeout
    deepspeed.init_distributed(**init_kwargs)
    adopt_deepspeed_kernel(created_now)


SHM_BUFFER_DIR = "/dev/shm"


def shared_memory_buffer_path(rank: int) -> str:
    """Where DeepSpeed's CPU shared-memory all-reduce (``deepspeed/ops/csrc/cpu/comm/shm.cpp``) keeps the
    workspace of ``rank`` of this job: named after the user, ``MASTER_ADDR`` and ``MASTER_PORT``."""
    return (f"{SHM_BUFFER_DIR}/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def unlink_shared_memory_buffer() -> None:
    """Collective on CPU, right after joining: remove the name of this rank's shared-memory workspace.

    DeepSpeed creates one ~66 MB workspace per rank in ``/dev/shm`` when all ranks share a host and never
    removes it, so every CPU job leaves its workspaces in memory until the machine reboots (a few hundred
    runs fill a 24 GB tmpfs). Once every rank has mapped every peer's workspace (the barrier: DeepSpeed
    opens them all during initialisation and never again), each rank unlinks its own name; the mappings
    stay valid, and the kernel frees the memory when the last process exits, also after a crash."""
    if not dist.is_initialized():
        return
    dist.barrier()
    try:
        os.unlink(shared_memory_buffer_path(dist.get_rank()))
    except FileNotFoundError:          # DeepSpeed's op not built, or the ranks span several hosts
        pass


def single_device() -> str:
    """The device of a process that runs alone (no process group)."""
    from deepspeed.accelerator import get_accelerator

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


# ------------------------------------------------------------------------------------- data parallelism

def dp_block(num_items: int, parallel: ParallelState | None) -> range:
    """This DP rank's contiguous block of ``range(num_items)``; blocks are disjoint and cover all items
    (no sampler padding, so nothing is counted twice). The TP ranks of a group share a DP rank, so they
    get the same block, as the tensor-parallel layers require. ``None`` is a single process."""
    parallel = as_state(parallel)
    return range(parallel.dp_rank * num_items // parallel.dp_size, (parallel.dp_rank + 1) * num_items // parallel.dp_size)


def dp_sum(values: Sequence[float], parallel: ParallelState | None,
           device: torch.device | str = "cpu") -> list[float]:
    """Sum each value over the DP group (fp64, one all-reduce on ``device``); identity with one DP rank."""
    totals = torch.tensor(list(values), dtype=torch.float64, device=device)
    parallel = as_state(parallel)
    if parallel.dp_size > 1:
        dist.all_reduce(totals, group=parallel.dp_group)
    return totals.tolist()


def means_over_dp(sums: dict[str, torch.Tensor], count: int, parallel: ParallelState,
                  device: torch.device | str | None = None) -> dict[str, float]:
    """Per-key means over ``count`` micro-batches and the DP ranks, in one all-reduce on ``device``
    (the engine's: NCCL reduces only accelerator tensors)."""
    stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32) for v in sums.values()]) / count
    if parallel.dp_size > 1:
        stacked = stacked.to(device) if device is not None else stacked
        dist.all_reduce(stacked, group=parallel.dp_group)
        stacked /= parallel.dp_size
    return dict(zip(sums, stacked.tolist()))


# ------------------------------------------------------------------------------------------- agreement

def raise_on_any_rank(fn: Callable[[], T], group=None) -> T:
    """``fn()`` on this rank; raises on every rank of ``group`` (default: the world) if it raised on any.

    Every rank of ``group`` must call it at the same point, as for any collective. Without an
    initialized process group it is just ``fn()``.
    """
    if not dist.is_available() or not dist.is_initialized():
        return fn()
    try:
        result, failure, error = fn(), None, None
    except Exception as err:  # noqa: BLE001 - every rank must reach the agreement, whatever happened
        result, failure, error = None, (type(err).__name__, str(err)), err
    first = agreed_failure(failure, group)
    if first is None:
        return result
    rank, (kind, message) = first
    if kind in USER_ERRORS:
        raise USER_ERRORS[kind](message) from None
    if error is not None and rank == dist.get_rank():
        raise error
    raise RuntimeError(f"rank {rank} failed with {kind}: {message}")


def agreed_failure(failure: tuple[str, str] | None, group=None) -> tuple[int, tuple[str, str]] | None:
    """``(global rank, (exception type name, message))`` of the lowest rank of ``group`` whose ``failure``
    is not None, the same on every rank; None when no rank failed."""
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return None
    failures: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, (dist.get_rank(), failure), group=group)
    return next((rank, fail) for rank, fail in failures if fail is not None)


def collective_device(group=None) -> torch.device:
    """Where a small collective's tensor lives: the CPU for gloo, the accelerator's current device for
    NCCL and the like."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


# ------------------------------------------------------------------------------ host-side agreement

# Rank 0's own work (resharding a checkpoint, exporting one) moves this many bytes per second at least,
# on the slowest shared filesystem we plan for; the waiting ranks' timeout is sized from it.
SLOWEST_BYTES_PER_S = 20e6
WAIT_MARGIN = timedelta(minutes=10)


def host_group(timeout: timedelta | None = None):
    """A gloo group of the whole world for agreements on host flags (stop requests, data errors): its
    all-reduce runs on the CPU, so agreeing every iteration never waits for the accelerator's queue to
    drain. On a gloo world it is the world group itself. Collective: every rank calls it once."""
    if dist.get_backend() == "gloo" and timeout is None:
        return dist.group.WORLD
    kwargs = {} if timeout is None else {"timeout": timeout}
    return dist.new_group(backend="gloo", **kwargs)


def agree_max(values: Sequence[int], group=None) -> list[int]:
    """Element-wise maximum of small integers over ``group`` (one all-reduce on the group's device; on
    :func:`host_group`, the host). Identity without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return [int(v) for v in values]
    flags = torch.tensor([int(v) for v in values], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags.tolist()


def first_rank_timeout(work_bytes: int) -> timedelta:
    """How long the other ranks wait for rank 0 to process ``work_bytes`` of checkpoint: the bytes at
    :data:`SLOWEST_BYTES_PER_S` (read and written, so twice), plus :data:`WAIT_MARGIN`; at least the
    margin. An 8.3B fp16 checkpoint with its optimizer state (~116 GB) gets about 3 h 20 min."""
    return timedelta(seconds=2 * work_bytes / SLOWEST_BYTES_PER_S) + WAIT_MARGIN


def run_on_first_rank(fn: Callable[[], T], work_bytes: int, first=None) -> T | None:
    """``fn()`` on the first rank (global rank 0, or the ranks for which ``first()`` is true) while the
    others wait; a failure reaches every rank as in :func:`raise_on_any_rank`.

    The approach to the watchdog: the wait is an agreement on a fresh gloo (host) group whose timeout
    fits the work (:func:`first_rank_timeout`), not a collective of the NCCL group, whose watchdog
    (10 minutes by default) would kill the waiting ranks while rank 0 still reshards or exports a
    checkpoint of a hundred gigabytes. Returns ``fn()``'s result on the ranks that ran it, None on the
    others. Collective: every rank calls it with the same ``work_bytes``.
    """
    if not dist.is_available() or not dist.is_initialized():
        return fn()
    runs_here = first() if first is not None else dist.get_rank() == 0
    group = dist.new_group(backend="gloo", timeout=first_rank_timeout(work_bytes))
    try:
        return raise_on_any_rank(lambda: fn() if runs_here else None, group=group)
    finally:
        dist.destroy_process_group(group)


# -------------------------------------------------------------------------------------------- roll call

# What gloo and NCCL say when a collective's peer never came (timeout) or went away (closed connection).
COLLECTIVE_FAILURE_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "closed by peer")


def is_collective_failure(err: BaseException) -> bool:
    """A collective that ended because a peer did not arrive in time or went away (gloo's and NCCL's
    RuntimeErrors), as opposed to an error of this rank's own work."""
    return isinstance(err, RuntimeError) and any(word in str(err).lower() for word in COLLECTIVE_FAILURE_WORDS)


def default_store():
    """The launcher's key-value store of the default process group (None when there is none)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def loop_run_number() -> int | None:
    """A number every rank gets the same for the n-th training run of this process group (one store
    increment per run, not per iteration): it keeps one run's roll calls apart from another's."""
    store = default_store() if dist.is_available() and dist.is_initialized() else None
    if store is None:
        return None
    world = dist.get_world_size()
    return (store.add("zoo/loop_runs", 1) + world - 1) // world


def ranks_that_did_not_arrive(point: str, timeout: timedelta) -> list[int] | None:
    """The global ranks that do not answer the roll call ``point`` within ``timeout`` (this rank answers
    first); None when there is no store to call it on.

    Called after a collective failed, by every rank that saw it fail. The roll call goes through the
    store, not a process group: a gloo group whose collective timed out has closed its connections (and
    its peers' then fail with "Connection closed by peer"), so no collective of it would report anything.
    Costs nothing until something failed. ``point`` must be the same on every rank (e.g. the run and the
    iteration)."""
    store = default_store()
    if store is None:
        return None
    world = dist.get_world_size()
    keys = [f"zoo/roll_call/{point}/{rank}" for rank in range(world)]
    store.set(keys[dist.get_rank()], "here")
    try:
        store.wait(keys, timeout)
    except RuntimeError:   # DistStoreError: someone did not come; the checks below say who
        pass
    return [rank for rank, key in enumerate(keys) if not store.check([key])]


def describe_duration(duration: timedelta) -> str:
    """``3 s``, ``10 min``, ``1.5 h``: a timeout as a person says it."""
    seconds = duration.total_seconds()
    if seconds < 120:
        return f"{seconds:g} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:g} min"
    return f"{seconds / 3600:g} h"


def directory_bytes(path: str | os.PathLike) -> int:
    """Total size of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total
