"""``finetune/<task>.py``: finetune a (pre- or post-norm) BERT on one task through DeepSpeed at any tp degree.

    deepspeed --num_gpus 2 finetune/mnli.py --deepspeed_config ds_configs/finetune_cpu.json \\
        --pretrained <BERT dir> --data-dir <MNLI dir> [--lr --batch-size --epochs --seed --save ...]

Flags also accept ``--key=value`` (the form ``wandb agent`` passes). Started as a plain process (no
launcher) the run is a world of one.
"""

from __future__ import annotations

import argparse

from zoo.cli.command import command_parser, run_command
from zoo.errors import alike_on_every_rank
from zoo.finetune.config import build_parser as finetune_parser
from zoo.finetune.config import config_from_args


def build_parser(task: str) -> argparse.ArgumentParser:
    return command_parser(finetune_parser(task))


def main(task: str, argv: list[str] | None = None, leave_process_group: bool = True) -> None:
    """Finetune on ``task``. A process group the run creates is destroyed after it succeeds, unless
    ``leave_process_group`` is False (an in-process sweep keeps one group for all its runs)."""
    def work() -> None:
        from zoo.distributed import single_process_env  # local: torch import cost, after parsing
        from zoo.finetune.finetune_job import finetune  # local: torch import cost, after parsing

        single_process_env()
        with alike_on_every_rank():   # every rank reads the same flags and files: the writer says it once
            config = config_from_args(task, args)
        finetune(config)

    args = build_parser(task).parse_args(argv)
    run_command(work, teardown=leave_process_group, log_level=args.log_level)
