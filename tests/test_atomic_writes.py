"""Outputs are written atomically through zoo.atomic, never over what the command did not write, and
with the permissions the umask gives.

* ``launch/export.py --out`` naming the run directory, another non-export directory, a file or a path
  under a file is refused with one sentence and exit 2 before any checkpoint is read; the run is intact.
  A previous export is replaced.
* ``launch/evaluate.py --out`` that cannot be written is refused before the evaluation starts.
* Exports, ``save_pretrained`` directories, loss.png and evaluation results get
  0755/0644 under umask 022 and 0750/0640 under umask 027, never tempfile's 0700/0600.

Everything runs in the pytest process on a tp=2 GPT-2 checkpoint of a few kB written without DeepSpeed.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch

import zoo.checkpoint.deepspeed_export as export
import zoo.eval.zero_shot as zero_shot
from zoo.atomic import staged_directory
from zoo.checkpoint.deepspeed_export import export_checkpoint
from zoo.checkpoint.hf.hf_io import is_hf_export
from zoo.checkpoint.layout import layout_only_state
from zoo.cli.evaluate import main as evaluate_main
from zoo.cli.export import main as export_main
from zoo.eval.zero_shot import export_cache_path, make_private_directory, transformers_directory
from zoo.models import GPT2LMHeadModel, gpt2_config
from zoo.training.metrics import plot_loss

TINY = dict(vocab_size=300, n_layer=1, n_embd=32, n_head=2, n_positions=16)


def one_sentence(message: str) -> str:
    assert "\n" not in message.strip() and message.rstrip().endswith("."), message
    return message


def write_run(root: Path, tp: int = 2) -> Path:
    """A run directory as pretraining leaves it: checkpoints/<tag>/mp_rank_XX_model_states.pt (module and
    client state, no optimizer), checkpoints/latest, metrics.jsonl and loss.png."""
    tag_dir = root / "checkpoints" / "iter_0000002"
    tag_dir.mkdir(parents=True)
    for rank in range(tp):
        torch.manual_seed(5)
        model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", **TINY), parallel=layout_only_state(tp, rank))
        torch.save({"module": model.state_dict(), "optimizer": None, "mp_world_size": tp, "iteration": 2,
                    "zoo_model": "gpt2-tiny", "tensor_parallel_size": tp, "model_config": model.hf_config_dict()},
                   tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
    (root / "checkpoints" / "latest").write_text(tag_dir.name)
    (root / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "loss": 5.0}) + "\n"
                                        + json.dumps({"iteration": 2, "loss": 4.0}) + "\n")
    (root / "loss.png").write_bytes(b"a plot")
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("atomic") / "run")


@pytest.fixture
def umask(request):
    """Run the test under ``request.param`` as the process umask, restoring the previous one."""
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_tree_modes(directory: Path, mask: int) -> None:
    assert mode(directory) == 0o777 & ~mask, (directory, oct(mode(directory)))
    for path in directory.rglob("*"):
        expected = (0o777 if path.is_dir() else 0o666) & ~mask
        assert mode(path) == expected, (path, oct(mode(path)), oct(expected))


def export_cli(capsys, load, out) -> str:
    """launch/export.py in process; returns the error sentence after checking exit code 2."""
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--load", str(load), "--out", str(out)])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: "), line
    return one_sentence(line[len("error: "):])


@pytest.fixture
def no_checkpoint_reads(monkeypatch):
    """Refusals must come before any work: reading a checkpoint file fails the test."""
    def forbidden(path):
        raise AssertionError(f"{path} was read before the output path was checked")

    monkeypatch.setattr(export, "read_model_states", forbidden)


# ----------------------------------------------------------------------------- 3.1: export --out
def test_export_into_the_run_directory_is_refused_and_deletes_nothing(run_dir, capsys, no_checkpoint_reads):
    before = snapshot(run_dir)
    message = export_cli(capsys, run_dir, run_dir)
    assert f"{run_dir} exists and is not a Hugging Face export" in message
    assert snapshot(run_dir) == before
    message = export_cli(capsys, run_dir, run_dir / "checkpoints")
    assert "is not a Hugging Face export" in message
    assert snapshot(run_dir) == before


def test_export_over_other_directories_and_files_is_refused(run_dir, tmp_path, capsys, no_checkpoint_reads):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep me")
    assert "is not a Hugging Face export" in export_cli(capsys, run_dir, notes)
    assert (notes / "todo.txt").read_text() == "keep me"

    # An export plus a file the user put there is no longer only an export.
    looks_exported = tmp_path / "hf_plus"
    looks_exported.mkdir()
    for name in ("config.json", "model.safetensors", "vocab.json", "README.md"):
        (looks_exported / name).write_text("{}")
    assert "is not a Hugging Face export" in export_cli(capsys, run_dir, looks_exported)
    assert (looks_exported / "README.md").is_file()

    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"data")
    assert f"{a_file} exists and is not a directory" in export_cli(capsys, run_dir, a_file)
    assert a_file.read_bytes() == b"data"

    message = export_cli(capsys, run_dir, a_file / "hf")
    assert f"lies under the file {a_file}" in message
    assert a_file.read_bytes() == b"data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_plus", "notes", "weights.bin"], "left files behind"


def test_a_previous_export_and_an_empty_directory_are_replaced(run_dir, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()   # empty: nothing to lose
    export_checkpoint(run_dir, out, max_shard_size=20_000)   # sharded: shards + index
    assert is_hf_export(out) and (out / "model.safetensors.index.json").is_file()
    export_checkpoint(run_dir, out)                          # replaces it by a single file
    assert is_hf_export(out) and not (out / "model.safetensors.index.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"], "staging or backup directories left behind"


def test_is_hf_export_accepts_only_config_weights_and_tokenizer_files(tmp_path):
    def directory(*names: str) -> Path:
        path = tmp_path / str(len(list(tmp_path.iterdir())))
        path.mkdir()
        for name in names:
            (path / name).write_text("x")
        return path

    assert is_hf_export(directory("config.json", "model.safetensors", "vocab.json", "merges.txt"))
    assert is_hf_export(directory("config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                                  "model-00002-of-00002.safetensors", "model.safetensors.index.json"))
    assert not is_hf_export(directory("config.json"))                                   # no weights
    assert not is_hf_export(directory("model.safetensors"))                             # no config
    assert not is_hf_export(directory("config.json", "model-00001-of-00001.safetensors"))  # shards without index
    assert not is_hf_export(directory("config.json", "model.safetensors", "metrics.jsonl"))
    with_subdir = directory("config.json", "model.safetensors")
    (with_subdir / "checkpoints").mkdir()
    assert not is_hf_export(with_subdir)


def test_save_pretrained_refuses_a_directory_it_did_not_write(tmp_path):
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", **TINY))
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"is not a Hugging Face export this command wrote") as err:
        model.save_pretrained(tmp_path)
    one_sentence(str(err.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


# ----------------------------------------------------------------------------- 4: permissions follow the umask
@pytest.mark.parametrize("umask", [0o022, 0o027], indirect=True)
def test_exports_honour_the_umask(run_dir, tmp_path, umask):
    export_checkpoint(run_dir, tmp_path / "hf", max_shard_size=20_000)
    assert_tree_modes(tmp_path / "hf", umask)
    GPT2LMHeadModel.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "saved")
    assert_tree_modes(tmp_path / "saved", umask)


@pytest.mark.parametrize("umask", [0o022, 0o027], indirect=True)
def test_loss_plot_and_evaluation_results_honour_the_umask(tmp_path, umask, monkeypatch, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "loss": 5.0}) + "\n")
    plot = plot_loss(tmp_path)
    assert plot.read_bytes().startswith(b"\x89PNG") and mode(plot) == 0o666 & ~umask

    results = {"task": "lambada", "strict": True, "accuracy": 0.5, "correct": 1, "total": 2,
               "multi_token_targets": 0, "truncated": 0}
    monkeypatch.setattr(zero_shot, "evaluate_checkpoint", lambda args: results)
    out = tmp_path / "new" / "lambada.json"
    evaluate_main(["--task", "lambada", "--data", "unused", "--load", "unused", "--out", str(out)])
    assert json.loads(out.read_text()) == results and mode(out) == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "metrics.jsonl", "new"]
    assert [p.name for p in out.parent.iterdir()] == ["lambada.json"], "temporary files left behind"


# ----------------------------------------------------------------------------- 3.9: evaluate --out
def evaluate_cli(capsys, monkeypatch, out) -> str:
    """launch/evaluate.py in process with an evaluation that must never start; returns the sentence."""
    def forbidden(args):
        raise AssertionError("the evaluation started before --out was checked")

    monkeypatch.setattr(zero_shot, "evaluate_checkpoint", forbidden)
    with pytest.raises(SystemExit) as exit_info:
        evaluate_main(["--task", "wikitext", "--data", "unused", "--load", "unused", "--out", str(out)])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: "), line
    return one_sentence(line[len("error: "):])


def test_evaluate_out_that_cannot_be_written_is_refused_before_evaluating(tmp_path, capsys, monkeypatch):
    a_file = tmp_path / "results"
    a_file.write_text("earlier results")
    assert f"--out's directory {a_file} is a file" in evaluate_cli(capsys, monkeypatch, a_file / "ppl.json")
    assert "lies under a file" in evaluate_cli(capsys, monkeypatch, a_file / "sub" / "ppl.json")
    assert f"--out {tmp_path} is a directory" in evaluate_cli(capsys, monkeypatch, tmp_path)
    assert a_file.read_text() == "earlier results"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_evaluate_out_in_a_read_only_directory_is_refused_before_evaluating(tmp_path, capsys, monkeypatch):
    read_only = tmp_path / "ro"
    read_only.mkdir(mode=0o500)
    try:
        assert "cannot be written (permission denied)" in evaluate_cli(capsys, monkeypatch, read_only / "ppl.json")
    finally:
        read_only.chmod(0o700)


# ----------------------------------------------------------------------------- the evaluation's export cache
def test_evaluation_exports_into_a_private_cache(run_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cache = export_cache_path()
    cache.mkdir(mode=0o755)   # e.g. left by an older zoo: taken back to 0700
    cache.chmod(0o755)
    exported = Path(transformers_directory(str(run_dir)))
    assert exported.parent == cache and is_hf_export(exported)
    assert mode(cache) == 0o700
    assert transformers_directory(str(run_dir)) == str(exported)   # reused, not exported again

    if os.geteuid() == 0:   # only root can plant a directory owned by someone else
        planted = tmp_path / "planted"
        planted.mkdir()
        os.chown(planted, os.getuid() + 1, -1)
        with pytest.raises(ValueError, match=r"is not a directory owned by this user") as err:
            make_private_directory(planted)
        one_sentence(str(err.value))


# ----------------------------------------------------------------------------- zoo.atomic itself
def test_staged_directory_under_a_file_is_one_sentence(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"lies under the file") as err:
        with staged_directory(a_file / "deeper" / "out", what="export"):
            raise AssertionError("a staging directory was handed out")
    one_sentence(str(err.value))
