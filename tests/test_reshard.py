"""Resuming a zoo DeepSpeed checkpoint at another tensor-parallel degree (zoo.checkpoint.reshard).

* End to end: a tp=2 (x dp=2) run saved at iteration 2 resumes at tp=4 (x dp=1) and at tp=1 (x dp=4)
  through the ordinary ``load``; the next 5 iterations' loss, LR and grad norm equal the un-resharded
  tp=2 continuation, and the resharded files carry DeepSpeed's step counts, the LR scheduler and the
  data position. One spawn of 4 processes runs all three runs.
* Optimizer layouts without processes: fp32 (torch AdamW), fp16 unfused (per-parameter fp32 masters)
  and fp16 fused (flat fp32 masters and flat Adam state per group, loss scaler state) survive
  tp 2 -> 4 -> 2 bit-exactly, and the tp=4 masters are the tp=2 ones re-sliced.
* Impossible layouts and incomplete checkpoints are one-sentence errors, with nothing written.

Tolerance: losses <= 1e-5 relative (fp32, dropout off; only the reduction order differs across tp);
resharded tensors are compared bit-exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.spawn import spawn
from tests.test_pretrain import run_config, train_events

REL_TOL = 1e-5
VOCAB = 1100   # padded to 1152 at tp=1, 1280 at tp=2, 1536 at tp=4: the padding changes with tp
NO_DROPOUT = dict(vocab_size=VOCAB, n_layer=2, n_embd=64, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
TRAIN_ITERS, SAVED_AT = 7, 2


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def corpus_prefix(tmp_path_factory):
    """A small random-token corpus of a ``VOCAB``-token vocabulary in the indexed format."""
    import numpy as np

    from zoo.data.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path_factory.mktemp("corpus") / "random"
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, vocab_size=VOCAB) as builder:
        for _ in range(24):
            builder.add_document(rng.integers(0, VOCAB, size=100))
    return str(prefix)


def _resume_at_other_tp_worker(rank, world_size, data_path, root):
    import torch.distributed as dist

    from zoo.training.pretrain import pretrain

    def config(tp, save, load=None):   # global batch 4 of micro-batches of 1: gas = 4 / dp
        return run_config(data_path, save, tp, 1, 4, train_iters=TRAIN_ITERS, model_overrides=dict(NO_DROPOUT),
                          save_interval=0 if load else SAVED_AT, load=load)

    pretrain(config(2, f"{root}/tp2"))   # the un-resharded run: saved at iteration 2, continued to 7
    if rank == 0:   # the iteration-2 checkpoint as its own run directory, 'latest' naming it
        source = Path(root, "tp2", "checkpoints", f"iter_{SAVED_AT:07d}")
        target = Path(root, "saved", "checkpoints")
        shutil.copytree(source, target / source.name)
        (target / "latest").write_text(source.name)
    dist.barrier()
    pretrain(config(4, f"{root}/tp4", load=f"{root}/saved"))
    pretrain(config(1, f"{root}/tp1", load=f"{root}/saved"))


@pytest.fixture(scope="module")
def resumed(corpus_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    spawn(_resume_at_other_tp_worker, 4, corpus_prefix, str(root))
    return root


def test_resume_at_tp4_and_tp1_continues_the_tp2_run(resumed):
    reference = [e for e in train_events(resumed / "tp2") if e["iteration"] > SAVED_AT]
    assert [e["iteration"] for e in reference] == list(range(SAVED_AT + 1, TRAIN_ITERS + 1))
    for tp in (4, 1):
        events = train_events(resumed / f"tp{tp}")
        assert [e["iteration"] for e in events] == [e["iteration"] for e in reference], tp
        for ours, theirs in zip(events, reference):
            assert rel(ours["loss"], theirs["loss"]) <= REL_TOL, (tp, ours, theirs)
            assert rel(ours["grad_norm"], theirs["grad_norm"]) <= REL_TOL, (tp, ours, theirs)
            assert ours["lr"] == theirs["lr"] and ours["consumed_samples"] == theirs["consumed_samples"], tp


def test_resharded_files_carry_counters_scheduler_and_data_position(resumed):
    from zoo.checkpoint.files import read_model_states

    checkpoints = resumed / "saved" / "checkpoints"
    source = read_model_states(checkpoints / f"iter_{SAVED_AT:07d}" / "mp_rank_00_model_states.pt")
    for tp in (4, 1):
        copy = checkpoints / "resharded" / f"iter_{SAVED_AT:07d}-tp{tp}"
        assert sorted(p.name for p in copy.glob("mp_rank_*")) == [f"mp_rank_{r:02d}_model_states.pt" for r in range(tp)]
        for rank in range(tp):
            states = read_model_states(copy / f"mp_rank_{rank:02d}_model_states.pt")
            assert states["tensor_parallel_size"] == states["mp_world_size"] == tp
            assert states["resharded_from"]["tensor_parallel_size"] == 2
            for key in ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "iteration",
                        "consumed_samples"):
                assert states[key] == source[key], (tp, key)
            steps = {float(entry["step"]) for entry in states["optimizer"]["state"].values()}
            assert steps == {float(SAVED_AT)}, (tp, steps)
    assert source["consumed_samples"] == SAVED_AT * 4 and source["lr_scheduler"]["last_batch_iteration"] == 1


# ----------------------------------------------------------------------------- optimizer layouts, no processes
TINY = dict(vocab_size=1000, n_positions=16, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


def synthetic_checkpoint(tag_dir: Path, tp: int, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """A tp-sharded checkpoint in DeepSpeed's file layout with random weights, Adam moments and fp32 masters
    (zero in the vocab padding, as training leaves them) in the optimizer layout ``kind``; returns the
    masters (zoo layout, padded at tp) of each of them, by parameter name."""
    from zoo.checkpoint.layout import layout_model, optimizer_groups
    from zoo.checkpoint.reshard import flatten
    from zoo.models import GPT2Config
    from zoo.parallel import is_tensor_parallel
    from zoo.parallel.utils import shard_tensor

    config = GPT2Config(**TINY)
    layout = layout_model(config, tp)
    groups = optimizer_groups(layout)
    generator = torch.Generator().manual_seed(3)
    masters: dict[str, dict[str, torch.Tensor]] = {"weight": {}, "exp_avg": {}, "exp_avg_sq": {}, "master": {}}
    for name, param in layout.named_parameters():
        shape = list(param.shape)
        if is_tensor_parallel(param):
            shape[param.partition_dim] *= tp
        for which in masters:
            tensor = torch.randn(shape, generator=generator)
            if name == "transformer.wte.weight":
                tensor[config.vocab_size:] = 0
            masters[which][name] = tensor.abs() if which == "exp_avg_sq" else tensor

    def local(which, name, rank):
        param = layout.get_parameter(name)
        full = masters[which][name]
        if not is_tensor_parallel(param):
            return full.clone()
        return shard_tensor(full, param.partition_dim, rank, tp, getattr(param, "partition_stride", 1)).clone()

    tag_dir.mkdir(parents=True)
    names = [n for g in groups for n in g]
    for rank in range(tp):
        module = {name: local("weight", name, rank).half() for name, _ in layout.named_parameters()}
        hyper = [{"lr": 1e-3, "weight_decay": wd, "betas": (0.9, 0.999), "eps": 1e-8} for wd in (0.01, 0.0)]
        if kind == "fp16_fused":
            state = {g: {"step": 5, **{w: flatten([local(w, n, rank) for n in group]) for w in ("exp_avg", "exp_avg_sq")}}
                     for g, group in enumerate(groups)}
            inner = {"state": state, "param_groups": [{**h, "params": [g]} for g, h in enumerate(hyper)]}
        else:
            state = {i: {"step": torch.tensor(5.0), "exp_avg": local("exp_avg", n, rank),
                         "exp_avg_sq": local("exp_avg_sq", n, rank)} for i, n in enumerate(names)}
            sizes = [len(g) for g in groups]
            inner = {"state": state, "param_groups": [{**hyper[0], "params": list(range(sizes[0]))},
                                                      {**hyper[1], "params": list(range(sizes[0], sum(sizes)))}]}
        optimizer = inner
        if kind != "torch":
            optimizer = {"dynamic_loss_scale": True, "cur_scale": 512.0, "cur_iter": 5, "last_overflow_iter": 3,
                         "scale_factor": 2.0, "scale_window": 1000, "optimizer_state_dict": inner, "clip_grad": 1.0}
            if kind == "fp16_fused":
                optimizer["fp32_groups_flat"] = [flatten([local("master", n, rank) for n in g]) for g in groups]
            else:
                optimizer["fp32_groups"] = [[local("master", n, rank) for n in g] for g in groups]
        torch.save({"module": module, "optimizer": optimizer, "lr_scheduler": {"last_batch_iteration": 4},
                    "global_steps": 5, "global_samples": 20, "skipped_steps": 1, "mp_world_size": tp,
                    "dp_world_size": 1, "zoo_model": "gpt2-tiny", "model_config": config.to_hf_dict(),
                    "tensor_parallel_size": tp, "iteration": 5, "consumed_samples": 20, "rng": {"python": rank}},
                   tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
    return masters


def read_optimizer_masters(tag_dir: Path, tp: int, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """The merged masters (padding cut) of weights, Adam moments and fp32 masters of a checkpoint."""
    from zoo.checkpoint.deepspeed_export import merged_master
    from zoo.checkpoint.files import read_model_states
    from zoo.checkpoint.layout import layout_model
    from zoo.checkpoint.reshard import OptimizerResharder, TensorResharder
    from zoo.models import GPT2Config

    config = GPT2Config(**TINY)
    states = [read_model_states(tag_dir / f"mp_rank_{r:02d}_model_states.pt") for r in range(tp)]
    layout = layout_model(config, tp)
    reader = OptimizerResharder(TensorResharder(config, tp, tp, tag_dir))
    read = [reader.by_name(s["optimizer"], tag_dir) for s in states]
    out: dict[str, dict[str, torch.Tensor]] = {"weight": {}, "exp_avg": {}, "exp_avg_sq": {}, "master": {}}
    for name, _ in layout.named_parameters():
        out["weight"][name] = merged_master(layout, name, [s["module"][name] for s in states])
        for which in ("exp_avg", "exp_avg_sq"):
            out[which][name] = merged_master(layout, name, [r[0][name][which] for r in read])
        if kind != "torch":
            out["master"][name] = merged_master(layout, name, [r[1][name] for r in read])
    for which in out:
        if "transformer.wte.weight" in out[which]:
            out[which]["transformer.wte.weight"] = out[which]["transformer.wte.weight"][:TINY["vocab_size"]]
    return out


@pytest.mark.parametrize("kind", ["torch", "fp16_unfused", "fp16_fused"])
def test_optimizer_layouts_reshard_exactly(tmp_path, kind):
    from zoo.checkpoint.files import read_model_states
    from zoo.checkpoint.reshard import reshard_checkpoint

    written = synthetic_checkpoint(tmp_path / "tp2", 2, kind)
    expected = {which: {name: (t[:TINY["vocab_size"]] if name == "transformer.wte.weight" else t)
                        for name, t in by_name.items()} for which, by_name in written.items()}
    reshard_checkpoint(tmp_path / "tp2", 4, tmp_path / "tp4")
    reshard_checkpoint(tmp_path / "tp4", 2, tmp_path / "back")
    for tag, tp in (("tp4", 4), ("back", 2)):
        merged = read_optimizer_masters(tmp_path / tag, tp, kind)
        for which in ("weight", "exp_avg", "exp_avg_sq") + (("master",) if kind != "torch" else ()):
            for name, tensor in expected[which].items():
                want = tensor.half() if which == "weight" else tensor
                assert torch.equal(merged[which][name], want), (tag, which, name)
        states = read_model_states(tmp_path / tag / "mp_rank_01_model_states.pt")
        assert (states["global_steps"], states["skipped_steps"], states["lr_scheduler"]) == (5, 1, {"last_batch_iteration": 4})
        if kind != "torch":
            optimizer = states["optimizer"]
            assert (optimizer["cur_scale"], optimizer["cur_iter"], optimizer["last_overflow_iter"]) == (512.0, 5, 3)
            inner = optimizer["optimizer_state_dict"]
            assert [g["weight_decay"] for g in inner["param_groups"]] == [0.01, 0.0]
    original = read_model_states(tmp_path / "tp2" / "mp_rank_00_model_states.pt")["module"]
    back = read_model_states(tmp_path / "back" / "mp_rank_00_model_states.pt")["module"]
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_copy_of_an_earlier_resharder_is_written_again(tmp_path):
    """A resharded copy whose record lacks this resharder's format (as copies written before the ZeRO step fix
    do) is not reused: ensure_resharded replaces it; a current copy is reused as it is."""
    import json

    from zoo.checkpoint.reshard import SOURCE_RECORD, ensure_resharded

    synthetic_checkpoint(tmp_path / "tp2", 2, "torch")
    out = ensure_resharded(tmp_path / "tp2", 4, tmp_path / "tp4")
    record = out / SOURCE_RECORD
    written = record.stat().st_mtime_ns
    assert ensure_resharded(tmp_path / "tp2", 4, tmp_path / "tp4") == out and record.stat().st_mtime_ns == written
    old = json.loads(record.read_text())
    del old["format"]
    record.write_text(json.dumps(old))
    ensure_resharded(tmp_path / "tp2", 4, tmp_path / "tp4")
    assert "format" in json.loads(record.read_text())


# ----------------------------------------------------------------------------- errors
def one_sentence(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message.rstrip().endswith("."), message
    return message


def test_impossible_layout_is_one_sentence(tmp_path):
    from zoo.checkpoint.reshard import reshard_checkpoint

    synthetic_checkpoint(tmp_path / "tp2", 2, "torch")
    with pytest.raises(ValueError, match=r"cannot be laid out at tp=8 \(n_head=4 is not divisible by tensor-parallel "
                                         r"size 8; use a tp degree that divides 4\)") as err:
        reshard_checkpoint(tmp_path / "tp2", 8, tmp_path / "tp8")
    one_sentence(err)
    assert not (tmp_path / "tp8").exists() and [p.name for p in tmp_path.iterdir()] == ["tp2"]


def test_missing_rank_file_and_zero_partitions_are_refused(tmp_path):
    from zoo.checkpoint.reshard import reshard_checkpoint

    synthetic_checkpoint(tmp_path / "tp2", 2, "torch")
    (tmp_path / "tp2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"keeps its optimizer state in ZeRO/BF16 partitions over dp=1; pass the new "
                                         r"data-parallel degree") as err:
        reshard_checkpoint(tmp_path / "tp2", 4, tmp_path / "tp4")
    one_sentence(err)
    (tmp_path / "tp2" / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"mp_rank_01_model_states.pt is missing from a tp=2 checkpoint") as err:
        reshard_checkpoint(tmp_path / "tp2", 4, tmp_path / "tp4")
    one_sentence(err)
    assert not (tmp_path / "tp4").exists()


@pytest.mark.parametrize("option", ["round_robin_gradients", "elastic_checkpoint"])
def test_zero_checkpoint_with_reordering_options_is_not_resharded(tmp_path, option):
    """DeepSpeed records the run's ds_config in the model states: a ZeRO checkpoint written with
    round_robin_gradients (parameters reordered across ranks) or elastic_checkpoint (optimizer state saved per
    parameter) is refused in one sentence before anything is written."""
    from zoo.checkpoint.reshard import reshard_checkpoint

    synthetic_checkpoint(tmp_path / "tp2", 2, "torch")
    for rank in range(2):
        path = tmp_path / "tp2" / f"mp_rank_{rank:02d}_model_states.pt"
        from zoo.checkpoint.safe_load import safe_torch_load  # the loader zoo itself reads states with
        states = safe_torch_load(path, mmap=False)
        states["ds_config"] = {"train_batch_size": 2, "zero_optimization": {"stage": 1, option: True}}
        torch.save(states, path)
        (tmp_path / "tp2" / f"zero_pp_rank_0_mp_rank_{rank:02d}_optim_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"mp_rank_00_model_states.pt was written with zero_optimization.{option}: "
                                         r"true, whose partitions zoo cannot reshard; resume it at the tp x dp layout "
                                         r"it was written with") as err:
        reshard_checkpoint(tmp_path / "tp2", 1, tmp_path / "tp1", new_dp=2)
    one_sentence(err)
    assert not (tmp_path / "tp1").exists()
