"""BERT pretraining samples: sentence-order prediction pairs with whole-word n-gram masking.

Input: an indexed dataset whose documents are runs of sentences (one indexed sequence per sentence,
see :mod:`zoo.data.bert_preprocess`). The rules are those of Megatron-LM's BERT dataset and of
ALBERT's ``create_pretraining_data.py`` (Lan et al. 2019, which Megatron-LM's BERT follows):

**Sample spans (per epoch, precomputed).** Each document with at least two non-empty sentences is
cut greedily into spans of consecutive sentences. A span's target length is
``max_num_tokens = max_seq_length - 3`` ([CLS], [SEP], [SEP]), or with probability
``short_seq_prob`` a length drawn uniformly from ``[2, max_num_tokens]``. A span closes once it
holds at least its target length and at least two sentences, provided two or more sentences of the
document remain; the last span takes the rest. Documents with fewer than two non-empty sentences
form no pair and are skipped. The spans of all documents of the split are shuffled; each epoch
draws fresh target lengths and a fresh shuffle from ``numpy.random.default_rng((seed, split,
0, epoch))``. ``ds[i]`` reads row ``i`` of this (first sentence, end sentence, target) table: O(1).

**Pair (per sample).** Segment A is the first ``k`` sentences of the span, ``k`` uniform in
``[1, n-1]``, and B the rest. With probability 0.5 A and B are swapped and the sentence-order
label is 1 (0 = in order). While ``len(A) + len(B)`` exceeds the target, one token is removed from
the longer segment (B on a tie), from its front or its back with probability 0.5 each (as
Megatron-LM does, the short target also bounds the truncation). The sample is
``[CLS] A [SEP] B [SEP]`` with token types 0 for ``[CLS] A [SEP]`` and 1 for ``B [SEP]``, padded
with [PAD] to ``max_seq_length``.

**Masking (per sample).** See :func:`mask_whole_word_ngrams`: whole-word n-grams, ``p(n) ∝ 1/n``
for ``n <= max_ngram``, ``max(1, round(masked_lm_prob * content tokens))`` tokens (content = not
[CLS]/[SEP]/[PAD]), each replaced by [MASK] (80 %), a random non-special vocabulary id (10 %) or
kept (10 %). One deliberate difference from Megatron-LM's order of draws is explained in
:func:`sample_ngram_spans`.

All per-sample randomness (split point, swap, truncation, masking) comes from
``numpy.random.default_rng((seed, split, 1, i))``; ``i`` is the global sample index, which fixes
the epoch too, so a sample is the same every time it is read, in any process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zoo.data.gpt_dataset import SPLIT_NAMES, check_token_ids, split_document_ranges
from zoo.data.indexed_dataset import IndexedDataset
from zoo.data.tokenizers import load_bert_tokenizer
from zoo.errors import UserError

IGNORE_INDEX = -100
_MAPPING_STREAM, _SAMPLE_STREAM = 0, 1  # keep the two RNG seed families apart
_RESERVED_TOKEN = re.compile(r"\[(?:[A-Z]+|unused\d+)\]")  # [PAD] [CLS] ... and [unused123]


# ----------------------------------------------------------------------------------------------
# Vocabulary facts the sampler needs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WordPieceVocab:
    """What masking needs from a WordPiece tokenizer, as plain arrays (cheap to pickle to workers).

    ``is_continuation[id]`` is True for "##" pieces; ``random_ids`` are the ids a random
    replacement draws from: the whole vocabulary except special and reserved ("[unusedN]") tokens.
    """

    size: int
    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    is_continuation: np.ndarray
    random_ids: np.ndarray

    @classmethod
    def from_tokenizer(cls, tokenizer) -> WordPieceVocab:
        vocab = tokenizer.get_vocab()
        size = len(tokenizer)
        is_continuation = np.zeros(size, dtype=bool)
        reserved = np.zeros(size, dtype=bool)
        for token, i in vocab.items():
            is_continuation[i] = token.startswith("##")
            reserved[i] = bool(_RESERVED_TOKEN.fullmatch(token))
        reserved[list(tokenizer.all_special_ids)] = True
        ids = {}
        for name in ("pad", "cls", "sep", "mask"):
            ids[name] = getattr(tokenizer, f"{name}_token_id")
            if ids[name] is None:
                raise UserError(f"the tokenizer has no [{name.upper()}] token; use a BERT WordPiece tokenizer.")
        return cls(
            size=size,
            pad_id=ids["pad"],
            cls_id=ids["cls"],
            sep_id=ids["sep"],
            mask_id=ids["mask"],
            is_continuation=is_continuation,
            random_ids=np.flatnonzero(~reserved),
        )


# ----------------------------------------------------------------------------------------------
# Whole-word n-gram masking
# ----------------------------------------------------------------------------------------------


def whole_words(maskable: np.ndarray, is_continuation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[start, end)`` token positions of the whole words among the maskable positions.

    A word is a token plus the "##" pieces that follow it. A maskable position starts a word unless
    it is a "##" piece right after another maskable position (so a "##" piece left at the front of
    a truncated segment is a word of its own).
    """
    maskable = np.asarray(maskable, dtype=bool)
    previous = np.concatenate([[False], maskable[:-1]])
    starts = np.flatnonzero(maskable & ~(np.asarray(is_continuation, dtype=bool) & previous))
    run_end = np.flatnonzero(maskable & ~np.concatenate([maskable[1:], [False]])) + 1  # ends of maskable runs
    next_start = np.concatenate([starts[1:], [len(maskable)]])
    ends = np.minimum(next_start, run_end[np.searchsorted(run_end, starts, side="right")])
    return starts, ends


