"""Raw text -> tokenized indexed dataset (``<prefix>.bin/.idx``), in parallel.

Input formats, chosen by file name (``datasets`` reads them; the files stay local):

- ``.txt`` (or ``.txt.gz``): one document per line.
- ``.jsonl``, ``.json`` (optionally ``.gz``/``.bz2``/``.xz``/``.zst``): one JSON object per document;
  the text is under ``json_key`` (default ``"text"``).
- ``.parquet``: one row per document; the text is the column ``json_key``.

Documents whose text is empty or whitespace are skipped. Documents without a string text (the field is
missing, null, or a number, list or object) are skipped too, counted, and reported per file in one
:class:`SkippedDocumentsWarning` naming the line of the first. A file that cannot be read at all (empty,
not UTF-8, a line that is not a JSON object, corrupt compression) raises ``ValueError`` with one
sentence naming the file and line. Each document becomes one sequence of
GPT-2 ids followed by <|endoftext|> (``append_eod``). Files are read in the given order, and
documents keep their order. ``datasets`` stores its Arrow copies in a temporary directory next
to the output, removed afterwards.
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
import tempfile
import time
import warnings
import zlib
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from zoo.assets import BUNDLED_CORPUS
from zoo.data.indexed_dataset import IndexedDatasetBuilder, dataset_exists
from zoo.data.tokenizers import load_gpt2_tokenizer

_COMPRESSION = (".gz", ".bz2", ".xz", ".zst")
_LOADERS = ((".txt", "text"), (".jsonl", "json"), (".json", "json"), (".parquet", "parquet"))


@dataclass(frozen=True)
class PreprocessSummary:
    prefix: str
    documents: int
    tokens: int
    seconds: float

    @property
    def docs_per_s(self) -> float:
        return self.documents / self.seconds if self.seconds > 0 else float("inf")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        return (
            f"{self.prefix}: {self.documents} documents, {self.tokens} tokens in {self.seconds:.2f} s "
            f"({self.docs_per_s:.1f} docs/s, {self.tokens_per_s:.0f} tokens/s)"
        )


def _loader_for(path: str) -> str:
    name = path.lower()
    for ext in _COMPRESSION:
        if name.endswith(ext):
            name = name[: -len(ext)]
            break
    for ext, loader in _LOADERS:
        if name.endswith(ext):
            return loader
    raise ValueError(
        f"input '{path}' has an unsupported extension; use .txt (one document per line), "
        ".jsonl/.json (optionally .gz) or .parquet."
    )


def _encode_batch(batch, tokenizer, key, eod):
    """datasets.map function: drop blank documents, tokenize the rest, append EOD."""
    texts = [t for t in batch[key] if isinstance(t, str) and t.strip()]
    if not texts:
        return {"input_ids": []}
    ids = tokenizer(texts, add_special_tokens=False, verbose=False, return_attention_mask=False)["input_ids"]
    if eod is not None:
        ids = [x + [eod] for x in ids]
    return {"input_ids": ids}


def validated_inputs(inputs, workers: int) -> tuple[list[str], list[str]]:
    """The input paths and their ``datasets`` loader names, with one-sentence errors."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    paths = [os.fspath(p) for p in inputs]
    if not paths:
        raise ValueError("no input files given; pass at least one --input FILE.")
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"input file '{p}' does not exist; check the --input path.")
    loaders = [_loader_for(p) for p in paths]
    if int(workers) < 1:
        raise ValueError(f"workers={workers} is invalid; use at least 1.")
    return paths, loaders


@contextmanager
def scratch_directory(output_prefix: str | os.PathLike):
    """A temporary directory beside ``output_prefix`` for ``datasets``' Arrow copies, removed afterwards.

    The output's directory is created if missing (one sentence if it cannot be); if the work then fails,
    the directories this created are removed again, so a failed run leaves nothing behind.
    """
    out_dir = Path(os.fspath(output_prefix)).resolve().parent
    created = []
    for directory in (out_dir, *out_dir.parents):
        if directory.exists() or directory.is_symlink():
            break
        created.append(directory)
    try:
        with _output_directory_errors(output_prefix):
            out_dir.mkdir(parents=True, exist_ok=True)
            scratch = tempfile.TemporaryDirectory(dir=out_dir, prefix=".zoo-preprocess-")
        with scratch as cache:
            yield cache
    except BaseException:
        for directory in created:  # deepest first; kept if something else appeared in it
            try:
                directory.rmdir()
            except OSError:
                break
        raise


