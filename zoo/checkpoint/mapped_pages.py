"""Giving back the pages of a memory-mapped checkpoint once a tensor of it has been used.

``torch.load(..., mmap=True)`` maps a file privately; every page a reader touches then counts in the
process's resident memory until the mapping goes, so streaming a whole checkpoint through one process
ends up resident in full. ``madvise(MADV_DONTNEED)`` on pages the process never wrote drops them from the
process (the kernel reads them again from the file if they are touched later), so after each tensor the
reader holds only what it is working on.

Only whole pages inside a mapping of one of the given files are released: a range of anonymous memory
would be zeroed by the same call, so nothing outside those mappings is ever passed to it, and a file
torch byteswapped in place on load (another byte order) is not released at all. Linux only; elsewhere
(no ``/proc/self/maps``) nothing is released.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

import torch

MADV_DONTNEED = 4   # Linux


def loaded_unchanged(path: str | os.PathLike) -> bool:
    """``torch.load(path, mmap=True)`` leaves the mapped bytes as they are in the file: the checkpoint is in
    this machine's byte order (torch byteswaps a foreign-order file's storages in place, making private
    pages that a release would revert). A file that cannot be read as a zip archive counts as changed."""
    try:
        with zipfile.ZipFile(path) as archive:
            records = [name for name in archive.namelist() if name.endswith("/byteorder")]
            order = archive.read(records[0]).decode() if records else "little"   # torch's default without one
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError, KeyError):
        return False
    return order == sys.byteorder


def mapped_ranges(paths: Iterable[str | os.PathLike]) -> list[tuple[int, int]]:
    """The [start, end) address ranges at which this process maps any of ``paths`` whose mapped bytes torch
    left unchanged (:func:`loaded_unchanged`); empty off Linux."""
    wanted = {os.fsencode(os.path.realpath(path)) for path in paths if loaded_unchanged(path)}
    try:
        lines = Path("/proc/self/maps").read_bytes().splitlines()   # bytes: any file name, any encoding
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in wanted:
            start, end = (int(address, 16) for address in fields[0].split(b"-"))
            ranges.append((start, end))
    return ranges


def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def release_pages(tensors: Iterable[torch.Tensor], ranges: list[tuple[int, int]]) -> int:
    """Drop from this process the whole pages of each tensor's storage that lie inside one of ``ranges``
    (mappings of checkpoint files, :func:`mapped_ranges`), which must be pages nobody wrote. Returns the
    bytes released (0 where nothing is mapped or ``madvise`` is missing)."""
    madvise = _madvise() if ranges else None
    if madvise is None:
        return 0
    page = mmap.PAGESIZE
    released = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
        for start, stop in ranges:
            first = -(-max(begin, start) // page) * page      # round up: never a page shared with a neighbour
            last = min(end, stop) // page * page              # round down
            if last > first and madvise(first, last - first, MADV_DONTNEED) == 0:
                released += last - first
    return released
