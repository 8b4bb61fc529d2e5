"""Build locks of DeepSpeed's JIT-compiled ops that their builder left behind.

DeepSpeed compiles its C++ ops (the CPU shared-memory all-reduce every CPU rank loads in
``deepspeed.init_distributed``, fused Adam, ...) on first use with ``torch.utils.cpp_extension.load``, which
builds in ``$TORCH_EXTENSIONS_DIR/<op>/`` (by default ``~/.cache/torch_extensions/<python>_<device>/<op>/``).
Each load, also one that finds the op built, first creates ``<op>/lock`` (torch's ``FileBaton``), keeps the
file open while it checks or builds, and removes it afterwards; a process that finds the lock waits, with no
timeout, until the file is gone. A process killed while it holds the lock (SIGKILL, the OOM killer, a
SIGTERM with Python's default handler, a test harness ending a timed-out rank) leaves the file, and every
later process of the user that loads the op waits forever: a job that never starts and says nothing.

:func:`take_over_dead_extension_locks` runs before DeepSpeed loads an op and removes such a lock when it can
tell that no builder holds it: no process of this host has the file open (a holder keeps it open from
creation to removal), it is older than a load that builds nothing takes, and it lies on a local filesystem
(a builder on another node of a shared home cannot be seen from here, so a lock on a network filesystem is
left to DeepSpeed's wait).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

__all__ = ["take_over_dead_extension_locks", "extension_locks", "held_open_here", "on_network_filesystem",
           "MIN_LOCK_AGE_S", "NETWORK_FILESYSTEMS"]

# A load that finds its op built holds the lock for well under a second; an older unheld lock was left by a
# builder, and one younger may be between its holder's close and remove.
MIN_LOCK_AGE_S = 5.0
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph",
                                 "glusterfs", "fuse.glusterfs", "fuse.sshfs", "fuse.ceph", "afs", "panfs", "wekafs"})


def extension_locks(root: str | os.PathLike | None = None) -> list[Path]:
    """The build locks present under the torch extensions root, one per op being loaded or left behind:
    ``root/<op>/lock``, as torch builds under ``$TORCH_EXTENSIONS_DIR``, and ``root/<python>_<device>/<op>/lock``,
    as it builds under its default root (``~/.cache/torch_extensions``). ``root`` None: torch's root."""
    if root is None:
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root  # local: imports setuptools

        root = get_default_build_root()
    return sorted({*Path(root).glob("*/lock"), *Path(root).glob("*/*/lock")})


def held_open_here(path: str | os.PathLike) -> bool:
    """Whether a process of this host that this user can inspect has ``path`` open (``/proc/<pid>/fd``)."""
    target = os.path.realpath(path)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            descriptors = list((proc / "fd").iterdir())
        except OSError:            # gone, or another user's process (the lock is in this user's cache)
            continue
        for descriptor in descriptors:
            try:
                if os.readlink(descriptor) == target:
                    return True
            except OSError:
                continue
    return False


def on_network_filesystem(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies on a network filesystem, by the longest matching mount point of /proc/mounts
    (True when that cannot be read: then nothing is taken over)."""
    target = os.path.realpath(path)
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return True
    best, fs_type = "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fs_type = point, fields[2]
    return fs_type is None or fs_type in NETWORK_FILESYSTEMS


def take_over_dead_extension_locks(root: str | os.PathLike | None = None, now: float | None = None) -> list[Path]:
    """Remove every build lock under the torch extensions root that no builder holds (module doc), saying
    so in one line on stderr; returns the removed paths. Every rank may call it: a lock removed by a peer
    first is skipped."""
    removed = []
    now = time.time() if now is None else now
    for lock in extension_locks(root):
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            continue
        if age < MIN_LOCK_AGE_S or on_network_filesystem(lock) or held_open_here(lock):
            continue
        try:
            lock.unlink()
        except FileNotFoundError:
            continue
        removed.append(lock)
        print(f"zoo: removed {lock}, a build lock of a JIT-compiled op that no process holds (its builder was "
              "killed); DeepSpeed would have waited on it forever.", file=sys.stderr, flush=True)
    return removed
