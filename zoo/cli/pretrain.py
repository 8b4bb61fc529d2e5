"""``launch/pretrain.py``: pretrain any model family of :mod:`zoo.models.families` with Megatron tensor
parallelism under DeepSpeed.

    deepspeed --num_gpus 8 launch/pretrain.py --deepspeed_config ds_configs/tp8.json --data-path PREFIX [--lr ...]
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/cpu_demo.json   # CPU, gloo

Start from transformers-layout weights (any tp; the directory's model_type must match the preset's family):

    deepspeed --num_gpus 4 launch/pretrain.py --deepspeed_config ds_configs/tp4.json --pretrained out/hf --data-path PREFIX

Resume with --load RUN_DIR, also at another tp x pp x dp layout or ZeRO stage than the checkpoint's: each rank
reads only its own slices of the checkpoint as it loads, and nothing is written beside it (launch/reshard.py
converts a run once for many jobs). Blend corpora with
--data-path W1 PREFIX1 W2 PREFIX2 ... (without it, the demo configs read a bundled Wikipedia sample). Before
DeepSpeed starts, the layout, the batch arithmetic and the planner's fit check on this device are checked
(--skip-fit-check to start anyway).
"""

from __future__ import annotations

import argparse

from zoo.cli.command import command_parser, run_command
from zoo.config.loading import load_run_config
from zoo.config.run_config import build_parser as run_config_parser
from zoo.errors import alike_on_every_rank
from zoo.operations.stop_requests import StopRequests


def build_parser() -> argparse.ArgumentParser:
    return command_parser(run_config_parser(__doc__))


def main(argv: list[str] | None = None) -> None:
    """Pretrain; the zoo block's ``sample_prompts`` are completed at the end of the run."""
    args = build_parser().parse_args(argv)

    def work() -> None:
        # for the whole process, never removed: a stop signal at any moment, from here to the exit, is recorded
        # and ends the run at an iteration boundary with a checkpoint, or lets a finishing run finish
        requests = StopRequests()
        requests.install()
        with alike_on_every_rank():   # every rank reads the same flags and files: the writer says it once
            config = load_run_config(args)
            check_launch(config)
        if not config.exit_signal_handler:   # --no-exit-signal-handler: a signal ends the process at once
            requests.stop_handling_signals()
        from zoo.inference import sample_lines  # local: torch import cost, after parsing
        from zoo.training.pretrain import pretrain  # local: DeepSpeed's import cost, after the checks

        pretrain(config, sample_lines, requests)

    run_command(work, log_level=args.log_level)


def check_launch(config) -> None:
    """The checks of :mod:`zoo.training.preflight` against this launcher's world size and this rank's device
    memory (measured here, unless ``--skip-fit-check``), before DeepSpeed is imported; first, that neither the
    ds_config nor --load asks for a DeepSpeed universal checkpoint (zoo.checkpoint.universal)."""
    from zoo.checkpoint.universal import check_no_load_universal, check_not_universal  # local: torch import cost
    from zoo.distributed.local_rank import launcher_local_rank  # local: torch import cost, after parsing
    from zoo.planning.fit_check import device_memory  # local: torch import cost, after parsing
    from zoo.training.preflight import check_before_launch, launcher_world_size  # local: torch import cost

    check_no_load_universal(config.ds_config, config.ds_config_path)
    check_not_universal(config.load)
    memory = None if config.skip_fit_check else device_memory(launcher_local_rank())
    check_before_launch(config, launcher_world_size(), memory)
