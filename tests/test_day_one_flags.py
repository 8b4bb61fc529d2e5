"""A Megatron user's first hour: their training flags override the ds_config (one rule, in --help) with the
schedule kept consistent, the run shows and keeps its effective settings, a paper-scale config without
--data-path and a run that cannot fit are refused before DeepSpeed is imported (the fit check reads its
memory figure from an argument: a stub here), and a ds_config path with a typo names the closest file.

Everything runs in the pytest process except one subprocess (that no DeepSpeed module is imported before
the refusals) and one 2-rank run (the flags reach DeepSpeed's optimizer; the writer alone prints the block
and writes config.json). Learning rates are compared with rel 1e-12 (float arithmetic of one ratio and one
product: a few ulps).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.checks import one_error_line
from tests.helpers.pretraining import TINY_MODEL, ds_config
from tests.spawn import spawn

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "ds_configs" / "cpu_demo.json"
BERT_DEMO = REPO / "ds_configs" / "bert_cpu_demo.json"
REL = 1e-12


def load(path=DEMO, *flags: str, block: dict | None = None, tmp_path: Path | None = None):
    """The RunConfig of ``path`` (its zoo block updated by ``block``) under the command line ``flags``."""
    from zoo.cli.pretrain import build_parser
    from zoo.config.loading import load_run_config

    if block is not None:
        content = json.loads(Path(path).read_text())
        content["zoo"].update(block)
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(content))
    return load_run_config(build_parser().parse_args(["--deepspeed_config", str(path), *flags]))


def tiny_corpus(prefix: Path, lengths=(40, 60, 100)) -> str:
    """An indexed dataset of one document per length (token ids 0..n-1)."""
    from zoo.data.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix, vocab_size=50257)
    for n in lengths:
        builder.add_document(np.arange(n))
    return builder.finalize()


# ----------------------------------------------------------------------------------------- the flags
def test_megatron_flags_rewrite_the_ds_config():
    config = load(DEMO, "--lr", "3e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "7", "--micro-batch-size", "2",
                  "--global-batch-size", "16", "--bf16", "--clip-grad", "0.5", "--weight-decay", "0.1")
    ds = config.ds_config
    assert ds["optimizer"]["params"]["lr"] == 3e-4 and ds["optimizer"]["params"]["weight_decay"] == 0.1
    params = ds["scheduler"]["params"]
    assert params["warmup_num_steps"] == 7
    assert math.isclose(params["cos_min_ratio"] * 3e-4, 1e-5, rel_tol=REL)
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (2, 16)
    assert ds["bf16"] == {"enabled": True} and config.dtype_name == "bf16"
    assert ds["gradient_clipping"] == 0.5


def test_lr_alone_keeps_the_files_floor_and_warmup_start():
    """cpu_demo.json: lr 2e-3, cos_min_ratio 0.1 (a floor of 2e-4). --lr 1e-3 keeps the floor at 2e-4."""
    params = load(DEMO, "--lr", "1e-3").ds_config["scheduler"]["params"]
    assert math.isclose(params["cos_min_ratio"] * 1e-3, 2e-4, rel_tol=REL)
    assert params["warmup_min_ratio"] == 0.0


def test_precedence_flag_over_block_over_ds_config(tmp_path):
    block = {"lr": 1e-3, "bf16": True, "micro_batch_size": 2}
    from_block = load(DEMO, block=block, tmp_path=tmp_path)
    assert from_block.ds_config["optimizer"]["params"]["lr"] == 1e-3          # the block over the file's 2e-3
    assert from_block.ds_config["train_micro_batch_size_per_gpu"] == 2 and from_block.dtype_name == "bf16"
    flagged = load(DEMO, "--lr", "5e-4", "--fp16", block=block, tmp_path=tmp_path)
    assert flagged.ds_config["optimizer"]["params"]["lr"] == 5e-4             # the flag over the block
    assert flagged.dtype_name == "fp16" and not flagged.ds_config.get("bf16", {}).get("enabled")
    assert load(DEMO).ds_config["optimizer"]["params"]["lr"] == 0.002          # neither: the file's


def test_help_states_the_one_rule():
    from zoo.cli.pretrain import build_parser

    text = " ".join(build_parser().format_help().split())
    assert ("a flag given on the command line overrides the ds_config's zoo block, which overrides the ds_config's "
            "own DeepSpeed values") in text
    listed = {word for word in build_parser().format_help().split() if word.startswith("--")}
    assert {"--lr", "--min-lr", "--lr-warmup-iters", "--micro-batch-size", "--global-batch-size", "--fp16", "--bf16",
            "--clip-grad", "--weight-decay", "--skip-fit-check"} <= listed


def test_warmup_decay_takes_absolute_rates():
    params = load(BERT_DEMO, "--lr", "5e-4", "--min-lr", "1e-5").ds_config["scheduler"]["params"]
    assert (params["warmup_max_lr"], params["warmup_min_lr"]) == (5e-4, 1e-5)


def test_overrides_applied_twice_change_nothing():
    from zoo.config.deepspeed_overrides import apply_overrides

    config = load(DEMO, "--lr", "7e-4", "--min-lr", "3e-5", "--global-batch-size", "16", "--fp16")
    once = json.dumps(config.ds_config, sort_keys=True)
    assert json.dumps(apply_overrides(config).ds_config, sort_keys=True) == once


def expected_rate(kind: str, k: int, peak=4e-4, floor=2e-5, warmup=5, total=20) -> float:
    """The learning rate after step k of the schedule --lr 4e-4 --min-lr 2e-5 --lr-warmup-iters 5
    --train-iters 20 asks for, as DeepSpeed defines its linear warm-up, cosine and linear decays."""
    if kind == "WarmupCosineLR":
        if k < warmup:
            return peak * k / warmup                          # warmup_min_ratio 0: from 0
        progress = min(1.0, (k - warmup + 1) / (total - warmup))
        return floor + (peak - floor) * (1 + math.cos(math.pi * progress)) / 2
    if k < warmup:
        return floor + (peak - floor) * k / warmup            # WarmupDecayLR warms up from its floor
    return floor + (peak - floor) * max(0.0, (total - k) / (total - warmup))


def test_deepspeed_runs_the_schedule_the_flags_ask_for():
    """DeepSpeed's own WarmupCosineLR / WarmupDecayLR, built from the dict deepspeed.initialize gets, follow
    the schedule of --lr, --min-lr, --lr-warmup-iters and --train-iters step for step, ending at --min-lr."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR

    from zoo.config.deepspeed_dict import deepspeed_dict

    for path, scheduler in ((DEMO, WarmupCosineLR), (BERT_DEMO, WarmupDecayLR)):
        config = load(path, "--lr", "4e-4", "--min-lr", "2e-5", "--lr-warmup-iters", "5", "--train-iters", "20")
        ds = deepspeed_dict(config, 1)
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=ds["optimizer"]["params"]["lr"])
        schedule = scheduler(optimizer, **ds["scheduler"]["params"])
        rates = []
        for _ in range(21):
            schedule.step()
            rates.append(optimizer.param_groups[0]["lr"])
        expected = [expected_rate(scheduler.__name__, k) for k in range(21)]
        assert all(math.isclose(a, b, rel_tol=REL, abs_tol=1e-18) for a, b in zip(rates, expected)), (rates, expected)
        assert math.isclose(rates[20], 2e-5, rel_tol=REL)


