"""Raw text -> BERT indexed dataset that keeps sentence boundaries (``<prefix>.bin/.idx``).

BERT's pretraining pairs (segment A / segment B, sentence-order prediction) are cut at sentence
boundaries, so unlike GPT preprocessing (one sequence per document) every **sentence** is its own
indexed sequence and a document is the run of its sentences: document ``d`` is sequences
``[doc_idx[d], doc_idx[d+1])``, the layout Megatron-LM's ``preprocess_data.py --split-sentences``
writes. Sequences hold WordPiece ids without special tokens ([CLS]/[SEP] are added per sample).

Input formats and bad-input handling are those of :func:`zoo.data.preprocess.preprocess` (``.txt``
one document per line, ``.jsonl``/``.json`` with the text under ``json_key``, ``.parquet``;
optionally compressed; documents without a string text are skipped and reported in one warning).
Sentences that tokenize to nothing are dropped, and so are documents left without a sentence.

The sentence splitter (:func:`split_sentences`) is a deliberately simple rule set, no model:

1. every line break is a boundary (paragraphs, headings and captions are their own sentences);
2. inside a line, a boundary follows ``.``, ``!`` or ``?`` (plus any closing quotes/brackets)
   when whitespace and then a capital letter (optionally after an opening quote/bracket) follow;
3. except after a single capital initial (``J. R. R. Tolkien``) or a common abbreviation
   (``Mr.``, ``Dr.``, ``St.``, ``e.g.``, ``i.e.``, ``vs.``, ...).
"""

from __future__ import annotations

import os
import re
import time
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from zoo.data.indexed_dataset import IndexedDatasetBuilder
from zoo.data.preprocess import (BUNDLED_CORPUS, PreprocessSummary, cached_corpus_prefix, load_texts,
                                 scratch_directory, validated_inputs)
from zoo.data.tokenizers import load_bert_tokenizer


# Words that end in "." without ending the sentence (compared lower-cased, without the final ".").
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st jr sr vs e.g i.e cf al fig gen col lt sgt capt rev gov sen rep mt ft approx".split()
)
_CANDIDATE_END = re.compile(r"""[.!?]+["')\]”’]*(?=\s+["'(\[“‘]?[A-Z])""")
_LAST_WORD = re.compile(r"(\S+)$")


def _ends_sentence(line: str, end: int) -> bool:
    """False when the "." that closes ``line[:end]`` belongs to an initial or an abbreviation."""
    word = _LAST_WORD.search(line, 0, end)
    token = word.group(1).rstrip("\"')]”’") if word else ""
    if not token.endswith("."):
        return True  # "!" or "?"
    stem = token.rstrip(".").lstrip("\"'([“‘")
    if len(stem) == 1 and stem.isupper():
        return False  # an initial, as in "J. R. R. Tolkien"
    return stem.lower() not in _ABBREVIATIONS


def split_sentences(text: str) -> list[str]:
    """Splits ``text`` into stripped, non-empty sentences by the rules in the module docstring."""
    sentences = []
    for line in text.splitlines():
        start = 0
        for match in _CANDIDATE_END.finditer(line):
            if _ends_sentence(line, match.end()):
                sentences.append(line[start : match.end()])
                start = match.end()
        sentences.append(line[start:])
    return [s.strip() for s in sentences if s.strip()]


@dataclass(frozen=True)
class BertPreprocessSummary(PreprocessSummary):
    sentences: int = 0

    def __str__(self) -> str:
        return super().__str__() + f", {self.sentences} sentences"


def _encode_sentences(batch, tokenizer, key):
    """datasets.map function: split each document into sentences and tokenize them all at once.

    Returns per kept document its ids back to back and the token count of each sentence.
    """
    docs = [split_sentences(t) if isinstance(t, str) else [] for t in batch[key]]
    flat = [s for doc in docs for s in doc]
    ids = []
    if flat:
        ids = tokenizer(flat, add_special_tokens=False, verbose=False, return_attention_mask=False)["input_ids"]
    out_ids, out_lengths, k = [], [], 0
    for doc in docs:
        sentence_ids = [x for x in ids[k : k + len(doc)] if x]
        k += len(doc)
        if sentence_ids:
            out_ids.append([t for s in sentence_ids for t in s])
            out_lengths.append([len(s) for s in sentence_ids])
    return {"input_ids": out_ids, "sentence_lengths": out_lengths}