@contextmanager
def _output_directory_errors(output_prefix):
    """Turns the errors of creating the output's directory into one sentence naming the prefix."""
    try:
        yield
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"output prefix '{os.fspath(output_prefix)}' lies under a file, not a directory; "
                         "choose a prefix inside a directory.") from None
    except PermissionError:
        raise ValueError(f"output prefix '{os.fspath(output_prefix)}' is in a directory that cannot be created "
                         "or written (permission denied); choose a prefix in a directory you can write to.") from None


class SkippedDocumentsWarning(UserWarning):
    """Some documents of an input file had no string text and have been skipped."""


def load_texts(paths: Sequence[str], loaders: Sequence[str], json_key: str, cache: str):
    """The inputs as one ``datasets.Dataset`` with a single string column "text", in file order.

    A file that cannot be read raises ``ValueError`` naming it (and the line, where there is one);
    each file's documents without a string text are reported in one :class:`SkippedDocumentsWarning`
    (their text becomes null, which the tokenizing step drops).
    """
    import datasets

    parts = []
    for path, loader in zip(paths, loaders):
        key = "text" if loader == "text" else json_key
        ds = _load_file(path, loader, key, cache)
        if key not in ds.column_names:
            raise ValueError(
                f"input '{path}' has no field '{key}' (fields: {', '.join(ds.column_names)}); "
                "pass --json-key with the name of the text field."
            )
        ds = ds.select_columns([key])
        ds = ds.rename_column(key, "text") if key != "text" else ds
        parts.append(_string_texts(ds, path, key, loader))
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _load_file(path: str, loader: str, key: str, cache: str):
    """``datasets.load_dataset`` of one file; a failure caused by the file becomes one sentence.

    pyarrow refuses a JSON field whose type changes between records; such a file (every record
    still one JSON object) is read again record by record, keeping only ``key`` as JSON values.
    """
    import datasets
    import pyarrow as pa

    if os.path.getsize(path) == 0:
        raise ValueError(_empty_file_sentence(path))
    try:
        with _without_datasets_read_errors():
            return datasets.load_dataset(loader, data_files=path, split="train", cache_dir=cache)
    except (datasets.exceptions.DatasetGenerationError, StopIteration, ValueError, EOFError, OSError) as err:
        problem = _describe_unreadable(path, loader)
        if problem is None and loader == "json" and isinstance(_root_cause(err), pa.ArrowInvalid):
            return _json_field_values(path, key, cache)
        problem = problem or _describe_cause(path, loader, err)
        if problem is None:
            raise
        raise ValueError(problem) from None


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
    import datasets

    features = datasets.Features({key: datasets.features.Json()})
    return datasets.Dataset.from_generator(_field_rows, features=features, cache_dir=cache,
                                           gen_kwargs={"path": path, "key": key})


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
            import zstandard
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
    import datasets
    import pyarrow as pa

    column = ds.data.column("text")
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        _check_utf8(column, path, loader)
        missing = column.null_count
        first = _first_null(column) if missing else None
        _warn_skipped(path, loader, Counter({f"without a '{key}' value": missing}), first)
        return ds
    if pa.types.is_null(column.type):
        _warn_skipped(path, loader, Counter({f"without a '{key}' value": len(ds)}), 0)
        return ds.cast(datasets.Features({"text": datasets.Value("string")}))
    if not isinstance(ds.features["text"], datasets.features.Json):
        raise ValueError(f"input '{path}' field '{key}' holds {column.type} values, not text; "
                         "pass --json-key with the name of the text field.")
    reasons, first = Counter(), []  # filled by the (single-process, in-order) map below

    def keep_strings(batch, indices):
        for index, text in zip(indices, batch["text"]):
            if not isinstance(text, str):
                reasons[f"without a '{key}' value" if text is None else f"with a non-string '{key}'"] += 1
                first[:] = first or [index]
        return {"text": [text if isinstance(text, str) else None for text in batch["text"]]}

    ds = ds.map(keep_strings, batched=True, with_indices=True, load_from_cache_file=False,
                features=datasets.Features({"text": datasets.Value("string")}), desc="Checking texts")
    _warn_skipped(path, loader, reasons, first[0] if first else None)
    return ds


def _check_utf8(column, path: str, loader: str) -> None:
    """pyarrow's JSON and Parquet readers keep invalid UTF-8 in string columns: refuse it here, naming the line."""
    import pyarrow as pa

    try:
        column.validate(full=True)
    except pa.ArrowInvalid as err:
        problem = _describe_unreadable(path, loader) or (
            f"input '{path}' holds text that is not UTF-8 ({err}); convert the file to UTF-8.")
        raise ValueError(problem) from None


def _first_null(column) -> int:
    import pyarrow.compute as pc

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


