"""Memory-mapped token store in Megatron-LM's ``MMapIndexedDataset`` layout (``.bin`` + ``.idx``).

This module reads and writes exactly the layout of Megatron-LM's ``MMapIndexedDataset`` (the
``mmap`` dataset-impl written by ``tools/preprocess_data.py``), so files move both ways.
All integers are little-endian.

``<prefix>.bin``: the token ids of every sequence, back to back, in the dtype named by the index
(no header).

``<prefix>.idx``::

    offset  size     field
    0       9        magic  b"MMIDIDX\\x00\\x00"
    9       8        version, uint64 == 1
    17      1        dtype code, uint8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                     6 float64, 7 float32, 8 uint16; as megatron.core's DType)
    18      8        N = number of sequences, uint64
    26      8        D = number of entries of the document index, uint64 (documents + 1)
    34      4*N      sequence lengths in tokens, int32
    34+4N   8*N      sequence pointers: byte offset of each sequence in .bin, int64
    34+12N  8*D      document index, int64: document d is sequences [doc_idx[d], doc_idx[d+1]);
                     doc_idx[0] == 0 and doc_idx[-1] == N

Megatron-core may append one int8 "mode" per sequence after the document index (multimodal
data); such trailing bytes are ignored. GPT preprocessing writes one sequence per document.
The writer picks uint16 when the vocab has fewer than 65500 entries, else int32, as Megatron does.
"""

from __future__ import annotations

import array
import os
import secrets
import struct
from pathlib import Path
from types import MappingProxyType

import numpy as np

from zoo.data.preprocess_data_path import sibling_datasets_hint
from zoo.errors import MissingInput, UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N sequences, D doc-index entries
DTYPE_CODES = MappingProxyType(
    {
        1: np.dtype(np.uint8),
        2: np.dtype(np.int8),
        3: np.dtype(np.int16),
        4: np.dtype(np.int32),
        5: np.dtype(np.int64),
        6: np.dtype(np.float64),
        7: np.dtype(np.float32),
        8: np.dtype(np.uint16),
    }
)
_INT32_MAX = np.iinfo(np.int32).max


def data_file_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def index_file_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def dataset_exists(prefix: str | os.PathLike) -> bool:
    """True when both ``<prefix>.bin`` and ``<prefix>.idx`` exist."""
    return os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))


def check_dataset_files(prefix: str | os.PathLike) -> None:
    """A ``MissingInput`` naming what is missing unless ``<prefix>.bin`` and ``<prefix>.idx`` both exist; when
    datasets beginning with the prefix exist (a directory's per-input outputs), it names them and their blend."""
    missing = [path for path in (data_file_path(prefix), index_file_path(prefix)) if not os.path.isfile(path)]
    if missing:
        found = sibling_datasets_hint(prefix)
        fix = found or "; pass the --output-prefix that launch/preprocess.py wrote, without .bin or .idx"
        raise MissingInput(f"--data-path {os.fspath(prefix)} names no indexed dataset ({' and '.join(missing)} "
                                f"{'is' if len(missing) == 1 else 'are'} missing){fix}.")


def best_fitting_dtype(vocab_size: int | None) -> np.dtype:
    """uint16 when every id fits (vocab < 65500), else int32; Megatron's rule."""
    if vocab_size is not None and vocab_size < 65500:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if candidate == dtype:
            return code
    raise UserError(f"dtype {dtype} has no code in the MMIDIDX layout; use uint16 or int32.")


