"""Many nodes, proven on loopback: two "nodes" of 2 CPU ranks each, started the way SLURM/Kubernetes job
scripts start DeepSpeed (one launcher per node: ``deepspeed --hostfile H --no_ssh --node_rank R
--master_addr HEAD --master_port P``), train exactly like one 4-rank launch.

The two-node run is the user's CLI (launch/pretrain.py) with ZeRO-1 at tp = 2 x dp = 2 and the demo
config's settings; the reference is the non-ZeRO run of the one-node 4-rank launch that tests/test_zero.py
checks (tests/helpers/zero_launch.py: the same data, model and batch): losses and grad norms equal <= 1e-5
(fp32). Also checks that launch/slurm_pretrain.sbatch is a complete job script (sbatch header, per-node
launch form, auto-resume).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers.pretraining import ds_config, train_events
from tests.helpers.random_corpus import MODEL
from tests.helpers.repo import REPO
from tests.helpers.zero_launch import ITERS, PARITY, assert_matches, deepspeed_cmd, launcher_env, one_node_launch


def two_node_config(path: Path) -> None:
    """tests/helpers/pretraining.py's ds_config (what the one-node reference ran) plus ZeRO-1, as a CLI config."""
    config = ds_config(1, 4, zero_optimization={"stage": 1})
    config["zoo"] = {"tensor_parallel_size": 2, "model": "gpt2-tiny", "seq_length": 32, "split": "80,20,0",
                     "log_interval": 1, "eval_interval": 0, "eval_iters": 1, "save_interval": 0, "data_workers": 0,
                     "model_overrides": dict(MODEL)}
    path.write_text(json.dumps(config))


def test_two_nodes_on_loopback_equal_one_four_rank_launch(tmp_path_factory):
    from tests.spawn import free_port

    runs, corpus = one_node_launch(tmp_path_factory)
    root = tmp_path_factory.mktemp("two_nodes")
    hostfile = root / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    two_node_config(root / "ds.json")
    port = free_port()
    common = ["--hostfile", str(hostfile), "--no_ssh", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    script = ["launch/pretrain.py", "--deepspeed_config", str(root / "ds.json"), "--data-path", corpus,
              "--save", str(root / "run"), "--train-iters", str(ITERS)]
    nodes = [subprocess.Popen([deepspeed_cmd(), *common, "--node_rank", str(rank), *script], env=launcher_env(),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, (out[-2000:], err[-3000:])
    assert_matches(train_events(root / "run"), train_events(runs / "base"), PARITY, "two nodes")
    tag = root / "run" / "checkpoints" / f"iter_{ITERS:07d}"
    assert {p.name for p in tag.glob("zero_pp_rank_*")} == {f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt"
                                                           for d in (0, 1) for t in (0, 1)}


@pytest.mark.parametrize("needle", [
    "#SBATCH --nodes", "#SBATCH --ntasks-per-node=1", "#SBATCH --signal=", "srun", "--no_ssh",
    "--node_rank \"$SLURM_NODEID\"", "--master_addr \"$HEAD\"", "--save \"$RUN\"", "--load \"$RUN\"",
    "--exit-duration-in-mins", "--exit-signal-handler", "launch/pretrain.py", "python launch/run.py"])
def test_slurm_script_uses_the_per_node_form(needle):
    text = (REPO / "launch" / "slurm_pretrain.sbatch").read_text()
    assert needle in text


def test_slurm_script_parses_as_bash():
    proc = subprocess.run(["bash", "-n", str(REPO / "launch" / "slurm_pretrain.sbatch")], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
