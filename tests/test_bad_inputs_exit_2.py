"""Hostile inputs to preprocessing and generation.

Each bad input ends in one sentence naming the file (and line) or the value and the fix; the CLIs
print it as ``error: ...`` and exit 2, leaving nothing behind. Documents without a string text are
skipped and reported in one warning. Everything runs in the pytest process.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import stat
from pathlib import Path

import pytest
import torch

from tests.checks import launch_script, one_error_line

REPO = Path(__file__).resolve().parent.parent




def _gzip_bytes(text: bytes) -> bytes:
    return gzip.compress(text)


# ------------------------------------------------------------------ preprocess: unreadable files
UNREADABLE = {
    "bad.jsonl": (b'{"text": "a"}\nnot json\n{"text": "b"}\n', ["line 2 is not valid JSON", "one JSON object"]),
    "cut.jsonl": (b'{"text": "a"}\n{"text": "b"\n', ["line 2 is not valid JSON"]),
    "number.jsonl": (b'{"text": "a"}\n5\n', ["line 2 holds a JSON number, not an object"]),
    "empty.jsonl": (b"", ["is empty", "remove it from --input"]),
    "blank.jsonl": (b"\n  \n", ["is empty"]),
    "empty.txt": (b"", ["is empty"]),
    "latin.txt": (b"fine\ncaf\xe9 au lait\n", ["line 2 is not UTF-8", "byte 0xe9 at column 4", "convert"]),
    "latin.jsonl": (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', ["line 2 is not UTF-8"]),
    "cut.jsonl.gz": (_gzip_bytes(b'{"text": "a"}\n' * 50)[:30], ["cannot be decompressed"]),
    "ints.jsonl": (b'{"text": 1}\n{"text": 2}\n', ["field 'text' holds int64 values, not text", "--json-key"]),
    "junk.parquet": (b"PAR1 not really", ["cannot be read (", "Parquet"]),
}


@pytest.mark.parametrize("name", sorted(UNREADABLE))
def test_preprocess_cli_names_the_file_and_line(name, tmp_path, capsys):
    content, needles = UNREADABLE[name]
    source = tmp_path / name
    source.write_bytes(content)
    code = launch_script("preprocess").main(["--input", str(source), "--output-prefix", str(tmp_path / "out" / "corpus")])
    assert code == 2
    message = one_error_line(capsys)
    assert f"'{source}'" in message and all(needle in message for needle in needles), message
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # out/ was created for the run, and removed


def test_bert_preprocess_reads_inputs_the_same_way(tmp_path):
    from zoo.data import preprocess_bert

    source = tmp_path / "bad.jsonl"
    source.write_bytes(UNREADABLE["bad.jsonl"][0])
    with pytest.raises(ValueError, match=r"bad.jsonl' line 2 is not valid JSON"):
        preprocess_bert([source], tmp_path / "o", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_output_prefix_under_a_file(tmp_path):
    from zoo.data import preprocess

    source = tmp_path / "ok.txt"
    source.write_text("hello\n")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"output prefix '.*file/sub/o' lies under a file, not a directory"):
        preprocess([source], tmp_path / "file" / "sub" / "o", progress=False)
    assert (tmp_path / "file").read_text() == "x"


# ------------------------------------------------------------------ preprocess: documents without text
def test_documents_without_string_text_are_counted_in_one_warning(tmp_path):
    from zoo.data import IndexedDataset, load_gpt2_tokenizer, preprocess
    from zoo.data.preprocess import SkippedDocumentsWarning

    mixed = tmp_path / "mixed.jsonl"   # text of mixed types: datasets reads the column as JSON values
    mixed.write_text('{"text": "hello"}\n{"other": 1}\n\n{"text": 5}\n{"text": null}\n{"text": "bye"}\n')
    holes = tmp_path / "holes.jsonl"   # a string column with a hole; blank lines are not records
    holes.write_text('{"text": "one"}\n\n{"id": 7}\n{"text": "two"}\n')
    objects = tmp_path / "objects.jsonl"   # a type change pyarrow refuses: read again record by record
    objects.write_text('{"text": "three", "id": 1}\n\n{"text": {"x": 1}, "id": "b"}\n')
    with pytest.warns(SkippedDocumentsWarning) as caught:
        summary = preprocess([mixed, holes, objects], tmp_path / "o", progress=False)
    messages = [str(w.message) for w in caught]
    assert messages == [
        f"{mixed}: skipped 3 document(s) without string text (2 without a 'text' value; 1 with a non-string "
        "'text'); the first is line 2.",
        f"{holes}: skipped 1 document(s) without string text (1 without a 'text' value); the first is line 3.",
        f"{objects}: skipped 1 document(s) without string text (1 with a non-string 'text'); the first is line 3.",
    ]
    tokenizer = load_gpt2_tokenizer()
    texts = ["hello", "bye", "one", "two", "three"]
    assert summary.documents == IndexedDataset(tmp_path / "o").num_documents == len(texts)
    assert summary.tokens == sum(len(tokenizer.encode(t)) + 1 for t in texts)


def test_bert_preprocess_warns_about_documents_without_text(tmp_path):
    from zoo.data import preprocess_bert
    from zoo.data.preprocess import SkippedDocumentsWarning

    source = tmp_path / "m.jsonl"
    source.write_text('{"text": "A first sentence. And a second one."}\n{"text": ["not", "text"]}\n')
    with pytest.warns(SkippedDocumentsWarning, match=r"skipped 1 document.*1 with a non-string 'text'.*line 2"):
        summary = preprocess_bert([source], tmp_path / "o", progress=False)
    assert summary.documents == 1 and summary.sentences == 2


# ------------------------------------------------------------------ tokenizer directories
def test_tokenizer_directory_errors_name_the_directory(tmp_path):
    from zoo.data import load_bert_tokenizer, load_gpt2_tokenizer

    with pytest.raises(FileNotFoundError, match=r"'.*empty' holds neither vocab.json and merges.txt nor tokenizer"):
        (tmp_path / "empty").mkdir()
        load_gpt2_tokenizer(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"'.*file' is not a directory"):
        load_bert_tokenizer(tmp_path / "file")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "vocab.json").write_bytes(b"\xff\xfe{")
    (broken / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match=r"tokenizer directory '.*broken' cannot be loaded \(.*\); check") as err:
        load_gpt2_tokenizer(broken)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ sampling settings
BAD_SETTINGS = [
    ({"temperature": math.nan}, "temperature nan"),
    ({"temperature": math.inf}, "temperature inf"),
    ({"temperature": -0.5}, "temperature -0.5"),
    ({"temperature": "0.7"}, "temperature '0.7'"),
    ({"top_p": math.nan}, "top-p nan"),
    ({"top_p": math.inf}, "top-p inf"),
    ({"top_p": 0.0}, "top-p 0.0"),
    ({"top_p": 1.5}, "top-p 1.5"),
    ({"top_k": -1}, "top-k -1"),
    ({"top_k": 2.5}, "top-k 2.5"),
]


@pytest.mark.parametrize("settings,needle", BAD_SETTINGS, ids=[n for _, n in BAD_SETTINGS])
def test_generation_config_refuses_bad_sampling_settings(settings, needle):
    from zoo.inference import GenerationConfig

    with pytest.raises(ValueError, match=needle) as err:
        GenerationConfig(**settings).validate()
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


@pytest.mark.parametrize("settings,needle", BAD_SETTINGS, ids=[n for _, n in BAD_SETTINGS])
def test_filters_refuse_bad_sampling_settings(settings, needle):
    """The Python API below GenerationConfig is protected too: no 'probability tensor contains nan'."""
    from zoo.inference import filter_logits

    with pytest.raises(ValueError, match=needle):
        filter_logits(torch.zeros(1, 4), **settings)


def test_tiny_temperatures_sample_the_arg_max():
    """z / T overflowing (fp32 at T=1e-39, fp16 logits at T=1e-4) still gives a distribution, not NaNs."""
    from zoo.inference import filter_logits, sample

    for logits, temperature in ((torch.tensor([[1.0, 3.0, 2.0]]), 1e-39),
                                (torch.tensor([[1.0, 3.0, 2.0]], dtype=torch.float16), 1e-4)):
        filtered = filter_logits(logits, temperature, top_p=0.9)
        assert not torch.isnan(filtered).any()
        assert sample(filtered, [torch.Generator().manual_seed(0)]).tolist() == [1]


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "nan"], "temperature nan"),
    (["--temperature", "inf"], "temperature inf"),
    (["--top-p", "nan"], "top-p nan"),
    (["--top-k", "-3"], "top-k -3"),
])
def test_generate_cli_refuses_bad_sampling_settings(flags, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch_script("generate").main(["--load", str(tmp_path / "model"), "--prompt", "x", *flags])
    assert exit_info.value.code == 2
    assert needle in one_error_line(capsys)


def test_generate_cli_checks_output_before_generating(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    cli = launch_script("generate")
    for output, needle in ((tmp_path / "file" / "out.jsonl", "cannot be written"), (tmp_path / "dir", "is a directory")):
        with pytest.raises(SystemExit) as exit_info:   # --load is no model: the output is checked first
            cli.main(["--load", str(tmp_path / "model"), "--prompt", "x", "--output", str(output)])
        assert exit_info.value.code == 2
        assert needle in one_error_line(capsys)
    assert (tmp_path / "file").read_text() == "x" and not any((tmp_path / "dir").iterdir())


def test_generate_output_is_atomic_with_the_umask_mode(tmp_path):
    import zoo.cli.generate as cli
    old = os.umask(0o022)
    try:
        cli.write_jsonl_atomic(tmp_path / "sub" / "out.jsonl", [{"prompt": "é", "tokens": [1]}])
    finally:
        os.umask(old)
    out = tmp_path / "sub" / "out.jsonl"
    assert [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()] == [{"prompt": "é", "tokens": [1]}]
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]
