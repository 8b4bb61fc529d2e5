"""Does a run fit, and how long will an iteration take? Answered from the config alone, before any GPU is rented.

:func:`plan` puts together, per rank: the exact parameter count and the model states
(:mod:`zoo.planning.model_states`: weights, gradients and Adam's state under ZeRO, DeepSpeed's own estimate
beside them), the activations (:mod:`zoo.planning.activations`, Korthikanti et al. 2022, for the family's
shape), the pipeline stages and bubble (:mod:`zoo.planning.pipeline_plan`), the context-parallel all-to-all
bytes (:mod:`zoo.planning.context_exchange`), and the time of an iteration:
Megatron's FLOPs formula generalised to the shape (:func:`zoo.planning.flops.model_flops_per_iteration`) over
an assumed model-FLOPs utilisation of the named GPU's dense peak (:mod:`zoo.planning.gpus`).
:mod:`zoo.planning.plan_report` prints it.

    python launch/plan.py --deepspeed_config ds_configs/tp8.json --num-gpus 8 [--gpu V100] [--json]   # zoo.cli.plan

All byte counts are per rank (one GPU); sizes are printed in GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from zoo.config.deepspeed_overrides import apply_overrides
from zoo.config.loading import load_run_config
from zoo.config.run_config import RunConfig
from zoo.config.validation import check_field_types, validate_for_world, validate_static
from zoo.errors import UserError
from zoo.planning.activations import (
    activation_bytes_of,
    attention_scores_bytes_of,
    embedding_activation_bytes,
    head_activation_bytes,
    layer_activation_bytes_of,
    output_activation_bytes_of,
)
from zoo.planning.context_exchange import all_to_all_bytes
from zoo.planning.flops import model_flops_per_iteration
from zoo.planning.gpus import CPU, check_precision_on, gpu_spec
from zoo.planning.model_states import (
    DTYPE_BYTES,
    accumulates_in_fp32,
    count_parameters,
    deepspeed_estimate,
    state_bytes,
    zero_stage_of,
)
from zoo.planning.pipeline_plan import bubble_fraction, plan_stages


@dataclass(frozen=True)
class Plan:
    """What one rank needs for a run; every ``*_bytes``-like field (weights ... total, margin) is bytes
    per rank. ``memory``, ``fits``, ``margin`` are None without a memory size (a CPU plan), the
    timing fields None without a GPU peak."""

    model: str
    config: str | None
    device: str
    world_size: int
    num_nodes: int
    tp: int
    dp: int
    dtype: str
    zero_stage: int
    recompute: str
    sequence_parallel: bool
    micro_batch: int
    global_batch: int
    gradient_accumulation_steps: int
    seq_length: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    padded_vocab: int
    params_total: int
    params_per_rank: int
    weights: int
    gradients: int
    optimizer: int
    model_states: int                   # weights + gradients + optimizer
    deepspeed_model_states: int | None  # DeepSpeed's own estimator's figure for them (None at stage 0: it has none)
    activations: int
    activations_layers: int
    activations_output: int
    activations_attention_scores: int   # the part of ``activations`` a fused attention kernel does not keep
    total: int
    memory: int | None
    fits: bool | None
    margin: int | None
    flops_per_iteration: float
    peak_tflops: float | None
    mfu: float
    seconds_per_iteration: float | None   # with pipeline stages: including the bubble
    pp: int = 1
    bubble_fraction: float = 0.0          # (P - 1) / (m + P - 1) of each step idle
    stages: tuple = ()                    # one StagePlan dict per pipeline stage (P > 1); the fields above: the heaviest
    kv_heads: int = 0                     # key/value heads (fewer than ``heads``: grouped-query attention)
    ffn_hidden: int = 0                   # the MLP's inner width
    ffn_matrices: int = 2                 # the MLP's GEMMs: 2 (GeLU), 3 (SwiGLU)
    cp: int = 1                           # context-parallel size: each sequence split over cp ranks (Ulysses)
    all_to_all_forward: int = 0           # bytes a rank sends in one layer's context all-to-alls per micro-batch
    all_to_all_backward: int = 0          # the same in backward (full recomputation: the forward's again)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)



def parse_memory(text: str | int) -> int:
    """Bytes of ``"32GB"``, ``"80 GiB"``, ``"16000MB"`` or a plain number of bytes.

    KB, MB, GB, TB are powers of 1000, KiB, MiB, GiB, TiB powers of 1024 (as in ``max_shard_size``).
    """
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in units or float(match.group(1)) <= 0:
        raise UserError(f"memory size {text!r} is not understood; write it like 32GB, 80GiB or 16000MB.")
    return int(float(match.group(1)) * units[match.group(2).lower()])


def run_config_of(source: RunConfig | Mapping[str, Any] | str | os.PathLike) -> RunConfig:
    """A validated :class:`RunConfig` from a RunConfig, a ds_config dict (with its zoo block) or a path."""
    if isinstance(source, RunConfig):
        check_field_types(source)
        return validate_static(apply_overrides(source))
    if isinstance(source, (str, os.PathLike)):
        return load_run_config(argparse.Namespace(deepspeed_config=str(source)))
    block = dict(source.get("zoo", {}) or {})
    known = {f.name for f in fields(RunConfig)} - {"ds_config", "ds_config_path"}
    unknown = sorted(set(block) - known)
    if unknown:
        raise UserError(f"unknown key {unknown[0]!r} in the zoo block; valid keys are {sorted(known)}.")
    config = RunConfig(**block, ds_config=copy.deepcopy(dict(source)), ds_config_path="<dict>")
    check_field_types(config)
    return validate_static(apply_overrides(config))


def model_config_of(config: RunConfig):
    """The model's config as pretraining builds it: the preset with overrides, or the shapes of the
    ``pretrained`` directory's config.json; activation checkpointing as the run config says."""
    # local: zoo.models imports torch and transformers (seconds); plan --help runs without them
    from zoo.models.families import family_of, model_config, pretrained_config

    built = model_config(config.model, **{**config.model_run_fields(), **config.model_overrides})
    if config.pretrained:
        built = pretrained_config(config.pretrained, family_of(built))
        built = built.replace(**config.model_run_fields())
    return built.validate(config.tensor_parallel_size)


