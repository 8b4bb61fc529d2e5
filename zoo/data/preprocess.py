"""Raw text -> tokenized indexed dataset (``<prefix>.bin/.idx``), in parallel.

Input formats, chosen by file name (``datasets`` reads them; the files stay local):

- ``.txt`` (or ``.txt.gz``): one document per line.
- ``.jsonl``, ``.json`` (optionally ``.gz``/``.bz2``/``.xz``/``.zst``): one JSON object per document;
  the text is under ``json_key`` (default ``"text"``).
- ``.parquet``: one row per document; the text is the column ``json_key``.

Documents whose text is empty or whitespace are skipped. Each document becomes one sequence of
GPT-2 ids followed by <|endoftext|> (``append_eod``). Files are read in the given order, and
documents keep their order. ``datasets`` stores its Arrow copies in a temporary directory next
to the output, removed afterwards.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from zoo.data.indexed_dataset import IndexedDatasetBuilder, dataset_exists
from zoo.data.tokenizers import load_gpt2_tokenizer

BUNDLED_CORPUS = Path(__file__).resolve().parent.parent / "assets" / "corpora" / "wiki-sample.jsonl.gz"
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

    out_dir = Path(os.fspath(output_prefix)).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    documents = tokens = 0
    with ExitStack() as stack:
        if not progress and datasets.is_progress_bar_enabled():  # silence datasets' own bars too
            datasets.disable_progress_bars()
            stack.callback(datasets.enable_progress_bars)
        cache = stack.enter_context(tempfile.TemporaryDirectory(dir=out_dir, prefix=".zoo-preprocess-"))
        parts = []
        for path, loader in zip(paths, loaders):
            ds = datasets.load_dataset(loader, data_files=path, split="train", cache_dir=cache)
            key = "text" if loader == "text" else json_key
            if key not in ds.column_names:
                raise ValueError(
                    f"input '{path}' has no field '{key}' (fields: {', '.join(ds.column_names)}); "
                    "pass --json-key with the name of the text field."
                )
            ds = ds.select_columns([key])
            parts.append(ds.rename_column(key, "text") if key != "text" else ds)
        raw = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
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
        del encoded, raw, parts, column
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