def test_batch_flags_drop_the_files_accumulation_steps(tmp_path):
    from zoo.config.validation import validate_for_world

    content = json.loads(DEMO.read_text())
    content["gradient_accumulation_steps"] = 2     # 8 = 4 x 2 x dp 1
    path = tmp_path / "gas.json"
    path.write_text(json.dumps(content))
    config = load(path, "--global-batch-size", "32")
    assert "gradient_accumulation_steps" not in config.ds_config
    assert validate_for_world(config, 2) == 8      # 32 = 4 x 8 x dp 1 at tp 2


def test_batch_arithmetic_is_one_sentence():
    from zoo.config.validation import validate_for_world

    config = load(DEMO, "--global-batch-size", "12", "--tensor-parallel-size", "1")
    with pytest.raises(ValueError) as err:
        validate_for_world(config, 2)
    message = str(err.value)
    assert ("the global batch 12 (train_batch_size, --global-batch-size) must equal micro-batch 4 x accumulation "
            "steps x data-parallel size 2 (= 2 ranks / (tp 1 x pp 1))") in message
    assert "pass --global-batch-size 8 or 16, or --micro-batch-size one of [1, 2, 3, 6]." in message
    assert message.count(". ") == 0


OVERRIDE_ERRORS = {
    "floor-above-peak": (["--lr", "1e-4", "--min-lr", "1e-3"], "would decay from lr 0.0001 up to a floor of 0.001"),
    "lr-below-files-floor": (["--lr", "1e-4"], "would decay from lr 0.0001 up to a floor of 0.0002"),
    "both-precisions": (["--fp16", "--bf16"], "fp16 and bf16 are both asked for"),
    "micro-0": (["--micro-batch-size", "0"], "micro_batch_size = 0 must be an integer of at least 1"),
    "negative-lr": (["--lr", "-1"], "lr = -1.0 must be a positive finite number"),
}


