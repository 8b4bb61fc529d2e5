"""One run owns its run directory: an advisory lock, and a fresh run never writes over an earlier run's outputs.

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
import re
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
from zoo.training.metrics import METRICS_FILE, check_metrics_file

__all__ = ["LOCK_FILE", "Holder", "RunDirectoryLock", "claim_pretraining_directory", "claim_finetuning_directory"]

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


# ------------------------------------------------------------------------------------- what is owned

def checkpoint_summary(run_dir: Path) -> str | None:
    """"latest iter_0000004" / "tags iter_0000002, iter_0000004" when ``run_dir`` holds DeepSpeed checkpoints,
    complete or not (a ``latest`` file, or a tag under ``checkpoints/`` with a model-states file), None
    otherwise. A tag without a completion marker (a save that did not finish, or one written by a zoo that
    wrote no markers) is still an earlier run's file, so it counts here though no reader would load it."""
    # local: zoo.checkpoint imports torch and transformers (seconds); a sweep's --out check reads only names
    from zoo.checkpoint.files import CHECKPOINT_SUBDIR, LATEST_FILE, tags_with_model_states

    root = run_dir / CHECKPOINT_SUBDIR
    latest = root / LATEST_FILE
    if latest.is_file():
        try:
            return f"latest {latest.read_text().strip() or '(empty)'}"
        except (OSError, UnicodeDecodeError):
            return "a latest file"
    tags = tags_with_model_states(root)
    if tags:
        return "tags " + ", ".join(tags[:3]) + (", ..." if len(tags) > 3 else "")
    return None


def claim_pretraining_directory(run_dir: str | os.PathLike, *, resuming: bool, overwrite: bool) -> RunDirectoryLock:
    """Lock ``--save`` for a pretraining run (writer rank only), after these read-only checks:

    * a run that does not continue this directory (not ``resuming``: no ``--load``, or a ``--load`` naming
      another run) into a directory holding checkpoints, complete or not (:func:`checkpoint_summary`), is
      refused unless ``overwrite``: its saves would write over that run's tags. A run that continues the
      directory (``--load`` names it) is never refused for its checkpoints: it resumes from the newest
      complete one, or starts from iteration 0 over tags whose save did not finish;
    * a run that does not continue this directory, into one holding a ``metrics.jsonl``, is refused unless
      ``overwrite`` (it is another run's history);
    * a resumed run's ``metrics.jsonl`` must read line by line: a corrupt line before the last one is a
      sentence naming the file and the line (a torn last line is dropped later, with a warning).

    With ``overwrite``, the earlier run's ``metrics.jsonl`` and what zoo wrote into ``checkpoints/``
    (:func:`remove_earlier_checkpoints`) are removed once the lock is held, said in one line, and what was
    left there (the user's files) in another; a ``checkpoints`` that is a symbolic link is refused in one
    sentence instead. A resumed run keeps them. Returns the held lock."""
    from zoo.checkpoint.files import CHECKPOINT_SUBDIR  # local: zoo.checkpoint imports torch and transformers

    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    replaced: list[str] = []

    def check() -> None:
        checkpoints = None if resuming else checkpoint_summary(run_dir)
        if checkpoints is not None and not overwrite:
            raise UserError(f"--save {run_dir} already holds the checkpoints of an earlier run ({checkpoints}), "
                             f"which this run's saves would overwrite; use --load {run_dir} to resume, or another "
                             "--save, or --overwrite to replace them.")
        if not resuming and metrics.exists() and not overwrite:
            raise UserError(f"--save {run_dir} already holds the {METRICS_FILE} of an earlier run; use --load "
                             f"{run_dir} to resume, or another --save, or --overwrite to replace it.")
        if resuming and metrics.is_file():
            check_metrics_file(metrics)
        if checkpoints is not None:
            refuse_symlinked_checkpoints(run_dir)
            replaced.append(f"checkpoints ({checkpoints})")
        if not resuming and metrics.exists():
            replaced.append(METRICS_FILE)

    lock = RunDirectoryLock(run_dir, "--save").acquire(check)
    if overwrite and replaced:
        try:
            left: list[str] = []
            if any(item.startswith("checkpoints") for item in replaced):
                left = remove_earlier_checkpoints(run_dir / CHECKPOINT_SUBDIR)
            if METRICS_FILE in replaced:
                metrics.unlink()
        except BaseException:
            lock.release()
            raise
        print(f"--overwrite: removed the earlier run's {' and '.join(replaced)} from {run_dir}", flush=True)
        if left:
            shown = ", ".join(left[:LEFT_SHOWN]) + (f" and {len(left) - LEFT_SHOWN} more" if len(left) > LEFT_SHOWN else "")
            print(f"--overwrite: left what zoo did not write in {run_dir / CHECKPOINT_SUBDIR}: {shown}", flush=True)
    return lock


def refuse_symlinked_checkpoints(run_dir: Path) -> None:
    """``--overwrite`` removes only what a run wrote into ``run_dir``: a ``checkpoints`` that is a symbolic
    link leads elsewhere, so it is one sentence rather than removals in the link's target."""
    from zoo.checkpoint.files import CHECKPOINT_SUBDIR

    checkpoints = run_dir / CHECKPOINT_SUBDIR
    if checkpoints.is_symlink():
        raise UserError(f"--save {run_dir}: its checkpoints {checkpoints} is a symbolic link to "
                         f"{os.readlink(checkpoints)}, whose contents --overwrite does not remove; remove the link "
                         "(or what it points to) yourself, or pass another --save.")


