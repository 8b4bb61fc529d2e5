"""The finetuning demo's pipeline at tiny size: the derived same-article task (balanced pairs, train and dev
articles disjoint, deterministic), its TSV layout, its one-sentence errors, and a run of the runner that
scores the dev accuracy beside the majority-class baseline and plots the dev curve.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from tests.spawn import spawn
from zoo.assets import BUNDLED_CORPUS
from zoo.finetune.demo_task import (
    SAME_ARTICLE_LABELS,
    derive_same_article,
    read_corpus,
    read_same_article,
    write_same_article_tsv,
)

REPO = Path(__file__).resolve().parent.parent
SMALL = {"train": 40, "dev": 20}


def _articles_of(guid: str) -> tuple[str, str]:
    """The two source article ids a derived pair's guid names: "<split>-<n>-<article a>-<article b>"."""
    _, _, first, second = guid.split("-")
    return first, second


def test_derived_pairs_are_balanced_labelled_by_source_and_the_splits_share_no_article():
    articles = read_corpus(BUNDLED_CORPUS)
    splits = derive_same_article(articles, num_pairs=SMALL)
    assert {split: len(pairs) for split, pairs in splits.items()} == SMALL
    sentences_of = {}
    for split, pairs in splits.items():
        assert sum(p.label for p in pairs) == len(pairs) // 2       # balanced: the majority baseline is 0.5
        for pair in pairs:
            first, second = _articles_of(pair.guid)
            assert pair.label == int(first == second) and pair.text_a != pair.text_b
            assert pair.guid.startswith(f"{split}-") and pair.text_a.strip() and pair.text_b.strip()
        sentences_of[split] = {text for p in pairs for text in (p.text_a, p.text_b)}
    train_articles = {a for p in splits["train"] for a in _articles_of(p.guid)}
    dev_articles = {a for p in splits["dev"] for a in _articles_of(p.guid)}
    assert train_articles and dev_articles and not train_articles & dev_articles
    assert not sentences_of["train"] & sentences_of["dev"]
    by_id = {str(a["id"]): " ".join(a["text"].split()) for a in articles}
    for pair in splits["train"] + splits["dev"]:
        first, second = _articles_of(pair.guid)
        assert pair.text_a in by_id[first] and pair.text_b in by_id[second]
        if pair.label == 1:                          # "same" pairs are consecutive sentences of the article
            assert f"{pair.text_a} {pair.text_b}" in by_id[first]
    assert derive_same_article(articles, num_pairs=SMALL) == splits                  # deterministic
    assert derive_same_article(articles, seed=1, num_pairs=SMALL) != splits         # drawn by the seed


def test_the_tsv_layout_reads_back_the_same_pairs(tmp_path):
    splits = derive_same_article(read_corpus(BUNDLED_CORPUS), num_pairs=SMALL)
    write_same_article_tsv(splits, tmp_path)
    header = (tmp_path / "dev.tsv").read_text().splitlines()[0]
    assert header == "id\tsentence1\tsentence2\tlabel"
    read = read_same_article(tmp_path)
    assert {s: [(p.text_a, p.text_b, p.label) for p in pairs] for s, pairs in read.items()} == \
        {s: [(p.text_a, p.text_b, p.label) for p in pairs] for s, pairs in splits.items()}
    assert SAME_ARTICLE_LABELS == ("different", "same")


def test_bad_data_is_one_sentence(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"same-article data '.*nowhere' does not exist; pass --data-dir"):
        read_same_article(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"no same-article split found in '.*'; pass a .jsonl\(.gz\) corpus"):
        read_same_article(tmp_path)
    corpus = tmp_path / "bad.jsonl.gz"
    with gzip.open(corpus, "wt") as f:
        f.write(json.dumps({"id": "1", "title": "x", "text": "One sentence here."}) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=r"line 2 of '.*bad.jsonl.gz' is not a JSON object"):
        read_same_article(corpus)
    with gzip.open(corpus, "wt") as f:
        f.write(json.dumps({"id": "1", "title": "x", "text": "Too short."}) + "\n")
    with pytest.raises(ValueError, match="only 0 article"):
        read_same_article(corpus)


@pytest.fixture(scope="module")
def tiny_post_norm_bert(tmp_path_factory):
    """A random post-norm BERT ("bert" layout, like MiniLM) with the full uncased vocab."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-post-norm-bert")
    transformers.BertForPreTraining(config).save_pretrained(path)
    return path


def _demo_worker(rank, world_size, pretrained, data_dir, save):
    from zoo.cli.finetune import main

    main("same-article", ["--deepspeed_config", str(REPO / "ds_configs" / "finetune_demo.json"),
                          "--pretrained", pretrained, "--data-dir", data_dir, "--save", save,
                          "--max-seq-length", "48", "--epochs", "2", "--batch-size", "4", "--log-interval", "1",
                          "--tensor-parallel-size", "1"])


def test_the_runner_scores_dev_accuracy_beside_the_majority_baseline(tiny_post_norm_bert, tmp_path):
    """One process (the demo's tp = 2 path is the runner's, covered in tests/test_finetune.py)."""
    splits = derive_same_article(read_corpus(BUNDLED_CORPUS), num_pairs={"train": 4, "dev": 6})
    write_same_article_tsv(splits, tmp_path / "data")
    spawn(_demo_worker, 1, str(tiny_post_norm_bert), str(tmp_path / "data"), str(tmp_path / "run"))
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["task"] == "same-article" and results["main_metric"] == "dev/accuracy" and results["steps"] == 2
    best = results["best"]["metrics"]
    assert best["dev/majority_baseline"] == 0.5                                   # 3 of 6 dev pairs are "same"
    assert best["dev/accuracy"] in {k / 6 for k in range(7)}
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [e["iteration"] for e in events if e.get("split") == "dev"] == [1, 2]
    assert (tmp_path / "run" / "dev.png").stat().st_size > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "predictions" / "dev.jsonl").read_text().splitlines()]
    assert [row["label"] for row in rows] == [SAME_ARTICLE_LABELS[p.label] for p in splits["dev"]]


def test_the_closing_lines_name_accuracy_and_baseline(capsys):
    from zoo.finetune.finetune_job import print_baseline_comparison

    print_baseline_comparison("dev/accuracy", {"score": 0.8125, "metrics": {"dev/accuracy": 0.8125,
                                                                           "dev/majority_baseline": 0.5}})
    assert capsys.readouterr().out == "dev/accuracy 0.8125 (best epoch) vs majority-class baseline 0.5000 (+0.3125)\n"
    print_baseline_comparison("dev_matched/accuracy", {"score": 0.8, "metrics": {"dev_matched/accuracy": 0.8}})
    assert capsys.readouterr().out == ""
