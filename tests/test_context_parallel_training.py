"""Pretraining with context parallelism (DeepSpeed-Ulysses) through zoo's training path against the unsplit run.

llama-tiny (4 query heads, 2 key/value heads), 64 tokens a sample, fp32, dropout off, 3 iterations of 2 micro-
batches on the small Wikipedia corpus, validating at the end:

* tp1 x cp2 (2 ranks) and tp2 x cp2 with sequence parallelism and ZeRO-1 (4 ranks) log the tp1 x cp1 run's
  losses, grad norms (clipping active), learning rates and validation loss, <= 1e-5 relative: DeepSpeed sums the
  gradients over the context ranks, each sample's shards are the unsplit sample and the validation counts
  every token once.
* tp1 x cp2 with selective recomputation and ZeRO-2, and with full recomputation, log the same; in bf16 it logs
  the cp 1 bf16 run's losses and grad norms within 1e-3.
* The cp2 run's checkpoint of iteration 2 resumes at cp1 (1 rank) with the uninterrupted run's iteration 3.
* The run's effective settings and its checkpoint name the context-parallel size.
"""

from __future__ import annotations

import json

import pytest

from tests.checks import rel_err
from tests.helpers.pretraining import ds_config, run_config, train_events
from tests.spawn import spawn

MODEL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2)
MICRO, GLOBAL, ITERS, SEQ = 2, 4, 3, 64
RTOL = 1e-5


def config(data_path, save, tp, cp, **changes):
    changes.setdefault("eval_interval", ITERS)
    changes.setdefault("ds_config", ds_config(MICRO, GLOBAL, gradient_clipping=0.5))   # below the norms: clipping acts
    return run_config(data_path, save, tp, MICRO, GLOBAL, ITERS, model="llama-tiny", model_overrides=dict(MODEL),
                      seq_length=SEQ, eval_iters=1, context_parallel_size=cp, **changes)


def _train(rank, world_size, data_path, save, tp, cp, changes):
    from zoo.training.pretrain import pretrain

    return pretrain(config(data_path, save, tp, cp, **changes))


def train(world_size, data_path, save, tp, cp, **changes):
    return spawn(_train, world_size, data_path, str(save), tp, cp, changes)


@pytest.fixture(scope="module")
def unsplit(corpus_prefix, tmp_path_factory):
    run = tmp_path_factory.mktemp("cp1")
    train(1, corpus_prefix, run, 1, 1)
    return run


def assert_same_run(run, reference, iterations=(1, 2, 3)):
    events = {e["iteration"]: e for e in train_events(run)}
    expected = {e["iteration"]: e for e in train_events(reference)}
    assert sorted(events) == list(iterations), sorted(events)
    for iteration in iterations:
        for key in ("loss", "grad_norm", "lr"):
            assert rel_err(events[iteration][key], expected[iteration][key]) <= RTOL, (iteration, key)
    assert expected[1]["grad_norm"] > 0.5   # clipping is active, so the norm itself is checked


def validation_loss(run) -> float:
    from zoo.training.metrics import read_metrics

    (valid,) = [e for e in read_metrics(run) if e.get("split") == "valid"]
    return valid["val_loss"]


def test_tp1_cp2_trains_as_the_unsplit_run_and_resumes_at_cp1(corpus_prefix, unsplit, tmp_path):
    from zoo.training.checkpointer import resumed_line
    from zoo.training.effective_settings import format_effective_settings
    from zoo.training.loop import LoopState

    run = tmp_path / "cp2"
    train(2, corpus_prefix, run, 1, 2, save_interval=2)
    assert_same_run(run, unsplit)
    assert rel_err(validation_loss(run), validation_loss(unsplit)) <= RTOL
    kept = json.loads((run / "config.json").read_text())
    assert kept["zoo"]["context_parallel_size"] == 2, kept["zoo"]
    assert "layout     tp 1 x cp 2 (each sequence split over 2 ranks) x pp 1 x dp 1 = 2 ranks" in \
        format_effective_settings(kept["effective"])

    (run / "checkpoints" / "latest").write_text("iter_0000002")    # resume from iteration 2's checkpoint
    resumed = tmp_path / "cp1-resumed"
    train(1, corpus_prefix, resumed, 1, 1, load=str(run))
    assert_same_run(resumed, unsplit, iterations=(3,))
    state = LoopState(iteration=2, consumed_samples=8)
    assert resumed_line("iter_0000002", state, (1, 1, 1, 2), (1, 1, 1, 1)).endswith("at tp1×cp2×pp1×dp1 → tp1×pp1×dp1")


