"""``launch/import_megatron.py``: import a Megatron-LM GPT checkpoint (any tp and pp, checkpoint_version 0 to
3.0, legacy ``release/`` too) into a transformers GPT-2 directory, from which zoo finetunes or continues
training at any layout (``GPT2LMHeadModel.from_pretrained(out, parallel=parallel)``), in one process.

    python launch/import_megatron.py --load <megatron --save dir> --out hf/ [--iteration 2000]
        [--vocab-size 50257] [--dtype float32|bfloat16|float16]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from zoo.cli.command import command_parser, run_command
from zoo.dtypes import add_dtype_argument, torch_dtype
from zoo.options import CommandParser, add_options, group_of, option


@dataclass(kw_only=True)
class ImportOptions:
    """The settings of one import."""

    load: str = option(group="checkpointing",
                       help="Megatron-LM checkpoint directory (its --save: latest_checkpointed_iteration.txt, "
                            "iter_*/ or release/), or one iteration's directory")
    iteration: int | None = option(None, group="checkpointing",
                                   help="iteration to import (default: the one the tracker file names)")
    out: str = option(group="checkpointing", help="output directory: new or empty (written atomically)")
    vocab_size: int | None = option(None, group="model",
                                    help="real vocabulary rows to keep; Megatron's padding rows are cut "
                                         "(default: the args' vocab_size, else GPT-2 BPE's 50257)")
    max_shard_size: str | None = option(None, group="checkpointing",
                                        help="split the weights into indexed shards above this size, e.g. 2GB "
                                             "(default: transformers' 5GB)")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, ImportOptions, with_defaults=True)
    add_dtype_argument(group_of(parser, "model"), None, "dtype of the written weights (default: the checkpoint's)")
    return command_parser(parser, launched=False)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    def work() -> None:
        from zoo.checkpoint.hf.hf_io import max_shard_size_of  # local: torch import cost, after parsing
        from zoo.checkpoint.megatron_import import import_megatron  # local: torch import cost, after parsing

        size = max_shard_size_of(args.max_shard_size)
        result = import_megatron(args.load, args.out, args.iteration, args.vocab_size, torch_dtype(args.dtype), size)
        config = result.config
        print(f"imported {result.iteration_dir} (Megatron-LM checkpoint_version {result.checkpoint_version:g}, "
              f"tp={result.tp_size}, pp={result.pp_size}) to {result.out}: GPT-2 with {config.n_layer} layers, "
              f"n_embd {config.n_embd}, {config.n_head} heads, {config.n_positions} positions, vocab "
              f"{config.vocab_size}, {config.activation_function}, in {str(result.dtype).replace('torch.', '')}")

    run_command(work, teardown=False, log_level=args.log_level)