def preprocess(
    inputs: Sequence[str | os.PathLike] | str | os.PathLike,
    output_prefix: str | os.PathLike,
    tokenizer=None,
    workers: int = 1,
    json_key: str = "text",
    append_eod: bool = True,
    progress: bool = True,
    batch_size: int = 64,
) -> PreprocessSummary:
    """Tokenizes ``inputs`` over ``workers`` processes into ``<output_prefix>.bin/.idx`` (atomically).

    ``tokenizer`` is a transformers tokenizer, a tokenizer directory, or None for bundled GPT-2.
    Returns the document/token counts and timing.
    """
    import datasets
    from tqdm.auto import tqdm

    start = time.perf_counter()
    paths, loaders = validated_inputs(inputs, workers)
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_gpt2_tokenizer(tokenizer)
    eod = tokenizer.eos_token_id if append_eod else None
    if append_eod and eod is None:
        raise ValueError(
            "the tokenizer has no end-of-document (eos) token; pass append_eod=False or another tokenizer."
        )

    documents = tokens = 0
    with ExitStack() as stack:
        cache = stack.enter_context(scratch_directory(output_prefix))
        if not progress and datasets.is_progress_bar_enabled():  # silence datasets' own bars too
            datasets.disable_progress_bars()
            stack.callback(datasets.enable_progress_bars)
        raw = load_texts(paths, loaders, json_key, cache)
        num_proc = min(int(workers), max(1, len(raw)))
        encoded = raw.map(
            _encode_batch,
            batched=True,
            batch_size=batch_size,
            num_proc=num_proc if num_proc > 1 else None,
            fn_kwargs={"tokenizer": tokenizer, "key": "text", "eod": eod},
            remove_columns=["text"],
            load_from_cache_file=False,
            new_fingerprint=f"zoo-tokenize-{os.getpid()}-{time.time_ns()}",
            desc="Tokenizing",
        )
        if len(encoded) == 0:
            raise ValueError(
                f"the inputs {', '.join(paths)} hold no non-blank documents; check the files and --json-key."
            )
        vocab = len(tokenizer)
        builder = stack.enter_context(IndexedDatasetBuilder(output_prefix, vocab_size=vocab))
        column = encoded.data.column("input_ids")
        bar = stack.enter_context(tqdm(total=len(encoded), desc="Writing", unit="doc", disable=not progress))
        for chunk in column.chunks:
            offsets = chunk.offsets.to_numpy()
            flat = chunk.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
            builder.add_documents(flat, np.diff(offsets))
            documents += len(chunk)
            tokens += int(offsets[-1] - offsets[0])
            bar.update(len(chunk))
        del encoded, raw, column
    return PreprocessSummary(os.fspath(output_prefix), documents, tokens, time.perf_counter() - start)


def default_cache_dir() -> Path:
    """``$ZOO_CACHE``, else ``~/.cache/zoo``."""
    return Path(os.environ.get("ZOO_CACHE") or Path.home() / ".cache" / "zoo")


def cached_corpus_prefix(corpus: str | os.PathLike, suffix: str, build, cache_dir: str | os.PathLike | None = None,
                         workers: int | None = None, progress: bool = False) -> str:
    """Prefix ``<cache>/<corpus name>_<suffix>`` of a corpus preprocessed once by
    ``build([corpus], prefix, workers=, progress=)``.

    When both files exist it returns at once. An exclusive file lock serializes concurrent callers and
    the builder's atomic rename means a crash leaves nothing half-written. Call it on one rank and
    barrier before the others read it.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    name = Path(corpus).name.split(".")[0]
    prefix = str(cache / f"{name}_{suffix}")
    if dataset_exists(prefix):
        return prefix
    with open(cache / f".{name}_{suffix}.lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no flock on this platform: the atomic rename still protects readers
            pass
        if not dataset_exists(prefix):
            workers = workers if workers is not None else min(2, os.cpu_count() or 1)
            build([corpus], prefix, workers=workers, progress=progress)
    return prefix


def default_corpus_prefix(
    cache_dir: str | os.PathLike | None = None,
    corpus: str | os.PathLike = BUNDLED_CORPUS,
    workers: int | None = None,
    progress: bool = False,
) -> str:
    """Prefix of ``corpus`` (default: the bundled Wikipedia sample) tokenized with GPT-2 in ``cache_dir``
    (default ``$ZOO_CACHE`` or ``~/.cache/zoo``), built once (see :func:`cached_corpus_prefix`)."""
    return cached_corpus_prefix(corpus, "gpt2_text_document", preprocess, cache_dir, workers, progress)