class IndexedDataset:
    """Read-only, memory-mapped view of ``<prefix>.bin/.idx``; nothing is loaded eagerly.

    ``ds[i]`` is sequence ``i`` and ``ds.get(i, offset, length)`` a part of it, both as read-only
    ``np.memmap`` slices (O(1), no copy). ``sizes``, ``pointers`` and ``doc_idx`` are memmap views
    of the index file. Pickling keeps only the prefix; the unpickled copy maps the files again.
    """

    def __init__(self, prefix: str | os.PathLike):
        self._prefix = os.fspath(prefix)
        idx_path, bin_path = index_file_path(self._prefix), data_file_path(self._prefix)
        missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
        if missing:
            raise MissingInput(
                f"indexed dataset '{self._prefix}' not found ({' and '.join(missing)} missing); "
                "build it with launch/preprocess.py --output-prefix PREFIX."
            )
        idx_bytes = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise UserError(f"index file '{idx_path}' is truncated ({idx_bytes} bytes); rebuild it.")
        magic, version, code, n_seq, n_doc_idx = _HEADER.unpack(head)
        if magic != MAGIC:
            raise UserError(
                f"index file '{idx_path}' is not a Megatron MMIDIDX index (bad magic {magic!r}); "
                "rebuild it with launch/preprocess.py."
            )
        if version != VERSION:
            raise UserError(f"index file '{idx_path}' has version {version}; only version 1 is read.")
        if code not in DTYPE_CODES:
            raise UserError(f"index file '{idx_path}' has unknown dtype code {code}; rebuild it.")
        o_sizes = _HEADER.size
        o_ptrs = o_sizes + 4 * n_seq
        o_docs = o_ptrs + 8 * n_seq
        o_end = o_docs + 8 * n_doc_idx
        if idx_bytes < o_end or n_doc_idx < 1:
            raise UserError(
                f"index file '{idx_path}' is truncated: {idx_bytes} bytes but its header announces "
                f"{n_seq} sequences and {n_doc_idx} document-index entries ({o_end} bytes); rebuild it."
            )
        self._dtype = DTYPE_CODES[code]
        idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        self._sizes = idx[o_sizes:o_ptrs].view(np.int32)
        self._pointers = idx[o_ptrs:o_docs].view(np.int64)
        self._doc_idx = idx[o_docs:o_end].view(np.int64)

        bin_bytes = os.path.getsize(bin_path)
        check_index(idx_path, bin_path, bin_bytes, self._sizes, self._pointers, self._doc_idx, self._dtype.itemsize)
        count = bin_bytes // self._dtype.itemsize
        if count:
            self._bin = np.memmap(bin_path, dtype=self._dtype, mode="r", shape=(count,))
        else:  # mmap refuses empty files
            self._bin = np.empty(0, dtype=self._dtype)

    def __getstate__(self):
        return self._prefix

    def __setstate__(self, prefix):
        self.__init__(prefix)

    def __repr__(self) -> str:
        return (
            f"IndexedDataset('{self._prefix}', sequences={len(self)}, "
            f"documents={self.num_documents}, dtype={self._dtype})"
        )

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per sequence (int32, memmap view)."""
        return self._sizes

    @property
    def pointers(self) -> np.ndarray:
        """Byte offset of each sequence in ``.bin`` (int64, memmap view)."""
        return self._pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """Document d is sequences ``[doc_idx[d], doc_idx[d+1])`` (int64, memmap view)."""
        return self._doc_idx

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self._sizes.sum(dtype=np.int64))

    def __len__(self) -> int:
        return len(self._sizes)

    def _check(self, i: int) -> int:
        n = len(self._sizes)
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        return i % n

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end when length is None)."""
        i = self._check(i)
        size = int(self._sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {i} of {size}")
        start = int(self._pointers[i]) // self._dtype.itemsize + offset
        return self._bin[start : start + length]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.get(j) for j in range(*i.indices(len(self)))]
        return self.get(i)

    def document(self, d: int) -> np.ndarray:
        """All tokens of document ``d`` (its sequences joined)."""
        if not 0 <= d < self.num_documents:
            raise IndexError(f"document {d} out of range for {self.num_documents} documents")
        first, last = int(self._doc_idx[d]), int(self._doc_idx[d + 1])
        if last - first == 1:
            return self.get(first)
        return np.concatenate([self.get(s) for s in range(first, last)]) if last > first else self._bin[:0]


