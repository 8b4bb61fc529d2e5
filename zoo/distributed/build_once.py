"""A file built once per filesystem, by whichever process claims it first.

Ranks of one job, and jobs on other nodes, that need the same derived file (a blend index beside the data)
on a shared filesystem (Lustre, NFS) must not each write it: the first process to create the lock file
``<target>.lock`` exclusively (``O_CREAT | O_EXCL``, atomic on local filesystems, NFSv3+ and Lustre) builds
the target, the others wait for the target to appear. The lock names its holder (host and pid):

* the builder writes the target atomically and removes the lock, also when the build fails, so a reader
  sees the whole target or none, and a failed build leaves nothing behind;
* a lock left by a process that died on this host (``kill -9``, a node's OOM killer) is taken over at once;
* a lock held by a process on another host is waited on for at most ``wait``, then one sentence names the
  lock and its holder (a crashed remote builder cannot be told from a slow one).

Nothing here depends on a process group or a local rank: the filesystem decides who builds.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from zoo.distributed.roll_call import describe_duration
from zoo.errors import UserError

__all__ = ["build_once", "lock_path", "FIRST_POLL_S", "LONGEST_POLL_S"]

FIRST_POLL_S = 0.05     # waiters look for the target this soon first, then ever less often
LONGEST_POLL_S = 1.0    # at most once a second: a thousand waiting ranks cost a thousand stats a second


def lock_path(target: Path) -> Path:
    return target.with_name(target.name + ".lock")


def build_once(target: str | os.PathLike, build: Callable[[Path], None], wait: timedelta) -> bool:
    """Make sure ``target`` exists: build it here (``build(target)``, which must write it atomically) when
    this process claims its lock, else wait for the process that holds the lock, at most ``wait``. Returns
    True when this call built it. A build's error reaches the caller after the lock is released; a wait
    that runs out raises one sentence (UserError) naming the lock file and its holder."""
    target = Path(target)
    lock = lock_path(target)
    deadline = time.monotonic() + wait.total_seconds()
    poll = FIRST_POLL_S
    while not target.exists():
        if claim(lock):
            try:
                if target.exists():   # finished by another process between the look and the claim
                    return False
                build(target)
                return True
            finally:
                release(lock)
        holder = lock_holder(lock)
        if holder_died_here(holder) and lock_holder(lock) == holder:
            release(lock)   # two waiters may both take over and both build: each write is whole
            continue
        if time.monotonic() >= deadline:
            raise UserError(f"{target} was not written within {describe_duration(wait)} by "
                             f"{describe_holder(holder)}, which holds {lock}; if no run is building it any more, "
                             "delete that lock file and start again.")
        time.sleep(poll)
        poll = min(2 * poll, LONGEST_POLL_S)
    return False


def claim(lock: Path) -> bool:
    """Create ``lock`` exclusively, naming this process in it; False when it exists already."""
    try:
        descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as out:
        out.write(f"{socket.gethostname()} {os.getpid()}\n")
    return True


def release(lock: Path) -> None:
    try:
        lock.unlink()
    except FileNotFoundError:
        pass


def lock_holder(lock: Path) -> tuple[str, int] | None:
    """(host, pid) a lock names; None while it is being written, or when it is gone or unreadable."""
    try:
        host, pid = lock.read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def holder_died_here(holder: tuple[str, int] | None) -> bool:
    """Whether the lock's holder was a process of this host that no longer exists."""
    if holder is None or holder[0] != socket.gethostname():
        return False
    try:
        os.kill(holder[1], 0)
    except ProcessLookupError:
        return True
    except PermissionError:   # another user's live process
        return False
    return False


def describe_holder(holder: tuple[str, int] | None) -> str:
    return "the process that created it" if holder is None else f"process {holder[1]} on {holder[0]}"
