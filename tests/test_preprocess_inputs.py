"""Preprocessing inputs and pipeline: directories, hub: datasets, one output per input or merged, the
same bytes for any number of workers, bounded read-ahead, a tokens/s bar, one sentence for bad input."""

import argparse
import gzip
import hashlib
import json
import re
from pathlib import Path

import datasets
import huggingface_hub
import numpy as np
import pytest

from tests.checks import launch_script, one_error_line
from zoo.assets import BUNDLED_CORPUS
from zoo.data import IndexedDataset, preprocess, preprocess_bert
from zoo.data.preprocess import add_preprocess_arguments, run_preprocess
from zoo.data.preprocess_pipeline import encoded_in_order

TEXTS = ["The first document.", "A second one, longer than the first.", "Third.", "Fourth and last document."]

# sha256 of the .bin/.idx that GPT and BERT preprocessing write for the first 20 articles of the bundled
# corpus: the layout and ids every existing dataset on disk was built with.
BUNDLED_20_SHA256 = {
    "gpt.bin": "abd0fb5899c480018786d261a15d25d70d6601369f867fff13d940cbe073c8e0",
    "gpt.idx": "210bbde155a1ca5896d88a1675b6a387200dacd66a3c7e02c9ea9e387aa2ae73",
    "bert.bin": "eb22c84b946bb98f61432e58b4e93eac2ddb7a8a5fefd84daad236d6b2446aeb",
    "bert.idx": "026edb5eafd896f3c38b5727744729cc80a4a9117046bed80a896d0595e47317",
}


def _corpus_dir(root: Path) -> Path:
    """a.jsonl (2 documents), sub/b.txt (1), c.jsonl.gz (1), and files preprocessing must pass over."""
    directory = root / "corpus"
    (directory / "sub").mkdir(parents=True)
    (directory / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:2]))
    (directory / "sub" / "b.txt").write_text(TEXTS[2] + "\n")
    with gzip.open(directory / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": TEXTS[3]}) + "\n")
    (directory / ".hidden.jsonl").write_text(json.dumps({"text": "never read"}) + "\n")
    (directory / "notes.md").write_text("not a corpus\n")
    return directory


def _args(inputs, prefix, **flags) -> argparse.Namespace:
    argv = ["--input", *map(str, inputs), "--output-prefix", str(prefix)]
    for flag, value in flags.items():
        argv += [f"--{flag.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return add_preprocess_arguments(argparse.ArgumentParser()).parse_args(argv)


def _documents(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds.document(d).tolist() for d in range(ds.num_documents)]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_outputs_keep_their_bytes_for_any_number_of_workers(tmp_path):
    source = tmp_path / "bundled20.jsonl"
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        source.write_text("".join(next(f) for _ in range(20)))
    for workers in (1, 2):
        preprocess([source], tmp_path / f"w{workers}" / "gpt", workers=workers, progress=False, batch_size=3)
        preprocess_bert([source], tmp_path / f"w{workers}" / "bert", workers=workers, progress=False, batch_size=3)
        for name, digest in BUNDLED_20_SHA256.items():
            assert _sha256(tmp_path / f"w{workers}" / name) == digest, (workers, name)


def test_a_directory_gives_one_output_per_file_or_one_merged(tmp_path):
    directory = _corpus_dir(tmp_path)
    files = [directory / "a.jsonl", directory / "c.jsonl.gz", directory / "sub" / "b.txt"]  # sorted path order
    singles = {}
    for path in files:
        preprocess([path], tmp_path / "single" / path.name, workers=1, progress=False)
        singles[path.name.split(".")[0]] = _documents(tmp_path / "single" / path.name)

    summaries = run_preprocess(_args([directory], tmp_path / "out" / "c", workers=2, batch_size=1))
    assert [s.prefix for s in summaries] == [str(tmp_path / "out" / f"c_{stem}") for stem in ("a", "c", "b")]
    for stem, documents in singles.items():
        assert _documents(tmp_path / "out" / f"c_{stem}") == documents
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"c_{s}.{e}" for s in "abc" for e in ("bin", "idx")]

    for workers in (1, 2):
        [merged] = run_preprocess(_args([directory], tmp_path / f"merged{workers}", workers=workers, merge=True,
                                        batch_size=1))
        assert merged.documents == 4
        assert _documents(tmp_path / f"merged{workers}") == singles["a"] + singles["c"] + singles["b"]
    for ext in ("bin", "idx"):
        assert (tmp_path / f"merged1.{ext}").read_bytes() == (tmp_path / f"merged2.{ext}").read_bytes()


def test_bert_directory_merged_equals_its_files_in_order(tmp_path):
    directory = _corpus_dir(tmp_path)
    [merged] = run_preprocess(_args([directory], tmp_path / "bert", model="bert", merge=True, workers=2))
    parts = [preprocess_bert([p], tmp_path / p.name, workers=1, progress=False)
             for p in (directory / "a.jsonl", directory / "c.jsonl.gz", directory / "sub" / "b.txt")]
    assert merged.sentences == sum(p.sentences for p in parts) == 4
    ds = IndexedDataset(tmp_path / "bert")
    assert [ds[i].tolist() for i in range(len(ds))] == [IndexedDataset(p.prefix)[i].tolist()
                                                        for p in parts for i in range(p.sentences)]


def test_hub_reads_a_local_dataset_directory(tmp_path):
    hub_dir = tmp_path / "my-dataset"
    hub_dir.mkdir()
    (hub_dir / "train.jsonl").write_text("".join(json.dumps({"body": t, "n": i}) + "\n" for i, t in enumerate(TEXTS)))
    preprocess([hub_dir / "train.jsonl"], tmp_path / "file", json_key="body", progress=False)
    summary = preprocess([f"hub:{hub_dir}"], tmp_path / "hub", json_key="body", workers=2, progress=False)
    assert summary.documents == len(TEXTS)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"hub.{ext}").read_bytes() == (tmp_path / f"file.{ext}").read_bytes()
    with pytest.raises(ValueError, match=r"hub dataset 'hub:.*my-dataset' has no field 'text' \(fields: body, n\); "
                                         r"pass --json-key"):
        preprocess([f"hub:{hub_dir}"], tmp_path / "o", progress=False)
    assert not list(tmp_path.glob("o.*"))