def check_index(idx_path: str, bin_path: str, bin_bytes: int, sizes: np.ndarray, pointers: np.ndarray,
                doc_idx: np.ndarray, itemsize: int) -> None:
    """The index describes sequences that lie inside ``.bin`` and documents made of them, or one sentence
    naming the file: sizes >= 0, pointers aligned to the dtype and in bounds, ``.bin`` ending where its last
    sequence ends (every writer of the format stores the sequences back to back, so a longer ``.bin`` is
    another corpus's, or one the index no longer describes), and a document index that starts at 0, never
    decreases and stays within the N sequences (one vectorised pass, no Python loop)."""
    n_seq = len(sizes)
    rebuild = "rebuild it with launch/preprocess.py"
    if n_seq:
        if int(sizes.min()) < 0:
            first = int(np.argmax(sizes < 0))
            raise UserError(f"index file '{idx_path}' is corrupt: sequence {first} has a negative size "
                             f"{int(sizes[first])}; {rebuild}.")
        misplaced = (pointers < 0) | (pointers % itemsize != 0)
        if misplaced.any():
            first = int(np.argmax(misplaced))
            raise UserError(f"index file '{idx_path}' is corrupt: sequence {first} starts at byte {int(pointers[first])}, "
                             f"not a non-negative multiple of the {itemsize}-byte token size; {rebuild}.")
        ends = pointers + sizes.astype(np.int64) * itemsize
        if int(ends.max()) > bin_bytes:
            first = int(np.argmax(ends > bin_bytes))
            raise UserError(f"data file '{bin_path}' is truncated: {bin_bytes} bytes but sequence {first} of the "
                             f"index ends at byte {int(ends[first])}; rebuild the dataset.")
    described = int(ends.max()) if n_seq else 0
    if bin_bytes > described:
        raise UserError(f"data file '{bin_path}' holds {bin_bytes} bytes but its index '{idx_path}' describes "
                         f"{described} ({n_seq} sequence{'' if n_seq == 1 else 's'}), so the two files are not one dataset (another corpus's "
                         "data or index); pass the prefix of a matching pair, or rebuild it with launch/preprocess.py.")
    if int(doc_idx[0]) != 0:
        raise UserError(f"index file '{idx_path}' is corrupt: its document index starts at sequence "
                         f"{int(doc_idx[0])}, not 0; {rebuild}.")
    if int(doc_idx.max()) > n_seq:
        first = int(np.argmax(doc_idx > n_seq))
        raise UserError(f"index file '{idx_path}' is corrupt: its document index names sequence "
                         f"{int(doc_idx[first])}, past the {n_seq} sequences it holds; {rebuild}.")
    steps = np.diff(doc_idx)
    if steps.size and int(steps.min()) < 0:
        first = int(np.argmax(steps < 0))
        raise UserError(f"index file '{idx_path}' is corrupt: document {first} ends at sequence "
                         f"{int(doc_idx[first + 1])}, before it starts at {int(doc_idx[first])}; {rebuild}.")


