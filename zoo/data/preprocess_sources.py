"""Where preprocessing reads documents from: files, directories of files, and ``hub:`` datasets.

An input is a file (read by :mod:`zoo.data.input_diagnosis`), a directory (its files with a readable
extension, found recursively, hidden files skipped, in sorted path order), or ``hub:NAME``,
``hub:OWNER/NAME`` or ``hub:OWNER/NAME/CONFIG``: a dataset read by ``datasets.load_dataset(...,
streaming=True)`` split "train", never stored whole. A local dataset directory works as NAME
(``hub:/data/my-dataset``). Every source yields batches of texts in its own order; a text that is
not a string is yielded as None (the tokenizing step drops it).
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path

import datasets

from zoo.data.input_diagnosis import load_file_texts, loader_for, streamed_text_column
from zoo.data.preprocess_pipeline import (
    SkippedDocumentsWarning,
    encoded_in_order,
    scratch_directory,
    usable_workers,
    write_encoded,
)
from zoo.errors import MissingInput, UserError

HUB_PREFIX = "hub:"


@dataclass(frozen=True)
class Source:
    """One input: a local file with its ``datasets`` loader, or a hub dataset (``loader`` None)."""

    name: str
    loader: str | None = None
    config: str | None = None

    @property
    def label(self) -> str:
        """How sentences and output names refer to it: the path, or ``hub:NAME[/CONFIG]``."""
        if self.loader is not None:
            return self.name
        return HUB_PREFIX + self.name + (f"/{self.config}" if self.config else "")

    @property
    def stem(self) -> str:
        """The name of its own output: the file name without extensions, or the hub name's last part."""
        if self.loader is not None:
            return Path(self.name).name.split(".")[0]
        return (self.config or Path(self.name.rstrip("/")).name).replace("/", "_")


def expand_inputs(inputs, workers: int) -> list[Source]:
    """The sources named by ``inputs`` (paths, directories, ``hub:`` names) in order, with one-sentence
    errors for a missing path, an unreadable extension, an empty directory or ``workers`` below 1."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    names = [os.fspath(p) for p in inputs]
    if not names:
        raise UserError("no input files given; pass at least one --input FILE.")
    sources = []
    for name in names:
        if name.startswith(HUB_PREFIX):
            sources.append(_hub_source(name))
        elif os.path.isdir(name):
            files = _directory_files(name)
            sources.extend(Source(path, loader_for(path)) for path in files)
        elif os.path.isfile(name):
            sources.append(Source(name, loader_for(name)))
        else:
            raise MissingInput(f"input file '{name}' does not exist; check the --input path.")
    if int(workers) < 1:
        raise UserError(f"workers={workers} is invalid; use at least 1.")
    return sources


def _hub_source(name: str) -> Source:
    spec = name[len(HUB_PREFIX):]
    if os.path.isdir(spec):
        return Source(spec)
    spec = spec.strip("/")
    parts = spec.split("/")
    if not spec or len(parts) > 3 or not all(parts):
        raise UserError(f"input '{name}' is not a hub dataset name; write hub:NAME, hub:OWNER/NAME or "
                         "hub:OWNER/NAME/CONFIG.")
    return Source("/".join(parts[:2]), config=parts[2] if len(parts) == 3 else None)


def _directory_files(directory: str) -> list[str]:
    """The readable files under ``directory`` (recursively, hidden ones skipped), in sorted path order."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for file in sorted(files):
            path = os.path.join(root, file)
            if file.startswith("."):
                continue
            try:
                loader_for(path)
            except ValueError:
                continue
            found.append(path)
    if not found:
        raise UserError(f"input directory '{directory}' holds no .jsonl, .json, .txt or .parquet files (optionally "
                         ".gz); pass a directory of such files or the files themselves.")
    return sorted(found)


def open_source(source: Source, json_key: str, cache: str):
    """The documents of ``source``, checked now (a bad file or an unreachable hub dataset raises one
    sentence before anything is written): a ``datasets.Dataset`` for a file, an ``IterableDataset``
    for a hub dataset."""
    if source.loader is not None:
        return load_file_texts(source.name, source.loader, json_key, cache)
    return _open_hub(source, json_key)


