"""Pretraining with pipeline stages against the one-stage run, dropout off, fp32.

* tp1 x pp2 (2 ranks, the spawn harness) and tp2 x pp2 (4 ranks, the real ``deepspeed`` launcher) train
  5 iterations of m = 4 micro-batches with the tp1 x pp1 run's losses, grad norms (clipping active: the
  norms are above 1) and validation loss, <= 1e-5 relative.
* A tp1 x pp2 run stopped after 3 iterations (``--exit-interval``) and resumed equals the uninterrupted one
  bit for bit (losses, grad norms, learning rates).
* The tp2 x pp2 run's checkpoint of iteration 3 resumes at tp1 x pp1 and at tp1 x pp4, and the tp1 x pp1
  run's at tp1 x pp2 (weights and Adam moments moved to the new layout), with the uninterrupted run's
  losses, grad norms and learning rates of iterations 4 and 5, <= 1e-5.
* The tp2 x pp2 checkpoint exports to transformers' GPT-2 layout, whose logits equal those of the tp1 x pp1
  run's export <= 1e-4 relative (weights after 5 Adam steps at lr up to 1e-3 agree to fp32 rounding), and
  equal zoo's GPT2LMHeadModel loaded from the same export <= 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checks import rel_err
from tests.helpers.pretraining import ds_config, run_config, train_events
from tests.helpers.repo import REPO
from tests.spawn import spawn

MODEL = dict(n_layer=4, n_embd=64, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
MICRO, GLOBAL, ITERS = 2, 8, 5          # m = 4 micro-batches per iteration at dp = 1
RTOL = 1e-5


def pipeline_config(data_path, save, tp, pp, **changes):
    return run_config(data_path, save, tp, MICRO, GLOBAL, ITERS, model_overrides=dict(MODEL),
                      pipeline_model_parallel_size=pp, eval_interval=ITERS, eval_iters=2, **changes)


def _runs(rank, world_size, data_path, root, pp):
    os.environ["LOCAL_RANK"] = str(rank)   # what the launcher sets; DeepSpeed's PipelineModule reads it
    from zoo.training.pretrain import pretrain

    if pp == 1:
        pretrain(pipeline_config(data_path, f"{root}/pp1", 1, 1, save_interval=3))
        return
    pretrain(pipeline_config(data_path, f"{root}/pp2", 1, pp))
    stopped = pretrain(pipeline_config(data_path, f"{root}/pp2-resumed", 1, pp, exit_interval=3))
    assert stopped["stopped_by"] == "--exit-interval 3", stopped
    pretrain(pipeline_config(data_path, f"{root}/pp2-resumed", 1, pp, load=f"{root}/pp2-resumed"))


def launch_tp2_pp2(data_path, run_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    from tests.spawn import free_port

    config = ds_config(MICRO, GLOBAL)
    config["zoo"] = {"tensor_parallel_size": 2, "pipeline_model_parallel_size": 2, "model": "gpt2-tiny",
                     "seq_length": 32, "train_iters": ITERS, "data_path": data_path, "split": "80,20,0",
                     "save": str(run_dir), "log_interval": 1, "eval_interval": ITERS, "eval_iters": 2,
                     "save_interval": 3, "model_overrides": MODEL}
    path = tmp_path / "tp2_pp2.json"
    path.write_text(json.dumps(config))
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "4", "--master_port", str(free_port()),
           "launch/pretrain.py", "--deepspeed_config", str(path)]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


def validation_loss(run_dir: Path) -> float:
    from zoo.training.metrics import read_metrics

    return [e for e in read_metrics(run_dir) if e.get("split") == "valid"][-1]["val_loss"]


def assert_same_run(reference: Path, other: Path, rtol: float) -> None:
    ref, got = train_events(reference), train_events(other)
    assert [e["iteration"] for e in got] == list(range(1, ITERS + 1))
    for a, b in zip(ref, got):
        for key in ("loss", "grad_norm", "lr"):
            assert rel_err(b[key], a[key]) <= rtol, (other.name, key, a, b)
    assert ref[0]["grad_norm"] > 1.0   # gradient clipping at 1.0 acts, so the norm over every stage matters
    assert rel_err(validation_loss(other), validation_loss(reference)) <= rtol


@pytest.fixture(scope="module")
def runs(corpus_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    spawn(_runs, 1, corpus_prefix, str(root), 1)
    spawn(_runs, 2, corpus_prefix, str(root), 2)
    proc = launch_tp2_pp2(corpus_prefix, root / "tp2-pp2", root)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return root


def test_tp1_pp2_equals_one_stage_run(runs):
    assert_same_run(runs / "pp1", runs / "pp2", RTOL)


def test_tp2_pp2_through_the_launcher_equals_one_stage_run(runs):
    assert_same_run(runs / "pp1", runs / "tp2-pp2", RTOL)
    names = {p.name for p in (runs / "tp2-pp2" / "checkpoints" / f"iter_{ITERS:07d}").iterdir()}
    # one optimizer/client file per (stage, TP rank); the weights in one file per layer entry and TP rank
    assert {f"mp_rank_0{r}_model_states.pt" for r in range(4)} <= names, names
    assert {f"layer_0{i}-model_0{t}-model_states.pt" for i in range(7) for t in range(2)} <= names, names


def test_pipeline_resume_is_bit_exact(runs):
    full, resumed = train_events(runs / "pp2"), train_events(runs / "pp2-resumed")
    assert [e["iteration"] for e in resumed] == list(range(1, ITERS + 1))
    for a, b in zip(full, resumed):
        for key in ("loss", "grad_norm", "lr", "consumed_samples"):
            assert a[key] == b[key], (key, a, b)


def test_pipeline_checkpoint_exports_to_transformers(runs, tmp_path):
    import transformers

    from zoo.checkpoint.deepspeed_export import export_checkpoint
    from zoo.models import GPT2LMHeadModel

    result = export_checkpoint(runs / "tp2-pp2", tmp_path / "pp")
    assert (result.tp_size, result.pp_size) == (2, 2)
    export_checkpoint(runs / "pp1", tmp_path / "one")
    ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "pp").eval()(ids).logits
        ours = GPT2LMHeadModel.from_pretrained(tmp_path / "pp").eval()(ids, gather_output=True).logits
        one_stage = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "one").eval()(ids).logits
    assert rel_err(ours, theirs) <= RTOL
    assert rel_err(theirs, one_stage) <= 1e-4


def _resume_elsewhere(rank, world_size, data_path, source, save, pp):
    """Resume ``source`` at tp1 x ``pp``; returns the files of ``source`` this rank opened (an audit hook
    sees every ``open``, torch.load's included), in order."""
    os.environ["LOCAL_RANK"] = str(rank)
    from zoo.training.pretrain import pretrain

    root, opened = os.path.realpath(source) + os.sep, []

    def record_opens(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(root):
                opened.append(path[len(root):])

    sys.addaudithook(record_opens)   # this rank's process ends with the spawn
    pretrain(pipeline_config(data_path, save, 1, pp, load=source))
    return opened


def checkpoint_of_iteration(run_dir: Path, iteration: int, root: Path) -> Path:
    """A run directory whose only checkpoint is ``run_dir``'s tag of ``iteration`` (what --load then resumes)."""
    import shutil

    tag = f"iter_{iteration:07d}"
    copy = root / f"{run_dir.name}-{tag}"
    shutil.copytree(run_dir / "checkpoints" / tag, copy / "checkpoints" / tag)
    (copy / "checkpoints" / "latest").write_text(tag)
    return copy


@pytest.mark.parametrize("source,pp", [("tp2-pp2", 1), ("tp2-pp2", 4), ("pp1", 2)])
def test_a_checkpoint_resumes_at_another_pipeline_layout(runs, corpus_prefix, tmp_path, source, pp):
    """P -> 1 and P -> P' (with a tp change) from the tp2 x pp2 run, 1 -> P from the one-stage run."""
    checkpoint = checkpoint_of_iteration(runs / source, 3, tmp_path)
    opened = spawn(_resume_elsewhere, pp, corpus_prefix, str(checkpoint), str(tmp_path / "resumed"), pp)
    assert_reads_only_its_own_files(opened, checkpoint, source, pp)
    uninterrupted = {e["iteration"]: e for e in train_events(runs / source)}
    resumed = train_events(tmp_path / "resumed")
    assert [e["iteration"] for e in resumed] == [4, 5]
    for event in resumed:
        reference = uninterrupted[event["iteration"]]
        for key in ("loss", "grad_norm", "lr"):
            assert rel_err(event[key], reference[key]) <= RTOL, (pp, key, event, reference)


def assert_reads_only_its_own_files(opened: list[list[str]], checkpoint: Path, source: str, pp: int) -> None:
    """In the 4-rank move (tp2 x pp2 -> tp1 x pp4) each rank opens only the files that hold its own parameters
    and the first rank's client state (4 to 9 of the tag's 18: 4 model-states, 14 layer files), plus its
    share (4-5) of the weights-only check of the tag's files; rank 0 alone looks through the tags. Every rank
    opened all 18, and the first rank's states three times more, when a rank read the whole checkpoint:
    .pt opens per rank [25, 25, 24, 24] then, [11, 13, 13, 8] now."""
    tag = next((checkpoint / "checkpoints").glob("iter_*"))
    checkpoint_files = sorted(p.name for p in tag.glob("*.pt"))
    per_rank = [sum(1 for path in files if path.endswith(".pt")) for files in opened]
    print(f"{source} -> tp1 x pp{pp}: .pt opens per rank {per_rank} of {len(checkpoint_files)} files in the tag")
    if (source, pp) == ("tp2-pp2", 4):
        share = -(-len(checkpoint_files) // pp)      # check_tag_files: every rank loads its share, weights-only
        assert max(per_rank) <= share + 10, per_rank
