"""Several pretraining corpora blended by weight: Megatron-LM's ``--data-path W1 P1 W2 P2 ...``.

``--data-path`` is one indexed-dataset prefix, or weight/prefix pairs whose weights are normalised to
sum to 1. :func:`check_data_path` validates it in full before any process group or model exists
(weights, item count, the files, token dtype and vocabulary agreement, the split), each problem as one
sentence naming the offending value and the fix.

Blending (:func:`blend_index`) decides, for every global sample ``i``, which corpus serves it and which
of that corpus's own samples: the ``j``-th sample of corpus ``k`` is due at time ``(j + 1/2) / w_k``, and
the samples are taken in order of due time (ties go to the corpus listed first). After ``n`` samples
corpus ``k`` has served ``w_k * n`` of them up to less than ``1/2 + w_k * K / 2`` (``K`` corpora), so
every window of consecutive samples, a global batch in particular, holds each corpus's share of it up to
``1 + w_k * K`` samples. The index depends only on the weights and its length, and the first ``n``
entries of a longer index equal the index of ``n``: a run that trains further, or resumes at another
data-parallel degree with the same global batch, continues the same sample sequence.

Each corpus is split into train/valid/test by its own documents (``--split`` applies per corpus) and
shuffled by its own dataset (:class:`~zoo.data.gpt_dataset.GPTDataset` or
:class:`~zoo.data.bert_dataset.BertDataset`); :class:`BlendedDataset` only routes sample ``i`` to
``datasets[corpus[i]][sample[i]]``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from zoo.data.gpt_dataset import parse_split
from zoo.data.indexed_dataset import IndexedDataset, check_dataset_files
from zoo.errors import UserError

# How many leading documents of each corpus the vocabulary check reads (their layout and last token):
# enough to tell an end-of-document id from chance, and O(1) in the corpus's size.
CHECKED_DOCUMENTS = 1000
# Fewer documents than this carry no evidence (a few may end alike, or hold one sentence, by chance).
MIN_CHECKED_DOCUMENTS = 4
BLEND_FORMAT = "W1 PREFIX1 W2 PREFIX2 ... (weights with indexed-dataset prefixes), or a single prefix"


def data_path_items(data_path: None | str | os.PathLike | Sequence) -> list[str] | None:
    """``data_path`` as a list of items: None stays None (the bundled corpus), a single string or path is
    a one-item list, numbers in a list (weights from a ds_config's zoo block) become strings."""
    if data_path is None:
        return None
    if isinstance(data_path, (str, os.PathLike)):
        return [os.fspath(data_path)]
    return [os.fspath(item) if isinstance(item, os.PathLike) else str(item) for item in data_path]


def parse_data_path(data_path: None | str | os.PathLike | Sequence) -> list[tuple[float, str]] | None:
    """``[(weight, prefix), ...]`` with weights normalised to sum to 1 (one prefix: weight 1.0), or None
    for no ``data_path``. Corpora of weight 0 are kept (their files are still checked); they serve no
    sample. Raises UserError, naming the value, for an empty list, an odd number of items (other than
    one), a weight that is not a finite number, a negative weight, or weights that are all zero."""
    items = data_path_items(data_path)
    if items is None:
        return None
    if not items:
        raise UserError(f"--data-path is empty; give {BLEND_FORMAT}.")
    if len(items) == 1:
        return [(1.0, items[0])]
    if len(items) % 2:
        raise UserError(f"--data-path has {len(items)} items ({' '.join(items)}), an odd number; give {BLEND_FORMAT}.")
    weights, prefixes = items[0::2], items[1::2]
    values = []
    for weight, prefix in zip(weights, prefixes):
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise UserError(f"--data-path weight {weight!r} (before prefix {prefix!r}) is not a number; give "
                             f"{BLEND_FORMAT}.")
        if value < 0:
            raise UserError(f"--data-path weight {weight} of {prefix!r} is negative; give every corpus a weight "
                             ">= 0 (they are normalised to sum to 1).")
        values.append(value)
    total = sum(values)
    if total <= 0:
        raise UserError(f"--data-path weights {' '.join(weights)} are all zero; give at least one corpus a "
                         "positive weight.")
    return [(value / total, prefix) for value, prefix in zip(values, prefixes)]


def blend_warnings(data_path: None | str | os.PathLike | Sequence) -> list[str]:
    """One sentence for each blend that is accepted but probably not what was meant: a corpus named twice
    (each entry draws from the same documents, so it is one corpus of the summed weight) and a corpus of
    weight 0 (it serves no sample). ``data_path`` must parse (:func:`parse_data_path`)."""
    items = data_path_items(data_path)
    if items is None or len(items) < 2:
        return []
    weights, prefixes = items[0::2], items[1::2]
    warnings, seen = [], {}
    for weight, prefix in zip(weights, prefixes):
        same = os.path.realpath(prefix)
        if same in seen:
            first_weight, first_prefix = seen[same]
            warnings.append(f"--data-path names the corpus {prefix} twice (weights {first_weight} and {weight}"
                            f"{'' if first_prefix == prefix else f', the first as {first_prefix}'}), so both entries "
                            f"draw from the same documents; give it once with the summed weight "
                            f"{float(first_weight) + float(weight):g}.")
        else:
            seen[same] = (weight, prefix)
        if float(weight) == 0:
            warnings.append(f"--data-path gives {prefix} weight {weight}, so no sample comes from it (its files are "
                            "still checked); drop it, or give it a positive weight.")
    return warnings


def check_data_path(data_path, split: str | Sequence[float] = "969,30,1") -> list[tuple[float, str]] | None:
    """Everything about ``--data-path`` and ``--split`` that can be checked before training starts:
    :func:`parse_data_path`, :func:`open_corpora` (files, dtype, vocabulary) and
    :func:`~zoo.data.gpt_dataset.parse_split`. Returns the parsed blend (None: the bundled corpus)."""
    parse_split(split)
    blend = parse_data_path(data_path)
    if blend is not None:
        open_corpora(blend)
    return blend


def open_corpora(blend: Sequence[tuple[float, str]]) -> list[IndexedDataset]:
    """The :class:`IndexedDataset` of every corpus of ``blend``, checked to exist and to agree: the same
    token dtype (recorded in each ``.idx``) and the same vocabulary. An ``.idx`` records no tokenizer, so
    the vocabulary is compared on what the data shows, from the first documents of each corpus: all hold
    one sequence per document (GPT preprocessing) or all one per sentence (BERT preprocessing); and when
    every document of a corpus ends with one id (the end-of-document token GPT preprocessing appends),
    that id is the same in every corpus that has one."""
    corpora = []
    for _, prefix in blend:
        check_dataset_files(prefix)
        corpora.append(IndexedDataset(prefix))
    first = corpora[0]
    for other in corpora[1:]:
        if other.dtype != first.dtype:
            raise UserError(f"--data-path corpora {first.prefix!r} and {other.prefix!r} hold token ids of different "
                             f"dtypes ({first.dtype} and {other.dtype}), so they come from different vocabularies; "
                             "preprocess every corpus of a blend with the same tokenizer.")
    layouts = [(corpus, sentence_per_sequence(corpus)) for corpus in corpora]
    known = [(corpus, layout) for corpus, layout in layouts if layout is not None]
    for corpus, layout in known[1:]:
        if layout != known[0][1]:
            by_sentence, by_document = (corpus, known[0][0]) if layout else (known[0][0], corpus)
            raise UserError(f"--data-path corpus {by_sentence.prefix!r} holds one sequence per sentence (BERT "
                             f"preprocessing) but {by_document.prefix!r} one per document (GPT preprocessing), so "
                             "they were tokenized for different models; preprocess every corpus of a blend with the "
                             "same tokenizer and script.")
    ends = [(corpus, document_end_id(corpus)) for corpus in corpora]
    marked = [(corpus, end) for corpus, end in ends if end is not None]
    for corpus, end in marked[1:]:
        if end != marked[0][1]:
            raise UserError(f"--data-path corpora {marked[0][0].prefix!r} and {corpus.prefix!r} end their documents "
                             f"with different end-of-document ids ({marked[0][1]} and {end}), so they were tokenized "
                             "with different vocabularies; preprocess every corpus of a blend with the same tokenizer.")
    return corpora


def sentence_per_sequence(indexed: IndexedDataset, documents: int = CHECKED_DOCUMENTS) -> bool | None:
    """True when some of the first ``documents`` documents of ``indexed`` hold several sequences (BERT
    preprocessing writes one per sentence), False when each holds one (GPT preprocessing writes one per
    document), None when fewer than :data:`MIN_CHECKED_DOCUMENTS` documents were read."""
    doc_idx = np.asarray(indexed.doc_idx[: documents + 1])
    if len(doc_idx) - 1 < MIN_CHECKED_DOCUMENTS:
        return None
    return bool((np.diff(doc_idx) > 1).any())


def document_end_id(indexed: IndexedDataset, documents: int = CHECKED_DOCUMENTS) -> int | None:
    """The id every one of the first ``documents`` non-empty documents of ``indexed`` ends with, or None
    when they end differently or fewer than :data:`MIN_CHECKED_DOCUMENTS` were read."""
    doc_idx = np.asarray(indexed.doc_idx[: documents + 1])
    last = doc_idx[1:] - 1
    last = last[doc_idx[1:] > doc_idx[:-1]]  # documents with at least one sequence
    last = last[np.asarray(indexed.sizes)[last] > 0]
    if len(last) < MIN_CHECKED_DOCUMENTS:
        return None
    ends = {int(indexed.get(int(s), int(indexed.sizes[s]) - 1, 1)[0]) for s in last}
    return ends.pop() if len(ends) == 1 else None


def blend_index(weights: Sequence[float], num_samples: int, chunk: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """``(corpus, sample)`` arrays of length ``num_samples``: global sample ``i`` is sample ``sample[i]``
    of corpus ``corpus[i]`` (see the module doc for the order and its bounds). ``corpus`` is uint16,
    ``sample`` int64; the samples of each corpus are numbered 0, 1, 2, ... in order of use.

    The due times are sorted a span of ``chunk`` time units at a time (about ``chunk`` samples, since the
    weights sum to 1): the spans are half-open and fixed, so ties never straddle two spans and the order
    equals one global stable sort of all due times, while memory beyond the result stays O(chunk)."""
    w = np.asarray(weights, dtype=np.float64)
    used = np.flatnonzero(w > 0)
    num_samples = int(num_samples)
    corpus = np.empty(num_samples, dtype=np.uint16)
    sample = np.empty(num_samples, dtype=np.int64)
    next_j = np.zeros(len(used), dtype=np.int64)  # each corpus's first sample not yet placed
    filled, span_end = 0, 0.0
    while filled < num_samples:
        span_end += chunk
        due, owner, number = [], [], []
        for slot, k in enumerate(used):
            j = np.arange(next_j[slot], max(next_j[slot], int(w[k] * span_end)) + 2, dtype=np.int64)
            times = (j + 0.5) / w[k]
            j, times = j[times < span_end], times[times < span_end]  # ascending, so a prefix of j
            due.append(times)
            owner.append(np.full(len(j), k, dtype=np.uint16))
            number.append(j)
            next_j[slot] += len(j)
        order = np.argsort(np.concatenate(due), kind="stable")[: num_samples - filled]
        corpus[filled : filled + len(order)] = np.concatenate(owner)[order]
        sample[filled : filled + len(order)] = np.concatenate(number)[order]
        filled += len(order)
    return corpus, sample


class BlendedDataset(torch.utils.data.Dataset):
    """The first ``num_samples`` samples of a blend: sample ``i`` is ``datasets[corpus[i]][sample[i]]``.

    ``index`` has ``corpus`` and ``sample`` arrays (a :class:`zoo.data.blend_cache.BlendIndex`, or anything
    with those two attributes that pickles cheaply to DataLoader workers). Every ``datasets[k]`` must
    hold the ``counts[k]`` samples the blend asks of it (:meth:`counts` tells how many, before the
    datasets are built)."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], index, num_samples: int | None = None):
        self.datasets = list(datasets)
        self.index = index
        self.num_samples = len(index.corpus) if num_samples is None else int(num_samples)
        if not 0 <= self.num_samples <= len(index.corpus):
            raise UserError(f"num_samples={self.num_samples} is outside the blend index's {len(index.corpus)} "
                             "samples; build the index for at least as many samples.")
        needed = self.counts(index, len(self.datasets), self.num_samples)
        for k, (dataset, count) in enumerate(zip(self.datasets, needed)):
            if len(dataset) < count:
                raise UserError(f"corpus {k} of the blend holds {len(dataset)} samples but the blend takes {count} "
                                 "of it; build its dataset with num_samples >= the blend's count.")

    @staticmethod
    def counts(index, num_corpora: int, num_samples: int) -> list[int]:
        """How many samples of each corpus the first ``num_samples`` samples of ``index`` use."""
        return np.bincount(np.asarray(index.corpus[:num_samples]), minlength=num_corpora).tolist()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        i = int(i)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        return self.datasets[int(self.index.corpus[i])][int(self.index.sample[i])]
