"""Reference points for a pretraining run's validation loss."""

from __future__ import annotations

import math

import numpy as np

from zoo.data import split_document_ranges


def unigram_perplexity(indexed, split: str, vocab_size: int) -> float:
    """Perplexity on the validation documents of a unigram model fitted on the training documents
    (add-one smoothing over the vocabulary): the score of a model that ignores context."""
    (train_lo, train_hi), (valid_lo, valid_hi), _ = split_document_ranges(indexed.num_documents, split)

    def tokens_of(lo: int, hi: int) -> np.ndarray:
        if hi <= lo:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.asarray(indexed.document(d), dtype=np.int64) for d in range(lo, hi)])

    counts = np.bincount(tokens_of(train_lo, train_hi), minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    valid = tokens_of(valid_lo, valid_hi)
    if valid.size == 0:
        return float("nan")
    return math.exp(-float(log_probs[valid].mean()))
