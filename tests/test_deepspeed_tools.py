"""DeepSpeed's offline tools refuse a zoo checkpoint written at tp > 1 with one sentence
(zoo.checkpoint.deepspeed_tools): the ``zero_to_fp32.py`` DeepSpeed copies beside the tags exits 2 naming
launch/export.py, and ``ds_to_universal --inject_missing_state`` stops before writing anything (left to
itself it completes with tensors merged in the wrong layout)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.spawn import spawn
from zoo.checkpoint.deepspeed_tools import guard_deepspeed_tools, refuse_universal_conversion

ORIGINAL = "# DeepSpeed's zero_to_fp32.py\n"


def _run_script(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=60)


def test_the_copied_recovery_scripts_exit_2_with_one_sentence_at_tp2(tmp_path):
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "iter_0000002").mkdir(parents=True)
    (checkpoints / "zero_to_fp32.py").write_text(ORIGINAL)
    (checkpoints / "latest").write_text("iter_0000002")
    replaced = guard_deepspeed_tools(checkpoints, 2)
    assert replaced == [checkpoints / "zero_to_fp32.py"]              # zero_to_torch.py was not there: not made
    assert not (checkpoints / "zero_to_torch.py").exists() and (checkpoints / "latest").read_text() == "iter_0000002"
    assert (checkpoints / "zero_to_fp32.py").stat().st_mode & 0o100
    result = _run_script(checkpoints / "zero_to_fp32.py", str(checkpoints), str(tmp_path / "out"))
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: this zoo checkpoint was written at tp=2")
    assert (f"`python launch/export.py --load {checkpoints.resolve()} [--tag TAG] --out DIR`"
            in result.stderr), result.stderr
    assert not (tmp_path / "out").exists()


def test_a_tp1_checkpoint_keeps_deepspeed_s_scripts(tmp_path):
    (tmp_path / "zero_to_fp32.py").write_text(ORIGINAL)
    assert guard_deepspeed_tools(tmp_path, 1) == []
    assert (tmp_path / "zero_to_fp32.py").read_text() == ORIGINAL

    class Engine:
        module = type("Module", (), {})()

    refuse_universal_conversion(Engine, 1)
    assert not hasattr(Engine.module, "universal_checkpoint_info")


def _save_tp2_zero_checkpoint(rank, world_size, directory):
    import deepspeed

    from zoo.checkpoint.files import model_states_path
    from zoo.models import GPT2LMHeadModel, gpt2_config
    from zoo.models.families import param_groups
    from zoo.parallel import ParallelState, model_parallel_seed

    deepspeed.init_distributed()
    ps = ParallelState.initialize(world_size)
    model_parallel_seed(0, ps)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", n_layer=1, n_embd=64, n_head=2, vocab_size=256, n_positions=32),
                            parallel=ps)
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 9,
              "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.0), config=config, mpu=ps)
    refuse_universal_conversion(engine, ps.tp_size)
    engine.save_checkpoint(directory, tag="iter_0000001", save_latest=False)
    import torch.distributed as dist

    dist.barrier()
    tag = Path(directory) / "iter_0000001"
    if rank == 0:
        assert guard_deepspeed_tools(directory, ps.tp_size) == [Path(directory) / "zero_to_fp32.py",
                                                                 Path(directory) / "zero_to_torch.py"]
    dist.barrier()
    engine.load_checkpoint(directory, tag="iter_0000001")             # DeepSpeed's resume still reads it

    from zoo.checkpoint.safe_load import safe_torch_load  # the loader zoo itself reads states with
    states = safe_torch_load(model_states_path(tag, ps.tp_rank), mmap=False)
    return states["universal_checkpoint_info"]


def test_deepspeed_s_tools_stop_on_a_tp2_zero_checkpoint(tmp_path):
    directory = tmp_path / "checkpoints"
    for info in spawn(_save_tp2_zero_checkpoint, 2, str(directory)):   # plain dicts and str: weights_only-safe
        (reason,) = info["autotp_unsupported_parameter_patterns"].values()
        assert isinstance(reason, str) and reason.startswith("this zoo checkpoint was written at tp=2"), info
    tag = directory / "iter_0000001"
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        result = _run_script(directory / script, str(directory), str(tmp_path / "fp32"))
        assert result.returncode == 2 and f"DeepSpeed's {script} cannot merge" in result.stderr, result
    out = tmp_path / "universal"
    result = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                             "--output_folder", str(out), "--inject_missing_state"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "this zoo checkpoint was written at tp=2" in result.stderr and "launch/export.py" in result.stderr
    assert not out.exists() or not any(out.rglob("*.pt")), sorted(out.rglob("*"))
