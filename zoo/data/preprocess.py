"""Raw text -> GPT indexed dataset (``<prefix>.bin/.idx``), one sequence per document, in parallel.

Inputs are files, directories of files, or ``hub:`` datasets (:mod:`zoo.data.preprocess_sources`);
each file is checked by :mod:`zoo.data.input_diagnosis` before anything is written. Documents whose
text is empty, whitespace or not a string are skipped. Each document becomes one sequence of GPT-2
ids followed by <|endoftext|> (``append_eod``). Inputs are read in the given order and documents
keep their order, so the output is the same bytes for every number of workers
(:mod:`zoo.data.preprocess_pipeline`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
from collections.abc import Sequence

import numpy as np

from zoo.assets import BUNDLED_CORPUS
from zoo.data.bert_preprocess import preprocess_bert
from zoo.data.preprocess_data_path import data_path_value
from zoo.data.preprocess_pipeline import (
    PreprocessSummary,
    SkippedDocumentsWarning,
    cached_corpus_prefix,
    default_cache_dir,
    usable_workers,
)
from zoo.data.tokenizers import load_bert_tokenizer, load_gpt2_tokenizer
from zoo.errors import UserError

__all__ = ["BUNDLED_CORPUS", "PreprocessSummary", "SkippedDocumentsWarning", "add_preprocess_arguments",
           "cached_corpus_prefix", "data_path_line", "default_cache_dir", "default_corpus_prefix", "encode_documents",
           "preprocess", "run_preprocess"]


def encode_documents(texts: list, tokenizer, eod: int | None) -> tuple[np.ndarray, np.ndarray]:
    """One batch, in a worker: the non-blank string texts tokenized in one fast-tokenizer call, each
    followed by ``eod`` (unless None), as (ids back to back, int32; tokens per document, int64)."""
    kept = [text for text in texts if isinstance(text, str) and text.strip()]
    if not kept:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    ids = tokenizer(kept, add_special_tokens=False, verbose=False, return_attention_mask=False)["input_ids"]
    if eod is not None:
        for document in ids:
            document.append(eod)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths


def _write_documents(builder, encoded) -> tuple[int, int]:
    flat, lengths = encoded
    builder.add_documents(flat, lengths)
    return len(lengths), flat.size


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
    """Tokenizes ``inputs`` over ``workers`` processes into one ``<output_prefix>.bin/.idx`` (atomically).

    ``inputs`` are files, directories or ``hub:`` names, read in order. ``tokenizer`` is a transformers
    tokenizer, a tokenizer directory, or None for bundled GPT-2. Returns the document/token counts and timing.
    """
    from zoo.data.preprocess_sources import tokenize_sources  # local: reading inputs imports datasets (~1.5 s)

    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_gpt2_tokenizer(tokenizer)
    eod = tokenizer.eos_token_id if append_eod else None
    if append_eod and eod is None:
        raise UserError(
            "the tokenizer has no end-of-document (eos) token; pass append_eod=False or another tokenizer."
        )
    encode = functools.partial(encode_documents, tokenizer=tokenizer, eod=eod)
    documents, tokens, seconds = tokenize_sources(inputs, output_prefix, encode, _write_documents, len(tokenizer),
                                                  workers, json_key, progress, batch_size)
    return PreprocessSummary(os.fspath(output_prefix), documents, tokens, seconds)


def default_corpus_prefix(
    cache_dir: str | os.PathLike | None = None,
    corpus: str | os.PathLike = BUNDLED_CORPUS,
    workers: int | None = None,
    progress: bool = False,
) -> str:
    """Prefix of ``corpus`` (default: the bundled Wikipedia sample) tokenized with GPT-2 in ``cache_dir``
    (default ``$ZOO_CACHE`` or ``~/.cache/zoo``), built once (see :func:`cached_corpus_prefix`)."""
    return cached_corpus_prefix(corpus, "gpt2_text_document", preprocess, cache_dir, workers, progress)


def add_preprocess_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``launch/preprocess.py``, for :func:`run_preprocess`."""
    parser.add_argument("--input", nargs="+", required=True, metavar="INPUT",
                        help="raw text files (.txt one document per line, .jsonl/.json, .parquet; optionally .gz), "
                             "directories of them, or hub:NAME, hub:OWNER/NAME[/CONFIG] (streamed)")
    parser.add_argument("--output-prefix", required=True,
                        help="writes PREFIX.bin and PREFIX.idx (with several inputs and no --merge, "
                             "PREFIX_<input name>.bin/.idx per input); the last line printed is the --data-path "
                             "value that trains on them")
    parser.add_argument("--merge", action="store_true", help="write all inputs into one PREFIX.bin/.idx")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--json-key", default="text", help="text field of .jsonl/.json/.parquet/hub inputs")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: bundled GPT-2)")
    parser.add_argument("--model", choices=("gpt", "bert"), default="gpt",
                        help="gpt: one sequence per document, with <|endoftext|>; bert: one sequence per sentence")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="append <|endoftext|> (gpt)")
    parser.add_argument("--batch-size", type=int, default=64, help="documents per tokenizer call")
    return parser


def run_preprocess(args: argparse.Namespace) -> list[PreprocessSummary]:
    """Preprocesses what :func:`add_preprocess_arguments` parsed, printing one summary line per output, then the
    ``--data-path`` value that trains on all of them (:func:`data_path_line`).

    Without ``--merge``, several inputs (or a directory of several files) give one output each, named
    ``<prefix>_<input name>``, written one after the other; each output is complete or absent.
    """
    from zoo.data.preprocess_sources import expand_inputs, output_prefixes  # local: imports datasets (~1.5 s)

    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size} is invalid; use at least 1.")
    sources = expand_inputs(args.input, args.workers)
    workers = usable_workers(args.workers)   # said once, not once per output
    outputs = output_prefixes(sources, args.output_prefix, args.merge)
    if args.model == "bert":
        tokenizer = load_bert_tokenizer(args.tokenizer)
        run = functools.partial(preprocess_bert, tokenizer=tokenizer)
    else:
        tokenizer = load_gpt2_tokenizer(args.tokenizer)
        run = functools.partial(preprocess, tokenizer=tokenizer, append_eod=args.append_eod)
    summaries = []
    for prefix, group in outputs:
        inputs = [source.label for source in group]
        summaries.append(run(inputs, prefix, workers=workers, json_key=args.json_key, batch_size=args.batch_size))
        print(summaries[-1])
    print(data_path_line(summaries))
    return summaries


def data_path_line(summaries: Sequence[PreprocessSummary]) -> str:
    """The line preprocessing ends with: the ``--data-path`` value that trains on every output written, the
    outputs blended by their share of the tokens (:func:`~zoo.data.preprocess_data_path.data_path_value`)."""
    value = data_path_value([(summary.prefix, summary.tokens) for summary in summaries])
    blend = " (a blend of the outputs, weighted by their tokens; --merge writes one)" if len(summaries) > 1 else ""
    return f"train on it with: --data-path {value}{blend}"