def preprocess_bert(
    inputs: Sequence[str | os.PathLike] | str | os.PathLike,
    output_prefix: str | os.PathLike,
    tokenizer=None,
    workers: int = 1,
    json_key: str = "text",
    progress: bool = True,
    batch_size: int = 64,
) -> BertPreprocessSummary:
    """Sentence-splits and tokenizes ``inputs`` into ``<output_prefix>.bin/.idx`` (atomically).

    One indexed sequence per sentence, one indexed document per input document (see module doc).
    ``tokenizer`` is a transformers tokenizer, a tokenizer directory, or None for the bundled
    bert-base-uncased WordPiece vocab. Returns the document/sentence/token counts and timing.
    """
    import datasets
    from tqdm.auto import tqdm

    start = time.perf_counter()
    paths, loaders = validated_inputs(inputs, workers)
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_bert_tokenizer(tokenizer)

    documents = sentences = tokens = 0
    with ExitStack() as stack:
        cache = stack.enter_context(scratch_directory(output_prefix))
        if not progress and datasets.is_progress_bar_enabled():
            datasets.disable_progress_bars()
            stack.callback(datasets.enable_progress_bars)
        raw = load_texts(paths, loaders, json_key, cache)
        num_proc = min(int(workers), max(1, len(raw)))
        encoded = raw.map(
            _encode_sentences,
            batched=True,
            batch_size=batch_size,
            num_proc=num_proc if num_proc > 1 else None,
            fn_kwargs={"tokenizer": tokenizer, "key": "text"},
            remove_columns=["text"],
            load_from_cache_file=False,
            new_fingerprint=f"zoo-bert-tokenize-{os.getpid()}-{time.time_ns()}",
            desc="Tokenizing",
        )
        if len(encoded) == 0:
            raise ValueError(
                f"the inputs {', '.join(paths)} hold no non-blank documents; check the files and --json-key."
            )
        builder = stack.enter_context(IndexedDatasetBuilder(output_prefix, vocab_size=len(tokenizer)))
        bar = stack.enter_context(tqdm(total=len(encoded), desc="Writing", unit="doc", disable=not progress))
        for table in encoded.with_format("arrow").iter(batch_size=1024):
            ids = table.column("input_ids").combine_chunks()
            lengths = table.column("sentence_lengths").combine_chunks()
            flat = ids.values.to_numpy(zero_copy_only=False)
            doc_offsets = ids.offsets.to_numpy()
            sentence_lengths = lengths.values.to_numpy(zero_copy_only=False)
            sentence_offsets = lengths.offsets.to_numpy()
            for d in range(len(table)):
                doc_sizes = sentence_lengths[sentence_offsets[d] : sentence_offsets[d + 1]]
                doc_tokens = flat[doc_offsets[d] : doc_offsets[d + 1]]
                for sentence in np.split(doc_tokens, np.cumsum(doc_sizes)[:-1]):
                    builder.add_item(sentence)
                builder.end_document()
                sentences += len(doc_sizes)
            documents += len(table)
            tokens += int(doc_offsets[-1] - doc_offsets[0])
            bar.update(len(table))
        del encoded, raw
    return BertPreprocessSummary(
        os.fspath(output_prefix), documents, tokens, time.perf_counter() - start, sentences=sentences
    )


def default_bert_corpus_prefix(
    cache_dir: str | os.PathLike | None = None,
    corpus: str | os.PathLike = BUNDLED_CORPUS,
    workers: int | None = None,
    progress: bool = False,
) -> str:
    """Prefix of ``corpus`` (default: the bundled Wikipedia sample) sentence-split and tokenized with
    the bundled uncased WordPiece vocab in ``cache_dir`` (default ``$ZOO_CACHE`` or ``~/.cache/zoo``).

    Built once (see :func:`zoo.data.preprocess.cached_corpus_prefix`).
    """
    return cached_corpus_prefix(corpus, "bert-uncased_sentences", preprocess_bert, cache_dir, workers, progress)
