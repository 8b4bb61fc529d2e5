"""``launch/plan.py``: does a config fit, and how long will an iteration take? Per-rank memory (weights,
gradients, optimizer, activations) and seconds per iteration, from the ds_config alone (no GPU, no process
group; see zoo.planning.planner).

    python launch/plan.py --deepspeed_config ds_configs/tp8.json --num-gpus 8 [--num-nodes 1]
        [--gpu V100|A100|H100|H200|cpu] [--gpu-memory 32GB] [--mfu 0.4] [--json]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from zoo.cli.command import command_parser, run_command
from zoo.options import CommandParser, add_options, option
from zoo.planning.gpus import CPU, GPUS
from zoo.planning.plan_report import format_plan
from zoo.planning.planner import plan


@dataclass(kw_only=True)
class PlanOptions:
    """What the plan is for: the config and the devices."""

    deepspeed_config: str = option(group="model", flag=("--deepspeed_config", "--deepspeed-config"),
                                   help="ds_config JSON with its zoo block (model, tp, seq_length, "
                                        "checkpoint_activations)")
    num_gpus: int = option(group="parallelism", flag=("--num-gpus", "--num_gpus"),
                           help="devices per node (as for the deepspeed launcher)")
    num_nodes: int = option(1, group="parallelism", flag=("--num-nodes", "--num_nodes"), help="nodes")
    gpu: str = option("V100", group="parallelism", help=f"one of {[g.name for g in GPUS] + [CPU]}")
    gpu_memory: str | None = option(None, group="parallelism",
                                    help="memory per device, e.g. 32GB or 80GiB (default: the GPU's)")
    mfu: float = option(0.4, group="training", help="assumed model-FLOPs utilisation")
    json: bool = option(False, group="logging", help="print the fields as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return command_parser(add_options(parser, PlanOptions, with_defaults=True), launched=False)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def work() -> None:
        result = plan(args.deepspeed_config, args.num_gpus, num_nodes=args.num_nodes, gpu=args.gpu,
                      gpu_memory=args.gpu_memory, mfu=args.mfu)
        print(result.to_json() if args.json else format_plan(result))

    run_command(work, teardown=False, log_level=args.log_level)
