"""``launch/smoke.py``: zoo's acceptance run on the launched devices (see zoo.smoke); exit code 0 when every
check passed on every rank, 1 when one failed, 2 for a bad flag.

    deepspeed --num_gpus N launch/smoke.py [--model gpt2-1.2b] [--seq-length 1024]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from zoo.cli.command import command_parser, run_command
from zoo.options import CommandParser, add_options, option


@dataclass(kw_only=True)
class SmokeOptions:
    """The models and sizes the acceptance run trains."""

    model: str = option("gpt2-tiny", group="model",
                        help="GPT-2 or Llama preset of the language-model checks, e.g. gpt2-1.2b, llama-tiny")
    bert_model: str = option("bert-tiny", group="model", help="BERT preset of the BERT step, e.g. bert-336m")
    seq_length: int = option(32, group="data", help="tokens per sample of the language model")
    bert_seq_length: int | None = option(None, group="data",
                                         help="sequence length of the BERT step (default: --seq-length, capped at "
                                              "the BERT preset's positions, 512 for the paper's sizes)")
    tensor_parallel_size: int | None = option(None, group="parallelism", help="default: every launched rank")
    micro_batch_size: int = option(2, group="training", help="samples per rank and step")
    steps: int = option(10, group="training", help="training steps per precision")
    lr: float = option(3e-4, group="training", help="learning rate")
    seed: int = option(1234, group="training", help="seeds the weights and the data")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return command_parser(add_options(parser, SmokeOptions, with_defaults=True))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """0 when every check passed on every rank, 1 otherwise, 2 for a bad flag (checked before any collective)."""
    args = parse_args(argv)

    def work() -> int:
        import torch.distributed as dist  # local: torch import cost, after parsing

        from zoo import smoke as acceptance  # local: torch import cost, after parsing

        def started():
            acceptance.validate(args)
            return acceptance.setup(args)

        smoke = run_command(started, teardown=False, return_code=True)
        if not isinstance(smoke, acceptance.Smoke):
            return smoke
        smoke.say(f"smoke: {dist.get_world_size()} ranks on {smoke.device}, tp={smoke.parallel.tp_size} "
                  f"dp={smoke.parallel.dp_size}, {smoke.args.model} + {smoke.args.bert_model}")
        ok = acceptance.run(smoke)
        smoke.say("smoke: all checks passed" if ok else "smoke: FAILED")
        return 0 if ok else 1

    return run_command(work, return_code=True, log_level=args.log_level)
