"""zoo's tools refuse DeepSpeed universal checkpoints (zoo.checkpoint.universal): ``launch/pretrain.py`` and
``launch/reshard.py`` given a universal checkpoint as --load, or a ds_config with ``"checkpoint":
{"load_universal": true}``, exit 2 with one sentence naming the fix (``launch/export.py`` too, for --load and --tag) (resume the zoo checkpoint at the new layout,
or convert it with launch/reshard.py) before anything is built or written; a run whose own ``latest`` names a zoo
tag is not refused because a universal folder lies beside it.

The universal checkpoint is real: a one-rank ZeRO-1 DeepSpeed engine of a tiny zoo GPT-2 saves a tag, and
DeepSpeed's own ``ds_to_universal`` converts it (tp = 1, so zoo leaves DeepSpeed's tools alone; its missing
``universal_checkpoint_info`` is injected as DeepSpeed's ``--inject_missing_state`` does), writing
``<save>/iter_0000001_universal/`` and ``<save>/latest_universal`` as its documentation shows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checks import one_error_line
from tests.spawn import spawn

REPO = Path(__file__).resolve().parent.parent
DEMO_DS_CONFIG = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())
TAG = "iter_0000001"
FIX = "resume the zoo checkpoint it was converted from with --load at the new"


def _save_zero_checkpoint(rank, world_size, directory):
    import deepspeed

    from zoo.models import GPT2LMHeadModel, gpt2_config
    from zoo.models.families import param_groups

    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=16))
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.0), config=config)
    engine.save_checkpoint(directory, tag=TAG)


@pytest.fixture(scope="module")
def universal(tmp_path_factory) -> Path:
    """``<save>/iter_0000001_universal``, written by DeepSpeed's ds_to_universal; ``<save>`` also keeps the ZeRO
    tag it came from and DeepSpeed's ``latest``."""
    save = tmp_path_factory.mktemp("universal") / "checkpoints"
    spawn(_save_zero_checkpoint, 1, str(save))
    out = save / f"{TAG}_universal"
    result = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                             str(save / TAG), "--output_folder", str(out), "--inject_missing_state",
                             "--num_extract_workers", "1", "--num_merge_workers", "1"],
                            capture_output=True, text=True, timeout=180, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (save / "latest_universal").read_text().strip() == out.name
    assert (out / "zero" / "optimizer_state.pt").is_file() and (out / "zero" / "transformer.wte.weight").is_dir()
    return out


def universal_save_directory(universal: Path, into: Path) -> Path:
    """A save directory holding only the universal folder and its ``latest_universal`` (as ds_to_universal left
    them), the form a user following DeepSpeed's documentation passes as --load."""
    save = into / "universal-only" / "checkpoints"
    if not save.exists():
        save.mkdir(parents=True)
        shutil.copytree(universal, save / universal.name)
        (save / "latest_universal").write_text(universal.name)
    return save


def run_directory_whose_latest_names(universal: Path, into: Path) -> Path:
    """A run directory whose ``checkpoints/latest`` names the universal folder."""
    run = into / "latest-named"
    if not run.exists():
        shutil.copytree(universal, run / "checkpoints" / universal.name)
        (run / "checkpoints" / "latest").write_text(universal.name)
    return run


LOADS = {
    "the folder": lambda universal, tmp: universal,
    "its save directory": universal_save_directory,
    "a run whose latest names it": run_directory_whose_latest_names,
}


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refuse_training(monkeypatch) -> None:
    """Reaching training is the failure this file guards against: stop there instead of training."""
    import zoo.training.pretrain

    def reached(*args, **kwargs):
        raise AssertionError("launch/pretrain.py went on to train")

    monkeypatch.setattr(zoo.training.pretrain, "pretrain", reached)


def pretrain_exit(argv, monkeypatch) -> int:
    from zoo.cli.pretrain import main

    refuse_training(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


def reshard_exit(argv, monkeypatch) -> int:
    from zoo.cli.reshard import main

    for name in ("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code


@pytest.mark.parametrize("form", list(LOADS))
def test_pretrain_refuses_a_universal_checkpoint_as_load(universal, form, tmp_path, monkeypatch, capsys):
    load = LOADS[form](universal, tmp_path)
    before = tree(universal.parent)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(DEMO_DS_CONFIG))
    code = pretrain_exit(["--deepspeed_config", str(config), "--load", str(load), "--save", str(tmp_path / "run")],
                         monkeypatch)
    line = one_error_line(capsys, from_zoo=True)
    assert code == 2, line
    assert f"--load {load} is a DeepSpeed universal checkpoint" in line and FIX in line, line
    assert "launch/reshard.py" in line, line
    assert not (tmp_path / "run").exists() and tree(universal.parent) == before


def test_pretrain_refuses_load_universal_in_the_ds_config(tmp_path, monkeypatch, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({**DEMO_DS_CONFIG, "checkpoint": {"load_universal": True}}))
    code = pretrain_exit(["--deepspeed_config", str(config), "--save", str(tmp_path / "run")], monkeypatch)
    line = one_error_line(capsys, from_zoo=True)
    assert code == 2, line
    assert f'DeepSpeed config {config} sets "checkpoint": {{"load_universal": true}}' in line and FIX in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]


@pytest.mark.parametrize("form", list(LOADS))
def test_reshard_refuses_a_universal_checkpoint_as_load(universal, form, tmp_path, monkeypatch, capsys):
    load = LOADS[form](universal, tmp_path)
    before = tree(tmp_path)
    code = reshard_exit(["--load", str(load), "--tensor-parallel-size", "1"], monkeypatch)
    line = one_error_line(capsys, from_zoo=True)
    assert code == 2, line
    assert f"--load {load} is a DeepSpeed universal checkpoint" in line and FIX in line, line
    assert tree(tmp_path) == before


def test_reshard_refuses_load_universal_in_the_run_s_config(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**DEMO_DS_CONFIG, "checkpoint": {"load_universal": True}}))
    before = tree(tmp_path)
    code = reshard_exit(["--load", str(run), "--tensor-parallel-size", "1"], monkeypatch)
    line = one_error_line(capsys, from_zoo=True)
    assert code == 2, line
    assert f'DeepSpeed config {run / "config.json"} sets "checkpoint": {{"load_universal": true}}' in line, line
    assert tree(tmp_path) == before


def test_a_run_whose_latest_names_a_zoo_tag_is_resumed_as_usual(universal, tmp_path):
    """The universal folder and its latest_universal beside the ZeRO tag do not make zoo refuse the run."""
    from zoo.checkpoint.universal import check_not_universal, universal_folder

    save = universal.parent
    assert (save / "latest").read_text().strip() == TAG and (save / "latest_universal").is_file()
    assert universal_folder(save) is None and universal_folder(save.parent) is None
    check_not_universal(save.parent)
    assert universal_folder(universal) == universal


@pytest.mark.parametrize("form", [*LOADS, "--tag naming it"])
def test_export_refuses_a_universal_checkpoint(universal, form, tmp_path, capsys):
    from zoo.cli.export import main

    if form == "--tag naming it":
        load, tag = universal.parent.parent, ["--tag", universal.name]
    else:
        load, tag = LOADS[form](universal, tmp_path), []
    before = tree(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["--load", str(load), *tag, "--out", str(tmp_path / "hf")])
    line = one_error_line(capsys, from_zoo=True)
    assert exit_info.value.code == 2, line
    assert " is a DeepSpeed universal checkpoint" in line and "export the zoo checkpoint it was converted" in line, line
    assert tree(tmp_path) == before

