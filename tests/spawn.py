"""The one multi-process harness: ``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)``
in ``world_size`` CPU processes joined by a gloo process group on a free loopback port. The processes
are forked from a fork server that imported torch, transformers, DeepSpeed and zoo once (a fresh
interpreter per rank would pay those imports every time: about 4x the suite's time on 2 cores).

Each rank uses one torch thread. The group is always destroyed and every process reaped, also on
failure or timeout. Returns the list of per-rank return values (they must be picklable); raises
AssertionError that opens with the last line of each failed rank's error, then carries every failed
rank's whole traceback (an assertion in ``fn``, rewritten by pytest, shows its values there).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import queue
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zoo.operations.launcher import free_port

DEFAULT_TIMEOUT_S = 240


def _worker(fn, rank, world_size, port, args, results):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            # Plain pickle copies tensors by value: torch's shared-memory queue transport could hand the
            # parent a handle to memory this process frees when it exits.
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))


# Modules every worker needs, imported once by the fork server instead of once per process: among them the
# pretraining entry and pyplot, which the writer rank of every pretraining spawn imports to draw loss.png
# (pyplot alone is about 0.5 s a process on 2 cores).
PRELOAD = ["torch", "torch.distributed", "transformers", "deepspeed", "zoo.models", "zoo.parallel",
           "zoo.training.pretrain", "matplotlib.pyplot", "tests.spawn"]


def _context():
    """A fork server that has already imported the heavy modules: workers start as forks of a clean,
    single-threaded process (no CUDA, no process group, no OpenMP pool yet), not fresh interpreters."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def remove_shared_memory_buffers(port: int) -> None:
    """The /dev/shm workspaces DeepSpeed's CPU all-reduce made for this spawn's port (workers that call
    ``deepspeed.initialize`` without zoo's join, which unlinks them itself): DeepSpeed never removes them."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def spawn(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S) -> list:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, rank, world_size, port, args, results), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[bool, object]] = {}
    try:
        for _ in range(world_size):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                break
            outcomes[rank] = (ok, value)
            if not ok:  # a failed rank leaves its peers blocked in a collective: stop waiting
                break
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(outcomes) == world_size else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        remove_shared_memory_buffers(port)
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        messages = [f"rank {r}: {tb.strip().splitlines()[-1]}" for r, tb in sorted(failures.items())]
        tracebacks = [f"rank {r} failed:\n{tb}" for r, tb in sorted(failures.items())]
        raise AssertionError("\n".join(messages + tracebacks))
    missing = sorted(set(range(world_size)) - set(outcomes))
    if missing:
        raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f}s")
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
