"""A random-token corpus over a small vocabulary, and the tiny dropout-free GPT-2 that trains on it: runs
fast, and its vocab (1100, not a multiple of 128) is padded differently at every tp."""

from __future__ import annotations

from pathlib import Path

VOCAB = 1100   # padded to 1152 at tp=1, 1280 at tp=2, 1536 at tp=4
MODEL = dict(vocab_size=VOCAB, n_layer=2, n_embd=64, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def make_corpus(prefix: Path) -> str:
    """A small random-token corpus of a ``VOCAB``-token vocabulary in the indexed format."""
    import numpy as np

    from zoo.data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, vocab_size=VOCAB) as builder:
        for _ in range(24):
            builder.add_document(rng.integers(0, VOCAB, size=100))
    return str(prefix)
