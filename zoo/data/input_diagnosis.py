"""The input diagnosis of preprocessing: local files read through ``datasets``, every problem one sentence.

Input formats, chosen by file name (``datasets`` reads them into Arrow files in a scratch directory;
the inputs stay where they are):

- ``.txt`` (or ``.txt.gz``): one document per line.
- ``.jsonl``, ``.json`` (optionally ``.gz``/``.bz2``/``.xz``/``.zst``): one JSON object per document;
  the text is under ``json_key`` (default ``"text"``).
- ``.parquet``: one row per document; the text is the column ``json_key``.

A file that cannot be read at all (empty, not UTF-8, a line that is not a JSON object, corrupt
compression, a text field of another type) raises ``UserError`` with one sentence naming the file and
line. Documents without a string text (the field is missing, null, or a number, list or object) become
null texts, which the tokenizing step drops; they are counted and reported per file in one
:class:`SkippedDocumentsWarning` naming the line of the first. Every file is checked before anything
is tokenized, so a bad input never leaves an output behind.
"""

from __future__ import annotations

import bz2
import gzip
import itertools
import json
import logging
import lzma
import os
import re
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from zoo.data.preprocess_pipeline import SkippedDocumentsWarning
from zoo.errors import UserError

COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
_LOADERS = ((".txt", "text"), (".jsonl", "json"), (".json", "json"), (".parquet", "parquet"))
# Rows per record batch of the Arrow copies: the tokenizing step reads them one batch at a time, so this
# bounds its memory whatever the size of the file.
ARROW_BATCH_ROWS = 256


def loader_for(path: str) -> str:
    """The ``datasets`` loader of ``path`` by its extension ("text", "json" or "parquet"), or one sentence."""
    name = path.lower()
    for ext in COMPRESSION_SUFFIXES:
        if name.endswith(ext):
            name = name[: -len(ext)]
            break
    for ext, loader in _LOADERS:
        if name.endswith(ext):
            return loader
    raise UserError(
        f"input '{path}' has an unsupported extension; use .txt (one document per line), "
        ".jsonl/.json or .parquet, each optionally compressed as .gz, .bz2, .xz or .zst."
    )


def load_file_texts(path: str, loader: str, json_key: str, cache: str):
    """``path`` as a ``datasets.Dataset`` (Arrow files under ``cache``) with one string column "text".

    A file that cannot be read raises ``UserError`` naming it (and the line, where there is one); the
    file's documents without a string text are reported in one :class:`SkippedDocumentsWarning`
    (their text becomes null, which the tokenizing step drops).
    """
    key = "text" if loader == "text" else json_key
    ds = _load_file(path, loader, key, cache)
    if key not in ds.column_names:
        raise UserError(
            f"input '{path}' has no field '{key}' (fields: {', '.join(ds.column_names)}); "
            "pass --json-key with the name of the text field."
        )
    ds = ds.select_columns([key])
    ds = ds.rename_column(key, "text") if key != "text" else ds
    return _string_texts(ds, path, key, loader)


def _load_file(path: str, loader: str, key: str, cache: str):
    """``datasets.load_dataset`` of one file; a failure caused by the file becomes one sentence.

    pyarrow refuses a JSON field whose type changes between records; such a file (every record
    still one JSON object) is read again record by record, keeping only ``key`` as JSON values.
    """
    if os.path.getsize(path) == 0:
        raise UserError(_empty_file_sentence(path))
    try:
        with _without_datasets_read_errors():
            return datasets.load_dataset(loader, data_files=path, split="train", cache_dir=cache,
                                        writer_batch_size=ARROW_BATCH_ROWS)
    except (datasets.exceptions.DatasetGenerationError, StopIteration, ValueError, EOFError, OSError) as err:
        problem = _describe_unreadable(path, loader)
        if problem is None and loader == "json" and isinstance(_root_cause(err), pa.ArrowInvalid):
            return _json_field_values(path, key, cache)
        problem = problem or _describe_cause(path, loader, err)
        if problem is None:
            raise
        raise UserError(problem) from None


def _json_records(path: str):
    """The records of a JSON-lines file or a JSON array (already known to be valid), streamed in order."""
    with _open_decompressed(path) as source:
        head = []
        for raw in source:
            head.append(raw)
            if raw.strip():
                break
        if head and head[-1].lstrip().startswith(b"["):
            yield from json.loads(b"".join(head) + source.read())
            return
        for raw in itertools.chain(head, source):
            if raw.strip():
                yield json.loads(raw)


def _field_rows(path: str, key: str):
    for record in _json_records(path):
        yield {key: record.get(key)}


