"""The ``--data-path`` value that trains on what preprocessing wrote, for the line preprocessing ends with
and for the error of a ``--data-path`` prefix that names no dataset while datasets beginning with it exist
(the ``<prefix>_<input name>`` outputs of a directory preprocessed without ``--merge``).

Several outputs become one blend, each weighted by its share of the tokens, so every corpus serves the
share of the samples it would have in one merged corpus (:mod:`zoo.data.blending` normalises the weights).
Only the standard library is imported, so the indexed-dataset reader can use it without cost.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence

# A missing prefix's error names at most this many datasets beginning with it (with their blend); beyond, it
# names the first and the last and the count.
MAX_NAMED_SIBLINGS = 16


def data_path_value(outputs: Sequence[tuple[str, int]]) -> str:
    """The ``--data-path`` value, shell-quoted, for ``outputs`` as (prefix, tokens or any size proportional to
    them): the prefix alone for one output, else ``W1 P1 W2 P2 ...`` with each weight its share of the tokens
    (4 significant digits). Outputs without tokens are left out of a blend, as they serve no sample; when none
    has tokens every output gets weight 1."""
    if len(outputs) == 1:
        return shlex.quote(os.fspath(outputs[0][0]))
    total = sum(size for _, size in outputs)
    if total <= 0:
        return " ".join(f"1 {shlex.quote(os.fspath(prefix))}" for prefix, _ in outputs)
    return " ".join(f"{size / total:.4g} {shlex.quote(os.fspath(prefix))}" for prefix, size in outputs if size > 0)


def datasets_beginning_with(prefix: str | os.PathLike) -> list[str]:
    """The prefixes, in sorted order and written as ``prefix`` is, of the complete datasets (``.bin`` and ``.idx``)
    beside ``prefix`` whose names begin with its name; empty when its directory cannot be listed."""
    prefix = os.fspath(prefix)
    directory, name = os.path.split(prefix)
    if not name:
        return []
    try:
        entries = os.listdir(directory or ".")
    except OSError:
        return []
    found = []
    for entry in sorted(entries):
        stem = entry[:-len(".bin")]
        if entry.endswith(".bin") and entry.startswith(name) and stem != name:
            candidate = os.path.join(directory, stem)
            if os.path.isfile(candidate + ".bin") and os.path.isfile(candidate + ".idx"):
                found.append(candidate)
    return found


def sibling_datasets_hint(prefix: str | os.PathLike) -> str:
    """The clause a missing ``prefix``'s error ends with when datasets beginning with it exist: which, and the
    ``--data-path`` blend of them (weighted by the size of their ``.bin``, which is proportional to their tokens
    as a blend's corpora share one token dtype) or ``--merge``; empty when there are none."""
    found = datasets_beginning_with(prefix)
    if not found:
        return ""
    merge = f"or preprocess with --merge to write one {os.fspath(prefix)}"
    if len(found) > MAX_NAMED_SIBLINGS:
        return (f"; found {len(found)} datasets beginning with it ({found[0]} ... {found[-1]}): pass the "
                f"--data-path that launch/preprocess.py printed, {merge}")
    value = data_path_value([(candidate, os.path.getsize(candidate + ".bin")) for candidate in found])
    return f"; found {', '.join(found)}: pass --data-path {value}, {merge}"
