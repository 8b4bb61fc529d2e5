"""Hostile inputs and faults end in one sentence (exit 2) or go on, never in a traceback.

* a rank's standard streams: closed at start (``>&-``) or pointed at ``/dev/full``, a guarded process
  goes on, its prints and log records land in the run directory's output-rank<R>.log, and it exits 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

GUARDED_AT_START = """
import logging, sys
from tqdm import tqdm
early = logging.getLogger("early_library")
early.addHandler(logging.StreamHandler(sys.stdout))     # a library's handler, made before the guard
early.propagate = False
from zoo.operations.output_guard import guard_output, keep_output_in
guard_output()
keep_output_in(sys.argv[1])
print("a log line", flush=True)
early.warning("a library's warning")
for _ in tqdm(range(3)):
    pass
print("an error line", file=sys.stderr, flush=True)
open(sys.argv[1] + "/survived", "w").close()
"""


@pytest.mark.parametrize("stdout", ["closed", "/dev/full"])
def test_a_rank_survives_a_closed_or_full_stdout(tmp_path, stdout):
    env = dict(os.environ, RANK="1")
    if stdout == "closed":
        cmd = f'exec "{sys.executable}" -c "$0" "$1" >&-'
    else:
        cmd = f'exec "{sys.executable}" -c "$0" "$1" >/dev/full'
    proc = subprocess.run(["bash", "-c", cmd, GUARDED_AT_START, str(tmp_path)], cwd=REPO, env=env,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "survived").exists()
    log = (tmp_path / "output-rank1.log").read_text()
    assert "Traceback" not in log + proc.stderr, log + proc.stderr
    reason = "stdout was closed at start" if stdout == "closed" else "writing to stdout/stderr failed (ENOSPC"
    assert f"rank 1: {reason}" in log, log
    assert "a library's warning" in log and "an error line" in log, log