class IndexedDatasetBuilder:
    """Writes ``<prefix>.bin/.idx`` atomically.

    Tokens stream into a temporary ``.bin`` next to the target; :meth:`finalize` fsyncs it, writes
    and fsyncs a temporary ``.idx``, removes any old ``.idx``, then renames ``.bin`` and ``.idx``
    into place (``os.replace``). A crash at any point leaves either no ``.idx`` or a complete
    pair, never a half-written file. Used as a context manager, it finalizes on success and
    deletes its temporary files on error.
    """

    def __init__(self, prefix: str | os.PathLike, *, dtype=None, vocab_size: int | None = None):
        self._prefix = os.fspath(prefix)
        self._dtype = np.dtype(dtype) if dtype is not None else best_fitting_dtype(vocab_size)
        if self._dtype.kind not in "iu":
            raise UserError(f"token dtype must be an integer type, got {self._dtype}.")
        dtype_code(self._dtype)
        info = np.iinfo(self._dtype)
        self._lo, self._hi = info.min, info.max
        Path(self._prefix).parent.mkdir(parents=True, exist_ok=True)
        self._sizes = array.array("q")
        self._doc_idx = array.array("q", [0])
        self._bin_tmp = self._tmp_name(data_file_path(self._prefix))
        self._bin = self._open_new(self._bin_tmp)
        self._idx_tmp: str | None = None
        self._done = False

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @staticmethod
    def _tmp_name(path: str) -> str:
        return f"{path}.{secrets.token_hex(6)}.tmp"

    @staticmethod
    def _open_new(path: str):
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb")

    def add_item(self, tokens) -> None:
        """Appends one sequence (1-D ids) to the current document."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise UserError(f"a sequence must be 1-D token ids, got shape {arr.shape}.")
        if arr.size:
            lo, hi = arr.min(), arr.max()
            if lo < self._lo or hi > self._hi:
                raise UserError(
                    f"token ids span [{lo}, {hi}], outside {self._dtype}; build with a larger vocab_size/dtype."
                )
        if arr.size > _INT32_MAX:
            raise UserError(f"a sequence of {arr.size} tokens exceeds the int32 length field; split it.")
        self._bin.write(arr.astype(self._dtype, copy=False).tobytes())
        self._sizes.append(arr.size)

    def end_document(self) -> None:
        """Closes the current document (all sequences added since the previous call)."""
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens) -> None:
        """Appends one document made of a single sequence."""
        self.add_item(tokens)
        self.end_document()

    def add_documents(self, flat_tokens, lengths) -> None:
        """Appends ``len(lengths)`` single-sequence documents whose ids lie back to back in ``flat_tokens``."""
        flat = np.asarray(flat_tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if flat.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != flat.size or (lengths < 0).any():
            raise UserError("flat_tokens must be 1-D and lengths must be non-negative and sum to its size.")
        if lengths.size and lengths.max() > _INT32_MAX:
            raise UserError("a document exceeds the int32 length field; split it.")
        if flat.size:
            lo, hi = flat.min(), flat.max()
            if lo < self._lo or hi > self._hi:
                raise UserError(
                    f"token ids span [{lo}, {hi}], outside {self._dtype}; build with a larger vocab_size/dtype."
                )
        self._bin.write(flat.astype(self._dtype, copy=False).tobytes())
        first = len(self._sizes)
        self._sizes.extend(lengths.tolist())
        self._doc_idx.extend(range(first + 1, first + 1 + lengths.size))

    def finalize(self) -> str:
        """Commits both files and returns the prefix."""
        if self._done:
            return self._prefix
        if self._doc_idx[-1] != len(self._sizes):
            self.end_document()  # sequences after the last end_document() form one last document
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            sizes = np.frombuffer(self._sizes, dtype=np.int64) if len(self._sizes) else np.zeros(0, np.int64)
            pointers = np.zeros(len(sizes), dtype=np.int64)
            np.cumsum(sizes[:-1] * self._dtype.itemsize, out=pointers[1:])
            doc_idx = np.frombuffer(self._doc_idx, dtype=np.int64)
            self._idx_tmp = self._tmp_name(index_file_path(self._prefix))
            with self._open_new(self._idx_tmp) as f:
                f.write(_HEADER.pack(MAGIC, VERSION, dtype_code(self._dtype), len(sizes), len(doc_idx)))
                f.write(sizes.astype("<i4").tobytes())
                f.write(pointers.astype("<i8").tobytes())
                f.write(doc_idx.astype("<i8").tobytes())
                f.flush()
                os.fsync(f.fileno())
            # Drop a stale .idx first so a crash between the renames never pairs old and new files.
            Path(index_file_path(self._prefix)).unlink(missing_ok=True)
            os.replace(self._bin_tmp, data_file_path(self._prefix))
            os.replace(self._idx_tmp, index_file_path(self._prefix))
            _fsync_dir(Path(self._prefix).parent)
        except BaseException:
            self.abort()
            raise
        self._done = True
        return self._prefix

    def abort(self) -> None:
        """Deletes the temporary files; the target files are untouched."""
        if not self._bin.closed:
            self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        elif not self._done:
            self.abort()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
