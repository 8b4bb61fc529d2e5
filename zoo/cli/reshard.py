"""``launch/reshard.py``: convert a run's checkpoint to another (tp, pp, dp) layout once, so that later jobs
``--load`` it at that layout without moving it again. It runs on the ranks of the new layout, under the
launcher, with tp x pp x dp ranks (the on-resume move's code, each rank reading only the parts of the
checkpoint it holds), and writes a new run directory beside the source (``<run>-tp<T>pp<P>dp<D>`` unless
--out says otherwise) atomically; the source and any non-empty directory are never written to.

    deepspeed --num_gpus 2 launch/reshard.py --load runs/demo --tensor-parallel-size 1 --pipeline-model-parallel-size 2
    deepspeed --num_gpus 4 launch/reshard.py --load runs/demo --tensor-parallel-size 2 --pipeline-model-parallel-size 1 \\
        --data-parallel-size 2 --zero-stage 1 --out runs/demo-tp2

The engine is built from the settings the run kept in <run>/config.json (--deepspeed_config to use another file);
the precision stays the checkpoint's (a change is refused: see --precision). Then resume with
``--load <out> --deepspeed_config <out>/config.json`` at the new layout.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from zoo.cli.command import command_parser, run_command
from zoo.options import CommandParser, add_options, option


@dataclass(kw_only=True)
class ReshardOptions:
    """The settings of one offline conversion."""

    load: str = option(group="checkpointing", help="run directory written with --save, or its checkpoints/")
    out: str | None = option(None, group="checkpointing",
                             help="new or empty output run directory (default: <run>-tp<T>pp<P>dp<D> beside it)")
    tensor_parallel_size: int = option(group="parallelism", help="tp of the converted checkpoint")
    pipeline_model_parallel_size: int = option(1, group="parallelism", help="pp of the converted checkpoint")
    data_parallel_size: int | None = option(None, group="parallelism",
                                            help="dp of the converted checkpoint (default: ranks / (tp x pp))")
    zero_stage: int | None = option(None, group="parallelism",
                                    help="ZeRO stage 0, 1 or 2 of the converted run (default: the run's)")
    precision: str | None = option(None, group="training", choices=("fp32", "fp16", "bf16"),
                                   help="must be the checkpoint's (default); a change is refused in one sentence")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, ReshardOptions, with_defaults=True)
    parser.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                        help="the run's ds_config (default: <run>/config.json)")
    return command_parser(parser)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def work() -> None:
        from zoo.checkpoint.universal import check_conversion_not_universal  # local: torch import cost
        from zoo.errors import alike_on_every_rank
        from zoo.training.offline_reshard import convert_checkpoint, plan_conversion  # local: torch import cost
        from zoo.training.preflight import launcher_world_size

        with alike_on_every_rank():   # every rank reads the same flags and files: the writer says it once
            check_conversion_not_universal(args.load, args.deepspeed_config)
            conversion = plan_conversion(args.load, args.tensor_parallel_size, args.pipeline_model_parallel_size,
                                         args.data_parallel_size, args.zero_stage, args.precision, args.out,
                                         launcher_world_size(), args.deepspeed_config)
        record = convert_checkpoint(conversion)
        if record["writer"]:
            print(conversion_line(conversion, record), flush=True)

    run_command(work, log_level=args.log_level)


def conversion_line(conversion, record) -> str:
    """One line: what was converted, from which layout to which, and where the result is."""
    tp, pp, dp = conversion.layout
    return (f"converted {record['tag']} (iteration {record['iteration']}, {record['consumed_samples']} samples "
            f"consumed) from {record['layout']} to tp={tp} x pp={pp} x dp={dp}, {record['precision']}, in "
            f"{record['seconds']:.1f} s ({record['peak_bytes'] / 2**20:.1f} MiB peak on rank 0): {conversion.output}; "
            f"resume with --load {conversion.output} --deepspeed_config {conversion.output / 'config.json'}")
