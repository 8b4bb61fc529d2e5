"""Reference points for a pretraining run's validation loss, and the run's closing validation line beside them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zoo.data import split_document_ranges

SOP_CHANCE = 0.5   # sentence-order prediction: the pairs are swapped with probability 0.5


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


def causal_lm_validation_line(means: dict[str, Any], unigram: float | None) -> str:
    """A causal LM's closing validation line: loss and perplexity, beside the unigram model's perplexity
    (``unigram`` None leaves it out)."""
    line = f"validation loss {means['loss']:.4f}, validation perplexity {math.exp(min(means['loss'], 50.0)):.2f}"
    return line if unigram is None else f"{line} (unigram baseline of the corpus: {unigram:.1f})"


def mlm_sop_validation_line(means: dict[str, Any], unigram: float | None) -> str:
    """BERT's closing validation line: MLM perplexity and SOP accuracy, each beside its baseline: a unigram
    model's perplexity (masked tokens are a sample of the corpus's tokens, so a model that ignores context scores
    about the unigram perplexity on them) and chance, 0.5. Never the exp of the summed MLM + SOP loss. A run whose
    validation logged no MLM/SOP split gets the causal LM's line of its loss."""
    if "mlm_loss" not in means or "sop_acc" not in means:
        return causal_lm_validation_line(means, unigram)
    mlm = f"validation MLM loss {means['mlm_loss']:.4f}, MLM perplexity {math.exp(min(means['mlm_loss'], 50.0)):.2f}"
    if unigram is not None:
        mlm += f" (unigram baseline {unigram:.1f})"
    return f"{mlm}; SOP accuracy {means['sop_acc']:.3f} (chance {SOP_CHANCE})"