def ngram_probabilities(max_ngram: int) -> np.ndarray:
    """``p(n) ∝ 1/n`` for ``n = 1..max_ngram`` (SpanBERT/ALBERT's n-gram masking)."""
    inverse = 1.0 / np.arange(1, max_ngram + 1)
    return inverse / inverse.sum()


def _free_reach(word_starts: np.ndarray, word_ends: np.ndarray, covered: np.ndarray) -> np.ndarray:
    """For each word, how many free (not yet chosen), adjacent words start there (0 when it is chosen)."""
    num_words = len(word_starts)
    index = np.arange(num_words)
    free = ~covered
    linked = np.zeros(num_words, dtype=bool)  # word w and w+1 are free and touch
    linked[:-1] = free[:-1] & free[1:] & (word_ends[:-1] == word_starts[1:])
    run_last = np.flatnonzero(~linked)  # last word of each run of linked words
    return np.where(free, run_last[np.searchsorted(run_last, index)] - index + 1, 0)


def sample_ngram_spans(
    word_starts: np.ndarray,
    word_ends: np.ndarray,
    num_to_predict: int,
    max_ngram: int,
    rng: np.random.Generator,
) -> list[tuple[int, int]]:
    """Chooses non-overlapping whole-word n-grams covering at most ``num_to_predict`` tokens.

    Returns ``(first_word, n)`` pairs. Until the budget is met: draw ``n`` with ``p(n) ∝ 1/n``;
    draw the first word uniformly among the places where ``n`` words are adjacent (an n-gram never
    jumps over [SEP]), none of them chosen before, and their tokens fit the remaining budget; with
    no such place, try ``n - 1`` and so on (Megatron-LM's back-off); stop when no single word fits.

    Megatron-LM and ALBERT instead visit the starts in random order, draw ``n`` for each and skip
    a start whose n-gram overlaps an earlier one; that rejection drops long n-grams more often
    (realized lengths ≈ 0.60/0.25/0.14 instead of 6/11, 3/11, 2/11 on 128-token samples of the
    bundled corpus). Drawing ``n`` first and then a free place keeps the realized lengths at
    ``1/n`` but for the budget back-off (≈ +0.03 for n = 1 at 128 tokens, +0.005 at 512).
    """
    word_starts, word_ends = np.asarray(word_starts), np.asarray(word_ends)
    token_prefix = np.concatenate([[0], np.cumsum(word_ends - word_starts)])
    cumulative_probs = np.cumsum(ngram_probabilities(max_ngram))
    covered = np.zeros(len(word_starts), dtype=bool)
    spans, masked = [], 0
    while masked < num_to_predict:
        reach = _free_reach(word_starts, word_ends, covered)
        draw = rng.random() * cumulative_probs[-1]
        n = min(int(np.searchsorted(cumulative_probs, draw, side="right")) + 1, max_ngram)
        candidates = np.zeros(0, dtype=np.int64)
        while n >= 1:
            candidates = np.flatnonzero(reach >= n)
            sizes = token_prefix[candidates + n] - token_prefix[candidates]
            candidates = candidates[sizes <= num_to_predict - masked]
            if len(candidates):
                break
            n -= 1
        if n == 0:
            break
        w = int(candidates[rng.integers(len(candidates))])
        covered[w : w + n] = True
        spans.append((w, n))
        masked += int(token_prefix[w + n] - token_prefix[w])
    return spans


