"""``launch/reshard.py`` (zoo.training.offline_reshard): a checkpoint converted offline to another layout resumes
there with exactly the state the on-resume move gives, and without a second move; every bad case is one sentence,
exit code 2 and nothing written.

One spawn of 2 ranks trains bf16 + ZeRO-1 (BF16_Optimizer) at tp1 x pp2 for 2 iterations (dropout off), then
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

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.layout_change_runs import ITERS, KEYS, engine_state, precision_run_config
from tests.helpers.pretraining import train_events
from tests.helpers.random_corpus import make_corpus
from tests.spawn import spawn

SOURCE_TP, SOURCE_PP, NEW_TP, NEW_PP = 1, 2, 2, 1


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _runs(rank, world_size, data, root):
    os.environ["LOCAL_RANK"] = str(rank)
    import torch.distributed as dist

    from zoo.training import checkpointer
    from zoo.training.offline_reshard import convert_checkpoint, plan_conversion
    from zoo.training.pretrain import pretrain

    root = Path(root)
    source = root / "source"
    pretrain(precision_run_config(data, str(source), SOURCE_TP, SOURCE_PP, "bf16"))   # 4 iterations, saved at 2, 4
    if rank == 0:   # the iteration-2 checkpoint as the run's latest
        (source / "checkpoints" / "latest").write_text("iter_0000002")
        shutil.rmtree(source / "checkpoints" / "iter_0000004")
    dist.barrier()
    before = snapshot(source)
    original_load, loaded = checkpointer.Checkpointer.load, {}

    def load_and_record(self, load, *args, **kwargs):
        client = original_load(self, load, *args, **kwargs)
        loaded[self.config.save] = (engine_state(self.engine), "resharded_from" in client)
        return client

    checkpointer.Checkpointer.load = load_and_record   # this rank's process ends with the spawn
    on_resume = root / "on-resume"
    pretrain(precision_run_config(data, str(on_resume), NEW_TP, NEW_PP, "bf16", load=str(source)))
    plan = plan_conversion(str(source), NEW_TP, NEW_PP, None, None, None, None, world_size)
    record = convert_checkpoint(plan)
    converted = root / "source-tp2pp1dp1"
    written = {"latest": (converted / "checkpoints" / "latest").read_text().strip(),
               "files": sorted(p.name for p in (converted / "checkpoints" / "iter_0000002").iterdir())}
    pretrain(precision_run_config(data, str(converted), NEW_TP, NEW_PP, "bf16", load=str(converted)))
    # one stage on both sides, tp2 x dp1 -> tp1 x dp2: the offline tool against the on-resume move
    one_stage = {}
    for name in ("one-stage-on-resume", "one-stage-converted"):
        out = root / name
        if name == "one-stage-converted":
            convert_checkpoint(plan_conversion(str(converted), 1, 1, 2, None, None, str(out), world_size))
        load = out if name == "one-stage-converted" else converted
        cfg = precision_run_config(data, str(out), 1, 1, "bf16", load=str(load))
        cfg.train_iters = ITERS + 1
        pretrain(cfg)
        one_stage[name] = loaded[str(out)]
    return {"one_stage": one_stage, "on_resume": loaded[str(on_resume)], "converted": loaded[str(converted)], "record": record,
            "output": str(plan.output), "written": written, "source_unchanged": snapshot(source) == before}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline")
    corpus = make_corpus(root / "random")
    return root, spawn(_runs, 2, corpus, str(root))


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
    reference, resumed = train_events(root / "on-resume"), train_events(converted_dir)
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