def test_hub_offline_without_cache_is_one_sentence_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code = launch_script("preprocess").main(["--input", "hub:no-such-owner/no-such-corpus/en",
                                             "--output-prefix", str(tmp_path / "out" / "c")])
    assert code == 2
    message = one_error_line(capsys)
    assert message.startswith("error: hub dataset 'hub:no-such-owner/no-such-corpus/en' cannot be loaded ("), message
    assert "HF_HUB_OFFLINE" in message, message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("inputs, needle", [
    (["empty-dir"], "input directory '{tmp}/empty-dir' holds no .jsonl, .json, .txt or .parquet files"),
    (["hub:a/b/c/d"], "input 'hub:a/b/c/d' is not a hub dataset name; write hub:NAME"),
    (["x/a.jsonl", "y/a.txt"], "inputs '{tmp}/x/a.jsonl' and '{tmp}/y/a.txt' would both write '{tmp}/o_a'; "
                               "rename one, or pass --merge"),
])
def test_bad_inputs_are_one_sentence(tmp_path, capsys, inputs, needle):
    (tmp_path / "empty-dir").mkdir()
    for name in ("x/a.jsonl", "y/a.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text('{"text": "hi"}\n' if name.endswith("jsonl") else "hi\n")
    paths = [item if item.startswith("hub:") else str(tmp_path / item) for item in inputs]
    before = sorted(tmp_path.rglob("*"))
    code = launch_script("preprocess").main(["--input", *paths, "--output-prefix", str(tmp_path / "o")])
    assert code == 2
    assert needle.format(tmp=tmp_path) in one_error_line(capsys, from_zoo=True)
    assert sorted(tmp_path.rglob("*")) == before


def test_workers_read_a_bounded_number_of_batches_ahead():
    pulled = []

    def batches():
        for number in range(50):
            pulled.append(number)
            yield [number]

    results = encoded_in_order(np.asarray, batches(), workers=2)
    assert next(results).tolist() == [0]
    assert len(pulled) <= 2 * 2 + 2  # the window (2 * workers + 1) and the one refill after the first result
    assert [r.tolist() for r in results] == [[n] for n in range(1, 50)]


def test_progress_bar_counts_tokens_per_second(tmp_path, capsys):
    source = tmp_path / "t.txt"
    source.write_text("\n".join(TEXTS) + "\n")
    summary = preprocess([source], tmp_path / "o", progress=True)
    err = capsys.readouterr().err
    assert re.search(rf"Tokenizing o: {summary.tokens}(\.0)?tok \[[^\]]*tok/s, docs=4\]", err), err