@dataclass(frozen=True)
class MaskedSample:
    input_ids: np.ndarray  # tokens after masking
    labels: np.ndarray  # original id at chosen positions, IGNORE_INDEX elsewhere
    spans: list  # (first token, end token, n words) of each chosen n-gram


def mask_whole_word_ngrams(
    tokens: np.ndarray,
    maskable: np.ndarray,
    vocab: WordPieceVocab,
    rng: np.random.Generator,
    masked_lm_prob: float = 0.15,
    max_ngram: int = 3,
) -> MaskedSample:
    """BERT's masked-LM corruption with whole-word n-grams (the rules of Megatron-LM's BERT).

    Only ``maskable`` positions (never [CLS], [SEP] or [PAD]) are candidates. The budget is
    ``max(1, round(masked_lm_prob * maskable.sum()))`` tokens, filled with whole-word n-grams by
    :func:`sample_ngram_spans`, so all pieces of a word are chosen together. Each chosen token
    independently becomes [MASK] with p 0.8, a random id from ``vocab.random_ids`` with p 0.1,
    or stays as it is with p 0.1; its label is the original id either way.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    starts, ends = whole_words(maskable, vocab.is_continuation[tokens])
    num_to_predict = max(1, int(round(masked_lm_prob * int(np.count_nonzero(maskable)))))
    chosen = sample_ngram_spans(starts, ends, num_to_predict, max_ngram, rng)
    spans = [(int(starts[w]), int(ends[w + n - 1]), n) for w, n in chosen]
    positions = np.array(sorted(p for first, end, _ in spans for p in range(first, end)), dtype=np.int64)
    labels = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
    labels[positions] = tokens[positions]
    out = tokens.copy()
    action = rng.random(len(positions))
    to_mask = positions[action < 0.8]
    to_random = positions[(action >= 0.8) & (action < 0.9)]
    out[to_mask] = vocab.mask_id
    out[to_random] = vocab.random_ids[rng.integers(len(vocab.random_ids), size=len(to_random))]
    return MaskedSample(out, labels, spans)


# ----------------------------------------------------------------------------------------------
# Sentence spans and segment pairs
# ----------------------------------------------------------------------------------------------


def build_sample_spans(
    sizes: np.ndarray,
    doc_idx: np.ndarray,
    documents: tuple[int, int],
    max_num_tokens: int,
    short_seq_prob: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """One epoch's ``(first sentence, end sentence, target length)`` rows, in document order.

    ``sizes``/``doc_idx`` are the indexed dataset's; ``documents`` is the split's ``[d0, d1)``.
    Follows the span rules of the module docstring; O(sentences) with no per-token work.
    """
    d0, d1 = documents
    first_seq, last_seq = int(doc_idx[d0]), int(doc_idx[d1])
    sizes = np.asarray(sizes[first_seq:last_seq], dtype=np.int64).tolist()
    # Upper bound on the span count: every span has >= 2 sentences.
    budget = max(1, (last_seq - first_seq) // 2 + 1)
    targets = np.where(
        rng.random(budget) < short_seq_prob, rng.integers(2, max_num_tokens + 1, size=budget), max_num_tokens
    ).tolist()
    rows = []
    for d in range(d0, d1):
        lo, hi = int(doc_idx[d]), int(doc_idx[d + 1])
        remaining = sum(1 for s in range(lo, hi) if sizes[s - first_seq] > 0)
        if remaining < 2:
            continue  # no pair can be made from this document
        start, tokens, count = lo, 0, 0
        for s in range(lo, hi):
            size = sizes[s - first_seq]
            if size == 0:
                continue
            tokens += size
            count += 1
            remaining -= 1
            target = targets[len(rows)]
            if remaining == 0 or (tokens >= target and count >= 2 and remaining >= 2):
                rows.append((start, hi if remaining == 0 else s + 1, target))
                start, tokens, count = s + 1, 0, 0
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def truncate_pair(a: np.ndarray, b: np.ndarray, max_num_tokens: int, rng: np.random.Generator):
    """Removes tokens from the longer segment, at a random end, until ``len(a) + len(b) <= max_num_tokens``.

    Equivalent to the one-token-at-a-time loop (longer segment loses a token, B on a tie, front or
    back with p 0.5), done in closed form: the counts per segment are fixed by the lengths, and the
    front/back choices are independent coin flips, i.e. a binomial per segment.
    """
    excess = len(a) + len(b) - max_num_tokens
    if excess <= 0:
        return a, b
    gap = min(excess, abs(len(a) - len(b)))
    rest = excess - gap
    cut_a = (gap if len(a) > len(b) else 0) + rest // 2
    cut_b = (gap if len(a) <= len(b) else 0) + rest - rest // 2
    front_a, front_b = rng.binomial(cut_a, 0.5), rng.binomial(cut_b, 0.5)
    return a[front_a : len(a) - (cut_a - front_a)], b[front_b : len(b) - (cut_b - front_b)]


# ----------------------------------------------------------------------------------------------
# The dataset
# ----------------------------------------------------------------------------------------------


class BertDataset(torch.utils.data.Dataset):
    """Sentence-order-prediction pairs with whole-word n-gram masking over one split (see module doc).

    ``ds[i]`` is a dict of int64 tensors: ``input_ids``, ``token_type_ids``, ``attention_mask``,
    ``labels`` (all of length ``max_seq_length``) and the scalar ``next_sentence_label``
    (0 = A then B as in the document, 1 = swapped), the names transformers' BertForPreTraining
    takes. ``len(ds)`` is ``num_samples``, by default one epoch of pairs.

    ``tokenizer`` (default: bundled bert-base-uncased) must have exactly ``vocab_size`` entries,
    the unpadded vocabulary of the model; ``max_position_embeddings``, when given, bounds
    ``max_seq_length``.
    """

    def __init__(
        self,
        indexed: IndexedDataset | str | os.PathLike,
        max_seq_length: int = 512,
        seed: int = 1234,
        split: str | Sequence[float] = "969,30,1",
        which: str = "train",
        num_samples: int | None = None,
        masked_lm_prob: float = 0.15,
        max_ngram: int = 3,
        vocab_size: int = 30522,
        short_seq_prob: float = 0.1,
        tokenizer=None,
        max_position_embeddings: int | None = None,
    ):
        if not isinstance(indexed, IndexedDataset):
            indexed = IndexedDataset(indexed)
        _check_arguments(
            which, max_seq_length, max_position_embeddings, masked_lm_prob, max_ngram, short_seq_prob
        )
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_bert_tokenizer(tokenizer)
        if len(tokenizer) != int(vocab_size):
            raise UserError(
                f"the tokenizer has {len(tokenizer)} tokens but vocab_size={vocab_size}; pass the "
                "tokenizer the data was built with and its unpadded size as vocab_size."
            )
        if len(indexed) == 0 or indexed.num_tokens == 0:
            raise UserError(
                f"indexed dataset '{indexed.prefix}' is empty (no sentences); preprocess a non-empty corpus "
                "with preprocess_bert."
            )
        self.indexed = indexed
        self.vocab = WordPieceVocab.from_tokenizer(tokenizer)
        self.max_seq_length = int(max_seq_length)
        self.max_num_tokens = self.max_seq_length - 3
        self.seed = int(seed)
        self.which = which
        self.masked_lm_prob = float(masked_lm_prob)
        self.max_ngram = int(max_ngram)
        self.short_seq_prob = float(short_seq_prob)
        self._split_id = SPLIT_NAMES.index(which)
        self.document_range = split_document_ranges(indexed.num_documents, split)[self._split_id]

        epoch0 = self._epoch_spans(0)
        d0, d1 = self.document_range
        if len(epoch0) == 0 and d1 > d0:
            raise UserError(
                f"none of the {d1 - d0} documents of the {which} split has two or more sentences, so no "
                "sentence pair can be built; preprocess the corpus with preprocess_bert "
                "(one sequence per sentence)."
            )
        self.samples_per_epoch = len(epoch0)
        num_samples = self.samples_per_epoch if num_samples is None else int(num_samples)
        if num_samples < 0:
            raise UserError(f"num_samples={num_samples} is invalid; it must be >= 0.")
        if num_samples > 0 and self.samples_per_epoch == 0:
            raise UserError(
                f"the {which} split of {indexed.prefix} (documents {d0}..{d1}) holds no sentence pairs but num_samples="
                f"{num_samples}; give it more data or a larger split weight."
            )
        epochs, total = [epoch0], len(epoch0)
        while total < num_samples:
            epochs.append(self._epoch_spans(len(epochs)))
            total += len(epochs[-1])
        self.num_samples = num_samples
        self.num_epochs = len(epochs) if num_samples else 0
        self._spans = np.concatenate(epochs)[:num_samples]

    def _epoch_spans(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, self._split_id, _MAPPING_STREAM, epoch))
        indexed = self.indexed
        spans = build_sample_spans(
            indexed.sizes, indexed.doc_idx, self.document_range, self.max_num_tokens, self.short_seq_prob, rng
        )
        return spans[rng.permutation(len(spans))]

    def __len__(self) -> int:
        return self.num_samples

    def sample_span(self, i: int) -> tuple[int, int, int]:
        """``(first sentence, end sentence, target length)`` of sample ``i`` (indexed-sequence numbers)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        first, end, target = self._spans[i]
        return int(first), int(end), int(target)

    def segments(self, i: int, rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """Segments A and B of sample ``i`` (truncated, before masking) and the sentence-order label, drawn
        from ``rng`` (by default a fresh copy of the sample's own generator, so equal to what training sees)."""
        rng = self._sample_rng(i) if rng is None else rng
        first, end, target = self.sample_span(i)
        sentences = [np.asarray(self.indexed.get(s), dtype=np.int64) for s in range(first, end)]
        sizes = np.array([len(s) for s in sentences])
        # Split points k leave at least one token on each side (empty sentences never decide).
        before = np.cumsum(sizes)[:-1]
        valid = np.flatnonzero((before > 0) & (before < sizes.sum())) + 1
        k = int(valid[rng.integers(len(valid))])
        a, b = np.concatenate(sentences[:k]), np.concatenate(sentences[k:])
        swapped = int(rng.random() < 0.5)
        if swapped:
            a, b = b, a
        a, b = truncate_pair(a, b, target, rng)
        return a, b, swapped

    def _sample_rng(self, i: int) -> np.random.Generator:
        """The generator of sample ``i``'s draws (split point, swap, truncation, masking), in that order."""
        return np.random.default_rng((self.seed, self._split_id, _SAMPLE_STREAM, int(i)))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        rng = self._sample_rng(i)
        a, b, swapped = self.segments(i, rng)
        v, n = self.vocab, self.max_seq_length
        length = len(a) + len(b) + 3
        tokens = np.full(n, v.pad_id, dtype=np.int64)
        tokens[:length] = np.concatenate([[v.cls_id], a, [v.sep_id], b, [v.sep_id]])
        check_token_ids(tokens[:length], v.size, self.indexed, f"sample {i} of the {self.which} split")
        token_types = np.zeros(n, dtype=np.int64)
        token_types[len(a) + 2 : length] = 1
        maskable = np.zeros(n, dtype=bool)
        maskable[1 : len(a) + 1] = True
        maskable[len(a) + 2 : length - 1] = True
        masked = mask_whole_word_ngrams(tokens, maskable, v, rng, self.masked_lm_prob, self.max_ngram)
        attention = np.zeros(n, dtype=np.int64)
        attention[:length] = 1
        return {
            "input_ids": torch.from_numpy(masked.input_ids),
            "token_type_ids": torch.from_numpy(token_types),
            "attention_mask": torch.from_numpy(attention),
            "labels": torch.from_numpy(masked.labels),
            "next_sentence_label": torch.tensor(swapped, dtype=torch.long),
        }


def _check_arguments(which, max_seq_length, max_position_embeddings, masked_lm_prob, max_ngram, short_seq_prob):
    if which not in SPLIT_NAMES:
        raise UserError(f"which={which!r} is invalid; use one of {', '.join(SPLIT_NAMES)}.")
    if int(max_seq_length) < 5:
        raise UserError(
            f"max_seq_length={max_seq_length} is too short; [CLS] A [SEP] B [SEP] needs at least 5 positions."
        )
    if max_position_embeddings is not None and int(max_seq_length) > int(max_position_embeddings):
        raise UserError(
            f"max_seq_length={max_seq_length} exceeds the model's max_position_embeddings="
            f"{max_position_embeddings}; use a max_seq_length of at most {max_position_embeddings}."
        )
    if not 0.0 < float(masked_lm_prob) < 1.0:
        raise UserError(f"masked_lm_prob={masked_lm_prob} is invalid; use a probability in (0, 1) such as 0.15.")
    if int(max_ngram) < 1:
        raise UserError(f"max_ngram={max_ngram} is invalid; use 1 (whole words only) or more, such as 3.")
    if not 0.0 <= float(short_seq_prob) <= 1.0:
        raise UserError(f"short_seq_prob={short_seq_prob} is invalid; use a probability in [0, 1] such as 0.1.")


def build_bert_datasets(
    prefix: str | os.PathLike,
    max_seq_length: int,
    seed: int,
    split: str | Sequence[float] = "969,30,1",
    num_samples: Sequence[int | None] = (None, None, None),
    **kwargs,
) -> tuple[BertDataset, BertDataset, BertDataset]:
    """Train, valid and test :class:`BertDataset` over one indexed dataset (a split may be empty).

    ``kwargs`` go to every :class:`BertDataset` (masking, vocab and tokenizer settings); the
    tokenizer is loaded once and shared.
    """
    indexed = IndexedDataset(prefix)
    if kwargs.get("tokenizer") is None or isinstance(kwargs["tokenizer"], (str, os.PathLike)):
        kwargs["tokenizer"] = load_bert_tokenizer(kwargs.get("tokenizer"))
    return tuple(
        BertDataset(indexed, max_seq_length, seed, split=split, which=which, num_samples=n, **kwargs)
        for which, n in zip(SPLIT_NAMES, num_samples)
    )
