"""Every layout change on resume is one path: the new run's ranks move the checkpoint (zoo.checkpoint.layout_change),
each rank reading only the files of the names it holds and holding at most its share plus the largest tensor.

One spawn of 4 ranks (dropout off):
  gpt2    ZeRO-1 fp32 at tp2 x dp2, 3 iterations, checkpoint at iteration 2;
  counted that checkpoint resumed at tp4 x dp1 (ZeRO-1) for iteration 3: every rank's move record (files opened,
          bytes of source tensors read, peak bytes held, share + largest tensor) and the resume line;
  dp4     that checkpoint, and a bf16 (BF16_Optimizer) ZeRO-1 tp2 x dp2 one, resumed at tp1 x dp4 (ZeRO-1) for
          iteration 3: each rank reads and holds only its own dp partition's elements;
  bert    BERT (pre-norm, SOP) at tp2 x dp2, 4 iterations, checkpoint at 2, resumed at tp1 x dp4 for 3 and 4;
  bad     on resume, the checkpoint missing a rank's file and the checkpoint resumed in bf16: one sentence each,
          the same on every rank, the same sentence the offline conversion gives (one check function), nothing
          written beside the source; launch/pretrain.py (one rank) prints the first as its one error line and
          exits 2.
Claims: no rank holds more than its share (12 bytes x the parameters it holds: fp32 master and two Adam moments,
the planner's accounting) plus the largest merged tensor, nor reads more bytes out of the files; a rank opens only
the source's files of its names;
the resume line says source and new layout, precision, tag, iteration, samples, seconds and the largest peak
with its rank; the BERT run continues the uninterrupted one within 1e-5 relative (fp32: only the reduction order
differs between layouts). Seen to fail: a move whose reader merged every name's master and moments before filling
any (as a one-process resharder holds them) held 3,210,752 bytes on every rank, 2.85x its bound of 1,127,552; a
reader that merged each name's whole tensor and sliced it read 2,380,800 bytes a rank (seen: 504,960 to 799,872).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.pretraining import run_config, train_events
from tests.helpers.random_corpus import MODEL, make_corpus
from tests.helpers.repo import REPO
from tests.helpers.zero_launch import rel
from tests.spawn import spawn

PARITY = 1e-5
BERT_MODEL = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
MISSING = "mp_rank_01_model_states.pt"
# ZeRO-1 tp2 x dp2 sources resumed at tp1 x dp4: run directory -> (source run, loss tolerance relative: fp32 differs
# between layouts only in the reduction order, bf16 in its rounding too)
ZERO_DP4 = {"counted-dp4": ("gpt2", PARITY), "bf16-dp4": ("gpt2-bf16", 2e-3)}


def gpt2_config(data, save, tp, iters, load=None, save_interval=0, bf16=False):
    config = run_config(data, save, tp, 2, 8, train_iters=iters, model_overrides=dict(MODEL), load=load,
                        save_interval=save_interval, data_workers=0)
    config.ds_config["zero_optimization"] = {"stage": 1}
    if bf16:
        config.ds_config["bf16"] = {"enabled": True}
    return config


def bert_config(data, save, tp, iters, load=None, save_interval=0):
    config = run_config(data, save, tp, 2, 8, train_iters=iters, model="bert-tiny", model_overrides=dict(BERT_MODEL),
                        load=load, save_interval=save_interval, data_workers=0)
    config.ds_config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 1, "warmup_max_lr": 1e-3,
                                                                         "total_num_steps": 10}}
    return config


def saved_copy(root: Path, run: str, name: str, rank: int, drop: str | None = None) -> Path:
    """``run``'s iteration-2 checkpoint as run directory ``name`` of its own (without file ``drop``)."""
    import torch.distributed as dist

    if rank == 0:
        tag = root / run / "checkpoints" / "iter_0000002"
        shutil.copytree(tag, root / name / "checkpoints" / tag.name)
        (root / name / "checkpoints" / "latest").write_text(tag.name)
        if drop:
            (root / name / "checkpoints" / tag.name / drop).unlink()
    dist.barrier()
    return root / name


