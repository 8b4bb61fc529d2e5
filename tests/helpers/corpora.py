"""Small real corpora for pretraining tests, cut from the Wikipedia sample bundled with zoo."""

from __future__ import annotations

import gzip
from pathlib import Path

from tests.helpers.repo import REPO

WIKI_SAMPLE = REPO / "zoo" / "assets" / "corpora" / "wiki-sample.jsonl.gz"


def wiki_sample_corpus(root: Path, articles: int = 12) -> str:
    """The first ``articles`` articles of the bundled Wikipedia sample, preprocessed (GPT-2 BPE) into the
    indexed format under ``root``; returns the corpus prefix."""
    from zoo.data import preprocess

    with gzip.open(WIKI_SAMPLE, "rt") as src:
        lines = [next(src) for _ in range(articles)]
    (root / "small.jsonl").write_text("".join(lines))
    prefix = str(root / "small")
    preprocess([str(root / "small.jsonl")], prefix, workers=1, progress=False)
    return prefix
