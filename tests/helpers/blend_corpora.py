"""Corpora whose every document says which corpus it came from, for tests of blending by weight: corpus k
writes token ids in [k * CORPUS_IDS, (k + 1) * CORPUS_IDS), each document ending with EOD."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

SEQ = 8
WEIGHTS = (0.2, 0.3, 0.5)
EOD = 50256
CORPUS_IDS = 1000


def write_corpus(prefix, k: int, documents: int = 60, end_id: int = EOD, dtype=None, seed: int = 0):
    """``documents`` documents of 10..40 ids of corpus ``k``'s own range, each ending with ``end_id``."""
    from zoo.data import IndexedDatasetBuilder

    rng = np.random.default_rng((seed, k))
    with IndexedDatasetBuilder(prefix, vocab_size=50257, dtype=dtype) as builder:
        for n in rng.integers(10, 40, size=documents):
            builder.add_document(np.append(rng.integers(k * CORPUS_IDS, (k + 1) * CORPUS_IDS, size=n - 1), end_id))
    return str(prefix)


def blend_items(prefixes, weights=WEIGHTS) -> list[str]:
    """The ``--data-path`` items of a blend: weight, prefix, weight, prefix, ..."""
    return [item for weight, prefix in zip(weights, prefixes) for item in (str(weight), prefix)]


def data_fields(data_path, train_iters: int, split: str = "90,10,0", eval_interval: int = 0):
    """The fields of a RunConfig that PretrainingData reads, on sequences of ``SEQ`` tokens."""
    return SimpleNamespace(data_path=data_path, split=split, seed=1234, seq_length=SEQ, train_iters=train_iters,
                           eval_iters=2, eval_interval=eval_interval)