def check_plan_arguments(num_gpus: int, num_nodes: int, mfu: float) -> None:
    """Device counts are positive integers and the MFU a fraction, else one sentence naming the flag."""
    for name, value in (("--num-gpus", num_gpus), ("--num-nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{name} {value!r} must be a positive integer; pass the number of devices per node "
                             "and of nodes.")
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise UserError(f"--mfu {mfu!r} must be a fraction in (0, 1]; pass e.g. --mfu 0.4.")


def check_layout_divides(config: RunConfig, num_gpus: int, num_nodes: int) -> None:
    """tp x pp x cp divides the world, else one sentence naming the layout, the devices and the fix."""
    tp, pp, world = config.tensor_parallel_size, config.pipeline_model_parallel_size, num_gpus * num_nodes
    cp = config.context_parallel_size
    if world % (tp * pp * cp) != 0:
        layout = (f"tensor_parallel_size {tp}" + (f" x pipeline_model_parallel_size {pp}" if pp > 1 else "")
                  + (f" x context_parallel_size {cp}" if cp > 1 else ""))
        raise UserError(f"{layout} of {config.ds_config_path} does not divide the {world} devices ({num_gpus} per "
                         f"node x {num_nodes} nodes); plan a multiple of {tp * pp * cp} devices.")


def check_sequence_fits(config: RunConfig, shape) -> None:
    """The run's sequences fit the model's position table, else one sentence naming both."""
    if config.seq_length > shape.max_positions:
        raise UserError(f"seq_length {config.seq_length} exceeds the {config.model} model's position table of "
                         f"{shape.max_positions}; pass a seq_length of {shape.max_positions} or less.")


def plan(source: RunConfig | Mapping[str, Any] | str | os.PathLike, num_gpus: int, *, num_nodes: int = 1,
         gpu: str = "V100", gpu_memory: str | int | None = None, mfu: float = 0.4,
         with_deepspeed_estimate: bool = True) -> Plan:
    """The per-rank memory and the iteration time of a run on ``num_gpus`` x ``num_nodes`` devices.

    ``source``: a RunConfig, a ds_config dict or the path of a ds_config JSON (its zoo block names the
    model, tp, pp, context_parallel_size, seq_length, checkpoint_activations and, in model_overrides,
    sequence_parallel and recompute_granularity; the DeepSpeed part the batch sizes, fp16/bf16/fp32 and the
    ZeRO stage). The data-parallel size is world / (tp x pp x cp), and ZeRO partitions over the dp x cp ranks
    of DeepSpeed's sequence-data-parallel group.
    ``num_gpus`` is per node, as for the deepspeed launcher: world size = num_gpus x num_nodes. ``gpu``: a name of :data:`GPUS` or ``"cpu"`` (no peak, so no timing, and no
    memory unless ``gpu_memory`` is given). ``gpu_memory``: bytes or a size like "32GB"; by default the
    GPU's memory. ``with_deepspeed_estimate`` False leaves ``deepspeed_model_states`` None, so that DeepSpeed
    is not imported (the fit check before a launch). Raises UserError/MissingInput with one sentence on
    bad input.
    """
    # local: zoo.models imports torch and transformers (seconds); plan --help runs without them
    from zoo.models.config import recompute_mode  # local: torch and transformers import cost
    from zoo.models.families import family_of  # local: torch and transformers import cost

    check_plan_arguments(num_gpus, num_nodes, mfu)
    spec = None if str(gpu).lower() == CPU else gpu_spec(gpu)
    memory = parse_memory(gpu_memory) if gpu_memory is not None else (spec.memory_bytes if spec else None)

    config = run_config_of(source)
    tp, pp, world = config.tensor_parallel_size, config.pipeline_model_parallel_size, num_gpus * num_nodes
    check_layout_divides(config, num_gpus, num_nodes)
    gas = validate_for_world(config, world)
    model_config = model_config_of(config)
    family = family_of(model_config)
    shape = family.shape(model_config)
    check_sequence_fits(config, shape)

    cp = config.context_parallel_size
    dp = world // (tp * pp * cp)
    zero_ranks = dp * cp                 # DeepSpeed's sequence-data-parallel group: ZeRO partitions over it
    dtype, zero_stage = config.dtype_name, zero_stage_of(config.ds_config)
    check_precision_on(spec, dtype, config.ds_config_path)
    fp32_accumulation = accumulates_in_fp32(config.ds_config)
    recompute = recompute_mode(model_config) or "none"
    sequence_parallel = bool(model_config.sequence_parallel) and tp > 1
    params = count_parameters(model_config, tp)
    weights, gradients, optimizer = state_bytes(params.per_rank, dtype, zero_stage, zero_ranks, fp32_accumulation)

    s, b, h, heads = config.seq_length, config.ds_config["train_micro_batch_size_per_gpu"], shape.hidden, shape.heads
    padded_vocab = model_config.padded_vocab_size(tp)
    # torch keeps dropout masks as bool on GPUs and in the input's dtype on CPU (its unfused dropout)
    widths = {"value_bytes": DTYPE_BYTES[dtype], "mask_bytes": DTYPE_BYTES[dtype] if spec is None else 1}
    layers_bytes = activation_bytes_of(shape, s, b, tp, sequence_parallel, recompute, **widths, cp=cp)
    output_bytes = output_activation_bytes_of(shape, s, b, padded_vocab, tp, sequence_parallel, **widths,
                                              mlm_transform=family.lm_head_transform, cp=cp)
    scores_held = {"none": shape.layers, "selective": 0, "full": 1}[recompute]   # full: the recomputed layer's
    scores_bytes = scores_held * attention_scores_bytes_of(shape, s, b, tp, **widths, cp=cp)
    exchange = all_to_all_bytes(shape, s, b, tp, cp, recompute, value_bytes=widths["value_bytes"])
    activations = round(layers_bytes + output_bytes)
    total = weights + gradients + optimizer + activations
    stages: tuple = ()
    params_per_rank = params.per_rank
    if pp > 1:
        stages = plan_stages(
            model_config, config.pipeline_partition_method, tp, pp, gas, recompute,
            layer_bytes=lambda mode: layer_activation_bytes_of(shape, s, b, tp, sequence_parallel, mode, **widths,
                                                               cp=cp),
            embedding_bytes=embedding_activation_bytes(shape, s, b, tp, sequence_parallel,
                                                       mask_bytes=widths["mask_bytes"], cp=cp),
            head_bytes=head_activation_bytes(shape, s, b, padded_vocab, tp, sequence_parallel, cp=cp,
                                             value_bytes=widths["value_bytes"], mlm_transform=family.lm_head_transform),
            model_state_bytes=lambda params: state_bytes(params, dtype, zero_stage, zero_ranks, fp32_accumulation))
        heaviest = max(stages, key=lambda stage: stage.total)
        weights, gradients, optimizer = heaviest.weights, heaviest.gradients, heaviest.optimizer
        activations, total, params_per_rank = heaviest.activations, heaviest.total, heaviest.params_per_rank
        layers_bytes = heaviest.activations   # per stage, the layers' and the ends' share are not told apart
        output_bytes = 0.0
    deepspeed_states = (deepspeed_estimate(params_per_rank, params.largest_layer_per_rank, zero_stage, zero_ranks)
                        if with_deepspeed_estimate else None)

    global_batch = config.ds_config["train_batch_size"]
    flops = model_flops_per_iteration(global_batch, s, shape, padded_vocab, recompute=recompute == "full")
    peak = spec.peak_tflops if spec else None
    bubble = bubble_fraction(pp, gas)
    seconds = flops / (world * peak * 1e12 * mfu) / (1 - bubble) if peak else None
    return Plan(model=config.model, config=config.ds_config_path, device=spec.name if spec else CPU,
                world_size=world, num_nodes=num_nodes, tp=tp, dp=dp, dtype=dtype, zero_stage=zero_stage,
                recompute=recompute, sequence_parallel=sequence_parallel, micro_batch=b, global_batch=global_batch,
                gradient_accumulation_steps=gas, seq_length=s, layers=shape.layers, hidden=h, heads=heads,
                vocab=shape.vocab, padded_vocab=padded_vocab, params_total=params.total,
                params_per_rank=params_per_rank, weights=weights, gradients=gradients, optimizer=optimizer,
                model_states=weights + gradients + optimizer, deepspeed_model_states=deepspeed_states,
                activations=activations, activations_layers=round(layers_bytes),
                activations_output=round(output_bytes), activations_attention_scores=round(scores_bytes),
                total=total, memory=memory,
                fits=None if memory is None else total <= memory,
                margin=None if memory is None else memory - total, flops_per_iteration=flops,
                peak_tflops=peak, mfu=mfu, seconds_per_iteration=seconds, pp=pp, bubble_fraction=bubble,
                stages=tuple(stage.as_dict() for stage in stages), kv_heads=shape.kv_heads,
                ffn_hidden=shape.ffn_hidden, ffn_matrices=shape.ffn_matrices, cp=cp,
                all_to_all_forward=round(exchange[0]), all_to_all_backward=round(exchange[1]))


__all__ = ["Plan", "check_layout_divides", "check_plan_arguments", "check_sequence_fits", "model_config_of",
           "parse_memory", "plan", "run_config_of"]
