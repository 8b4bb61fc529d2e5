"""What a user reads in the first hour: the resume line, Megatron's log-line fields (MFU, memory, skipped and
NaN iterations, an ETA in days), TensorBoard scalars equal to metrics.jsonl, a redirected log without
carriage returns or repeated library warnings, and the BERT summary's MLM perplexity and SOP accuracy.

One 2-rank spawn serves the run-level checks: a tp1 x pp2 run of 2 iterations with --tensorboard-dir, then
its resume at tp2 x pp1 to iteration 3 (a layout change), each rank's stdout captured.
Tolerances: TensorBoard stores scalars as float32, so each read-back value equals metrics.jsonl's value
rounded to float32, exactly.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.pretraining import run_config
from tests.helpers.repo import REPO
from tests.spawn import spawn

DAY = 86400


# ----------------------------------------------------------------------------------------- the log line
def event(**changes) -> dict:
    base = {"iteration": 20, "loss": 6.5, "lr": 1e-4, "loss_scale": 1.0, "grad_norm": 1.25, "tokens_per_s": 524.0,
            "tflops": 123.4, "eta_s": 3 * DAY + 3600, "skipped_iterations": 2, "nan_iterations": 1}
    return {**base, **changes}


def test_eta_past_a_day_prints_days():
    from zoo.training.loop_tasks import format_log_line

    assert "ETA 3 days 01:00:00" in format_log_line(event(), 60)
    assert "ETA 1 day 00:00:05" in format_log_line(event(eta_s=DAY + 5), 60)
    assert "ETA 00:59:59" in format_log_line(event(eta_s=3599), 60)


def test_log_line_carries_mfu_memory_and_skipped_and_nan_counts():
    from zoo.training.loop_tasks import format_log_line

    gpu = format_log_line(event(mfu_pct=12.47, mem_allocated_gb=12.3, mem_reserved_gb=14.0), 60)
    assert "123.400 TFLOPs/device (MFU 12.5%)" in gpu
    assert "mem 12.30/14.00 GB allocated/reserved" in gpu
    assert "skipped 2" in gpu and "nan/inf 1" in gpu
    cpu = format_log_line(event(rss_gb=0.41), 60)
    assert "MFU" not in cpu and "mem 0.41 GB RSS" in cpu


def test_mfu_is_against_the_planner_peak_of_the_device():
    from zoo.planning.gpus import peak_tflops_of
    from zoo.training.log_window import mfu_percent

    assert mfu_percent(98.94, peak_tflops_of("NVIDIA H100 80GB HBM3")) == pytest.approx(10.0)
    assert mfu_percent(98.94, None) is None


# ----------------------------------------------------------------------------------------- run level
def _first_hour_worker(rank, world_size, data_path, root):
    from zoo.training.pretrain import pretrain

    outputs = []
    for changes in ({"train_iters": 2, "pipeline_model_parallel_size": 2},
                    {"train_iters": 3, "tensor_parallel_size": 2, "load": f"{root}/run"}):
        config = run_config(data_path, f"{root}/run", 1, 2, 4, tensorboard_dir=f"{root}/tb", **changes)
        out = io.StringIO()
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
            warnings.simplefilter("always")
            pretrain(config)
        outputs.append((out.getvalue(), [str(w.message) for w in caught]))
    return outputs


@pytest.fixture(scope="module")
def resumed_run(corpus_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("first_hour")
    return root, spawn(_first_hour_worker, 2, corpus_prefix, str(root))


def test_resume_says_tag_iteration_samples_and_layout_change(resumed_run):
    _, ranks = resumed_run
    (_, _), (resumed_out, _) = ranks[0]
    line = "resumed from iter_0000002 (iteration 2, 8 samples consumed) at tp1×pp2×dp1 → tp2×pp1×dp1"
    assert resumed_out.count(line) == 1, resumed_out
    assert "resumed from" not in ranks[1][1][0]


def test_pipeline_broadcast_autograd_warning_is_silenced(resumed_run):
    _, ranks = resumed_run
    for (_, caught), _ in ranks:   # the pipeline run of each rank
        assert not [m for m in caught if "c10d::broadcast_" in m], caught


def test_log_events_carry_memory_and_skipped_and_nan_counts(resumed_run):
    from zoo.training.metrics import read_metrics

    root, _ = resumed_run
    train = [e for e in read_metrics(root / "run") if "split" not in e]
    assert [e["iteration"] for e in train] == [1, 2, 3]
    for e in train:
        assert {"loss", "lr", "loss_scale", "grad_norm", "tokens_per_s", "tflops"} <= set(e)
        assert e["skipped_iterations"] == 0 and e["nan_iterations"] == 0
        assert 0.05 < e["rss_gb"] < 64          # a CPU rank's resident set, in GB
        assert "mfu_pct" not in e               # no peak for a CPU


def test_tensorboard_scalars_equal_metrics_jsonl(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from zoo.training.metrics import read_metrics

    root, _ = resumed_run
    expected: dict[tuple[str, int], float] = {}
    for e in read_metrics(root / "run"):
        for key, value in e.items():
            if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool):
                expected[(key, e["iteration"])] = value
    found: dict[tuple[str, int], float] = {}
    for run in sorted({p.parent for p in (root / "tb").rglob("events.out.tfevents.*")}):
        accumulator = EventAccumulator(str(run), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            for scalar in accumulator.Scalars(tag):
                found[(tag, scalar.step)] = scalar.value
    assert set(found) == set(expected)
    for key, value in expected.items():
        assert found[key] == float(np.float32(value)), key


# ----------------------------------------------------------------------------------------- a redirected log
ONCE_AT_MOST = ("Attempting to get learning rate from scheduler before it has started",
                "`past_key_values`/`cache_params` are deprecated")


def test_redirected_demo_log_has_no_carriage_returns_and_library_warnings_at_most_once(tmp_path):
    """The demo config through the real launcher, 2 ranks, stdout and stderr redirected to one file."""
    from tests.spawn import free_port

    log = tmp_path / "demo.log"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "launch/pretrain.py", "--deepspeed_config", "ds_configs/cpu_demo.json", "--save", str(tmp_path / "run"),
           "--train-iters", "2", "--log-interval", "1", "--eval-interval", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    with log.open("wb") as handle:
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, timeout=400)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text, [line for line in text.split("\n") if "\r" in line][:3]
    for message in ONCE_AT_MOST:
        assert text.count(message) <= 1, message
    assert text.count("iteration       2/2 |") == 1


# ----------------------------------------------------------------------------------------- BERT summary
def test_bert_summary_reports_mlm_perplexity_and_sop_accuracy_beside_their_baselines():
    from zoo.models.families import CAUSAL_LM, MLM_SOP
    from zoo.training.pretraining_objectives import OBJECTIVES

    means = {"loss": 7.5, "mlm_loss": 6.8, "sop_loss": 0.7, "sop_acc": 0.625}
    line = OBJECTIVES[MLM_SOP].validation_line(means, unigram=1234.5)
    assert f"MLM perplexity {np.exp(6.8):.2f} (unigram baseline 1234.5)" in line
    assert "SOP accuracy 0.625 (chance 0.5)" in line
    assert f"{np.exp(7.5):.2f}" not in line
    gpt = OBJECTIVES[CAUSAL_LM].validation_line({"loss": 6.0}, unigram=2184.9)
    assert gpt == f"validation loss 6.0000, validation perplexity {np.exp(6.0):.2f} (unigram baseline of the " \
                  "corpus: 2184.9)"
