"""A run's configuration from the command line: the ``--deepspeed_config`` file and its zoo block, the flags
over both (:data:`zoo.config.run_config.PRECEDENCE`), the Megatron shape flags moved into ``model_overrides``,
checked (:mod:`zoo.config.validation`) and returned as one :class:`~zoo.config.run_config.RunConfig`."""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Mapping

from zoo.config.deepspeed_overrides import apply_overrides, precision_flags_given
from zoo.config.ds_config_file import check_ds_config, read_ds_config
from zoo.config.run_config import RunConfig
from zoo.config.validation import check_field_types, check_input_paths, data_warnings, validate_static
from zoo.options import check_block_keys, merged_settings


def load_run_config(args: argparse.Namespace) -> RunConfig:
    """ds_config file (``--deepspeed_config``) + its zoo block, then CLI flags on top; validated."""
    path = getattr(args, "deepspeed_config", None)
    ds_config = read_ds_config(path)
    block = ds_config.get("zoo", {})
    if not isinstance(block, dict):
        check_block_keys(block, RunConfig, path)
    check_ds_config(ds_config, path, needs_optimizer=True)
    block = check_block_keys(block, RunConfig, path)
    if precision_flags_given(args):   # --fp16 or --bf16 chooses the precision: the block's choice is not read
        block = {key: value for key, value in block.items() if key not in ("fp16", "bf16")}
    config = RunConfig(**merged_settings(RunConfig, block, args), ds_config=copy.deepcopy(ds_config),
                       ds_config_path=str(path))
    check_field_types(config)
    config = check_input_paths(validate_static(apply_overrides(shape_flags_into_overrides(config))))
    if launched_as_writer():
        for warning in data_warnings(config):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    return config


LAUNCHER_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")   # torchrun/DeepSpeed, mpirun, srun


def launched_as_writer(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is global rank 0 as its launcher numbers it (a single process is), so that a
    warning found from the configuration alone is printed once, before any process group exists."""
    environ = os.environ if environ is None else environ
    for name in LAUNCHER_RANK_VARIABLES:
        if name in environ:
            return environ[name].strip() == "0"
    return True


MEGATRON_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_key_value_heads",
                        "max_position_embeddings", "make_vocab_size_divisible_by")


def shape_flags_into_overrides(config: RunConfig) -> RunConfig:
    """``config`` with the Megatron shape flags it was given moved into ``model_overrides`` (flags win over the
    block's overrides), under the field names of its preset's family; the flag fields are left unset."""
    from zoo.models.families import megatron_shape_overrides  # local: torch import cost

    flags = {name: getattr(config, name) for name in MEGATRON_SHAPE_FLAGS}
    if any(value is not None for value in flags.values()):
        config.model_overrides = {**config.model_overrides, **megatron_shape_overrides(config.model, flags)}
        for name in MEGATRON_SHAPE_FLAGS:
            setattr(config, name, None)
    return config


__all__ = ["LAUNCHER_RANK_VARIABLES", "MEGATRON_SHAPE_FLAGS", "launched_as_writer", "load_run_config",
           "shape_flags_into_overrides"]