def _json_field_values(path: str, key: str, cache: str):
    """Field ``key`` of every record of ``path`` as a JSON-valued column (missing: null)."""
    features = datasets.Features({key: datasets.features.Json()})
    return datasets.Dataset.from_generator(_field_rows, features=features, cache_dir=cache,
                                           gen_kwargs={"path": path, "key": key}, writer_batch_size=ARROW_BATCH_ROWS)


@contextmanager
def _without_datasets_read_errors():
    """Drops the line ``datasets``' JSON and Parquet readers log before raising on a file they cannot
    parse: the raise becomes this module's one sentence, which would otherwise follow a second account."""
    loggers = [logging.getLogger(f"datasets.packaged_modules.{name}.{name}") for name in ("json", "parquet")]

    def below_error(record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR

    for logger in loggers:
        logger.addFilter(below_error)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(below_error)


def _root_cause(err: BaseException) -> BaseException:
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ if err.__cause__ is not None else err.__context__
    return err


def _describe_cause(path: str, loader: str, err: BaseException) -> str | None:
    """A sentence from the error ``datasets`` met, when that was a malformed value (not e.g. a full disk)."""
    cause = _root_cause(err)
    if isinstance(cause, OSError) or not isinstance(cause, (ValueError, StopIteration)):
        return None
    detail = (str(cause).strip().splitlines() or [type(cause).__name__])[0].split(". ")[0].rstrip(".")
    row = re.search(r"\bin row (\d+)$", detail)
    if row:  # pyarrow counts the records from 0
        detail = f"{detail[:row.start()].rstrip()} at {_record_place(path, loader, int(row.group(1)))}"
    fixes = {"json": "make each line one JSON object whose fields keep one type throughout the file",
             "text": "check that it is UTF-8 text", "parquet": "check that it is a complete Parquet file"}
    return f"input '{path}' cannot be read ({detail}); {fixes[loader]}."


def _empty_file_sentence(path: str) -> str:
    return f"input '{path}' is empty; remove it from --input or fill it with documents."


def _open_decompressed(path: str):
    """``path`` as a binary file, decompressed by its extension; None for .zst without ``zstandard``."""
    openers = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
    for ext, opener in openers.items():
        if path.lower().endswith(ext):
            return opener(path, "rb")
    if path.lower().endswith(".zst"):
        try:
            import zstandard  # local: an optional dependency, needed only for .zst inputs
        except ImportError:
            return None
        return zstandard.open(path, "rb")
    return open(path, "rb")


def _describe_unreadable(path: str, loader: str) -> str | None:
    """Reads ``path`` again after ``datasets`` failed on it: one sentence naming what is wrong with it
    (empty, corrupt compression, not UTF-8, a line that is not a JSON object), or None if it finds nothing."""
    if loader == "parquet":
        return _empty_file_sentence(path) if os.path.getsize(path) == 0 else None
    try:
        source = _open_decompressed(path)
        if source is None:
            return None
        with source:
            return _describe_text_problem(path, loader, source)
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as err:
        return (f"input '{path}' cannot be decompressed ({err}); check that the file is complete "
                "and not corrupt.")


def _describe_text_problem(path: str, loader: str, source) -> str | None:
    """The first problem of a text or JSON file read from the binary file ``source``, or None."""
    lines, layout = [], None
    for number, raw in enumerate(source, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            return (f"input '{path}' line {number} is not UTF-8 (byte 0x{raw[err.start]:02x} at column "
                    f"{err.start + 1}); convert the file to UTF-8, e.g. with iconv -f latin1 -t utf-8.")
        if layout is None and line.strip():
            layout = "array" if line.lstrip().startswith("[") else "lines"
        if loader == "json" and layout == "lines" and line.strip():
            problem = _describe_json_line(path, number, line)
            if problem:
                return problem
        elif loader == "json" and layout == "array":
            lines.append(line)
    if layout is None:
        return _empty_file_sentence(path)
    if loader == "json" and layout == "array":
        return _describe_json_array(path, "".join(lines))
    return None


def _json_kind(value) -> str:
    names = {str: "string", bool: "boolean", int: "number", float: "number", list: "array", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _describe_json_line(path: str, number: int, line: str) -> str | None:
    try:
        value = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as err:
        return (f"input '{path}' line {number} is not valid JSON ({err.msg} at column {err.colno}); "
                "each line of a JSON-lines file must be one JSON object.")
    if not isinstance(value, dict):
        return (f"input '{path}' line {number} holds a JSON {_json_kind(value)}, not an object; "
                "each line of a JSON-lines file must be one JSON object.")
    return None


def _describe_json_array(path: str, text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return (f"input '{path}' line {err.lineno} is not valid JSON ({err.msg} at column {err.colno}); "
                "fix the file or write it as JSON lines, one object per line.")
    bad = [i for i, item in enumerate(value, start=1) if not isinstance(item, dict)] if isinstance(value, list) else []
    if bad:
        return (f"input '{path}' holds a JSON array whose item {bad[0]} is a {_json_kind(value[bad[0] - 1])}, "
                "not an object; make every item one object per document.")
    return None


def _string_texts(ds, path: str, key: str, loader: str):
    """``ds`` with its "text" column as strings: documents whose text is missing, null or not a string
    become null (dropped when tokenizing) and are reported in one :class:`SkippedDocumentsWarning`."""
    column_type = ds.data.schema.field("text").type
    if pa.types.is_string(column_type) or pa.types.is_large_string(column_type):
        missing, first, seen = 0, None, 0
        for part in streamed_text_column(ds):
            _check_utf8(part, path, loader)
            if part.null_count and first is None:
                first = seen + _first_null(part)
            missing += part.null_count
            seen += len(part)
        _warn_skipped(path, loader, Counter({f"without a '{key}' value": missing}), first)
        return ds
    if pa.types.is_null(column_type):
        _warn_skipped(path, loader, Counter({f"without a '{key}' value": len(ds)}), 0)
        return ds.cast(datasets.Features({"text": datasets.Value("string")}))
    if not isinstance(ds.features["text"], datasets.features.Json):
        raise UserError(f"input '{path}' field '{key}' holds {column_type} values, not text; "
                         "pass --json-key with the name of the text field.")
    reasons, first = Counter(), []  # filled by the (single-process, in-order) map below

    def keep_strings(batch, indices):
        for index, text in zip(indices, batch["text"]):
            if not isinstance(text, str):
                reasons[f"without a '{key}' value" if text is None else f"with a non-string '{key}'"] += 1
                first[:] = first or [index]
        return {"text": [text if isinstance(text, str) else None for text in batch["text"]]}

    ds = ds.map(keep_strings, batched=True, with_indices=True, load_from_cache_file=False,
                writer_batch_size=ARROW_BATCH_ROWS,
                features=datasets.Features({"text": datasets.Value("string")}), desc="Checking texts")
    _warn_skipped(path, loader, reasons, first[0] if first else None)
    return ds


def streamed_text_column(ds) -> Iterator:
    """The "text" column of a file's ``datasets.Dataset``, one record batch of its Arrow copy at a time.

    The copy is read as a stream, not through datasets' memory map: a mapped file's pages, once read, stay
    in the process's resident memory until it is unmapped, so reading a mapped 200 MB corpus would hold
    200 MB. A dataset that is not one mapped file (in memory, or with an indices mapping) is read
    through datasets.
    """
    table = ds.data
    if isinstance(table, datasets.table.MemoryMappedTable) and getattr(ds, "_indices", None) is None:
        with pa.OSFile(table.path) as source:
            for batch in pa.ipc.open_stream(source):
                part = pa.Table.from_batches([batch])
                for name, args, kwargs in table.replays:  # the column selection and renaming datasets recorded
                    part = getattr(part, name)(*args, **kwargs)
                yield part.column("text")
        return
    for part in ds.with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS):
        yield part.column("text")


def _check_utf8(column, path: str, loader: str) -> None:
    """pyarrow's JSON and Parquet readers keep invalid UTF-8 in string columns: refuse it here, naming the line."""
    try:
        column.validate(full=True)
    except pa.ArrowInvalid as err:
        problem = _describe_unreadable(path, loader) or (
            f"input '{path}' holds text that is not UTF-8 ({err}); convert the file to UTF-8.")
        raise UserError(problem) from None


def _first_null(column) -> int:
    return pc.index(pc.is_null(column), True).as_py()


def _warn_skipped(path: str, loader: str, reasons: Counter, first: int | None) -> None:
    """One warning: how many documents of ``path`` were skipped, why, and where the first one is."""
    count = sum(reasons.values())
    if not count:
        return
    why = "; ".join(f"{n} {reason}" for reason, n in reasons.most_common() if n)
    warnings.warn(f"{path}: skipped {count} document(s) without string text ({why}); "
                  f"the first is {_record_place(path, loader, first)}.", SkippedDocumentsWarning, stacklevel=5)


def _record_place(path: str, loader: str, index: int) -> str:
    """Where record ``index`` (0-based) of ``path`` is: its line in a JSON-lines file, else its number."""
    if loader == "json":
        source = _open_decompressed(path)
        if source is not None:
            with source:
                seen = -1
                for number, raw in enumerate(source, start=1):
                    stripped = raw.strip()
                    if seen == -1 and stripped.startswith(b"["):
                        break  # a JSON array: lines are not records
                    seen += bool(stripped)
                    if seen == index:
                        return f"line {number}"
    return f"record {index + 1}"