def _open_hub(source: Source, json_key: str):
    try:
        stream = datasets.load_dataset(source.name, source.config, split="train", streaming=True)
    except (ConnectionError, FileNotFoundError, ValueError) as err:
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")
        raise UserError(f"hub dataset '{source.label}' cannot be loaded ({detail}); check the name and config and "
                         "that the hub is reachable (HF_HUB_OFFLINE unset), or pass downloaded files as --input."
                         ) from None
    fields = list(stream.features) if stream.features is not None else None
    if fields is not None and json_key not in fields:
        raise UserError(f"hub dataset '{source.label}' has no field '{json_key}' (fields: {', '.join(fields)}); "
                         "pass --json-key with the name of the text field.")
    return stream


def text_batches(source: Source, documents, json_key: str, batch_size: int) -> Iterator[list]:
    """Lists of at most ``batch_size`` texts of ``documents`` (from :func:`open_source`), in order."""
    if source.loader is not None:
        yield from _rebatched((part.to_pylist() for part in streamed_text_column(documents)), batch_size)
        return
    skipped, first = 0, None
    for number, batch in enumerate(documents.iter(batch_size=batch_size)):
        if json_key not in batch:
            raise UserError(f"hub dataset '{source.label}' has no field '{json_key}' (fields: {', '.join(batch)}); "
                             "pass --json-key with the name of the text field.")
        texts = [text if isinstance(text, str) else None for text in batch[json_key]]
        missing = [i for i, text in enumerate(texts) if text is None]
        if missing and first is None:
            first = number * batch_size + missing[0]
        skipped += len(missing)
        yield texts
    if skipped:
        warnings.warn(f"{source.label}: skipped {skipped} document(s) without string text; the first is record "
                      f"{first + 1}.", SkippedDocumentsWarning, stacklevel=2)


def _rebatched(lists: Iterator[list], batch_size: int) -> Iterator[list]:
    """The items of ``lists`` in order, regrouped into lists of ``batch_size`` (the last may be shorter)."""
    pending: list = []
    for items in lists:
        pending.extend(items)
        while len(pending) >= batch_size:
            yield pending[:batch_size]
            del pending[:batch_size]
    if pending:
        yield pending


def output_prefixes(sources: Sequence[Source], output_prefix: str, merge: bool) -> list[tuple[str, list[Source]]]:
    """(prefix, sources) of every output: one for all sources when ``merge`` or when there is one source,
    else ``<output_prefix>_<stem>`` per source; two sources with one stem are refused in one sentence."""
    if merge or len(sources) == 1:
        return [(output_prefix, list(sources))]
    by_stem: dict[str, Source] = {}
    for source in sources:
        if source.stem in by_stem:
            raise UserError(f"inputs '{by_stem[source.stem].label}' and '{source.label}' would both write "
                             f"'{output_prefix}_{source.stem}'; rename one, or pass --merge for one output.")
        by_stem[source.stem] = source
    return [(f"{output_prefix}_{stem}", [source]) for stem, source in by_stem.items()]


def tokenize_sources(
    inputs,
    output_prefix: str | os.PathLike,
    encode: Callable,
    write: Callable,
    vocab_size: int,
    workers: int,
    json_key: str,
    progress: bool,
    batch_size: int,
) -> tuple[int, int, float]:
    """Every input, checked first, then tokenized by ``encode`` in ``workers`` processes and written by
    ``write`` into ``<output_prefix>.bin/.idx`` in input order. Returns (documents, tokens, seconds).

    ``inputs`` are paths, directories or ``hub:`` names (see :func:`expand_inputs`); they form one output.
    """
    start = time.perf_counter()
    sources = expand_inputs(inputs, workers)
    workers = usable_workers(int(workers))
    with ExitStack() as stack:
        cache = stack.enter_context(scratch_directory(output_prefix))
        if not progress and datasets.is_progress_bar_enabled():  # silence datasets' own bars too
            datasets.disable_progress_bars()
            stack.callback(datasets.enable_progress_bars)
        opened = [open_source(source, json_key, cache) for source in sources]
        batches = itertools.chain.from_iterable(
            text_batches(source, documents, json_key, batch_size) for source, documents in zip(sources, opened))
        labels = ", ".join(source.label for source in sources)
        encoded = stack.enter_context(closing(encoded_in_order(encode, batches, workers)))
        documents, tokens = write_encoded(
            output_prefix, vocab_size, encoded, write,
            f"the inputs {labels} hold no non-blank documents; check the files and --json-key.", progress)
    return documents, tokens, time.perf_counter() - start
