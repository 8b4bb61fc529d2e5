"""Preprocessing a directory writes one dataset per input; preprocessing ends by printing the ``--data-path``
that trains on all of them, and a ``--data-path`` naming their common prefix is refused in one sentence that
names them and that same value."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from zoo.data.blending import check_data_path
from zoo.data.indexed_dataset import IndexedDataset, check_dataset_files
from zoo.data.preprocess import add_preprocess_arguments, run_preprocess
from zoo.data.preprocess_data_path import MAX_NAMED_SIBLINGS, data_path_value

DOCUMENTS = {"a.jsonl": ["The first document of a.", "A second, longer document of the file a, with more words."],
             "b.txt": ["The only document of b."]}


def _preprocess(tmp_path, capsys, *flags: str) -> tuple[str, str]:
    """Preprocesses a directory of two files into ``data/corpus_text_document`` (in-process); returns the
    prefix and the last line printed."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS["a.jsonl"]))
    (corpus / "b.txt").write_text("\n".join(DOCUMENTS["b.txt"]) + "\n")
    prefix = str(tmp_path / "data" / "corpus_text_document")
    (tmp_path / "data").mkdir()
    parser = add_preprocess_arguments(argparse.ArgumentParser())
    run_preprocess(parser.parse_args(["--input", str(corpus), "--output-prefix", prefix, *flags]))
    return prefix, capsys.readouterr().out.splitlines()[-1]


def _printed_value(line: str) -> list[str]:
    assert line.startswith("train on it with: --data-path "), line
    return shlex.split(line.removeprefix("train on it with: --data-path ").split(" (")[0])


def test_a_directory_ends_with_the_blend_of_its_parts_weighted_by_tokens(tmp_path, capsys):
    prefix, line = _preprocess(tmp_path, capsys)
    parts = [f"{prefix}_a", f"{prefix}_b"]
    tokens = [IndexedDataset(part).num_tokens for part in parts]
    value = _printed_value(line)
    assert value[1::2] == parts
    assert [float(weight) for weight in value[0::2]] == pytest.approx([t / sum(tokens) for t in tokens], abs=5e-5)
    blend = check_data_path(value)   # the printed value is one pretraining accepts: files, dtype, vocabulary
    assert [p for _, p in blend] == parts


def test_merge_ends_with_the_one_prefix(tmp_path, capsys):
    prefix, line = _preprocess(tmp_path, capsys, "--merge")
    assert _printed_value(line) == [prefix]
    check_dataset_files(prefix)


def test_the_parts_common_prefix_is_refused_naming_the_parts_and_the_printed_blend(tmp_path, capsys):
    prefix, line = _preprocess(tmp_path, capsys)
    with pytest.raises(FileNotFoundError) as err:
        check_dataset_files(prefix)
    message = str(err.value)
    assert message.startswith(f"--data-path {prefix} names no indexed dataset ({prefix}.bin and {prefix}.idx are "
                              f"missing); found {prefix}_a, {prefix}_b: pass --data-path "), message
    assert shlex.split(message.split(": pass --data-path ")[1].split(", or preprocess")[0]) == _printed_value(line)
    assert message.endswith(f", or preprocess with --merge to write one {prefix}.")


def test_a_prefix_with_no_dataset_beginning_with_it_keeps_the_plain_fix(tmp_path):
    (tmp_path / "other.bin").write_bytes(b"")
    (tmp_path / "other.idx").write_bytes(b"")
    (tmp_path / "nope_half.bin").write_bytes(b"")   # no .idx: not a dataset
    with pytest.raises(FileNotFoundError) as err:
        check_dataset_files(tmp_path / "nope")
    assert "found" not in str(err.value) and str(err.value).endswith(
        "pass the --output-prefix that launch/preprocess.py wrote, without .bin or .idx.")


def test_many_parts_are_counted_not_listed(tmp_path):
    for i in range(MAX_NAMED_SIBLINGS + 1):
        for suffix in (".bin", ".idx"):
            (tmp_path / f"c_{i:02d}{suffix}").write_bytes(b"\0\0")
    with pytest.raises(FileNotFoundError) as err:
        check_dataset_files(tmp_path / "c")
    assert (f"found {MAX_NAMED_SIBLINGS + 1} datasets beginning with it ({tmp_path / 'c_00'} ... "
            f"{tmp_path / f'c_{MAX_NAMED_SIBLINGS:02d}'})") in str(err.value)


def test_data_path_value_quotes_paths_and_leaves_out_empty_outputs():
    assert data_path_value([("data/my corpus", 5)]) == "'data/my corpus'"
    assert data_path_value([("a", 3), ("b", 1), ("empty", 0)]) == "0.75 a 0.25 b"
    assert data_path_value([("a", 0), ("b", 0)]) == "1 a 1 b"
