"""Raw text -> BERT indexed dataset that keeps sentence boundaries (``<prefix>.bin/.idx``).

BERT's pretraining pairs (segment A / segment B, sentence-order prediction) are cut at sentence
boundaries, so unlike GPT preprocessing (one sequence per document) every **sentence** is its own
indexed sequence and a document is the run of its sentences: document ``d`` is sequences
``[doc_idx[d], doc_idx[d+1])``, the layout Megatron-LM's ``preprocess_data.py --split-sentences``
writes. Sequences hold WordPiece ids without special tokens ([CLS]/[SEP] are added per sample).

Inputs, bad-input handling and the parallel pipeline are those of GPT preprocessing
(:mod:`zoo.data.preprocess_sources`, :mod:`zoo.data.input_diagnosis`, :mod:`zoo.data.preprocess_pipeline`):
files, directories or ``hub:`` datasets; documents without a string text are skipped and reported in one
warning; the output is the same bytes for every number of workers.
Sentences that tokenize to nothing are dropped, and so are documents left without a sentence.

The sentence splitter (:func:`split_sentences`) is a deliberately simple rule set, no model:

1. every line break is a boundary (paragraphs, headings and captions are their own sentences);
2. inside a line, a boundary follows ``.``, ``!`` or ``?`` (plus any closing quotes/brackets)
   when whitespace and then a capital letter (optionally after an opening quote/bracket) follow;
3. except after a single capital initial (``J. R. R. Tolkien``) or a common abbreviation
   (``Mr.``, ``Dr.``, ``St.``, ``e.g.``, ``i.e.``, ``vs.``, ...).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zoo.assets import BUNDLED_CORPUS
from zoo.data.preprocess_pipeline import PreprocessSummary, cached_corpus_prefix
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


def encode_sentences(texts: list, tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One batch, in a worker: each string text split into sentences, all sentences tokenized in one
    fast-tokenizer call. Sentences without tokens are dropped, then documents without sentences.

    Returns (ids back to back, int32; tokens per sentence, int64; sentences per kept document, int64).
    """
    docs = [split_sentences(t) if isinstance(t, str) else [] for t in texts]
    flat = [s for doc in docs for s in doc]
    ids = []
    if flat:
        ids = tokenizer(flat, add_special_tokens=False, verbose=False, return_attention_mask=False)["input_ids"]
    kept_ids, per_document, k = [], [], 0
    for doc in docs:
        sentence_ids = [x for x in ids[k : k + len(doc)] if x]
        k += len(doc)
        if sentence_ids:
            kept_ids.extend(sentence_ids)
            per_document.append(len(sentence_ids))
    lengths = np.fromiter(map(len, kept_ids), dtype=np.int64, count=len(kept_ids))
    tokens = np.fromiter(itertools.chain.from_iterable(kept_ids), dtype=np.int32, count=int(lengths.sum()))
    return tokens, lengths, np.asarray(per_document, dtype=np.int64)


class _SentenceWriter:
    """Writes encoded batches, one indexed sequence per sentence and one document per input document,
    and counts the sentences written."""

    def __init__(self):
        self.sentences = 0

    def __call__(self, builder, encoded) -> tuple[int, int]:
        tokens, lengths, per_document = encoded
        sentence_lengths = iter(lengths.tolist())
        offset = 0
        for count in per_document.tolist():
            for _ in range(count):
                length = next(sentence_lengths)
                builder.add_item(tokens[offset : offset + length])
                offset += length
            builder.end_document()
        self.sentences += len(lengths)
        return len(per_document), tokens.size


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
    ``inputs`` are files, directories or ``hub:`` names, read in order. ``tokenizer`` is a transformers
    tokenizer, a tokenizer directory, or None for the bundled bert-base-uncased WordPiece vocab.
    Returns the document/sentence/token counts and timing.
    """
    from zoo.data.preprocess_sources import tokenize_sources  # local: reading inputs imports datasets (~1.5 s)

    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_bert_tokenizer(tokenizer)
    writer = _SentenceWriter()
    encode = functools.partial(encode_sentences, tokenizer=tokenizer)
    documents, tokens, seconds = tokenize_sources(inputs, output_prefix, encode, writer, len(tokenizer), workers,
                                                  json_key, progress, batch_size)
    return BertPreprocessSummary(os.fspath(output_prefix), documents, tokens, seconds, sentences=writer.sentences)


def default_bert_corpus_prefix(
    cache_dir: str | os.PathLike | None = None,
    corpus: str | os.PathLike = BUNDLED_CORPUS,
    workers: int | None = None,
    progress: bool = False,
) -> str:
    """Prefix of ``corpus`` (default: the bundled Wikipedia sample) sentence-split and tokenized with
    the bundled uncased WordPiece vocab in ``cache_dir`` (default ``$ZOO_CACHE`` or ``~/.cache/zoo``).

    Built once (see :func:`zoo.data.preprocess_pipeline.cached_corpus_prefix`).
    """
    return cached_corpus_prefix(corpus, "bert-uncased_sentences", preprocess_bert, cache_dir, workers, progress)
