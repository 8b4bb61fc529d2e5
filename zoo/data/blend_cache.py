"""The blend index of a run, built once and shared: cached next to the data, built once per filesystem.

The cache file ``<first prefix>.blend-<digest>.npy`` lies beside the first corpus (or, when that
directory is not writable, under ``$ZOO_CACHE/blends``). Its digest covers the format, the corpora's
absolute prefixes, their normalised weights and the number of samples, so a different blend never
reads another's index. The first process to claim its lock file (``<index>.lock``) writes it, atomically
(:func:`zoo.distributed.build_once`, :func:`zoo.atomic.atomic_file`): a reader sees a complete index or
none, and ranks of every node and job sharing the filesystem wait for that one build. Every rank maps it read-only, so the index costs one copy per node in the
page cache, and DataLoader workers receive only its path.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import numpy as np

from zoo.atomic import atomic_file
from zoo.data import default_cache_dir
from zoo.data.blending import blend_index
from zoo.distributed import build_once, first_rank_timeout, raise_on_any_rank, run_on_every_rank
from zoo.errors import UserError

CACHE_FORMAT = 1
BLEND_DTYPE = np.dtype([("corpus", "<u2"), ("sample", "<i8")])


class BlendIndex:
    """A blend index read (memory-mapped) from its cache file: ``corpus`` and ``sample`` arrays of
    ``num_samples`` entries (see :func:`zoo.data.blending.blend_index`). ``built_here`` tells whether this
    process built the file. Pickling keeps only the path; the copy maps the file again."""

    def __init__(self, path: str | os.PathLike, num_samples: int, num_corpora: int, built_here: bool = False):
        self.path = Path(path)
        self.num_samples = int(num_samples)
        self.num_corpora = int(num_corpora)
        self.built_here = built_here
        try:
            table = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError):  # not an .npy file, or one cut short
            table = None
        if table is None or table.dtype != BLEND_DTYPE or table.shape != (self.num_samples,):
            raise UserError(f"blend index {self.path} does not hold the {self.num_samples} blend entries its name "
                             "stands for; delete it so that the next run rebuilds it.")
        self.corpus, self.sample = table["corpus"], table["sample"]

    def __getstate__(self):
        return str(self.path), self.num_samples, self.num_corpora

    def __setstate__(self, state):
        self.__init__(*state)

    def __len__(self) -> int:
        return self.num_samples


def blend_cache_path(blend: Sequence[tuple[float, str]], num_samples: int) -> Path:
    """Where the index of ``blend`` (normalised ``(weight, prefix)`` pairs) for ``num_samples`` samples is
    cached: beside the first corpus when its directory is writable, else under ``$ZOO_CACHE/blends``."""
    key = {"format": CACHE_FORMAT, "num_samples": int(num_samples),
           "corpora": [[float(weight).hex(), os.path.abspath(prefix)] for weight, prefix in blend]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    first = Path(blend[0][1])
    directory = first.parent if os.access(first.parent, os.W_OK) else default_cache_dir() / "blends"
    return directory / f"{first.name}.blend-{digest}.npy"


def build_blend_cache(blend: Sequence[tuple[float, str]], num_samples: int) -> bool:
    """Writes the index's cache file unless it exists, once per filesystem: the process that claims its lock
    file builds it, any other (a rank of this job or of a job on another node) waits for it, at most
    :func:`blend_wait` (:func:`zoo.distributed.build_once`). True when this call wrote it."""
    path = blend_cache_path(blend, num_samples)
    if path.is_file():
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return build_once(path, lambda target: write_blend_index(blend, num_samples, target),
                          blend_wait(num_samples))
    except OSError as err:
        why = "permission denied" if isinstance(err, PermissionError) else err.strerror
        raise UserError(f"the blend index of --data-path cannot be written to {path.parent} ({why}); make the "
                         "first corpus's directory or $ZOO_CACHE writable.") from None


def write_blend_index(blend: Sequence[tuple[float, str]], num_samples: int, path: Path) -> None:
    """The index of ``blend`` for ``num_samples`` samples, written to ``path`` atomically."""
    corpus, sample = blend_index([weight for weight, _ in blend], num_samples)
    table = np.empty(len(corpus), dtype=BLEND_DTYPE)
    table["corpus"], table["sample"] = corpus, sample
    with atomic_file(path) as tmp:
        with open(tmp, "wb") as out:
            np.save(out, table, allow_pickle=False)


def index_bytes(num_samples: int) -> int:
    return int(num_samples) * BLEND_DTYPE.itemsize


def blend_wait(num_samples: int) -> timedelta:
    """How long a process waits for another to build an index of ``num_samples`` samples: the time rank 0's
    own work of that many bytes is given (:func:`zoo.distributed.first_rank_timeout`: 10 minutes plus its
    bytes written at 20 MB/s twice; about 15 minutes for the 3 GB index of a 20B-parameter run)."""
    return first_rank_timeout(index_bytes(num_samples))


def shared_blend_index(blend: Sequence[tuple[float, str]], num_samples: int) -> BlendIndex:
    """The blend index of ``blend`` for ``num_samples`` samples: built once per filesystem when its cache
    file is missing (:func:`build_blend_cache`; every rank takes part, whatever its local rank, and the
    filesystem decides who builds), then mapped by every rank. A failure on any rank reaches every rank as
    the same sentence; the ranks that wait do so on a host group sized from the work
    (:func:`zoo.distributed.run_on_every_rank`). Collective: every rank calls it with the same arguments;
    without a process group it builds (or reads) the file in this process."""
    built = run_on_every_rank(lambda: build_blend_cache(blend, num_samples), index_bytes(num_samples))
    path = blend_cache_path(blend, num_samples)
    return raise_on_any_rank(lambda: BlendIndex(path, num_samples, len(blend), built_here=bool(built)))
