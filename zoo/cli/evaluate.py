"""``launch/evaluate.py``: zero-shot WikiText-103 perplexity or LAMBADA accuracy of a GPT-2 or Llama checkpoint.

    python launch/evaluate.py --task wikitext --data wiki.test.tokens --load out/hf --out ppl.json
    deepspeed --num_gpus 8 launch/evaluate.py --task lambada --data lambada_test.jsonl --load out/hf \\
        --tensor-parallel-size 4          # tp=4 x dp=2
    python launch/evaluate.py --task wikitext --data wiki.test.tokens --load out/hf --dtype bfloat16
    python launch/evaluate.py --task wikitext --data wiki.test.tokens --load out/hf --tf32   # float32, TF32 GEMMs

--dtype float32 (the default) computes in full float32; on an Ampere/Hopper GPU, --tf32 (TF32 tensor cores
for float32 GEMMs) or --dtype bfloat16/float16 is several times faster. See zoo.eval.zero_shot.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from zoo.atomic import write_text_atomic
from zoo.cli.command import command_parser, run_command
from zoo.dtypes import add_dtype_argument
from zoo.options import CommandParser, add_options, group_of, option

TASKS = ("wikitext", "lambada")
TF32_HELP = ("let float32 matmuls and cuDNN use TF32 tensor cores (Ampere/Hopper GPUs: several times faster, "
             "inputs rounded to 10 mantissa bits); off by default, and a no-op on CPU")


@dataclass(kw_only=True)
class EvalOptions:
    """The settings of one zero-shot evaluation."""

    load: str = option(group="model",
                       help="HF-style GPT-2 or Llama directory (config.json + safetensors) or a zoo run directory")
    tokenizer: str | None = option(None, group="model",
                                   help="tokenizer directory (default: --load if it has one, else the bundled GPT-2 BPE)")
    task: str = option(group="data", choices=TASKS, help="the evaluation")
    data: str = option(group="data",
                       help="wiki.test.tokens / lambada_test.jsonl, or a datasets save_to_disk directory")
    split: str = option("test", group="data", help="split to take from a saved DatasetDict")
    seq_length: int | None = option(None, group="data",
                                    help="WikiText window length (default: the model's positions, 1024 for GPT-2)")
    overlap: int | None = option(None, group="data",
                                 help="WikiText window stride: tokens newly scored per window (default 32)")
    strict: bool = option(True, group="data", flag="--no-strict",
                          help="LAMBADA: predict only the last BPE token instead of the whole last word")
    batch_size: int = option(4, group="data", help="windows / passages per forward per DP rank")
    tensor_parallel_size: int = option(1, group="parallelism", help="tensor-parallel degree (the rest is dp)")
    out: str | None = option(None, group="logging", help="write the results here as JSON")
    wandb_project: str | None = option(None, group="logging", help="also log the results to this W&B project")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, EvalOptions, with_defaults=True)
    add_dtype_argument(group_of(parser, "model"), "float32", "weights and activations of the model")
    group_of(parser, "model").add_argument("--tf32", action="store_true", help=TF32_HELP)
    return command_parser(parser)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Every rank returns the results; rank 0 prints them, writes ``--out`` and logs to W&B."""
    args = build_parser().parse_args(argv)

    def work() -> dict[str, Any]:
        import torch.distributed as dist  # local: torch import cost, after parsing

        from zoo.eval import zero_shot  # local: torch import cost, after parsing
        from zoo.eval.wikitext import DEFAULT_OVERLAP  # local: torch import cost, after parsing

        if args.overlap is None:
            args.overlap = DEFAULT_OVERLAP
        if args.out:
            zero_shot.check_output_file(args.out)   # on every rank, before any work: no collective to agree on
        results = zero_shot.evaluate_checkpoint(args)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            print(zero_shot.format_results(results))
            if args.out:
                write_text_atomic(args.out, json.dumps(results, indent=2) + "\n")
            if args.wandb_project:
                zero_shot.log_to_wandb(args.wandb_project, results)
        return results

    return run_command(work, log_level=args.log_level)
