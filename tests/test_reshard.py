"""Resuming a zoo DeepSpeed checkpoint at another tensor-parallel degree: the run's ranks move it
(zoo.checkpoint.layout_change), reading it in its layout-free form (zoo.checkpoint.training_state, over the
non-ZeRO optimizer readers of zoo.checkpoint.reshard).

* End to end: a tp=2 (x dp=2) run saved at iteration 2 resumes at tp=4 (x dp=1) and at tp=1 (x dp=4)
  through the ordinary ``load``; the next 5 iterations' loss, LR and grad norm equal the unmoved
  tp=2 continuation, and the checkpoints the resumed runs write carry DeepSpeed's step counts, the LR
  scheduler and the data position on from the source; nothing is written beside the source. One spawn of
  4 processes runs all three runs.
* Optimizer layouts without processes: fp32 (torch AdamW), fp16 unfused (per-parameter fp32 masters)
  and fp16 fused (flat fp32 masters and flat Adam state per group, loss scaler state) read back
  bit-exactly, and each tp=4 rank's slice is the tp=2 master re-sliced (vocabulary re-padded).
* Impossible layouts and incomplete checkpoints are one-sentence errors, with nothing written.

Tolerance: losses <= 1e-5 relative (fp32, dropout off; only the reduction order differs across tp);
resharded tensors are compared bit-exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.pretraining import run_config, train_events
from tests.helpers.random_corpus import MODEL, make_corpus
from tests.spawn import spawn

REL_TOL = 1e-5
TRAIN_ITERS, SAVED_AT = 7, 2


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def random_corpus_prefix(tmp_path_factory):
    """The random-token corpus of tests/helpers/random_corpus.py: its vocabulary (1100) is padded differently at
    tp 1, 2 and 4, so the move re-pads the embedding."""
    return make_corpus(tmp_path_factory.mktemp("corpus") / "random")


def _resume_at_other_tp_worker(rank, world_size, data_path, root):
    import torch.distributed as dist

    from zoo.training.pretrain import pretrain

    def config(tp, save, load=None):   # global batch 4 of micro-batches of 1: gas = 4 / dp
        return run_config(data_path, save, tp, 1, 4, train_iters=TRAIN_ITERS, model_overrides=dict(MODEL),
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
def resumed(random_corpus_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    spawn(_resume_at_other_tp_worker, 4, random_corpus_prefix, str(root))
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


def test_moved_state_carries_counters_scheduler_and_data_position(resumed):
    """The resumed runs' own last checkpoints (iteration 7) continue the source's counters: DeepSpeed's step
    counts, every Adam step, the LR scheduler and the data position; no copy is written beside the source."""
    from zoo.checkpoint.files import read_model_states

    checkpoints = resumed / "saved" / "checkpoints"
    source = read_model_states(checkpoints / f"iter_{SAVED_AT:07d}" / "mp_rank_00_model_states.pt")
    assert source["consumed_samples"] == SAVED_AT * 4 and source["lr_scheduler"]["last_batch_iteration"] == 1
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"iter_{SAVED_AT:07d}", "latest"]
    more = TRAIN_ITERS - SAVED_AT
    for tp in (4, 1):
        tag = resumed / f"tp{tp}" / "checkpoints" / f"iter_{TRAIN_ITERS:07d}"
        assert sorted(p.name for p in tag.glob("mp_rank_*")) == [f"mp_rank_{r:02d}_model_states.pt" for r in range(tp)]
        for rank in range(tp):
            states = read_model_states(tag / f"mp_rank_{rank:02d}_model_states.pt")
            assert states["tensor_parallel_size"] == states["mp_world_size"] == tp
            assert (states["global_steps"], states["global_samples"], states["skipped_steps"]) == (
                source["global_steps"] + more, source["global_samples"] + 4 * more, source["skipped_steps"]), tp
            assert states["lr_scheduler"]["last_batch_iteration"] == source["lr_scheduler"]["last_batch_iteration"] + more
            assert (states["iteration"], states["consumed_samples"]) == (TRAIN_ITERS, source["consumed_samples"] + 4 * more)
            steps = {float(entry["step"]) for entry in states["optimizer"]["state"].values()}
            assert steps == {float(TRAIN_ITERS)}, (tp, steps)


# ----------------------------------------------------------------------------- optimizer layouts, no processes
TINY = dict(vocab_size=1000, n_positions=16, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


def synthetic_checkpoint(tag_dir: Path, tp: int, kind: str) -> dict[str, dict[str, torch.Tensor]]:
    """A tp-sharded checkpoint in DeepSpeed's file layout with random weights, Adam moments and fp32 masters
    (zero in the vocab padding, as training leaves them) in the optimizer layout ``kind``; returns the
    masters (zoo layout, padded at tp) of each of them, by parameter name."""
    from zoo.checkpoint.layout import layout_model, optimizer_groups
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
        ds_config = {"train_batch_size": 4, **({"fp16": {"enabled": True}} if kind != "torch" else {})}
        torch.save({"module": module, "optimizer": optimizer, "lr_scheduler": {"last_batch_iteration": 4},
                    "ds_config": ds_config,
                    "global_steps": 5, "global_samples": 20, "skipped_steps": 1, "mp_world_size": tp,
                    "dp_world_size": 1, "zoo_model": "gpt2-tiny", "model_config": config.to_hf_dict(),
                    "tensor_parallel_size": tp, "iteration": 5, "consumed_samples": 20, "rng": {"python": rank}},
                   tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
    return masters


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


@pytest.mark.parametrize("kind", ["torch", "fp16_unfused", "fp16_fused"])
def test_optimizer_layouts_read_exactly(tmp_path, kind):
    """The layout-free reader gives back every written tensor (merged over the 2 TP ranks, padded at tp=2), the
    counters, hyper-parameters and loss scaler; each tp=4 rank's slice, read straight out of the tp=2 shards, is
    the tp=2 master re-padded and re-sliced."""
    from zoo.checkpoint.layout import layout_model
    from zoo.checkpoint.training_state import CheckpointTrainingState
    from zoo.models import GPT2Config
    from zoo.parallel.partition import partition_specs

    written = synthetic_checkpoint(tmp_path / "tp2", 2, kind)
    tp4 = dict(layout_model(GPT2Config(**TINY), 4).named_parameters())
    specs = partition_specs(layout_model(GPT2Config(**TINY), 2))
    state = CheckpointTrainingState(tmp_path / "tp2", 2, 1, wanted=set(specs))
    for which, key in (("weight" if kind == "torch" else "master", "master"), ("exp_avg", "exp_avg"),
                       ("exp_avg_sq", "exp_avg_sq")):
        for name, tensor in written[which].items():
            want = tensor.half() if which == "weight" else tensor
            got = state.master(name, specs[name], key)
            assert torch.equal(got, want), (which, name)
            for rank in range(4):
                at_tp4, merged_bytes = state.local(name, specs[name], key, tp4[name].shape, rank, 4)
                assert merged_bytes == 4 * got.numel(), name
                full = tensor[:TINY["vocab_size"]] if name == "transformer.wte.weight" else tensor
                expected = specs[name].shard(specs[name].repad(full, tp4[name].shape[0] * 4), rank, 4)
                assert torch.equal(at_tp4, (expected.half() if which == "weight" else expected).float()), (name, rank)
    assert {float(state.step(name)) for name in specs} == {5.0}
    assert (state.first["global_steps"], state.first["skipped_steps"], state.first["lr_scheduler"]) == (
        5, 1, {"last_batch_iteration": 4})
    assert [g["weight_decay"] for g in state.optimizer_groups()] == [0.01, 0.0]
    if kind != "torch":
        scaler = state.loss_scaler()
        assert (scaler["cur_scale"], scaler["cur_iter"], scaler["last_overflow_iter"]) == (512.0, 5, 3)


# ----------------------------------------------------------------------------- errors
def one_sentence(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message.rstrip().endswith("."), message
    return message


def test_impossible_layout_is_one_sentence(tmp_path):
    from zoo.checkpoint.layout_change import check_layout_change

    synthetic_checkpoint(tmp_path / "tp2", 2, "torch")
    with pytest.raises(ValueError, match=r"cannot be laid out at tp=8 \(n_head=4 is not divisible by tensor-parallel "
                                         r"size 8; use a tp degree that divides 4\)") as err:
        check_layout_change(tmp_path / "tp2", (2, 1), 8, None, None, "--load run")
    one_sentence(err)
    assert [p.name for p in tmp_path.iterdir()] == ["tp2"]


def test_missing_rank_file_and_zero_partitions_are_refused(tmp_path):
    from zoo.checkpoint.layout_change import check_layout_change

    synthetic_checkpoint(tmp_path / "tp2", 2, "torch")
    (tmp_path / "tp2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"zero_pp_rank_0_mp_rank_01_optim_states.pt is missing from a "
                                                r"tp=2 checkpoint partitioned over dp=1") as err:
        check_layout_change(tmp_path / "tp2", (2, 1), 4, None, None, "--load run")
    one_sentence(err)
    (tmp_path / "tp2" / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"mp_rank_01_model_states.pt is missing from a tp=2 checkpoint") as err:
        check_layout_change(tmp_path / "tp2", (2, 1), 4, None, None, "--load run")
    one_sentence(err)
    assert sorted(p.name for p in (tmp_path / "tp2").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]


@pytest.mark.parametrize("option", ["round_robin_gradients", "elastic_checkpoint"])
def test_zero_checkpoint_with_reordering_options_is_not_resharded(tmp_path, option):
    """DeepSpeed records the run's ds_config in the model states: a ZeRO checkpoint written with
    round_robin_gradients (parameters reordered across ranks) or elastic_checkpoint (optimizer state saved per
    parameter) is refused in one sentence before anything is moved."""
    from zoo.checkpoint.layout_change import check_layout_change
    from zoo.checkpoint.safe_load import safe_torch_load  # the loader zoo itself reads states with

    synthetic_checkpoint(tmp_path / "tp2", 2, "torch")
    for rank in range(2):
        path = tmp_path / "tp2" / f"mp_rank_{rank:02d}_model_states.pt"
        states = safe_torch_load(path, mmap=False)
        states["ds_config"] = {"train_batch_size": 2, "zero_optimization": {"stage": 1, option: True}}
        torch.save(states, path)
        (tmp_path / "tp2" / f"zero_pp_rank_0_mp_rank_{rank:02d}_optim_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"mp_rank_00_model_states.pt was written with zero_optimization.{option}: "
                                         r"true, whose partitions zoo cannot reshard; resume it at the tp x dp layout "
                                         r"it was written with") as err:
        check_layout_change(tmp_path / "tp2", (2, 1), 1, None, None, "--load run")
    one_sentence(err)
