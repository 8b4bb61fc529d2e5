"""Raw files -> indexed dataset with parallel workers; the CLI's error contract; the corpus cache."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zoo.data import IndexedDataset, default_corpus_prefix, load_gpt2_tokenizer, preprocess

REPO = Path(__file__).resolve().parent.parent
EOD = 50256
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Megatron-LM splits GEMMs across GPUs.\nA second line in the same document.",
    "  leading spaces and ünïcödé",
    "<|endoftext|> is plain text here",
    "Short.",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_gpt2_tokenizer()


def _expected(tok, texts):
    return [tok.encode(t) + [EOD] for t in texts]


def test_jsonl_and_txt_with_two_workers(tmp_path, tokenizer):
    jsonl = tmp_path / "docs.jsonl"
    blank = [{"id": 99, "body": ""}, {"id": 98, "body": " \n "}]  # a batch (batch_size=2) of blanks only
    rows = [{"id": 0, "body": t} for t in TEXTS[:2]] + blank + [{"id": 5, "body": t} for t in TEXTS[2:]]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    txt = tmp_path / "lines.txt"
    lines = [t.replace("\n", " ") for t in TEXTS]
    txt.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")  # the blank line is no document

    summary = preprocess(
        [jsonl, txt], tmp_path / "out" / "corpus", tokenizer, workers=2, json_key="body", progress=False, batch_size=2
    )
    want = _expected(tokenizer, TEXTS) + _expected(tokenizer, lines)
    assert summary.documents == len(want) == 10
    assert summary.tokens == sum(map(len, want))
    assert summary.seconds > 0 and summary.tokens_per_s > 0
    ds = IndexedDataset(tmp_path / "out" / "corpus")
    assert ds.dtype == np.uint16 and ds.num_documents == len(want)
    for d, ids in enumerate(want):
        np.testing.assert_array_equal(ds.document(d), ids)
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.bin", "corpus.idx"]  # datasets' cache is gone


def test_gz_and_parquet_inputs(tmp_path, tokenizer):
    import datasets

    gz = tmp_path / "a.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS[:2])
    pq = tmp_path / "b.parquet"
    datasets.Dataset.from_dict({"text": TEXTS[2:]}).to_parquet(str(pq))
    summary = preprocess([gz, pq], tmp_path / "mixed", tokenizer, workers=1, progress=False)
    ds = IndexedDataset(tmp_path / "mixed")
    want = _expected(tokenizer, TEXTS)
    assert summary.documents == ds.num_documents == len(TEXTS)
    for d, ids in enumerate(want):
        np.testing.assert_array_equal(ds.document(d), ids)


def test_user_errors(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text('{"content": "hi"}\n')
    with pytest.raises(ValueError, match="json-key"):
        preprocess([src], tmp_path / "o", progress=False)
    with pytest.raises(ValueError, match="workers=0"):
        preprocess([src], tmp_path / "o", progress=False, json_key="content", workers=0)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    with pytest.raises(ValueError, match="no non-blank documents"):
        preprocess([blank], tmp_path / "o", progress=False)
    bad = tmp_path / "x.csv"
    bad.write_text("a\n")
    with pytest.raises(ValueError, match="unsupported extension"):
        preprocess([bad], tmp_path / "o", progress=False)
    assert not list(tmp_path.glob("o.*")) and not list(tmp_path.glob(".zoo-preprocess-*"))


def test_cli_missing_input_exits_2(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "preprocess.py"), "--input", str(tmp_path / "missing.jsonl"),
         "--output-prefix", str(tmp_path / "o")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing.jsonl" in lines[0]
    assert not list(tmp_path.iterdir())


def test_default_corpus_prefix_builds_once(tmp_path, tokenizer):
    corpus = tmp_path / "tiny.jsonl.gz"
    with gzip.open(corpus, "wt") as f:
        f.writelines(json.dumps({"id": i, "title": "t", "text": t}) + "\n" for i, t in enumerate(TEXTS))
    cache = tmp_path / "cache"
    prefix = default_corpus_prefix(cache, corpus=corpus, workers=1)
    assert prefix == str(cache / "tiny_gpt2_text_document")
    stamp = os.stat(prefix + ".idx").st_mtime_ns
    assert default_corpus_prefix(cache, corpus=corpus) == prefix
    assert os.stat(prefix + ".idx").st_mtime_ns == stamp
    assert IndexedDataset(prefix).num_tokens == sum(map(len, _expected(tokenizer, TEXTS)))
