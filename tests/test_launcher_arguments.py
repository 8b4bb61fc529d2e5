"""What zoo's launcher (launch/run.py) hands DeepSpeed's runner.

* A ``--num_gpus`` / ``--num_accelerators`` / ``--num_nodes`` below 1, which DeepSpeed reads as its default
  (one rank per accelerator, every node) without a word, is one sentence and exit code 2, before any
  process starts.
* A launch on this node alone that names no port rendezvouses on ``$MASTER_PORT``, else on a port free at
  the start, not on DeepSpeed's 29500: proven end to end with 29500 held by another process. A port
  given before the script, and any launch over a hostfile, keep the port given or DeepSpeed's.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from zoo.cli.run import main
from zoo.operations.launcher import runner_arguments

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED_DEFAULT_PORT = 29500
SCRIPT = ["train.py", "--deepspeed_config", "ds.json"]

RANK = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")          # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from DeepSpeed's launcher
dist.barrier()
open(sys.argv[-1], "w").write(os.environ["MASTER_PORT"])   # after --local_rank
dist.destroy_process_group()
"""


@pytest.mark.parametrize("counts", [["--num_gpus", "0"], ["--num_gpus=-1"], ["--num_accelerators", "-2"],
                                    ["--num_nodes", "0"]])
def test_a_count_below_one_is_one_sentence_and_exit_code_2(counts, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*counts, *SCRIPT])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    flag = counts[0].split("=")[0].replace("--num_accelerators", "--num_gpus")
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} ") and "is not a count" in lines[0], lines


def test_launch_run_py_refuses_num_gpus_0_before_starting_anything(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "rank.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = subprocess.run([sys.executable, "launch/run.py", "--num_gpus", "0", str(script)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --num_gpus 0 is not a count"), proc.stderr
    assert not marker.exists()


def test_positive_counts_and_the_scripts_own_flags_pass():
    assert runner_arguments(["--num_gpus", "2", "--master_port", "1234", *SCRIPT, "--num_gpus", "0"],
                            environ={}) == ["--num_gpus", "2", "--master_port", "1234", *SCRIPT, "--num_gpus", "0"]


def test_one_node_without_a_port_gets_a_free_one():
    argv = runner_arguments(["--num_gpus", "2", *SCRIPT, "--master_port", "7"], environ={})
    assert argv[0] == "--master_port" and argv[2:] == ["--num_gpus", "2", *SCRIPT, "--master_port", "7"]
    port = int(argv[1])
    assert port != DEEPSPEED_DEFAULT_PORT
    with socket.socket() as probe:
        probe.bind(("", port))                  # still free


def test_one_node_takes_master_port_from_the_environment():
    assert runner_arguments(SCRIPT, environ={"MASTER_PORT": "41234"}) == ["--master_port", "41234", *SCRIPT]


@pytest.mark.parametrize("given", [["--master_port", "1234"], ["--master_port=1234"]])
def test_a_port_given_is_kept(given):
    assert runner_arguments([*given, *SCRIPT], environ={"MASTER_PORT": "41234"}) == [*given, *SCRIPT]


def test_a_hostfile_launch_keeps_deepspeeds_port(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    argv = ["--hostfile", str(hostfile), *SCRIPT]
    assert runner_arguments(argv, environ={"MASTER_PORT": "41234"}) == argv


def test_a_master_port_that_is_no_port_is_one_sentence():
    with pytest.raises(ValueError, match=r"^MASTER_PORT=http is not a TCP port: .*$"):
        runner_arguments(SCRIPT, environ={"MASTER_PORT": "http"})


def test_a_one_node_launch_runs_while_deepspeeds_port_is_taken(tmp_path):
    """One rank through launch/run.py and DeepSpeed's runner and per-node launcher, with 29500 listened on
    by another process (or already busy on this machine): the rank's process group forms on another port."""
    script, seen = tmp_path / "rank.py", tmp_path / "port"
    script.write_text(RANK)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    with socket.socket() as other_job:
        try:
            other_job.bind(("", DEEPSPEED_DEFAULT_PORT))
            other_job.listen()
        except OSError:
            pass                                # taken already: as good for the check
        proc = subprocess.run([sys.executable, "launch/run.py", "--num_gpus", "1", str(script), str(seen)], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(seen.read_text()) != DEEPSPEED_DEFAULT_PORT
