"""launch/smoke.py, the acceptance run, through the real ``deepspeed`` launcher at 2 CPU ranks (gloo):
every check passes, fp16 is reported as skipped where DeepSpeed refuses it (CPUs without native fp16) and
trained with its loss scale checked where the CPU has native fp16, MFU is n/a, and the temporary checkpoint
directory is gone afterwards. A failed check makes the run exit 1. The loss-scale check passes on correct
fp16 training and fails when the scale is not applied.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.spawn import free_port, spawn

REPO = Path(__file__).resolve().parent.parent
CHECKS = ("parity", "generate", "train bf16", "checkpoint", "bert")


def test_smoke_script_passes_every_check_through_the_deepspeed_launcher(tmp_path):
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path))
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "launch/smoke.py"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    out = proc.stdout
    assert "tp=2 dp=1" in out, out[-3000:]
    for name in CHECKS:
        assert f"PASS {name}:" in out, (name, out[-3000:])
    assert "FAIL" not in out
    if native_fp16():
        assert "PASS train fp16:" in out and "PASS loss scale:" in out, out[-3000:]
    else:
        assert "skipped: fp16 not supported on cpu" in out
    assert "MFU n/a" in out
    assert "smoke: all checks passed" in out
    assert not list(tmp_path.glob("zoo-smoke-*")), "the temporary checkpoint directory was left behind"


def native_fp16() -> bool:
    """Whether DeepSpeed's CPU accelerator runs fp16 here (its own test: oneDNN's fp16 kernels)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _loss_scale_verdicts(rank, world_size):
    """The loss-scale check after fp16 and bf16 training: as zoo trains, then with the defect it exists for
    (DeepSpeed 0.19's ``engine.backward`` alone, which leaves the fp16 loss scale out at ZeRO stage 0)."""
    from deepspeed.accelerator import get_accelerator

    import zoo.training.loop
    from zoo import smoke
    from zoo.cli.smoke import parse_args

    # Where this CPU lacks native fp16 DeepSpeed refuses it; torch still computes fp16 here, and the override runs
    # DeepSpeed's real fp16 optimizer with dynamic loss scaling (DESIGN.md, "fp16 on CPU").
    get_accelerator().is_fp16_supported = lambda: True
    args = parse_args(["--steps", "2"])
    smoke.validate(args)
    state = smoke.setup(args)
    ids = smoke.train_batch(state, smoke.lm_config(state).vocab_size)
    verdicts = {}
    for name, backward in (("zoo", zoo.training.loop.backward), ("defect", lambda engine, loss: engine.backward(loss))):
        zoo.training.loop.backward = backward
        state.first_grad_norms = {}
        for precision in ("fp16", "bf16"):
            smoke.check_training(state, precision, ids)
        verdicts[name] = (smoke.check_loss_scale(state), dict(state.first_grad_norms))
    return verdicts


def test_the_loss_scale_check_passes_on_correct_fp16_training_and_fails_on_the_defect():
    """The check compares the unscaled first-step norms (zoo's where DeepSpeed's FP16_UnfusedOptimizer still
    reports its norm times S), so it passes when zoo applies the scale and fails when nobody does."""
    (verdicts,) = spawn(_loss_scale_verdicts, 1)
    assert verdicts["zoo"][0], verdicts
    assert not verdicts["defect"][0], verdicts


def _smoke_exit_code(rank, world_size, argv):
    from zoo.cli.smoke import main

    return main(argv)


def test_a_failed_check_exits_1():
    """With a learning rate of 0 the loss cannot fall: the training check fails and main returns 1."""
    assert spawn(_smoke_exit_code, 1, ["--lr", "0", "--steps", "2"]) == [1]


def test_a_bad_flag_is_one_sentence_and_exit_2(capsys):
    from zoo.cli.smoke import main

    assert main(["--model", "bert-tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model 'bert-tiny' is a BERT preset") and err.count("\n") == 1, err


def test_the_bert_step_caps_a_long_gpt2_sequence_at_the_bert_positions():
    """`--seq-length 1024 --bert-model bert-336m` gives the BERT step at most its 512 positions, so it does not
    die with a traceback after all the GPT-2 checks have run."""
    from zoo.cli.smoke import parse_args
    from zoo.smoke import validate

    args = parse_args(["--model", "gpt2-1.2b", "--seq-length", "1024", "--bert-model", "bert-336m"])
    validate(args)
    assert args.bert_seq_length == 512
    short = parse_args(["--seq-length", "64"])
    validate(short)
    assert short.bert_seq_length == 64


def test_a_bert_sequence_longer_than_its_positions_is_exit_2(capsys):
    from zoo.cli.smoke import main

    assert main(["--bert-model", "bert-336m", "--bert-seq-length", "600"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --bert-seq-length 600 does not fit bert-336m's 512 positions") and err.count("\n") == 1
