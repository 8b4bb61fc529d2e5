"""One run owns its run directory: an advisory lock that the writer rank takes before it writes there.

The writer rank (global rank 0) takes the lock before anything is written into the directory and holds it
for the whole run. A second run on the same directory is refused with one sentence naming the holder
(host, pid, since when), having touched nothing there: the checks below only read, and the lock file is
created only by a run that goes on.

* **flock** (``fcntl.flock``, exclusive, non-blocking) on ``<run>/.zoo.lock``, the file naming the holder in
  one JSON line. The kernel (or the NFS/Lustre lock manager) drops the lock when its process ends, however
  it ends, so a crashed holder never blocks the next run. A clean release removes the file; a run that opened
  the file just before that removal sees another inode under the name and starts over.
* **exclusive file**, where the filesystem refuses flock (ENOLCK, EOPNOTSUPP, ENOSYS): ``O_CREAT | O_EXCL``
  creates the lock file, whose holder line is then the lock. A file left by a process that is gone (same
  host, and that pid no longer runs or runs a later process) is stale: it is taken over with a warning.
  A holder on another host cannot be checked from here; the sentence says to remove the file if that run
  is over.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from zoo.atomic import check_writable_directory, default_file_mode, unwritable_directory
from zoo.errors import UserError

__all__ = ["LOCK_FILE", "Holder", "RunDirectoryLock"]

LOCK_FILE = ".zoo.lock"
FLOCK_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}
HOLDER_WRITE_WAIT_S = 1.0   # how long a refused run waits for a new holder to write its line into the file


def _process_start(pid: int | str = "self") -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22), which
    tells a reused pid from the process that wrote a lock file; None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """The process that holds a run directory: the JSON line of its lock file."""

    host: str
    pid: int
    since: str                          # ISO 8601, UTC, seconds
    process_start: str | None = None

    @classmethod
    def this_process(cls) -> Holder:
        return cls(host=socket.gethostname(), pid=os.getpid(),
                   since=datetime.now(UTC).isoformat(timespec="seconds"), process_start=_process_start())

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            fields = json.loads(text)
            return cls(host=str(fields["host"]), pid=int(fields["pid"]), since=str(fields["since"]),
                       process_start=fields.get("process_start"))
        except (ValueError, TypeError, KeyError):
            return None

    def line(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    def describe(self) -> str:
        return f"process {self.pid} on host {self.host}, since {self.since}"

    def is_gone(self) -> bool:
        """True only when this host can tell the holder ended: same host, and the pid runs no longer, or
        runs a process started at another time (a reused pid)."""
        if self.host != socket.gethostname():
            return False
        if not _pid_runs(self.pid):
            return True
        return self.process_start is not None and _process_start(self.pid) not in (None, self.process_start)


def read_holder(path: Path, wait_s: float = HOLDER_WRITE_WAIT_S) -> Holder | None:
    """The holder named in ``path``; a run that has just taken the lock may not have written its line yet,
    so an empty or partial file is read again for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            holder = Holder.parse(path.read_text())
        except OSError:
            holder = None
        if holder is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(0.05)


