"""Atomic writes: a file or a directory appears complete under its final name, or not at all.

Everything zoo writes for users (exports, resharded checkpoints, metrics, plots, predictions,
sweep summaries, the ``latest`` pointer) goes through these helpers: write to a temporary name
beside the target, then ``os.replace``. The temporary names come from :mod:`tempfile`, which
creates files 0600 and directories 0700; the helpers give the result the permissions a plain
``open``/``mkdir`` would have had under the process umask (0644/0755 under the usual 022), so
the directories can be shared as transformers' own are.

This module imports nothing from zoo: every layer may use it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from zoo.errors import UserError


def process_umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    return 0o666 & ~process_umask()


def default_dir_mode() -> int:
    return 0o777 & ~process_umask()


@contextmanager
def atomic_file(path: str | os.PathLike, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a clean exit it replaces ``path``.

    On an exception the temporary file is removed and ``path`` is untouched.
    """
    target = Path(path)
    handle, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=str(target.parent))
    os.close(handle)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, default_file_mode())
        if fsync:
            with open(tmp, "rb") as reader:
                os.fsync(reader.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike, text: str, fsync: bool = False) -> None:
    """``Path(path).write_text(text)``, atomically."""
    with atomic_file(path, fsync=fsync) as tmp:
        tmp.write_text(text)


@contextmanager
def staged_directory(target: str | os.PathLike, may_replace: Callable[[Path], bool] | None = None,
                     what: str = "directory") -> Iterator[Path]:
    """Yield an empty staging directory beside ``target``; on a clean exit it becomes ``target``.

    An existing ``target`` is replaced only when ``may_replace(target)`` says it is the kind of
    directory this command writes; anything else (a file, a directory of other things) is refused
    with a ``UserError`` *before* anything is written, so a command never deletes what it did not
    create. ``what`` names the kind in that sentence ("Hugging Face export", ...).
    """
    target = Path(target)
    check_output_directory(target, may_replace, what)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield staging
        give_default_modes(staging)
        check_replaceable(target, may_replace, what)
        replace_directory(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def give_default_modes(directory: Path) -> None:
    """Give ``directory`` and everything in it the modes a plain ``mkdir``/``open`` would have had under the
    umask: writers that stage through their own temporary files (safetensors writes 0600) must not
    decide who can read the result. Executable files stay executable."""
    dir_mode, file_mode = default_dir_mode(), default_file_mode()
    os.chmod(directory, dir_mode)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), dir_mode)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                executable = os.stat(path).st_mode & 0o100
                os.chmod(path, dir_mode if executable else file_mode)


def check_output_directory(target: str | os.PathLike, may_replace: Callable[[Path], bool] | None = None,
                           what: str = "directory") -> None:
    """Everything :func:`staged_directory` will need, checked without writing anything: ``target``
    does not lie under a file, its nearest existing ancestor can be written, and an existing
    ``target`` is one ``may_replace`` accepts. Call it first, before any expensive work."""
    target = Path(target)
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{target} lies under the file {ancestor}, not a directory; choose another output path "
                         f"for the {what}.")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{target} cannot be created ({ancestor} is not writable); choose an output path for the "
                         f"{what} in a directory you can write to.")
    check_replaceable(target, may_replace, what)


def check_replaceable(target: Path, may_replace: Callable[[Path], bool] | None, what: str) -> None:
    """Raise ``UserError`` unless ``target`` is absent or a directory ``may_replace`` accepts."""
    if not target.exists() and not target.is_symlink():
        return
    if not target.is_dir():
        raise UserError(f"{target} exists and is not a directory; choose another output path for the {what}.")
    if not any(target.iterdir()):
        return
    if may_replace is not None and not may_replace(target):
        raise UserError(f"{target} exists and is not a {what} this command wrote (it would be deleted); "
                         f"move it away or choose a new or empty output path.")


def replace_directory(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``, replacing an existing ``target`` without a moment where
    neither a complete old nor a complete new directory is there."""
    if target.exists():
        backup = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, backup / target.name)
        os.replace(staging, target)
        shutil.rmtree(backup, ignore_errors=True)
    else:
        os.replace(staging, target)


def check_writable_directory(directory: str | os.PathLike, flag: str) -> Path:
    """Create ``directory`` if needed and prove a file can be written there; otherwise one sentence.

    ``flag`` names the option that chose it (``--save``), so the message says what to change.
    """
    path = Path(directory)
    probe_parent = path
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a directory; pass a directory path.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=".zoo-write-check-", dir=str(probe_parent))
        os.close(handle)
        os.unlink(name)
    except (NotADirectoryError, FileExistsError):
        raise UserError(f"{flag} {path} lies under a file, not a directory; pass a directory path.") from None
    except OSError as err:
        raise unwritable_directory(flag, path, err) from None
    return path


def check_directory_can_be_made(directory: str | os.PathLike, flag: str) -> Path:
    """``directory`` is a writable directory, or can be created as one, proved without leaving anything:
    an existing file there or on its path, or a directory no file can be written into (read-only, a
    filesystem such as /proc), is one sentence naming ``flag``. The writer that needs it creates it later."""
    path = Path(directory)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == path else f"lies under the file {existing}"
        raise UserError(f"{flag} {path} {where}, not a directory; pass a directory path.")
    try:
        handle, name = tempfile.mkstemp(prefix=".zoo-write-check-", dir=str(existing))
        os.close(handle)
        os.unlink(name)
    except OSError as err:
        raise unwritable_directory(flag, path, err) from None
    return path


def unwritable_directory(flag: str, path: str | os.PathLike, err: OSError) -> UserError:
    """The one sentence for a directory chosen by ``flag`` that cannot be written (``err`` says why)."""
    why = "permission denied" if isinstance(err, PermissionError) else err.strerror
    return UserError(f"{flag} {path} cannot be written ({why}); pass a directory you can write to.")