LEFT_SHOWN = 5
ZOO_TAG = re.compile(r"iter_\d{7}")                        # zoo.training.checkpointer's tag names
ATOMIC_TEMPORARY = re.compile(r"\..+\.[^.]+\.tmp")          # zoo.atomic's temporary names, beside the target


def zoo_tag_file(name: str) -> bool:
    """A file zoo's save writes into a tag: DeepSpeed's model, pipeline-layer and optimizer states, and the
    completion marker (or its temporary)."""
    from zoo.checkpoint.files import COMPLETE_MARKER, MODEL_STATES_RE
    from zoo.checkpoint.zero_reshard import OPTIM_STATES_RE

    return bool(name == COMPLETE_MARKER or MODEL_STATES_RE.fullmatch(name) or OPTIM_STATES_RE.fullmatch(name)
                or re.fullmatch(r"layer_\d+-model_\d+-model_states\.pt", name)
                or (ATOMIC_TEMPORARY.fullmatch(name) and name.startswith(f".{COMPLETE_MARKER}.")))


def zoo_root_file(name: str) -> bool:
    """A file zoo's save writes beside the tags: ``latest`` (or its temporary) and DeepSpeed's recovery
    scripts."""
    from zoo.checkpoint.deepspeed_tools import RECOVERY_SCRIPTS
    from zoo.checkpoint.files import LATEST_FILE

    return (name == LATEST_FILE or name in RECOVERY_SCRIPTS
            or bool(ATOMIC_TEMPORARY.fullmatch(name) and name.startswith(f".{LATEST_FILE}.")))


def zoo_resharded_file(name: str) -> bool:
    """A file of a resharded copy (:mod:`zoo.checkpoint.reshard`): its source record and states files."""
    from zoo.checkpoint.reshard import SOURCE_RECORD

    return name == SOURCE_RECORD or (zoo_tag_file(name) and not name.startswith("."))


def _remove_files(directory: Path, is_zoos: Callable[[str], bool], prefix: str) -> list[str]:
    """Remove the regular files of ``directory`` that ``is_zoos`` names, then the directory if that emptied
    it; returns what is left (``prefix`` + name), never following a symbolic link."""
    left = []
    for entry in sorted(directory.iterdir()):
        if entry.is_file() and not entry.is_symlink() and is_zoos(entry.name):
            entry.unlink()
        else:
            left.append(prefix + entry.name)
    if not left:
        directory.rmdir()
    return left


def remove_earlier_checkpoints(root: Path) -> list[str]:
    """Remove what earlier zoo runs wrote into ``root`` (a run's ``checkpoints/``): the files zoo's saves
    write into its tags (``iter_`` and seven digits), ``latest`` and DeepSpeed's recovery scripts beside them,
    and resharded copies under ``resharded/``; a directory that this empties goes too, ``root`` included.
    Anything else (the user's files and directories, symbolic links, a file of the user's inside a tag) is
    left where it is; returns those paths relative to ``root``, sorted. Nothing is followed through a link."""
    from zoo.checkpoint.reshard import RESHARDED_SUBDIR

    left: list[str] = []
    for entry in sorted(root.iterdir()):
        if entry.is_symlink():
            left.append(entry.name)
        elif entry.is_dir() and ZOO_TAG.fullmatch(entry.name):
            left += _remove_files(entry, zoo_tag_file, f"{entry.name}/")
        elif entry.is_dir() and entry.name == RESHARDED_SUBDIR:
            left += _remove_resharded(entry)
        elif entry.is_file() and zoo_root_file(entry.name):
            entry.unlink()
        else:
            left.append(entry.name)
    if not left:
        root.rmdir()
    return left


def _remove_resharded(resharded: Path) -> list[str]:
    from zoo.checkpoint.reshard import SOURCE_RECORD

    left = []
    for copy in sorted(resharded.iterdir()):
        if copy.is_dir() and not copy.is_symlink() and (copy / SOURCE_RECORD).is_file():
            left += _remove_files(copy, zoo_resharded_file, f"{resharded.name}/{copy.name}/")
        else:
            left.append(f"{resharded.name}/{copy.name}")
    if not left:
        resharded.rmdir()
    return left


FINETUNING_OUTPUTS = (METRICS_FILE, "results.json")


def claim_finetuning_directory(run_dir: str | os.PathLike, overwrite: bool = False) -> RunDirectoryLock:
    """Lock a finetuning run's ``--save`` (writer rank only); a directory holding an earlier finetuning run's
    ``metrics.jsonl`` or ``results.json`` is refused (this run would write over them), unless ``overwrite``
    (``--overwrite``) asks for them to be replaced: they are removed once the lock is held."""
    run_dir = Path(run_dir)

    def check() -> None:
        earlier = [name for name in FINETUNING_OUTPUTS if (run_dir / name).exists()]
        if earlier and not overwrite:
            raise UserError(f"--save {run_dir} already holds the {' and '.join(earlier)} of an earlier finetuning "
                             f"run; pass another --save, or --overwrite to replace them.")

    lock = RunDirectoryLock(run_dir, "--save").acquire(check)
    replaced = [name for name in FINETUNING_OUTPUTS if (run_dir / name).exists()] if overwrite else []
    if replaced:
        try:
            for name in replaced:
                (run_dir / name).unlink()
        except BaseException:
            lock.release()
            raise
        print(f"--overwrite: removed the earlier run's {' and '.join(replaced)} from {run_dir}", flush=True)
    return lock
