"""A user error every rank hits is printed once, by the writer rank, on a line of its own; another rank
prints only an error of its own (one whole line, naming its rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.repo import REPO
from zoo.errors import UserError

SENTENCE = "n_head=3 is not divisible by tensor-parallel size 2; use a tp degree that divides 3."


def test_a_user_error_of_both_ranks_is_printed_once_through_the_launcher(tmp_path):
    from tests.spawn import free_port

    config = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())
    config["zoo"].update(model_overrides={"n_head": 3, "n_embd": 48, "n_layer": 1}, sample_prompts=[])
    config_path = tmp_path / "heads.json"
    config_path.write_text(json.dumps(config))
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "launch/pretrain.py", "--deepspeed_config", str(config_path), "--save", str(tmp_path / "run"),
           "--train-iters", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert output.count(SENTENCE) == 1, output[-3000:]
    assert f"error: {SENTENCE}\n" in output


def _agreed(message: str) -> ValueError:
    from zoo.errors import raise_failure_of_rank

    with pytest.raises(ValueError) as caught:
        raise_failure_of_rank(1, "UserError", message, None, this_rank=0)
    return caught.value


@pytest.mark.parametrize("rank, agreed, expected", [
    ("0", True, "error: bad value; fix it.\n"),
    ("1", True, ""),                                    # the writer prints the same sentence
    ("1", False, "error (rank 1): bad value; fix it.\n"),   # this rank's own: it may differ
    (None, False, "error: bad value; fix it.\n"),        # one plain process
])
def test_report_error_prints_on_the_writer_and_only_differing_sentences_elsewhere(rank, agreed, expected,
                                                                                   monkeypatch, capsys):
    from zoo.errors import report_error

    monkeypatch.delenv("RANK", raising=False)
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
    report_error(_agreed("bad value; fix it.") if agreed else UserError("bad value; fix it."))
    assert capsys.readouterr().err == expected