def _runs(rank, world_size, gpt2_data, bert_data, root):
    os.environ["LOCAL_RANK"] = str(rank)
    from zoo.training import checkpointer
    from zoo.training.pretrain import pretrain

    root = Path(root)
    original_load, moved, weights_are_masters = checkpointer.Checkpointer.load, {}, {}

    def load_and_record(self, load, *args, **kwargs):
        if Path(self.config.save).name in ZERO_DP4:   # the source's first iterations may leave weights at their init:
            zero_weights(self.engine)                  # only the move can make these equal the masters
        client = original_load(self, load, *args, **kwargs)
        moved[self.config.save] = client.get("resharded_from")
        weights_are_masters[self.config.save] = masters_rounded(self.engine)
        return client

    checkpointer.Checkpointer.load = load_and_record   # this rank's process ends with the spawn
    pretrain(gpt2_config(gpt2_data, str(root / "gpt2"), 2, 3, save_interval=2))
    source = saved_copy(root, "gpt2", "gpt2-saved", rank)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(gpt2_config(gpt2_data, str(root / "counted"), 4, 3, load=str(source)))
    pretrain(gpt2_config(gpt2_data, str(root / "counted-dp4"), 1, 3, load=str(source)))
    pretrain(gpt2_config(gpt2_data, str(root / "gpt2-bf16"), 2, 3, save_interval=2, bf16=True))
    pretrain(gpt2_config(gpt2_data, str(root / "bf16-dp4"), 1, 3, load=str(saved_copy(root, "gpt2-bf16", "bf16-saved", rank)),
                         bf16=True))
    pretrain(bert_config(bert_data, str(root / "bert"), 2, 4, save_interval=2))
    pretrain(bert_config(bert_data, str(root / "bert-tp1"), 1, 4, load=str(saved_copy(root, "bert", "bert-saved", rank))))
    refused = {}
    for case, config in (
            ("missing", gpt2_config(gpt2_data, str(root / "bad-missing"), 4, 3,
                                    load=str(saved_copy(root, "gpt2", "gpt2-missing", rank, drop=MISSING)))),
            ("precision", gpt2_config(gpt2_data, str(root / "bad-precision"), 4, 3, load=str(source), bf16=True))):
        try:
            pretrain(config)
        except (ValueError, FileNotFoundError) as err:
            refused[case] = str(err)
    return {"counted": moved[str(root / "counted")], "bert": moved[str(root / "bert-tp1")], "out": out.getvalue(),
            "refused": refused, **{run: dict(moved[str(root / run)], weights_are_masters=weights_are_masters[str(root / run)])
                                   for run in ZERO_DP4}}


def zero_weights(engine) -> None:
    import torch

    with torch.no_grad():
        for param in engine.module.parameters():
            param.zero_()