@pytest.mark.parametrize("case", sorted(OVERRIDE_ERRORS))
def test_impossible_overrides_are_one_sentence(case, tmp_path, capsys):
    from zoo.cli.pretrain import main

    flags, needle = OVERRIDE_ERRORS[case]
    with pytest.raises(SystemExit) as exit_info:
        main(["--deepspeed_config", str(DEMO), "--save", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2
    assert needle in one_error_line(capsys, from_zoo=True)
    assert not (tmp_path / "run").exists()


def test_schedule_flags_without_a_schedule_to_take_them(tmp_path):
    content = json.loads(DEMO.read_text())
    del content["scheduler"]
    (tmp_path / "none.json").write_text(json.dumps(content))
    content["scheduler"] = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}
    (tmp_path / "onecycle.json").write_text(json.dumps(content))
    with pytest.raises(ValueError, match="--min-lr sets a warm-up/decay schedule, and DeepSpeed config .* has no "
                                         "scheduler block"):
        load(tmp_path / "none.json", "--min-lr", "1e-5")
    assert load(tmp_path / "none.json", "--lr", "1e-3").ds_config["optimizer"]["params"]["lr"] == 1e-3
    with pytest.raises(ValueError, match="--lr cannot be carried into the OneCycle scheduler"):
        load(tmp_path / "onecycle.json", "--lr", "1e-3")


# ----------------------------------------------------------------------------------------- settings shown and kept
def test_effective_settings_block_and_config_json(tmp_path, capsys):
    from zoo.config.deepspeed_dict import deepspeed_dict
    from zoo.config.loading import load_run_config
    from zoo.training.effective_settings import record_effective_settings

    prefix = tiny_corpus(tmp_path / "corpus")
    save = tmp_path / "run"
    tiny_corpus(tmp_path / "corpus_b", lengths=(500,))
    config = load(DEMO, "--data-path", "3", prefix, "1", str(tmp_path / "corpus_b"), "--train-iters", "60",
                  "--lr", "1e-3", "--split", "1,0,0", "--save", str(save))
    content = record_effective_settings(config, 2, 2)
    out = capsys.readouterr().out
    assert f"effective settings (kept in {save / 'config.json'}):" in out
    assert "layout     tp 2 x pp 1 x dp 1 = 2 ranks" in out
    assert "batch      micro 4 x accumulation 2 x dp 1 = global 8 samples (1,024 tokens) per iteration" in out
    assert "cosine decay to 0.0002 at step 60 (total_num_steps set by train_iters; the ds_config says 150)" in out
    assert "2 layers, hidden 128, 4 heads, vocab 50257 (padded to 50432)" in out
    # the corpora: weights 0.75 / 0.25, documents and tokens from the files, epochs = drawn tokens / train tokens
    data = content["effective"]["data"]
    assert [(d["weight"], d["documents"], d["tokens"]) for d in data] == [(0.75, 3, 200), (0.25, 1, 500)]
    assert math.isclose(data[0]["epochs"], 0.75 * 60 * 8 * 128 / 200, rel_tol=REL)
    assert f"{prefix}: weight 0.75, 3 documents, 200 tokens, ~{data[0]['epochs']:.2f} epochs" in out

    kept = json.loads((save / "config.json").read_text())
    assert kept == json.loads(json.dumps(content))
    expected_ds = deepspeed_dict(config, 2)
    del expected_ds["gradient_accumulation_steps"]
    assert {k: v for k, v in kept.items() if k not in ("zoo", "effective")} == json.loads(json.dumps(expected_ds))
    assert kept["scheduler"]["params"]["total_num_steps"] == 60
    # the file is a ds_config that starts the same run again
    again = load_run_config(type("Args", (), {"deepspeed_config": str(save / "config.json")})())
    assert again.ds_config["optimizer"] == config.ds_config["optimizer"] and again.train_iters == 60
    assert again.data_path == config.data_path
    assert deepspeed_dict(again, 2) == deepspeed_dict(config, 2)       # DeepSpeed gets neither zoo nor effective
    assert sorted(p.name for p in save.iterdir()) == ["config.json"]   # nothing but the file: no temporaries


def test_config_json_not_written_by_zoo_is_left_alone(tmp_path):
    from zoo.training.effective_settings import record_effective_settings

    save = tmp_path / "out_hf"
    save.mkdir()
    theirs = '{"model_type": "gpt2", "n_layer": 2}\n'
    (save / "config.json").write_text(theirs)
    config = load(DEMO, "--save", str(save))
    with pytest.raises(ValueError, match=r"config.json exists and was not written by a zoo run .*; move it, or pass "
                                         r"another --save\.$"):
        record_effective_settings(config, 2, 2)
    assert (save / "config.json").read_text() == theirs
    (save / "config.json").unlink()
    record_effective_settings(config, 2, 2)
    record_effective_settings(load(DEMO, "--save", str(save), "--lr", "1e-3"), 2, 2)   # an earlier zoo run's: replaced
    assert json.loads((save / "config.json").read_text())["optimizer"]["params"]["lr"] == 1e-3


def _settings_worker(rank, world_size, data_path, save):
    import contextlib
    import io

    from zoo.config.deepspeed_overrides import apply_overrides
    from zoo.config.run_config import RunConfig
    from zoo.config.validation import validate_static
    from zoo.training.metrics import read_metrics
    from zoo.training.pretrain import pretrain

    config = RunConfig(tensor_parallel_size=2, model="gpt2-tiny", seq_length=32, train_iters=3, data_path=data_path,
                       split="80,20,0", save=save, log_interval=1, eval_interval=0, eval_iters=1,
                       model_overrides=dict(TINY_MODEL), ds_config=ds_config(2, 2), ds_config_path="<test>",
                       lr=4e-3, lr_warmup_iters=1)
    config = validate_static(apply_overrides(config))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(config)
    lrs = [e["lr"] for e in read_metrics(save) if "split" not in e] if rank == 0 else None
    return out.getvalue().count("effective settings"), lrs


def test_the_writer_alone_shows_and_keeps_the_settings_and_deepspeed_trains_with_the_flags(tmp_path):
    """2 ranks, tp 2, 3 iterations with --lr 4e-3 --lr-warmup-iters 1 over the file's WarmupCosineLR (lr 1e-3,
    floor ratio 0.1: an absolute floor of 1e-4, kept without --min-lr). DeepSpeed warms up over at least 2
    steps, so the steps run at 0 and 4e-3 / 2, then at the floor 1e-4 (the cosine's end at train_iters 3);
    the file's own lr would give 0, 5e-4, 1e-4."""
    prefix = tiny_corpus(tmp_path / "corpus", lengths=[300] * 8)
    save = tmp_path / "run"
    (rank0, lrs), (rank1, _) = spawn(_settings_worker, 2, prefix, str(save))
    assert (rank0, rank1) == (1, 0)
    kept = json.loads((save / "config.json").read_text())
    assert kept["optimizer"]["params"]["lr"] == 4e-3 and kept["scheduler"]["params"]["warmup_num_steps"] == 1
    assert kept["effective"]["layout"] == {"tp": 2, "cp": 1, "pp": 1, "dp": 1, "world_size": 2}
    assert [round(lr, 12) for lr in lrs] == [0.0, 2e-3, 1e-4], lrs


# ----------------------------------------------------------------------------------------- refused before launch
def test_paper_scale_config_without_data_path_is_one_sentence(tmp_path):
    from zoo.models.families import shape_of
    from zoo.planning.planner import model_config_of
    from zoo.training.preflight import check_bundled_corpus

    config = load(REPO / "ds_configs" / "tp2.json")
    with pytest.raises(ValueError) as err:
        check_bundled_corpus(config, shape_of(model_config_of(config)))
    assert "trains gpt2-2.5b (54 layers of hidden size 1920" in str(err.value)
    assert str(err.value).endswith("pass --data-path with a corpus written by launch/preprocess.py.")
    demo = load(DEMO)
    check_bundled_corpus(demo, shape_of(model_config_of(demo)))      # the demo's own corpus
    # decided by the model, not its name: the tiny preset widened to GPT-2 small's shape is refused too
    wide = load(DEMO, block={"model_overrides": {"n_layer": 12, "n_embd": 768, "n_head": 12}}, tmp_path=tmp_path)
    with pytest.raises(ValueError, match="trains gpt2-tiny .12 layers of hidden size 768"):
        check_bundled_corpus(wide, shape_of(model_config_of(wide)))


def test_fit_check_refuses_what_the_planner_says_does_not_fit(tmp_path):
    """The memory figure is an argument (the CLI measures it): a stub of exactly the planner's smallest
    footprint fits, one byte less is refused with the plan's numbers and the changes that help."""
    from zoo.planning.fit_check import DeviceMemory
    from zoo.planning.plan_report import gb
    from zoo.planning.planner import plan
    from zoo.training.preflight import check_before_launch

    prefix = tiny_corpus(tmp_path / "corpus")
    config = load(DEMO, "--data-path", prefix, "--tensor-parallel-size", "1")
    p = plan(config, 2, gpu="cpu", with_deepspeed_estimate=False)
    needed = p.total - p.activations_attention_scores
    assert check_before_launch(config, 2, DeviceMemory(needed, "a stub")) == 1
    with pytest.raises(ValueError) as err:
        check_before_launch(config, 2, DeviceMemory(needed - 1, "the stub's memory"))
    message = str(err.value)
    assert message.startswith(f"gpt2-tiny at tp=1 x pp=1 x dp=2 needs at least {gb(needed)} per rank (model states "
                              f"{gb(p.model_states)}: weights {gb(p.weights)}, gradients {gb(p.gradients)}, optimizer "
                              f"{gb(p.optimizer)} in fp32 with ZeRO stage 0;")
    assert "), more than the stub's memory; " in message
    for change in ("--tensor-parallel-size", '"zero_optimization": {"stage": 1}', "--recompute-granularity full",
                   "a smaller --micro-batch-size"):
        assert change in message, change
    assert message.endswith("or pass --skip-fit-check to start anyway.")
    skipping = load(DEMO, "--data-path", prefix, "--tensor-parallel-size", "1", "--skip-fit-check")
    assert check_before_launch(skipping, 2, DeviceMemory(1, "one byte")) == 1


def test_host_memory_is_measured_and_shared_by_the_nodes_ranks(tmp_path):
    from zoo.planning.fit_check import device_memory, host_available_bytes, ranks_on_this_node

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n")
    assert host_available_bytes(meminfo) == 20000000 * 1024
    assert ranks_on_this_node({"LOCAL_SIZE": "2"}) == 2 and ranks_on_this_node({}) == 1
    memory = device_memory(0, {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2"})
    assert memory.gpu_name is None and "shared by its 2 ranks" in memory.where
    assert device_memory(0, {"DS_ACCELERATOR": "xpu"}) is None   # not measured: no check


def test_gpu_memory_is_the_free_memory_of_the_ranks_gpu(monkeypatch):
    """No GPU here: torch's CUDA queries are stubbed (as a GPU node answers them) to check what is asked of
    which device, and which planner row the name selects."""
    import torch

    from zoo.planning.fit_check import device_memory, planner_device

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (70 * 10**9, 80 * 10**9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    memory = device_memory(3, {"LOCAL_SIZE": "8"})
    assert (memory.bytes_per_rank, memory.gpu_name, asked) == (70 * 10**9, "NVIDIA H100 80GB HBM3", [3])
    assert memory.where == "the 70.00 GB free on GPU 3 (NVIDIA H100 80GB HBM3)" and planner_device(memory) == "H100"
    assert device_memory(3, {"DS_ACCELERATOR": "cpu"}).gpu_name is None     # the user chose the CPU


def test_a_missing_config_names_the_closest_file(tmp_path, monkeypatch):
    from zoo.config.ds_config_file import read_ds_config

    monkeypatch.chdir(REPO)
    with pytest.raises(FileNotFoundError, match=r"DeepSpeed config ds_configs/tp_2.json does not exist; pass "
                                                r"ds_configs/tp2.json, the closest name there is\.$"):
        read_ds_config("ds_configs/tp_2.json")
    with pytest.raises(FileNotFoundError, match=r"pass ds_configs/cpu_demo.json, the closest"):
        read_ds_config("ds_configs/cpu-demo.json")
    (tmp_path / "mine_big.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"pass .*mine_big.json, the closest"):
        read_ds_config(str(tmp_path / "mine-big.json"))
    with pytest.raises(FileNotFoundError, match=r"does not exist; pass one of the files in ds_configs/\.$"):
        read_ds_config("ds_configs/zzzzzzzz.json")


PREFLIGHT_SCRIPT = """
import json, os, sys
from zoo.cli.pretrain import main
lines = []
for env, argv in json.loads(sys.argv[1]):
    os.environ.update(env)
    try:
        main(argv)
    except SystemExit as exit_info:
        lines.append([exit_info.code, "deepspeed" in sys.modules])
print(json.dumps(lines))
"""


def test_config_mistakes_are_refused_before_deepspeed_is_imported(tmp_path):
    """One interpreter runs the CLI on five bad launches; after each, no DeepSpeed module is loaded."""
    prefix = tiny_corpus(tmp_path / "corpus")
    bad_batch = json.loads(DEMO.read_text())
    bad_batch["train_batch_size"] = 12
    (tmp_path / "batch.json").write_text(json.dumps(bad_batch))
    two = {"WORLD_SIZE": "2", "LOCAL_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"}
    save = ["--save", str(tmp_path / "run")]
    cases = [
        (two, ["--deepspeed_config", str(DEMO), "--tensor-parallel-size", "4", *save]),           # the grid
        (two, ["--deepspeed_config", str(tmp_path / "batch.json"), "--tensor-parallel-size", "1", *save]),
        (two, ["--deepspeed_config", str(DEMO), "--seq-length", "512", *save]),                  # 256 positions
        (two, ["--deepspeed_config", str(REPO / "ds_configs" / "tp2.json"), *save]),             # no --data-path
        ({**two, "WORLD_SIZE": "8", "LOCAL_SIZE": "8"},                                            # 8.3B on this host
         ["--deepspeed_config", str(REPO / "ds_configs" / "tp8.json"), "--data-path", prefix, *save]),
    ]
    result = subprocess.run([sys.executable, "-c", PREFLIGHT_SCRIPT, json.dumps(cases)], cwd=REPO, text=True,
                            capture_output=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [[2, False]] * 5, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    needles = ["tensor-parallel size 4 does not divide the world size 2", "the global batch 12",
               "seq_length 512 exceeds", "names no --data-path", "gpt2-8.3b-32h at tp=8 x pp=1 x dp=1 needs at least"]
    assert len(errors) == 5 and all(n in e for n, e in zip(needles, errors)), errors
    assert "more than this host's" in errors[4] and "--skip-fit-check" in errors[4]
    assert not (tmp_path / "run").exists()
