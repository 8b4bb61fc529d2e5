"""Loading a checkpoint never runs code from it.

One tiny real checkpoint (gpt2, tp = 1, one iteration through pretrain) is written once per module; each
test copies it and replaces a states file with one whose pickle holds an object whose ``__reduce__``
opens (creates) a marker file when unpickled, as a planted checkpoint would run ``os.system``. Through
export, evaluate and generate (their ``main`` in this process) and ``pretrain --load`` (launch/pretrain.py
as a single-process job), the marker never appears, the exit code is 2, and the one sentence names the
file and the refused global. The allow-list itself is checked against the real checkpoint: it loads.
"""

from __future__ import annotations

import builtins
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.launch_env import one_rank_env
from tests.helpers.pretraining import ds_config, run_config
from tests.helpers.random_corpus import MODEL, make_corpus
from tests.spawn import free_port, spawn

REPO = Path(__file__).resolve().parent.parent


class OpensMarker:
    """Unpickled, it calls ``open(path, "w")``: the file appears iff the unpickler ran the call."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


def _train_one_iteration(rank, world_size, data_path, save):
    from zoo.training.pretrain import pretrain

    pretrain(run_config(data_path, save, 1, 1, 1, train_iters=1, model_overrides=dict(MODEL), data_workers=0))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("safe_load")
    corpus = make_corpus(root / "random")
    spawn(_train_one_iteration, 1, corpus, str(root / "run"))
    return root / "run", corpus


def planted_copy(real_run: tuple[Path, str], tmp_path: Path, file: str = "mp_rank_00_model_states.pt") -> tuple[Path, Path, Path]:
    """(run directory copy, the planted file, the marker path): ``file`` of the latest tag gains an
    entry whose unpickling would create the marker."""
    run = tmp_path / "run"
    shutil.copytree(real_run[0], run)
    tag = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    marker = tmp_path / "MARKER"
    from zoo.checkpoint.safe_load import safe_torch_load

    states = safe_torch_load(tag / file, mmap=False)
    states["planted"] = OpensMarker(str(marker))
    torch.save(states, tag / file)
    return run, tag / file, marker


def assert_refused(capsys, excinfo, planted: Path, marker: Path) -> None:
    assert excinfo.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    line = err[-1]
    assert str(planted) in line and "holds the pickled global io.open" in line, line
    assert line.count(". ") == 0 and line.endswith("."), line
    assert not marker.exists(), "the planted pickle ran"


def test_real_checkpoint_loads_with_the_allow_list(real_run):
    """Every .pt of a real tag (numpy RNG state, DeepSpeed's counters, zoo's client state) loads weights-only."""
    from zoo.checkpoint.files import tag_directory
    from zoo.checkpoint.safe_load import check_tag_files

    tag = tag_directory(real_run[0])
    check_tag_files(tag)
    with pytest.raises(Exception, match="Weights only load failed"):   # and torch's default list alone refuses it
        torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)


def test_export_refuses_a_planted_pickle(real_run, tmp_path, capsys):
    from zoo.cli.export import main

    run, planted, marker = planted_copy(real_run, tmp_path)
    with pytest.raises(SystemExit) as excinfo:
        main(["--load", str(run), "--out", str(tmp_path / "hf")])
    assert_refused(capsys, excinfo, planted, marker)
    assert not (tmp_path / "hf").exists()


def test_evaluate_refuses_a_planted_pickle(real_run, tmp_path, capsys, monkeypatch):
    import tempfile

    from zoo.cli.evaluate import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # the export cache lives under it
    run, planted, marker = planted_copy(real_run, tmp_path)
    data = tmp_path / "lambada_test.jsonl"
    data.write_text(json.dumps({"text": "The quick brown fox jumps over the lazy dog"}) + "\n")
    with pytest.raises(SystemExit) as excinfo:
        main(["--task", "lambada", "--data", str(data), "--load", str(run)])
    assert_refused(capsys, excinfo, planted, marker)


def test_generate_refuses_a_planted_pickle(real_run, tmp_path, capsys, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    spec = importlib.util.spec_from_file_location("zoo_generate_cli", REPO / "launch" / "generate.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    run, planted, marker = planted_copy(real_run, tmp_path)
    with pytest.raises(SystemExit) as excinfo:
        cli.main(["--load", str(run), "--prompt", "Hello", "--greedy", "--max-new-tokens", "2"])
    assert_refused(capsys, excinfo, planted, marker)


def test_resume_refuses_a_planted_optimizer_file(real_run, tmp_path):
    """checkpoint_to_load loads every .pt of the tag weights-only before DeepSpeed reads any: a planted
    file that zoo itself never reads (here an extra states file) is refused too."""
    from zoo.checkpoint.resume import checkpoint_to_load
    from zoo.parallel import ParallelState

    run, _, marker = planted_copy(real_run, tmp_path)
    tag = (run / "checkpoints" / "latest").read_text().strip()
    clean = safe_copy(real_run, tag)
    shutil.copy(clean, run / "checkpoints" / tag / "mp_rank_00_model_states.pt")   # model states clean again
    extra = run / "checkpoints" / tag / "expert_states.pt"
    torch.save({"planted": OpensMarker(str(marker))}, extra)
    with pytest.raises(ValueError) as err:
        checkpoint_to_load(run, ParallelState.single())
    assert str(extra) in str(err.value) and "io.open" in str(err.value)
    assert not marker.exists()


def safe_copy(real_run, tag: str) -> Path:
    return real_run[0] / "checkpoints" / tag / "mp_rank_00_model_states.pt"


def test_pretrain_load_refuses_a_planted_pickle(real_run, tmp_path):
    run, planted, marker = planted_copy(real_run, tmp_path)
    config = ds_config(1, 1)
    config["zoo"] = {"tensor_parallel_size": 1, "model": "gpt2-tiny", "seq_length": 32, "eval_interval": 0,
                     "split": "80,20,0", "log_interval": 1, "model_overrides": MODEL}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "launch/pretrain.py", "--deepspeed_config", str(tmp_path / "ds.json"),
                           "--data-path", real_run[1], "--save", str(tmp_path / "next"), "--load", str(run),
                           "--train-iters", "2"], env=one_rank_env(free_port()), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and str(planted) in line and "io.open" in line, proc.stderr[-3000:]
    assert not marker.exists(), "the planted pickle ran"


def _deepspeed_loads(rank, world_size, clean_run, planted_run, marker):
    """DeepSpeed's own load_checkpoint inside weights_only_loads: the clean tag loads whole (model,
    optimizer, scheduler, client state); the planted one is refused without running it."""
    import deepspeed

    from zoo.checkpoint.safe_load import weights_only_loads
    from zoo.models import GPT2LMHeadModel, gpt2_config
    from zoo.models.families import param_groups
    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(1)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", **MODEL), parallel=ps)
    engine, _, _, _ = deepspeed.initialize(model=model, mpu=ps, config=ds_config(1, 1),
                                           model_parameters=param_groups(model, 0.01))
    with weights_only_loads(engine):
        path, client = engine.load_checkpoint(f"{clean_run}/checkpoints")
    loaded = path is not None and client["iteration"] == 1 and "numpy" in client["rng"]
    try:
        with weights_only_loads(engine):
            engine.load_checkpoint(f"{planted_run}/checkpoints")
        refused = None
    except ValueError as err:
        refused = str(err)
    return loaded, refused, Path(marker).exists(), type(engine.checkpoint_engine).__name__


def test_deepspeed_load_reads_weights_only(real_run, tmp_path):
    run, planted, marker = planted_copy(real_run, tmp_path)
    loaded, refused, ran, engine_type = spawn(_deepspeed_loads, 1, str(real_run[0]), str(run), str(marker))[0]
    assert loaded and not ran and engine_type == "TorchCheckpointEngine"
    assert refused is not None and str(planted) in refused and "io.open" in refused, refused
