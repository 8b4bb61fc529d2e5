"""A CLI destroys the process group it created once its work succeeded (torch warns at exit about a group
never destroyed: seen on every NCCL run of an H100), and never a group its caller made, nor after a
failure, when another rank may still wait in a collective (zoo.distributed.process_group_left_on_success)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.helpers.pretraining import ds_config
from tests.spawn import free_port
from zoo.distributed import process_group_left_on_success


def _join_world_of_one() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


@pytest.fixture
def no_group_left():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_group_the_command_created_is_destroyed_after_success(no_group_left):
    with process_group_left_on_success():
        _join_world_of_one()
    assert not dist.is_initialized()


def test_the_callers_group_is_left_alone(no_group_left):
    _join_world_of_one()
    with process_group_left_on_success():
        pass
    assert dist.is_initialized()


def test_nothing_is_torn_down_after_a_failure(no_group_left):
    with pytest.raises(ValueError):
        with process_group_left_on_success():
            _join_world_of_one()
            raise ValueError("a rank failed")
    assert dist.is_initialized()


# ------------------------------------------------------------------------ joining: one sentence

def test_started_without_a_launcher_is_one_sentence():
    from zoo.distributed import check_launched

    with pytest.raises(ValueError) as err:
        check_launched(environ={}, script="launch/pretrain.py")
    assert str(err.value) == (
        "launch/pretrain.py was started without a launcher (RANK and WORLD_SIZE are not set); run it under "
        "deepspeed, e.g. `deepspeed --num_gpus 2 launch/pretrain.py ...` (or torchrun, or zoo's `python "
        "launch/run.py --num_gpus 2 launch/pretrain.py ...`); see the README.")
    check_launched(environ={"RANK": "0", "WORLD_SIZE": "1"})
    check_launched(environ={"OMPI_COMM_WORLD_RANK": "0"})     # mpirun: DeepSpeed discovers it


def test_a_taken_rendezvous_port_is_one_sentence():
    import socket

    from zoo.distributed import master_port_named

    with socket.socket() as other_job:
        other_job.bind(("127.0.0.1", 0))
        other_job.listen()
        port = other_job.getsockname()[1]
        with pytest.raises(ValueError) as err:
            with master_port_named(environ={"MASTER_PORT": str(port), "MASTER_ADDR": "127.0.0.1"}):
                dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    assert str(err.value) == (f"port {port} on 127.0.0.1 (MASTER_PORT) is already in use, probably by another "
                              f"job; pass another port to the launcher, e.g. `deepspeed --master_port {port + 1} "
                              "...` (torchrun: --master-port).")


# ------------------------------------------------------- every error path exits, through the launcher

def _launch_until_exit(tmp_path, name: str, data_path: str, zoo: dict, timeout_s: float = 300):
    """``deepspeed --num_gpus 2 launch/pretrain.py`` (tp = 2, 2 DataLoader workers a rank) until the job
    exits; the whole process group is killed if it has not after ``timeout_s``."""
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.spawn import free_port

    repo = Path(__file__).resolve().parent.parent
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(dict(ds_config(2, 2), zoo={
        "tensor_parallel_size": 2, "seq_length": 32, "train_iters": 3, "split": "80,20,0", "log_interval": 1,
        "eval_interval": 0, "save_interval": 0, "data_workers": 2, **zoo})))
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "launch/pretrain.py", "--deepspeed_config", str(config), "--data-path", data_path,
           "--save", str(tmp_path / name)]
    proc = subprocess.Popen(cmd, cwd=repo, env=dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{name}: the job did not exit within {timeout_s} s: {err[-3000:]}") from None
    return proc.returncode, out, err


def test_errors_with_dataloader_workers_alive_end_the_job(tmp_path):
    """Token ids outside the vocabulary (the data path) end the job with the sentence and code 2; a BERT
    config without segment embeddings fed sentence pairs fails in the forward (the model path, not a user
    error: its traceback and code 1). Both while each rank's DataLoader workers are alive, which ignore
    SIGTERM: the job exits instead of hanging at interpreter exit."""
    import gzip
    from pathlib import Path

    from zoo.data import preprocess, preprocess_bert

    bundled = Path(__file__).resolve().parent.parent / "zoo" / "assets" / "corpora" / "wiki-sample.jsonl.gz"
    with gzip.open(bundled, "rt") as src:
        (tmp_path / "small.jsonl").write_text("".join(next(src) for _ in range(6)))
    preprocess([str(tmp_path / "small.jsonl")], str(tmp_path / "gpt"), workers=1, progress=False)
    preprocess_bert([str(tmp_path / "small.jsonl")], str(tmp_path / "bert"), workers=1, progress=False)

    code, _, err = _launch_until_exit(tmp_path, "data", str(tmp_path / "gpt"), {
        "model": "gpt2-tiny", "model_overrides": {"n_layer": 1, "n_embd": 64, "n_head": 4, "vocab_size": 1000}})
    assert code == 2, err[-3000:]
    assert "outside the model's vocabulary of 1000 ids" in err, err[-3000:]

    code, _, err = _launch_until_exit(tmp_path, "model", str(tmp_path / "bert"), {
        "model": "bert-tiny", "model_overrides": {"num_hidden_layers": 1, "hidden_size": 64,
                                                   "num_attention_heads": 4, "type_vocab_size": 1}})
    assert code == 1, err[-3000:]
    assert "IndexError: index out of range in self" in err, err[-3000:]
