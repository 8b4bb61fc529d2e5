"""Runs through the real `deepspeed` launcher that a test interrupts: the command line, a driver whose
iterations are slowed so a signal lands mid-run, and the iterations a run has logged so far."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.spawn import free_port

SLOW_DRIVER = """
import sys, time
from zoo.training.loop import TrainingLoop
real_step = TrainingLoop.train_step
def slow_step(self, state):
    time.sleep(0.5)           # room for the test to signal mid-run
    return real_step(self, state)
TrainingLoop.train_step = slow_step
from zoo.cli.pretrain import main
main([arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")])
"""


def launcher_command(script: str, config: Path, data: str, run: Path, *flags: str) -> list[str]:
    """`deepspeed --num_gpus 2` on a free port running ``script`` with ``--save`` and ``--load`` both ``run``."""
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
            script, "--deepspeed_config", str(config), "--data-path", data, "--save", str(run), "--load", str(run),
            *flags]


def logged_iterations(run: Path) -> list[int]:
    """The iterations of every event in ``run``'s metrics.jsonl so far ([] before the file exists)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["iteration"] for line in path.read_text().splitlines() if line.strip()]