def test_tp2_cp2_with_sequence_parallelism_and_zero1_trains_as_the_unsplit_run(corpus_prefix, unsplit, tmp_path):
    run = tmp_path / "tp2-cp2"
    ds = ds_config(MICRO, GLOBAL, gradient_clipping=0.5, zero_optimization={"stage": 1})
    train(4, corpus_prefix, run, 2, 2, sequence_parallel=True, ds_config=ds)
    assert_same_run(run, unsplit)
    assert rel_err(validation_loss(run), validation_loss(unsplit)) <= RTOL


REFUSALS = {
    "sequence": (["--model", "llama-tiny", "--seq-length", "63"],
                 "seq_length 63 does not divide by the context-parallel size 2; pass a --seq-length that is a multiple "
                 "of 2."),
    "sequence-parallel": (["--model", "llama-tiny", "--seq-length", "66", "--tensor-parallel-size", "2",
                           "--sequence-parallel"],
                          "seq_length 66 does not divide by the context-parallel size 2 x tensor-parallel size 2 "
                          "(sequence parallelism); pass a --seq-length that is a multiple of 4."),
    "heads": (["--model", "llama-tiny", "--seq-length", "64", "--context-parallel-size", "8"],
              "4 attention heads over tensor-parallel size 1 leave 4 per rank, which the context-parallel size 8 "
              "does not divide"),
    "kv-heads": (["--model", "llama-tiny", "--seq-length", "64"],
                 "3 key/value heads over tensor-parallel size 1 leave 3 per rank, which neither divides nor is divided "
                 "by the context-parallel size 2"),
    "bert": (["--model", "bert-tiny", "--seq-length", "64"],
             "context parallelism is built for causal decoders (GPT-2, Llama)"),
    "pipeline": (["--model", "llama-tiny", "--seq-length", "64", "--pipeline-model-parallel-size", "2"],
                 "--context-parallel-size 2 with 2 pipeline stages is not supported"),
    "zero": (["--model", "llama-tiny", "--seq-length", "64", "--context-parallel-size", "0"],
             "context_parallel_size = 0 must be at least 1"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_layout_context_parallelism_cannot_run_is_one_sentence_and_exit_2(case, tmp_path, capsys):
    from tests.checks import one_error_line
    from zoo.cli.pretrain import main

    flags, sentence = REFUSALS[case]
    if "--context-parallel-size" not in flags:
        flags = [*flags, "--context-parallel-size", "2"]
    path = tmp_path / "ds.json"
    overrides = {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 3} if case == "kv-heads" else {}
    path.write_text(json.dumps(ds_config(MICRO, GLOBAL, zoo={"model_overrides": overrides})))
    with pytest.raises(SystemExit) as exit_info:
        main(["--deepspeed_config", str(path), "--save", str(tmp_path / "run"), *flags])
    assert exit_info.value.code == 2
    assert sentence in one_error_line(capsys, from_zoo=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]


@pytest.mark.parametrize("recompute,stage", [("selective", 2), ("full", 0)])
def test_tp1_cp2_with_recomputation_and_zero2_trains_as_the_unsplit_run(corpus_prefix, unsplit, tmp_path,
                                                                         recompute, stage):
    run = tmp_path / f"cp2-{recompute}"
    ds = ds_config(MICRO, GLOBAL, gradient_clipping=0.5, zero_optimization={"stage": stage})
    train(2, corpus_prefix, run, 1, 2, recompute_granularity=recompute, ds_config=ds)
    assert_same_run(run, unsplit)


BF16_RTOL = 1e-3   # bf16 rounding of other sums: 4.5e-5 seen (grad norm, iteration 3); a lost factor is ~1


def test_tp1_cp2_in_bf16_trains_as_the_unsplit_run_in_bf16(corpus_prefix, tmp_path):
    """bf16 (gradients accumulated and reduced in fp32): the cp 2 run's losses and grad norms within bf16's rounding
    of the cp 1 run's."""
    ds = ds_config(MICRO, GLOBAL, gradient_clipping=0.5, bf16={"enabled": True})
    train(1, corpus_prefix, tmp_path / "cp1", 1, 1, ds_config=ds)
    train(2, corpus_prefix, tmp_path / "cp2", 1, 2, ds_config=ds)
    expected = {e["iteration"]: e for e in train_events(tmp_path / "cp1")}
    for event in train_events(tmp_path / "cp2"):
        for key in ("loss", "grad_norm"):
            assert rel_err(event[key], expected[event["iteration"]][key]) <= BF16_RTOL, (event, key)
    assert len(expected) == ITERS
