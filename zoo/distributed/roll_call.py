"""Roll call: after a collective failed (timed out, or its connection closed), which ranks never came.

It goes through the launcher's key-value store, not a process group, and costs nothing until something
failed.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

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
