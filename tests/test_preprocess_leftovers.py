"""Preprocessing cleans up after a killed run of its own output prefix, and never starts more workers than CPUs.

1. the temporaries a killed preprocess (``kill -9``) left for ``<prefix>`` (``<prefix>.bin.<hex>.tmp``,
   ``.idx``, its scratch directory) are removed by the next run of that prefix, said in one line; another
   prefix's are not, nor those of a live preprocess of the same prefix (its scratch directory names its pid);
2. ``--workers`` above the CPUs this process may run on is capped there, said in one line.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zoo.data import IndexedDataset, load_gpt2_tokenizer, preprocess
from zoo.data.indexed_dataset import IndexedDatasetBuilder, data_file_path, index_file_path


@pytest.fixture(scope="module")
def tokenizer():
    return load_gpt2_tokenizer()


def _corpus(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("One document.", "Another one.")))
    return path


def _builders_temporaries(prefix: Path) -> list[Path]:
    """The temporary names IndexedDatasetBuilder writes ``prefix`` under, as a killed run leaves them."""
    paths = [Path(IndexedDatasetBuilder._tmp_name(data_file_path(prefix))),
             Path(IndexedDatasetBuilder._tmp_name(index_file_path(prefix)))]
    for path in paths:
        path.write_bytes(b"half written")
    return paths


def _scratch(out: Path, name: str, pid: int, host: str | None = None) -> Path:
    """A scratch directory as a preprocess of ``out/name`` by process ``pid`` names it."""
    scratch = out / f".zoo-preprocess-{name}@{host or socket.gethostname()}@{pid}@k3j2x9qa"
    (scratch / "arrow").mkdir(parents=True)
    return scratch


def _finished_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_a_rerun_removes_the_stale_temporaries_of_its_own_prefix_only(tmp_path, tokenizer, capsys):
    out = tmp_path / "out"
    out.mkdir()
    stale = _builders_temporaries(out / "corpus") + [_scratch(out, "corpus", _finished_pid())]
    others = _builders_temporaries(out / "corpus_part1") + _builders_temporaries(out / "other")

    preprocess([_corpus(tmp_path)], out / "corpus", tokenizer, progress=False)
    assert IndexedDataset(out / "corpus").num_documents == 2
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in others)
    assert capsys.readouterr().err.splitlines() == [
        f"note: removed 3 temporaries of {out / 'corpus'} left by a preprocess that did not finish: "
        + ", ".join(sorted(path.name for path in stale))]


@pytest.mark.parametrize("host, alive", [(None, True), ("another-node", False)], ids=["live", "another-host"])
def test_a_preprocess_of_the_same_prefix_that_may_still_run_keeps_its_temporaries(tmp_path, tokenizer, capsys, host,
                                                                                    alive):
    """A live writer of the same prefix, or one on another host (which cannot be checked from here)."""
    out = tmp_path / "out"
    out.mkdir()
    kept = _builders_temporaries(out / "corpus") + [_scratch(out, "corpus", os.getppid() if alive else 1, host)]
    preprocess([_corpus(tmp_path)], out / "corpus", tokenizer, progress=False)
    assert all(path.exists() for path in kept)
    assert "note: removed" not in capsys.readouterr().err


def test_workers_are_capped_at_the_cpus_available(tmp_path, tokenizer, capsys, monkeypatch):
    def no_processes(*args, **kwargs):
        raise AssertionError("a tokenizer process was started")

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(multiprocessing, "get_context", no_processes)
    summary = preprocess([_corpus(tmp_path)], tmp_path / "corpus", tokenizer, workers=64, progress=False)
    assert summary.documents == 2
    assert capsys.readouterr().err.splitlines() == [
        "note: --workers 64 is more than the 1 CPU this process may run on; tokenizing with 1 worker."]
