"""The demo's derived task, "same-article": do two sentences come from the same Wikipedia article?

No license-clean labelled sentence task ships inside a package on the registries, so the demo's task is
derived from the bundled Wikipedia sample (:data:`zoo.assets.BUNDLED_CORPUS`, CC BY-SA 3.0). It is a real
task on real text with labels that are true by construction, not a published benchmark.

Derivation (:func:`derive_same_article`), deterministic for a given corpus and ``seed``:

- Each article's text is cut into sentences (at ``. ! ?`` followed by a capital letter or a quote); a
  sentence of :data:`MIN_WORDS` to :data:`MAX_WORDS` words is kept. Articles with fewer than two kept
  sentences are left out.
- The articles, ordered by id, are permuted by ``seed``; the first :data:`DEV_FRACTION` of them are the dev
  articles, the rest the train articles. The two splits share no article, so the dev pairs are sentences
  the model never trained on, from articles it never trained on.
- Each split's pairs alternate labels, so both splits are balanced (``same`` and ``different`` equally
  often; a majority-class guess scores 0.5): a ``same`` pair is two consecutive sentences of one paragraph
  of an article (BERT's next-sentence positives), a ``different`` pair one sentence each of two articles
  (its negatives, drawn from another article), the article(s) drawn uniformly. No pair repeats. A model can
  tell the classes apart by topic and by the thread two consecutive sentences share.

Layouts read by :func:`read_same_article` (``--data-dir``):

- a corpus file, ``.jsonl`` or ``.jsonl.gz`` with one ``{"id", "title", "text"}`` object a line (the bundled
  sample's layout): the pairs are derived from it as above;
- a directory with GLUE-style ``train.tsv`` and ``dev.tsv`` (header ``id``, ``sentence1``, ``sentence2``,
  ``label`` with ``same``/``different``), e.g. written by :func:`write_same_article_tsv`.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import re
from collections.abc import Sequence
from pathlib import Path

from zoo.atomic import write_text_atomic
from zoo.errors import MissingInput, UserError
from zoo.finetune.examples import PairExample
from zoo.finetune.glue import TsvColumns, read_pair_tsv

SAME_ARTICLE_LABELS = ("different", "same")  # label ids 0, 1
SAME_ARTICLE_SPLIT_FILES = {"train": "train.tsv", "dev": "dev.tsv"}
MIN_WORDS, MAX_WORDS = 6, 24
DEV_FRACTION = 0.2
NUM_PAIRS = {"train": 1024, "dev": 400}
DATA_SEED = 0   # the pairs do not move with the training --seed: every run is scored on the same dev set

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def _kept(sentence: str) -> bool:
    return MIN_WORDS <= len(sentence.split()) <= MAX_WORDS and sentence[-1:] in ".!?"


def article_sentences(text: str) -> list[str]:
    """The sentences of one article's text with :data:`MIN_WORDS` to :data:`MAX_WORDS` words, in order."""
    return [s for paragraph in _paragraph_sentences(text) for s in paragraph if _kept(s)]


def consecutive_pairs(text: str) -> list[tuple[str, str]]:
    """The pairs of consecutive sentences of one paragraph of ``text`` that are both kept."""
    return [(a, b) for paragraph in _paragraph_sentences(text) for a, b in zip(paragraph, paragraph[1:])
            if _kept(a) and _kept(b)]


def _paragraph_sentences(text: str) -> list[list[str]]:
    return [[" ".join(s.split()) for s in _SENTENCE_END.split(paragraph.strip())] for paragraph in text.split("\n")]


