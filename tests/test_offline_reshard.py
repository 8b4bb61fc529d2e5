"""``launch/reshard.py`` (zoo.training.offline_reshard): a checkpoint converted offline to another layout resumes
there with exactly the state the on-resume move gives, and without a second move; every bad case is one sentence,
exit code 2 and nothing written.

One spawn of 2 ranks (tests/helpers/precision_launch.py, shared with tests/test_layout_change_precisions.py) trains
bf16 + ZeRO-1 (BF16_Optimizer) at tp1 x pp2 (dropout off), keeps its iteration-2 checkpoint as the latest, then
  (a) resumes that checkpoint at tp2 x pp1 (the on-resume move, zoo.checkpoint.layout_change) for iterations 3, 4;
  (b) converts it offline to tp2 x pp1 x dp1 (into the default <run>-tp2pp1dp1 beside it);
  (c) resumes the converted run at tp2 x pp1 for iterations 3 and 4;
then, one stage on both sides, converts that run's iteration-4 checkpoint (tp2 x dp1) to tp1 x dp2 and resumes it,
against the on-resume move from the same checkpoint.
Claims: right after loading, every rank's fp32 masters and Adam moments (read through DeepSpeed's accessors) in (c)
equal those in (a) exactly (torch.equal), (c)'s client state records no move while (a)'s does, (c)'s losses and grad
norms of iterations 3 and 4 equal (a)'s exactly (same weights, same reseeded streams, same layout), and the source run's
files are unchanged (names, sizes and mtimes); for the one-stage move, the masters and moments equal the on-resume
move's exactly and the converted run is resumed without a move.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.layout_change_runs import KEYS
from tests.helpers.precision_launch import ON_RESUME, precision_runs
from tests.helpers.pretraining import train_events


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The shared spawn's root and each rank's results of the conversion (tests/helpers/precision_launch.py: the
    bf16 tp1 x pp2 source and its on-resume move to tp2 x pp1 are the runs tests/test_layout_change_precisions.py
    checks)."""
    root, per_rank = precision_runs(tmp_path_factory)
    return root, [result["offline"] for result in per_rank]


def test_converted_checkpoint_resumes_with_the_on_resume_moves_state_and_no_second_move(runs):
    root, per_rank = runs
    for rank, result in enumerate(per_rank):
        assert result["output"] == str(root / "source-tp2pp1dp1"), result["output"]
        assert result["source_unchanged"], rank
        (moved, moved_flag), (converted, converted_flag) = result["on_resume"], result["converted"]
        assert moved_flag and not converted_flag, (rank, moved_flag, converted_flag)
        for key in KEYS:
            assert moved[key] and set(moved[key]) == set(converted[key]), (rank, key)
            for name, want in moved[key].items():
                assert torch.equal(converted[key][name], want), (rank, key, name)
    assert per_rank[0]["record"]["tag"] == "iter_0000002" and per_rank[0]["record"]["iteration"] == 2
    converted_dir = root / "source-tp2pp1dp1"
    written = per_rank[0]["written"]
    assert written["latest"] == "iter_0000002", written
    assert "mp_rank_01_model_states.pt" in written["files"] and not any("layer_" in f for f in written["files"]), written
    assert not list(root.glob(".source-tp2pp1dp1.tmp-*")), "staging directory left behind"
    for rank, result in enumerate(per_rank):   # one stage on both sides: the on-resume move's state, no second move
        (moved, _), (converted, converted_flag) = (result["one_stage"]["one-stage-on-resume"],
                                                   result["one_stage"]["one-stage-converted"])
        assert not converted_flag, rank
        for key in KEYS:
            assert moved[key] and set(moved[key]) == set(converted[key]), (rank, key)
            for name, want in moved[key].items():
                assert torch.equal(converted[key][name], want), (rank, key, name)
    reference, resumed = train_events(root / ON_RESUME), train_events(converted_dir)
    assert [e["iteration"] for e in resumed] == [3, 4] == [e["iteration"] for e in reference], (resumed, reference)
    for got, want in zip(resumed, reference):
        assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"]), (got, want)


def run_cli(argv, monkeypatch, capsys, world_size):
    from zoo.cli.reshard import main

    for name in ("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return exit_info.value.code, err


def broken_copy(root: Path, name: str, missing: str) -> Path:
    copy = root / name
    if not copy.exists():
        shutil.copytree(root / "source", copy, ignore=shutil.ignore_patterns("metrics.jsonl", "*.png"))
        (copy / "checkpoints" / "iter_0000002" / missing).unlink()
    return copy


BAD_CASES = {
    "missing model states": (lambda root: broken_copy(root, "no-mp01", "mp_rank_01_model_states.pt"), 2, [], 2,
                             "mp_rank_01_model_states.pt is missing"),
    "missing partition": (lambda root: broken_copy(root, "no-part01", "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"),
                          2, [], 2, "optim_states.pt is missing"),
    "heads": (lambda root: root / "source", 3, [], 3, "n_head=4 is not divisible by tensor-parallel size 3"),
    "zero-3": (lambda root: root / "source", 2, ["--zero-stage", "3"], 2, "ZeRO-3"),
    "precision": (lambda root: root / "source", 2, ["--precision", "fp16"], 2,
                  "the fp16 loss scaler would restart at the config's initial scale; drop --precision"),
    "world size": (lambda root: root / "source", 2, ["--data-parallel-size", "1"], 4, "this job has 4 ranks but the new layout"),
    "same layout": (lambda root: root / "source", 1, ["--pipeline-model-parallel-size", "2"], 2, "is already at"),
    "non-empty output": (lambda root: root / "source", 2, ["--out", "{root}/taken"], 2, "exists and is not empty"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_case_is_one_sentence_exit_2_and_nothing_written(runs, case, monkeypatch, capsys):
    root, _ = runs
    source_of, tp, extra, world_size, words = BAD_CASES[case]
    source = source_of(root)
    (root / "taken").mkdir(exist_ok=True)
    (root / "taken" / "keep.txt").write_text("mine")
    before = {str(p) for p in root.rglob("*")}
    argv = ["--load", str(source), "--tensor-parallel-size", str(tp)] + [a.format(root=root) for a in extra]
    code, err = run_cli(argv, monkeypatch, capsys, world_size)
    assert code == 2, (case, err)
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (case, err)
    assert {str(p) for p in root.rglob("*")} == before, case
    assert (root / "taken" / "keep.txt").read_text() == "mine"
