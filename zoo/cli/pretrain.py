"""``launch/pretrain.py``: pretrain GPT-2 or BERT with Megatron tensor parallelism under DeepSpeed.

    deepspeed --num_gpus 8 launch/pretrain.py --deepspeed_config ds_configs/tp8.json [--train-iters N ...]
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json   # CPU, gloo

Start from transformers-layout weights (any tp; the directory's model_type must match the preset's family):

    deepspeed --num_gpus 4 launch/pretrain.py --deepspeed_config ds_configs/tp4.json --pretrained out/hf

Resume with --load RUN_DIR, also at another --tensor-parallel-size than the checkpoint's: it is resharded
once into RUN_DIR/checkpoints/resharded/<tag>-tp<N>/ and loaded from there. Blend corpora with
--data-path W1 PREFIX1 W2 PREFIX2 ...; flags override the ds_config's zoo block.
"""

from __future__ import annotations

import argparse

from zoo.cli.runner import command_parser, run_command
from zoo.training.run_config import build_parser as run_config_parser
from zoo.training.run_config import load_run_config


def build_parser() -> argparse.ArgumentParser:
    return command_parser(run_config_parser(__doc__))


def main(argv: list[str] | None = None) -> None:
    """Pretrain; the zoo block's ``sample_prompts`` are completed at the end of the run."""
    args = build_parser().parse_args(argv)

    def work() -> None:
        from zoo.inference import sample_lines  # local: torch import cost, after parsing
        from zoo.training.pretrain import pretrain  # local: torch import cost, after parsing

        pretrain(load_run_config(args), sample_lines)

    run_command(work)