def read_corpus(path: str | os.PathLike) -> list[dict]:
    """The articles of a ``.jsonl``/``.jsonl.gz`` corpus file; a line that is not an article is an error."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    articles = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                article = json.loads(line)
            except json.JSONDecodeError:
                article = None
            if not isinstance(article, dict) or not isinstance(article.get("text"), str) or "id" not in article:
                raise UserError(f"line {number} of '{path}' is not a JSON object with \"id\" and \"text\"; pass a "
                                 "corpus in the bundled sample's layout (one {\"id\", \"title\", \"text\"} a line).")
            articles.append(article)
    return articles


def split_articles(article_ids: Sequence[str], seed: int) -> tuple[list[str], list[str]]:
    """(train ids, dev ids): the ids ordered, permuted by ``seed``, the first :data:`DEV_FRACTION` for dev."""
    ordered = sorted(article_ids)
    random.Random(seed).shuffle(ordered)
    num_dev = max(2, round(DEV_FRACTION * len(ordered)))
    return ordered[num_dev:], ordered[:num_dev]


def draw_pairs(sentences: dict[str, list[str]], consecutive: dict[str, list[tuple[str, str]]], num_pairs: int,
               split: str, seed: int) -> list[PairExample]:
    """``num_pairs`` distinct pairs over the articles of ``sentences``, labels alternating different/same (a
    "same" pair from ``consecutive``, the article's consecutive sentence pairs)."""
    ids = sorted(sentences)
    with_pairs = sorted(i for i in ids if consecutive[i])
    rng = random.Random(f"{seed}-{split}")
    seen: set[tuple[str, str]] = set()
    pairs: list[PairExample] = []
    attempts = 0
    while len(pairs) < num_pairs:
        attempts += 1
        if attempts > 50 * num_pairs:
            raise UserError(f"the {split} articles ({len(ids)}) have too few sentences for {num_pairs} distinct "
                             "pairs; pass a bigger corpus.")
        label = len(pairs) % 2
        if label == 1:
            article = rng.choice(with_pairs)
            first, second = rng.choice(consecutive[article])
            source = (article, article)
        else:
            source = tuple(rng.sample(ids, 2))
            first, second = rng.choice(sentences[source[0]]), rng.choice(sentences[source[1]])
        if (first, second) in seen:
            continue
        seen.add((first, second))
        pairs.append(PairExample(guid=f"{split}-{len(pairs)}-{source[0]}-{source[1]}", text_a=first, text_b=second,
                                 label=label))
    return pairs


def derive_same_article(articles: Sequence[dict], seed: int = DATA_SEED,
                        num_pairs: dict[str, int] | None = None) -> dict[str, list[PairExample]]:
    """The "train" and "dev" pairs of the articles (see the module's docstring); the splits share no article."""
    num_pairs = num_pairs or NUM_PAIRS
    consecutive = {str(a["id"]): pairs for a in articles if (pairs := consecutive_pairs(a["text"]))}
    if len(consecutive) < 4:
        raise UserError(f"only {len(consecutive)} article(s) have two consecutive sentences of {MIN_WORDS}-{MAX_WORDS} "
                         "words; pass a corpus with at least 4 such articles.")
    sentences = {i: article_sentences(a["text"]) for a in articles if (i := str(a["id"])) in consecutive}
    train_ids, dev_ids = split_articles(list(consecutive), seed)
    return {split: draw_pairs({i: sentences[i] for i in ids}, consecutive, num_pairs[split], split, seed)
            for split, ids in (("train", train_ids), ("dev", dev_ids))}


def read_same_article(data_dir: str | os.PathLike) -> dict[str, list[PairExample]]:
    """The "train" and "dev" splits of ``data_dir``: derived from a corpus file, or read from TSV files."""
    path = Path(data_dir)
    if path.is_file() and path.name.endswith((".jsonl", ".jsonl.gz")):
        return derive_same_article(read_corpus(path))
    if not path.exists():
        raise MissingInput(f"same-article data '{path}' does not exist; pass --data-dir with a .jsonl(.gz) "
                                "corpus (e.g. zoo/assets/corpora/wiki-sample.jsonl.gz) or a directory with "
                                "train.tsv and dev.tsv.")
    columns = TsvColumns(text_a="sentence1", text_b="sentence2", label="label", guid="id")
    splits = {split: read_pair_tsv(path / name, split, columns, SAME_ARTICLE_LABELS)
              for split, name in SAME_ARTICLE_SPLIT_FILES.items() if path.is_dir() and (path / name).is_file()}
    if not splits:
        raise UserError(f"no same-article split found in '{path}'; pass a .jsonl(.gz) corpus file or a directory "
                         "with train.tsv and dev.tsv (columns id, sentence1, sentence2, label).")
    return splits


def write_same_article_tsv(splits: dict[str, list[PairExample]], directory: str | os.PathLike) -> None:
    """``train.tsv``/``dev.tsv`` of the splits in the layout :func:`read_same_article` reads (each written
    atomically; a tab or newline inside a sentence becomes a space)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for split, examples in splits.items():
        lines = ["id\tsentence1\tsentence2\tlabel"] + [
            "\t".join([e.guid, " ".join(e.text_a.split()), " ".join(e.text_b.split()), SAME_ARTICLE_LABELS[e.label]])
            for e in examples]
        write_text_atomic(directory / SAME_ARTICLE_SPLIT_FILES[split], "\n".join(lines) + "\n")
