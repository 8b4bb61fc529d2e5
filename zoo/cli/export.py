"""``launch/export.py``: export a zoo DeepSpeed checkpoint of any registered family, trained at any tp degree,
to a transformers directory of the family's pretraining class (GPT2LMHeadModel, MegatronBertForPreTraining for
pre-norm BERT, BertForPreTraining for post-norm BERT, LlamaForCausalLM, ...), in one process.

    python launch/export.py --load runs/demo --out runs/demo/hf [--tag iter_0000300] [--dtype float16|bfloat16|float32]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from zoo.cli.command import command_parser, run_command
from zoo.dtypes import add_dtype_argument, torch_dtype
from zoo.options import CommandParser, add_options, group_of, option


@dataclass(kw_only=True)
class ExportOptions:
    """The settings of one export."""

    load: str = option(group="checkpointing", help="run directory written with --save, or its checkpoints/")
    tag: str | None = option(None, group="checkpointing", help="checkpoint tag (default: the one named in 'latest')")
    out: str = option(group="checkpointing",
                      help="output directory: new, empty, or a previous export (replaced atomically)")
    max_shard_size: str | None = option(None, group="checkpointing",
                                        help="split the weights into indexed shards above this size, e.g. 2GB "
                                             "(default: transformers' 5GB)")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, ExportOptions, with_defaults=True)
    add_dtype_argument(group_of(parser, "model"), None, "dtype of the written weights (default: the checkpoint's)")
    return command_parser(parser, launched=False)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def work() -> None:
        from zoo.checkpoint.deepspeed_export import export_checkpoint  # local: torch import cost, after parsing
        from zoo.checkpoint.hf.hf_io import max_shard_size_of  # local: torch import cost, after parsing
        from zoo.checkpoint.universal import check_export_not_universal  # local: torch import cost, after parsing

        check_export_not_universal(args.load, args.tag)
        size = max_shard_size_of(args.max_shard_size)
        result = export_checkpoint(args.load, args.out, args.tag, torch_dtype(args.dtype), size)
        print(f"exported {result.tag_dir} (tp={result.tp_size}"
              f"{f', pp={result.pp_size}' if result.pp_size > 1 else ''}) to {result.out} as model_type {result.model_type!r} "
              f"in {str(result.dtype).replace('torch.', '')}; model config from {result.config_source}")

    run_command(work, teardown=False, log_level=args.log_level)