def masters_rounded(engine) -> bool | None:
    """Whether every weight of a ZeRO/BF16 engine is its fp32 master (DeepSpeed's own accessor, collective over dp)
    in the weight's dtype, bit for bit (None without partitioned masters)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(engine.module.parameters())
    if not any(hasattr(param, "_hp_mapping") for param in params):
        return None
    return all(torch.equal(param.detach(), safe_get_full_fp32_param(param).to(param.dtype)) for param in params)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from zoo.data import preprocess_bert

    root = tmp_path_factory.mktemp("one_path")
    gpt2_data = make_corpus(root / "random")
    with gzip.open(REPO / "zoo" / "assets" / "corpora" / "wiki-sample.jsonl.gz", "rt") as src:
        (root / "small.jsonl").write_text("".join(next(src) for _ in range(12)))
    preprocess_bert([str(root / "small.jsonl")], str(root / "bert_small"), workers=1, progress=False)
    return root, spawn(_runs, 4, gpt2_data, str(root / "bert_small"), str(root), timeout=600), gpt2_data


# ----------------------------------------------------------------------------- what each rank read and held
def within_bound(record: dict) -> bool:
    """No rank held more than its share plus the largest merged tensor (``ranks``: per rank, in order, the
    seconds, peak bytes, share + largest tensor bytes, files, bytes read; zoo.checkpoint.layout_change.move_record)."""
    return all(peak <= bound for _, peak, bound, _, _ in record["ranks"])


def test_each_rank_holds_at_most_its_share_plus_the_largest_tensor(runs):
    root, per_rank, _ = runs
    records = [result["counted"] for result in per_rank]
    assert all(record["ranks"] == records[0]["ranks"] for record in records)   # agreed on every rank
    ranks = records[0]["ranks"]
    print("per rank (seconds, peak bytes, share + largest, files, bytes read):", ranks)
    assert len(ranks) == 4 and within_bound(records[0]), ranks
    for rank, (record, (_, peak, bound, files, bytes_read)) in enumerate(zip(records, ranks)):
        assert (record["peak_bytes"], record["files"], record["bytes_read"]) == (peak, files, bytes_read), rank
        assert 0 < peak and record["largest_bytes"] < bound, (rank, record)
        # tp2 x dp2 ZeRO-1 source: 2 model-states files and 2 x 2 partitions; every name of a rank at tp4 is in
        # both TP ranks' files, so a rank opens them all and no other
        assert files == 6, (rank, files)
        # only the ranges of its own slices (its share), and the whole of a shard straddling two partitions;
        # reading every name's whole merged tensors instead would be 2,380,800 bytes a rank here
        assert bytes_read <= record["share_bytes"] + record["largest_bytes"], (rank, bytes_read)
    assert records[0]["max_peak_bytes"] == max(peak for _, peak, _, _, _ in ranks)
    assert ranks[records[0]["peak_rank"]][1] == records[0]["max_peak_bytes"]


def test_the_resume_line_says_what_the_move_did(runs):
    _, per_rank, _ = runs
    record = per_rank[0]["counted"]
    line = next(line for line in per_rank[0]["out"].splitlines() if line.startswith("resumed from"))
    print(line)
    assert line.startswith("resumed from iter_0000002 (iteration 2, 16 samples consumed) at tp2×pp1×dp2 → "
                           "tp4×pp1×dp1: fp32 ZeRO-1 moved in "), line
    assert f"peak {record['max_peak_bytes']:,} bytes held (rank {record['peak_rank']}, whose share + largest tensor " \
           f"is {record['peak_rank_bound']:,}), at most 6 files and {record['max_bytes_read']:,} bytes read per rank" \
           in line, line
    assert not any(line.startswith("resumed from") for line in per_rank[1]["out"].splitlines())


# ----------------------------------------------------------------------------- ZeRO: each rank reads its partition
# The widest row of gpt2-tiny at tp1 (the MLP's output projection: 4 x 64 inputs): a rank copies whole rows of
# dimension 0, so at each end of its partition in each of the 2 optimizer groups it reads less than one row more
# than its fragment, for each of the 3 keys (fp32 master, 2 Adam moments) at 4 bytes.
ROW_SLACK = 2 * 2 * 256 * 12


@pytest.mark.parametrize("run", sorted(ZERO_DP4))
def test_under_zero_a_rank_reads_and_holds_only_its_dp_partition(runs, run):
    """tp2 x dp2 ZeRO-1 (fp32, and bf16: BF16_Optimizer) resumed at tp1 x dp4 (ZeRO-1): each rank's share is its
    flat fp32 partition (12 bytes per element, a quarter of the model's state at tp1, which is what a tp1 x dp1
    move reads); it reads that share (plus partial rows at its partition's ends) and holds at most one key's
    window of it at a time, plus where a source shard straddles two source partitions the copy of those rows.
    Right after the move every weight (zeroed before it) is its fp32 master in the weight's dtype, bit for bit
    (seen to fail when the low-precision weights are not gathered from the partitions), and the run continues
    the source run's iteration 3 (fp32: within 1e-5 relative; bf16: 2e-3, its rounding). Seen to fail on a move
    that copies each parameter's whole TP slice and keeps ZeRO's fragment: every rank read 2,242,560 bytes (the
    bound: 583,104; a tp1 x dp1 rank's share is 2,282,496) and held 884,736 (bound 388,736). Seen here: 530,688
    to 570,624 bytes read, 65,536 to 188,416 held."""
    from zoo.checkpoint.files import model_states_path, read_model_states
    from zoo.checkpoint.training_state import local_shapes

    root, per_rank, _ = runs
    source, tolerance = ZERO_DP4[run]
    first_path = model_states_path(root / "gpt2-saved" / "checkpoints" / "iter_0000002", 0)
    shapes = local_shapes(read_model_states(first_path)["model_config"], 1, first_path)
    whole = 12 * sum(shape.numel() for shape in shapes.values())   # a tp1 x dp1 rank's share: every element
    alignment_padding = 12 * 2 * 8   # each of 2 groups padded to a multiple of 2 x dp elements
    ranks = per_rank[0][run]["ranks"]
    print(f"{run} per rank (seconds, peak bytes, share + largest, files, bytes read):", ranks, "tp1 x dp1 share:",
          whole)
    for rank, result in enumerate(per_rank):
        record = result[run]
        assert (record["tensor_parallel_size"], record["data_parallel_size"], record["to_zero_stage"]) == (2, 2, 1)
        assert record["weights_are_masters"] is True, rank
        share, peak, read = record["share_bytes"], record["peak_bytes"], record["bytes_read"]
        quarter = whole / 4 + alignment_padding
        assert 0 < read <= quarter + ROW_SLACK, (rank, read, whole)
        assert 0 < peak <= 2 * (quarter + ROW_SLACK) / 3, (rank, peak, whole)
        assert share <= quarter and read <= share + ROW_SLACK, (rank, read, share)
    reference = [e for e in train_events(root / source) if e["iteration"] == 3]
    resumed = train_events(root / run)
    assert [e["iteration"] for e in resumed] == [3] and len(reference) == 1, resumed
    assert rel(resumed[0]["loss"], reference[0]["loss"]) <= tolerance, (resumed, reference)
    assert rel(resumed[0]["grad_norm"], reference[0]["grad_norm"]) <= tolerance, (resumed, reference)


# ----------------------------------------------------------------------------- BERT through the same path
def test_bert_tp2_resumes_at_tp1_and_continues_the_run(runs):
    root, per_rank, _ = runs
    record = per_rank[0]["bert"]
    assert (record["tensor_parallel_size"], record["data_parallel_size"], record["precision"]) == (2, 2, "fp32")
    reference = [e for e in train_events(root / "bert") if e["iteration"] > 2]
    resumed = train_events(root / "bert-tp1")
    assert [e["iteration"] for e in resumed] == [e["iteration"] for e in reference] == [3, 4], resumed
    for ours, theirs in zip(resumed, reference):
        assert rel(ours["loss"], theirs["loss"]) <= PARITY, (ours, theirs)
        assert rel(ours["grad_norm"], theirs["grad_norm"]) <= PARITY, (ours, theirs)
        assert ours["lr"] == theirs["lr"] and ours["consumed_samples"] == theirs["consumed_samples"]


# ----------------------------------------------------------------------------- bad cases on resume
def test_bad_cases_on_resume_are_the_offline_sentences_and_write_nothing(runs):
    from zoo.checkpoint.layout_change import check_layout_change

    root, per_rank, _ = runs
    refused = per_rank[0]["refused"]
    assert all(result["refused"] == refused for result in per_rank), [r["refused"] for r in per_rank]
    tag = root / "gpt2-missing" / "checkpoints" / "iter_0000002"
    assert refused["missing"] == (f"{tag / MISSING} is missing from checkpoint iter_0000002 (its zoo_complete.json "
                                  f"lists it); copy every file of the tag directory, or write an older complete tag "
                                  f"into {tag.parent / 'latest'}."), refused
    source = root / "gpt2-saved"
    with pytest.raises(ValueError) as err:
        check_layout_change(source / "checkpoints" / "iter_0000002", (2, 1), 4, "bf16", 1, f"--load {source}")
    assert refused["precision"] == str(err.value), refused
    assert "the optimizer's master weights would change type" in refused["precision"], refused
    for name in ("gpt2-saved", "gpt2-missing"):
        assert sorted(p.name for p in (root / name / "checkpoints").iterdir()) == ["iter_0000002", "latest"]
    for case in ("missing", "precision"):
        assert not (root / f"bad-{case}" / "checkpoints").exists(), case


def test_a_source_missing_a_rank_file_exits_2_from_the_script(runs):
    """launch/pretrain.py, one rank, resuming the checkpoint that lost mp_rank_01 with the source run's own
    settings (its config.json) at tp1: the same one sentence as an error line, exit code 2, nothing written."""
    from tests.spawn import free_port

    root, per_rank, corpus = runs
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "launch/pretrain.py", "--deepspeed_config", str(root / "gpt2" / "config.json"),
                           "--tensor-parallel-size", "1", "--data-path", corpus, "--save", str(root / "cli-missing"),
                           "--load", str(root / "gpt2-missing")], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {per_rank[0]['refused']['missing']}"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (root / "cli-missing" / "checkpoints").exists()


def test_which_resumes_move():
    """A move for another tp or pp, another dp of partitioned optimizer state, optimizer state in other files
    (another ZeRO stage, or ZeRO-3 on one side, which the check then refuses); DeepSpeed's own load for dp alone
    without partitions, and for ZeRO-3 on both sides at one layout."""
    from types import SimpleNamespace

    from zoo.checkpoint.layout_change import needs_layout_change
    from zoo.checkpoint.zero_reshard import PartitionFiles

    at = SimpleNamespace(tp_size=2, pp_size=1, dp_size=2)
    zero, bf16 = PartitionFiles("", 2, 2), PartitionFiles("bf16_", 2, 2)
    assert needs_layout_change((1, 1), at) and needs_layout_change((2, 2), at)
    assert not needs_layout_change((2, 1), at)                                   # dp 1 -> 2 without partitions
    assert not needs_layout_change((2, 1), at, zero, "zero_pp_rank", 1)
    assert needs_layout_change((2, 1), at, PartitionFiles("", 4, 2), "zero_pp_rank", 1)   # partitions over dp 4
    assert needs_layout_change((2, 1), at, zero, None, 1)                        # ZeRO-1 checkpoint, no ZeRO now
    assert needs_layout_change((2, 1), at, None, "zero_pp_rank", 0)              # and the other way round
    assert needs_layout_change((2, 1), at, zero, "bf16_zero_pp_rank", 1) and not needs_layout_change(
        (2, 1), at, bf16, "bf16_zero_pp_rank", 1)
    assert needs_layout_change((2, 1), at, zero, "stage3", 1) and needs_layout_change((2, 1), at, zero, None, 3)
    assert not needs_layout_change((2, 1), at, zero, "stage3", 3)
