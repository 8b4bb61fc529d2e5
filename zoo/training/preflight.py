"""What a pretraining launch can be refused for from its config and its launcher alone, checked before
DeepSpeed is imported, a process group exists or a model is built.

- The rank grid and the batch arithmetic against the launcher's world size (micro-batch x accumulation
  steps x dp = global batch: :func:`zoo.config.validation.validate_for_world`).
- The sequence length against the model's position table.
- A model larger than the demo's without ``--data-path``: the bundled Wikipedia sample is the demo
  configs' corpus, and a paper-scale model would train on it silently (:func:`check_bundled_corpus`).
- fp16 asked for on a device without native fp16 (a CPU without AVX512-FP16/AMX, where DeepSpeed refuses
  fp16 in a traceback): one sentence naming ``--bf16`` (:func:`check_precision_supported`; the one check
  that imports DeepSpeed, for its accelerator, and only for an fp16 run).
- The planner's fit check on this rank's device (:func:`zoo.planning.fit_check.check_fit`), unless
  ``--skip-fit-check``; the device's memory is an argument, filled by the caller from the device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from zoo.config.run_config import RunConfig
from zoo.config.validation import validate_for_world
from zoo.distributed.local_rank import world_size_of
from zoo.errors import UserError
from zoo.planning.fit_check import DeviceMemory, check_fit
from zoo.planning.planner import model_config_of

__all__ = ["BUNDLED_CORPUS_MAX_LAYER_PARAMETERS", "check_before_launch", "check_bundled_corpus",
           "launcher_world_size"]

# The bundled sample holds ~0.5M GPT-2 tokens (96 Wikipedia articles). The demo presets (gpt2-tiny,
# bert-tiny) have 0.4M transformer-layer parameters; a model of more than 20 times that would only
# memorise the sample, and a paper-scale one is a config that forgot its --data-path.
BUNDLED_CORPUS_MAX_LAYER_PARAMETERS = 8_000_000


def launcher_world_size(environ: Mapping[str, str] | None = None) -> int:
    """The world size the launcher set (1 for a process started without one)."""
    return world_size_of(os.environ if environ is None else environ)


def layer_parameters(layers: int, hidden: int) -> int:
    """The transformer layers' parameters, 12 L h^2 (attention 4h^2, MLP 8h^2; biases and LayerNorms left out)."""
    return 12 * layers * hidden * hidden


def check_bundled_corpus(config: RunConfig, shape) -> None:
    """Without ``data_path`` the run reads the bundled sample: refused in one sentence for a model of more than
    :data:`BUNDLED_CORPUS_MAX_LAYER_PARAMETERS` transformer-layer parameters (``shape``: the model's)."""
    if config.data_path is not None:
        return
    size = layer_parameters(shape.layers, shape.hidden)
    if size <= BUNDLED_CORPUS_MAX_LAYER_PARAMETERS:
        return
    source = config.ds_config_path or "the config"
    raise UserError(f"{source} trains {config.model} ({shape.layers} layers of hidden size {shape.hidden}, "
                     f"{size / 1e6:,.0f}M transformer parameters) and names no --data-path, so it would read the "
                     "bundled Wikipedia sample (~0.5M tokens), which is for the demo configs (models of at most "
                     f"{BUNDLED_CORPUS_MAX_LAYER_PARAMETERS // 1_000_000}M, e.g. ds_configs/cpu_demo.json); pass "
                     "--data-path with a corpus written by launch/preprocess.py.")


def check_precision_supported(config: RunConfig) -> None:
    """An fp16 run on a device whose DeepSpeed accelerator has no native fp16 is one sentence naming ``--bf16``
    (DeepSpeed's own refusal is a ValueError traceback at ``deepspeed.initialize``)."""
    check_fp16_supported(config.dtype_name, config.ds_config_path or "the config", "--fp16 or ")


def check_fp16_supported(dtype_name: str, source: str, flag: str = "", use_bf16: str = "pass --bf16 instead") -> None:
    """:func:`check_precision_supported` for any job: ``dtype_name`` of the ds_config ``source`` (``flag``: how else
    fp16 may have been asked for, e.g. "--fp16 or "; ``use_bf16``: how the job is told to train in bf16)."""
    if dtype_name != "fp16":
        return
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed's import cost, for fp16 runs only

    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return
    raise UserError(f"fp16 is enabled (by {flag}{source}) but this {accelerator.device_name()} device has no "
                     f"native fp16, so DeepSpeed cannot train in it; {use_bf16} (bf16 runs natively here), "
                     "or run the fp16 config on a GPU.")


def check_seq_length(config: RunConfig, shape) -> None:
    if config.seq_length > shape.max_positions:
        raise UserError(f"seq_length {config.seq_length} exceeds the {config.model} model's position table of "
                         f"{shape.max_positions}; pass --seq-length {shape.max_positions} or less.")


def check_before_launch(config: RunConfig, world_size: int, memory: DeviceMemory | None) -> int:
    """Every check of the module docstring, in the order a user fixes them; returns the gradient-accumulation
    steps. ``memory``: what this rank may use on its device (None: not measured, no fit check)."""
    from zoo.models.families import shape_of  # local: torch and transformers import cost

    gas = validate_for_world(config, world_size)
    shape = shape_of(model_config_of(config))
    check_seq_length(config, shape)
    check_bundled_corpus(config, shape)
    if memory is not None and not config.skip_fit_check:
        check_fit(config, world_size, memory)
    check_precision_supported(config)   # last: the one check that imports DeepSpeed (fp16 runs only)
    return gas
