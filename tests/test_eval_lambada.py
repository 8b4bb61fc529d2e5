"""LAMBADA zero-shot accuracy (paper Appendix E.2): strict vs non-strict targets, zoo against a
reference loop over transformers' own GPT-2, saved datasets, and the CLI (JSON output, W&B
failures, user errors with exit code 2).

Accuracies are compared exactly. That is rounding-proof because every scored position of the reference
decides "is the target the arg-max?" by at least 1e-4 of max|logits| (asserted on the data, see
``reference_margin``), far above fp32 rounding of the logits (~1e-7 relative).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.lambada_reference import (
    DECISION_MARGIN,
    greedy_passages,
    reference_correct,
    reference_margin,
    write_jsonl,
)
from tests.helpers.tiny_hf_gpt2 import save_tiny_hf_gpt2

REPO = Path(__file__).resolve().parent.parent
HEISENBERG = (679, 13254, 3900)     # GPT-2 BPE of " Heisenberg": " He", "isen", "berg"


@pytest.fixture(scope="module")
def tokenizer():
    from zoo.data import load_gpt2_tokenizer

    return load_gpt2_tokenizer()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_tiny_hf_gpt2(tmp_path_factory.mktemp("tiny_gpt2"), seed=3)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()


class BigramOracle(torch.nn.Module):
    """A stand-in LM whose arg-max after token a is ``table[a]`` (token 0 when absent)."""

    def __init__(self, table: dict[int, int], vocab_size: int = 50257, n_positions: int = 64):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, n_positions=n_positions)
        self.table = table

    def forward(self, input_ids, **_):
        following = torch.tensor([[self.table.get(t, 0) for t in row] for row in input_ids.tolist()])
        return SimpleNamespace(logits=torch.nn.functional.one_hot(following, self.config.vocab_size).float())


# --------------------------------------------------------------------------- strict vs non-strict
def test_multi_token_last_word_splits_differently(tokenizer):
    from zoo.eval import build_example

    text = "The physicist was named Heisenberg"
    strict = build_example(text, tokenizer, strict=True)
    assert strict.target == HEISENBERG
    assert strict.context == tuple(tokenizer("The physicist was named")["input_ids"])
    loose = build_example(text, tokenizer, strict=False)
    assert loose.target == HEISENBERG[-1:]
    assert loose.context == strict.context + HEISENBERG[:-1]


def test_strict_needs_every_piece_non_strict_only_the_last(tokenizer):
    from zoo.eval import evaluate_lambada

    named, to, dog = (tokenizer(w)["input_ids"][-1] for w in (" named", " to", " dog"))
    # Knows "isen" -> "berg" and "He" -> "isen", and " to" -> " He"; never predicts " He" after " named".
    oracle = BigramOracle({HEISENBERG[1]: HEISENBERG[2], HEISENBERG[0]: HEISENBERG[1], to: HEISENBERG[0]})
    assert named not in oracle.table and dog not in oracle.table.values()
    texts = ["The physicist was named Heisenberg",            # strict wrong (" He"), non-strict right
             "Quantum mechanics owes much to Heisenberg",     # right in both
             "The cat chased the dog"]                        # wrong in both
    strict = evaluate_lambada(oracle, texts, tokenizer, strict=True, batch_size=2)
    loose = evaluate_lambada(oracle, texts, tokenizer, strict=False, batch_size=2)
    assert (strict.correct, strict.total, strict.multi_token_targets) == (1, 3, 2)
    assert (loose.correct, loose.total, loose.multi_token_targets) == (2, 3, 0)
    assert strict.accuracy == pytest.approx(1 / 3)


def test_long_passages_lose_the_start_of_their_context(tokenizer):
    from zoo.eval import evaluate_lambada

    oracle = BigramOracle({HEISENBERG[1]: HEISENBERG[2], HEISENBERG[0]: HEISENBERG[1]}, n_positions=8)
    text = "one two three four five six seven eight nine ten eleven He Heisenberg"
    result = evaluate_lambada(oracle, [text], tokenizer, strict=False)
    assert (result.correct, result.truncated) == (1, 1)


# --------------------------------------------------------------------------- against transformers
@pytest.mark.parametrize("strict", [True, False])
def test_zoo_accuracy_equals_transformers_reference_loop(tmp_path, hf_dir, hf_model, tokenizer, strict):
    from zoo.eval import evaluate_lambada, read_lambada
    from zoo.models import GPT2LMHeadModel

    texts = greedy_passages(hf_model, tokenizer)
    path = write_jsonl(tmp_path / "lambada_test.jsonl", texts)
    expected = reference_correct(hf_model, tokenizer, texts, strict)
    assert 0 < expected < len(texts), "the file must hold both right and wrong passages"
    assert reference_margin(hf_model, tokenizer, texts, strict) >= DECISION_MARGIN, "a near-tie: change the passages"

    zoo_model = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    result = evaluate_lambada(zoo_model, read_lambada(path), tokenizer, strict=strict, batch_size=3)
    assert (result.correct, result.total, result.truncated) == (expected, len(texts), 0)
    assert result.accuracy == expected / len(texts)


def test_saved_dataset_reads_like_the_file(tmp_path):
    import datasets

    from zoo.eval import read_lambada

    texts = ["The physicist was named Heisenberg", "The cat chased the dog"]
    path = write_jsonl(tmp_path / "lambada_test.jsonl", texts)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "lambada"))
    assert read_lambada(tmp_path / "lambada") == read_lambada(path) == texts


# --------------------------------------------------------------------------- user errors and CLI
def test_file_errors(tmp_path):
    from zoo.eval import read_lambada

    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist; pass --data"):
        read_lambada(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl holds no passages"):
        read_lambada(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"text": "a b"}\n{"txt": "c d"}\n')
    with pytest.raises(ValueError, match=r"line 2 of .*bad.jsonl has no string 'text' field"):
        read_lambada(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"text": "a b"\n')
    with pytest.raises(ValueError, match=r"line 1 of .*broken.jsonl is not valid JSON"):
        read_lambada(tmp_path / "broken.jsonl")


def test_cli_writes_json_and_survives_wandb_failure(tmp_path, hf_dir, hf_model, tokenizer, monkeypatch, capsys):
    import wandb

    from zoo.cli.evaluate import main

    def refuse(*_, **__):
        raise RuntimeError("no network")

    monkeypatch.setattr(wandb, "init", refuse)
    texts = greedy_passages(hf_model, tokenizer)
    data = write_jsonl(tmp_path / "lambada_test.jsonl", texts)
    out = tmp_path / "results" / "lambada.json"
    main(["--task", "lambada", "--data", str(data), "--load", hf_dir, "--out", str(out),
          "--wandb-project", "zoo-eval"])
    captured = capsys.readouterr()
    assert "lambada (strict): accuracy" in captured.out
    assert "warning: W&B logging skipped (RuntimeError: no network)" in captured.err
    written = json.loads(out.read_text())
    assert written["correct"] == reference_correct(hf_model, tokenizer, texts, strict=True)
    assert (written["tp"], written["dp"], written["total"]) == (1, 1, len(texts))
    assert sorted(p.name for p in out.parent.iterdir()) == ["lambada.json"]     # no temporary left


@pytest.mark.parametrize("argv, message", [
    (["--task", "wikitext", "--data", "{tmp}/nowhere.tokens"], "nowhere.tokens does not exist"),
    (["--task", "wikitext", "--data", "{tmp}/wiki.test.tokens", "--seq-length", "65"],
     "sequence length 65 exceeds the model's n_positions 64; pass --seq-length 64 or less."),
])
def test_cli_user_errors_exit_2(tmp_path, hf_dir, capsys, argv, message):
    from zoo.cli.evaluate import main

    (tmp_path / "wiki.test.tokens").write_text(" \n = Robert Boulter = \n \n Robert Boulter is an actor . \n")
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(tmp=tmp_path) for a in argv] + ["--load", hf_dir])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_cli_subprocess_exits_2_on_a_line_without_text(tmp_path, hf_dir):
    data = tmp_path / "lambada_test.jsonl"
    data.write_text('{"text": "The cat chased the dog"}\n{"passage": "no text field here"}\n')
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "evaluate.py"), "--task", "lambada",
                           "--data", str(data), "--load", hf_dir],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"error: line 2 of {data} has no string 'text' field; write one "
                                   '{"text": ...} object per line, as in lambada_test.jsonl.')
