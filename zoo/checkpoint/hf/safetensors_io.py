"""Streaming safetensors writes: a directory of safetensors files written one tensor at a time.

safetensors itself writes a file only from tensors that are all in memory. A file is its header (the JSON
table of every tensor's dtype, shape and byte range) followed by the data in the header's order, so once the
shapes are known the header can be written first (:func:`safetensors_header`, byte for byte what
``safetensors.torch.save_file(..., metadata={"format": "pt"})`` writes) and each tensor appended as it is
produced and then freed (:func:`write_rows`): the writer holds one tensor at a time, whatever the file size.

:func:`stream_directory` writes a whole directory that way, atomically (:func:`zoo.atomic.staged_directory`).
An entry is anything with ``key``, ``shape``, ``dtype`` and ``nbytes``.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from zoo.atomic import staged_directory
from zoo.errors import UserError

# safetensors' dtype names, in the order of its Rust ``Dtype`` enum: a file stores its tensors' data in
# descending dtype order, then by name, and the header lists them in that order.
SAFETENSORS_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int32: "I32", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
SAFETENSORS_METADATA = {"format": "pt"}


class Entry(Protocol):
    """One tensor of a file being written: its key, shape, dtype and size in bytes."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int: ...


def safetensors_order(entries: Iterable[Entry]) -> list:
    """The order safetensors stores tensors in: larger dtypes first, then by key."""
    ranks = {dtype: rank for rank, dtype in enumerate(SAFETENSORS_DTYPES)}
    entries = list(entries)
    for entry in entries:
        if entry.dtype not in ranks:
            raise UserError(f"tensor {entry.key!r} has dtype {entry.dtype}, which zoo does not write to "
                             f"safetensors; cast the model to one of {sorted(map(str, ranks))}.")
    return sorted(entries, key=lambda entry: (-ranks[entry.dtype], entry.key))


def safetensors_header(ordered: Sequence[Entry]) -> bytes:
    """The first bytes of a safetensors file holding ``ordered`` (in :func:`safetensors_order`): the header's
    length (8 bytes, little endian) and the header, JSON padded with spaces to a multiple of 8, byte for
    byte what ``safetensors.torch.save_file(..., metadata={"format": "pt"})`` writes."""
    header: dict = {"__metadata__": SAFETENSORS_METADATA}
    offset = 0
    for entry in ordered:
        header[entry.key] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                             "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_rows(handle, entry: Entry, rows: list[torch.Tensor]) -> None:
    """Append ``entry``'s data: ``rows``, consecutive blocks of its first dimension (or the whole tensor),
    each cast to the entry's dtype on its own."""
    written = 0
    for block in rows:
        block = block.detach().to("cpu", entry.dtype).contiguous().reshape(-1)
        handle.write(block.view(torch.uint8).numpy())
        written += block.numel() * block.element_size()
    if written != entry.nbytes:
        raise RuntimeError(f"tensor {entry.key!r} produced {written} bytes, its header says {entry.nbytes}")


def stream_directory(directory, files: list[tuple[str, list]], produce: Callable[[Entry], list[torch.Tensor] | None],
                     text_files: dict[str, str], copies: Iterable[Path], is_replaceable: Callable[[Path], bool],
                     kind: str, is_writer: bool = True) -> Exception | None:
    """Write ``directory``: each of ``files`` (name, entries in :func:`safetensors_order`) header first, then
    each entry's data as ``produce(entry)`` returns it (row blocks, see :func:`write_rows`), plus
    ``text_files`` (name -> contents) and ``copies`` of other files.

    ``produce`` is called once per entry, in file order, on every rank (it may be a collective that returns
    None off the writer); only the writer writes, atomically (temp dir, then rename, with the umask's
    permissions), replacing an existing ``directory`` only where ``is_replaceable`` says so (``kind`` names it
    in the refusal). Returns the writer's error (None on success) after every entry was produced, so that
    collective producers on the other ranks never wait for a writer that gave up.
    """
    sequence = [entry for _, ordered in files for entry in ordered]
    if not is_writer:
        for entry in sequence:
            produce(entry)
        return None
    produced = 0
    try:
        with staged_directory(directory, is_replaceable, kind) as staging:
            for name, text in text_files.items():
                (staging / name).write_text(text)
            for name, ordered in files:
                with open(staging / name, "wb") as handle:
                    handle.write(safetensors_header(ordered))
                    for entry in ordered:
                        rows = produce(entry)
                        produced += 1
                        write_rows(handle, entry, rows)
                        del rows
            for path in copies:
                shutil.copyfile(path, staging / Path(path).name)   # copyfile, not copy2: the umask sets the mode
    except Exception as err:  # noqa: BLE001 - the other ranks still produce the rest: stay in step, then report
        for entry in sequence[produced:]:
            produce(entry)
        return err
    return None
