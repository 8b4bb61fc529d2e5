"""Settings zoo accepts but that are probably not what was meant get one line; outcomes that are failures
end non-zero.

``--data-path`` naming a corpus twice or with weight 0, a two-number ``--split`` (a warning, once, from the
writer); ``--temperature 0`` (greedy) and a ``--max-new-tokens`` past the model's context (where it stopped);
a sweep whose runs failed (exit 1, naming them); RACE questions that are all skipped (why, not "no split").
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- --data-path and --split
@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[str, str]:
    from zoo.data.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp("corpora")
    prefixes = []
    for name in ("a", "b"):
        with IndexedDatasetBuilder(root / name, vocab_size=50257) as builder:
            builder.add_document(np.arange(1, 40))
        prefixes.append(str(root / name))
    return prefixes[0], prefixes[1]


def _warnings_of(flags: list[str], capsys, monkeypatch, rank: str | None = None) -> list[str]:
    from zoo.cli.pretrain import build_parser
    from zoo.config.loading import load_run_config

    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
    load_run_config(build_parser().parse_args(["--deepspeed_config", str(REPO / "ds_configs" / "cpu_demo.json"),
                                               *flags]))
    return capsys.readouterr().err.splitlines()


def test_the_same_corpus_twice_and_a_zero_weight_are_said(corpora, capsys, monkeypatch):
    a, b = corpora
    alias = f"{Path(a).parent}/./{Path(a).name}"   # the same files, named otherwise
    assert _warnings_of(["--data-path", "0.5", a, "0.5", alias, "0", b], capsys, monkeypatch) == [
        f"warning: --data-path names the corpus {alias} twice (weights 0.5 and 0.5, the first as {a}), so both "
        "entries draw from the same documents; give it once with the summed weight 1.",
        f"warning: --data-path gives {b} weight 0, so no sample comes from it (its files are still checked); drop "
        "it, or give it a positive weight."]
    assert _warnings_of(["--data-path", "0.5", a, "0.5", a], capsys, monkeypatch, rank="1") == []   # the writer's
    assert _warnings_of(["--data-path", "0.3", a, "0.7", b], capsys, monkeypatch) == []


def test_a_split_of_two_numbers_is_said(corpora, capsys, monkeypatch):
    assert _warnings_of(["--data-path", corpora[0], "--split", "1,1"], capsys, monkeypatch) == [
        "warning: --split 1,1 has 2 numbers of train,valid,test, read as 1,1,0: no test documents; give all three, "
        "e.g. 1,1,0, to say so."]
    assert _warnings_of(["--data-path", corpora[0], "--split", "98,2,0"], capsys, monkeypatch) == []


# ----------------------------------------------------------------------------- generation
@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    """A tiny transformers GPT-2 of 16 positions with the real vocabulary (the CLI's bundled BPE)."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=16, n_embd=32, n_layer=1, n_head=2))
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return str(path)


def _generate_cli():
    spec = importlib.util.spec_from_file_location("launch_generate", REPO / "launch" / "generate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


def test_temperature_zero_says_greedy_and_a_stop_at_the_context_says_where(tiny_gpt2, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    results = _generate_cli().main(["--load", tiny_gpt2, "--prompt", "Hello world", "--prompt", "A",
                                    "--temperature", "0", "--max-new-tokens", "40"])
    assert [r.finish_reason for r in results] == ["context", "context"]
    counts = [len(r.tokens) for r in results]
    assert capsys.readouterr().err.splitlines() == [
        "note: --temperature 0 is greedy decoding (the most likely token at every step), so --seed, --top-k and "
        "--top-p do not change the completions.",
        "generation settings: greedy (--temperature 0), max_new_tokens 40 (--max-new-tokens), eos_token_id [50256] "
        "(generation_config.json)",
        f"note: 2 completions stopped where the prompt and completion filled the model's context of 16 tokens, "
        f"before --max-new-tokens 40: [0] after {counts[0]}, [1] after {counts[1]} new tokens."]
    assert counts == [14, 15]


# ----------------------------------------------------------------------------- sweeps
def test_a_sweep_whose_runs_failed_exits_non_zero_naming_them(tmp_path, capsys):
    from zoo.cli.sweep import main

    program = tmp_path / "fails.py"
    program.write_text("import sys\nprint('no data')\nsys.exit(1)\n")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"name: failing\nprogram: {program}\nmethod: grid\nmetric:\n  name: best/dev/accuracy\n"
                     "parameters:\n  seed:\n    values: [1, 2]\n")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main([str(sweep), "--out", str(out), "--no-wandb"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: 2 of 2 sweep runs did not finish (seed1, seed2); their logs are {out}/<run>.log, fix what they "
        "report and run the sweep again.")
    assert (out / "seed1.log").read_text() == "no data\n"


# ----------------------------------------------------------------------------- RACE
def test_race_questions_all_skipped_say_why(tmp_path):
    from zoo.finetune.race import read_race

    level = tmp_path / "train" / "middle"
    level.mkdir(parents=True)
    (level / "1.txt").write_text(json.dumps({"id": "1", "article": "An article.", "questions": ["Why?", "How?"],
                                             "options": [["a", "b", "c"], ["a", "b", "c", "d", "e"]],
                                             "answers": ["A", "B"]}))
    with pytest.raises(ValueError) as refused:
        read_race(tmp_path)
    assert str(refused.value) == (
        f"all 2 questions in {tmp_path / 'train'} were skipped (2 question(s) without exactly 4 text options), "
        "because zoo's RACE head scores exactly 4 options (A-D) per question; give every question 4 text options "
        "and an answer letter A-D.")


