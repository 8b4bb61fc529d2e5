"""``finetune/sweep.py``: run a W&B sweep grid locally, no YAML editing needed (see zoo.finetune.sweep).

    python finetune/sweep.py finetune/sweeps/<task>-<size>.yaml --pretrained <BERT dir> [--data-dir DIR|hub:NAME]
        [--deepspeed-config FILE] [--project P] [--entity E] [--count N] [--out DIR] [--overwrite] [--dry-run]

Each grid point is one W&B run (offline unless WANDB_MODE says otherwise; grouped by the sweep's name) in its
own directory under --out; prints and saves the table of settings with the median over seeds, and a plot.
"""

from __future__ import annotations

import argparse
import sys

from zoo.cli.command import command_parser, run_command
from zoo.finetune.sweep import DEFAULT_PROJECT, failed_runs_sentence, run_sweep
from zoo.finetune.sweep_overrides import SweepOverrides
from zoo.options import CommandParser, add_groups, group_of

FAILED_RUNS_EXIT_CODE = 1   # the runs failed, not the sweep's own settings (those exit 2)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="finetune/sweep.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", help="a W&B sweep YAML, e.g. finetune/sweeps/race-336m.yaml")
    add_groups(parser)
    model, data, training = group_of(parser, "model"), group_of(parser, "data"), group_of(parser, "training")
    model.add_argument("--pretrained", default=None,
                       help="the BERT directory every run starts from (replaces the file's pretrained)")
    data.add_argument("--data-dir", default=None,
                      help="the task's data: a directory or hub:NAME[/CONFIG] (replaces the file's data-dir)")
    training.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config", default=None,
                          help="the ds_config of every run (replaces the file's deepspeed_config)")
    training.add_argument("--count", type=int, default=None, help="run only the first N grid points")
    training.add_argument("--dry-run", action="store_true",
                          help="check everything, print the resolved runs, run nothing")
    parallelism = group_of(parser, "parallelism")
    parallelism.add_argument("--launcher", default=None,
                             help="command prefix, e.g. 'deepspeed --num_gpus 8' (default: this python)")
    parallelism.add_argument("--in-process", action="store_true",
                             help="run every point in this process (tp = 1; saves the start-up of each run)")
    checkpointing = group_of(parser, "checkpointing")
    checkpointing.add_argument("--out", default=None, help="output directory (default runs/sweeps/<name>)")
    checkpointing.add_argument("--overwrite", action="store_true",
                               help="replace an earlier sweep's tables and runs in --out (each run gets --overwrite)")
    logging = group_of(parser, "logging")
    logging.add_argument("--project", default=None,
                         help=f"W&B project (default: the file's project, $WANDB_PROJECT, else {DEFAULT_PROJECT})")
    logging.add_argument("--entity", default=None,
                         help="W&B entity, a user or team (default: the file's entity, $WANDB_ENTITY, else W&B's)")
    logging.add_argument("--no-wandb", action="store_true",
                         help="run the grid untracked (every run gets WANDB_MODE=disabled)")
    return command_parser(parser, launched=False)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    overrides = SweepOverrides(pretrained=args.pretrained, data_dir=args.data_dir,
                               deepspeed_config=args.deepspeed_config)
    result = run_command(lambda: run_sweep(args.sweep, args.out, args.count, args.dry_run, args.launcher,
                                           args.project, in_process=args.in_process, overrides=overrides,
                                           entity=args.entity, overwrite=args.overwrite,
                                           track_wandb=not args.no_wandb),
                         teardown=False, log_level=args.log_level)
    if (failed := failed_runs_sentence(result)) is not None:
        print(f"error: {failed}", file=sys.stderr, flush=True)
        sys.exit(FAILED_RUNS_EXIT_CODE)