class RunDirectoryLock:
    """The exclusive lock of one run directory (see the module docstring); :meth:`acquire`, then
    :meth:`release` (also at the end of a ``with`` block)."""

    def __init__(self, run_dir: str | os.PathLike, flag: str = "--save"):
        self.run_dir = Path(run_dir)
        self.flag = flag
        self.path = self.run_dir / LOCK_FILE
        self.holder = Holder.this_process()
        self._fd: int | None = None
        self._flock = True
        self._created_directory = False

    # ------------------------------------------------------------------------------------------ acquire
    def acquire(self, check: Callable[[], None] = lambda: None) -> RunDirectoryLock:
        """Take the lock, or raise ``UserError`` naming the holder. ``check`` (the caller's read-only checks
        of the directory's contents) runs once no other run can hold the directory and before this run
        writes anything there; when it raises, nothing was written and the lock is not kept."""
        if not self.run_dir.is_dir():
            # a file, a path under a file, a directory that cannot be created: one sentence each
            check_writable_directory(self.run_dir, self.flag)
            self._created_directory = True
        try:
            return self._acquire(check)
        except BaseException:
            self._remove_created_directory_if_empty()
            raise

    def _acquire(self, check: Callable[[], None]) -> RunDirectoryLock:
        for _ in range(10):   # each round ends unless a holder removed the file while this run opened it
            self._refuse_unless_regular_file()
            existed = self.path.exists()
            if not existed:
                check()
            fd = self._open(os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._in_use(read_holder(self.path)) from None
            except OSError as err:
                os.close(fd)
                if err.errno not in FLOCK_UNSUPPORTED:
                    raise UserError(f"{self.flag} {self.run_dir}: its lock file {self.path} cannot be locked "
                                     f"({err.strerror}); pass a directory on a filesystem you can write to.") from None
                if not existed:
                    with contextlib.suppress(OSError):
                        self.path.unlink()
                return self._acquire_exclusive_file(check)
            if not self._names_this_file(fd):
                os.close(fd)
                continue
            if existed:
                try:
                    check()
                except BaseException:
                    os.close(fd)
                    raise
            self._fd = fd
            self._write_holder()
            return self
        raise UserError(f"{self.flag} {self.run_dir}: its lock file {self.path} keeps being replaced by other "
                         "runs; make sure one run at a time uses this directory.")

    def _open(self, flags: int) -> int:
        """Open the lock file itself, never what a symbolic link in its place points to (``O_NOFOLLOW``),
        and only a regular file: the holder line is written into what is opened, so a link planted there
        would make this run truncate and rewrite a file of the user's."""
        try:
            fd = os.open(self.path, flags | os.O_NOFOLLOW, default_file_mode())
        except OSError as err:
            if err.errno == errno.ELOOP:   # a link put there after the check
                self._refuse_unless_regular_file()
            raise unwritable_directory(self.flag, self.run_dir, err) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            self._refuse_unless_regular_file()
        return fd

    def _refuse_unless_regular_file(self) -> None:
        """Raise the sentence for a lock path that exists and is not a regular file (a symbolic link, a
        directory, a device or pipe); zoo never writes its holder line into such a path."""
        try:
            found = os.lstat(self.path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(found.st_mode):
            return
        if stat.S_ISLNK(found.st_mode):
            what = f"a symbolic link to {os.readlink(self.path)}"
        elif stat.S_ISDIR(found.st_mode):
            what = "a directory"
        else:
            what = "a special file"
        raise UserError(f"{self.flag} {self.run_dir}: its lock file {self.path} is {what}, not a regular file, and "
                         f"zoo writes its lock only into a file of its own; remove {self.path} and run again.")

    def _names_this_file(self, fd: int) -> bool:
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            return False
        opened = os.fstat(fd)
        return (on_disk.st_dev, on_disk.st_ino) == (opened.st_dev, opened.st_ino)

    def _write_holder(self) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, self.holder.line().encode(), 0)
        os.fsync(self._fd)

    def _acquire_exclusive_file(self, check: Callable[[], None]) -> RunDirectoryLock:
        """The lock where flock is refused: the lock file itself, created with O_EXCL."""
        self._flock = False
        for _ in range(10):
            self._refuse_unless_regular_file()
            if self.path.exists():
                holder = read_holder(self.path)
                if holder is None or not holder.is_gone():
                    raise self._in_use(holder)
                check()
                print(f"warning: {self.path} names {holder.describe()}, which no longer runs; taking the lock "
                      "over.", file=sys.stderr, flush=True)
                if read_holder(self.path, wait_s=0) == holder:   # not a run that took it over meanwhile
                    with contextlib.suppress(FileNotFoundError):
                        self.path.unlink()
            else:
                check()
            try:
                self._fd = self._open(os.O_RDWR | os.O_CREAT | os.O_EXCL)
            except ValueError:
                if self.path.exists():   # another run created it first: look at its holder again
                    continue
                raise
            self._write_holder()
            return self
        raise self._in_use(read_holder(self.path))

    def _in_use(self, holder: Holder | None) -> UserError:
        if holder is None:
            return UserError(f"{self.flag} {self.run_dir} is in use by another run (its lock file {self.path} "
                              f"names no holder); wait for that run to end, or remove {self.path} if no run uses "
                              f"the directory, or pass another {self.flag}.")
        where = "" if holder.host == socket.gethostname() else f" (if that run has ended, remove {self.path})"
        return UserError(f"{self.flag} {self.run_dir} is in use by another run ({holder.describe()}); wait for it "
                          f"to end or stop it, or pass another {self.flag}{where}.")

    # ------------------------------------------------------------------------------------------ release
    def release(self) -> None:
        """Remove the lock file and let go of the lock (idempotent). The file is removed while the lock is
        still held, so no other run ever sees it unlocked under this holder's name. A run directory this
        lock created and nothing else wrote into is removed too (a run that failed before writing)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._flock or read_holder(self.path, wait_s=0) == self.holder:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            if self._flock:
                fcntl.flock(fd, fcntl.LOCK_UN)   # also for copies of the descriptor in forked workers
        finally:
            os.close(fd)
            self._remove_created_directory_if_empty()

    def _remove_created_directory_if_empty(self) -> None:
        if self._created_directory:
            with contextlib.suppress(OSError):   # not empty: the run's outputs stay
                self.run_dir.rmdir()

    def __enter__(self) -> RunDirectoryLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
