"""Does a run fit, and how long will an iteration take? Answered from the config alone, before any GPU is rented.

Parameters are counted exactly: the model is built on the meta device at the config's tp degree (vocab
padding included), nothing allocated. Per-rank bytes follow the usual accounting of mixed-precision
training with Adam (Rajbhandari et al. 2020, "ZeRO", section 3.1), under ZeRO stages 1 and 2 what
DeepSpeed 0.19's optimizer holds at the peak of its step (measured; DeepSpeed's own estimate is printed
beside it), and the activation formulas of
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (section 4).
Every formula reads the family's shape from the registry (:class:`zoo.models.families.ModelShape`: heads
and key/value heads, MLP width and GEMMs, norm, dropouts, attention kernel), so GPT-2 and BERT get the
paper's numbers and Llama its own. Time is Megatron's FLOPs formula generalised to the shape
(:func:`zoo.planning.flops.model_flops_per_iteration`) over an
assumed model-FLOPs utilisation of the named GPU's dense peak.

    python launch/plan.py --deepspeed_config ds_configs/tp8.json --num-gpus 8 [--gpu V100] [--json]   # zoo.cli.plan

All byte counts are per rank (one GPU); sizes are printed in GB = 10^9 bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from zoo.config.deepspeed_overrides import apply_overrides
from zoo.config.run_config import (
    RunConfig,
    check_field_types,
    load_run_config,
    validate_for_world,
    validate_static,
)
from zoo.errors import UserError
from zoo.planning.flops import model_flops_per_iteration
from zoo.planning.pipeline_plan import bubble_fraction, plan_stages


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model: dense fp16/bf16 tensor-core peak (TFLOP/s, no sparsity), its memory in bytes, and whether it
    has bf16 at all (the V100 computes fp16 only)."""

    name: str
    peak_tflops: float
    memory_bytes: int
    bf16: bool = True


# The one table of GPU peaks in zoo (launch/smoke.py's MFU reads it too). Matched against device names by
# fragment, most specific first ("H100 PCIe" before "H100").
GPUS = (
    GpuSpec("H100 PCIe", 756.0, 80 * 10**9),
    GpuSpec("H100 NVL", 835.0, 94 * 10**9),
    GpuSpec("H100", 989.4, 80 * 10**9),      # SXM
    GpuSpec("H200", 989.4, 141 * 10**9),
    GpuSpec("A100", 312.0, 80 * 10**9),
    GpuSpec("V100", 125.0, 32 * 10**9, bf16=False),
)
CPU = "cpu"
RECOMPUTE_MODES = ("none", "selective", "full")
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def check_precision_on(spec: GpuSpec | None, dtype: str, source: str | None) -> None:
    """A run in bf16 planned on a GPU without bf16 (the V100) is one sentence naming the GPUs that have it."""
    if spec is not None and dtype == "bf16" and not spec.bf16:
        with_bf16 = ", ".join(gpu.name for gpu in GPUS if gpu.bf16)
        raise UserError(f"{source or 'the config'} trains in bf16, which the {spec.name} does not have; train in "
                         f"fp16 there (--fp16), or plan for a GPU with bf16 (--gpu one of {with_bf16}).")


def peak_tflops_of(device_name: str) -> float | None:
    """Dense peak of the first table row whose name is part of ``device_name`` (e.g. torch's
    "NVIDIA A100-SXM4-80GB"); None for an unknown device."""
    return next((gpu.peak_tflops for gpu in GPUS if gpu.name in device_name), None)


def gpu_spec(name: str) -> GpuSpec:
    """The table row named ``name`` (case-insensitive)."""
    for gpu in GPUS:
        if gpu.name.lower() == name.strip().lower():
            return gpu
    raise UserError(f"GPU {name!r} is not in the planner's table; pass --gpu one of "
                     f"{[gpu.name for gpu in GPUS] + [CPU]}.")


# ---------------------------------------------------------------------------------------------- activations
def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise UserError(f"recompute {recompute!r} is not a mode; use one of {list(RECOMPUTE_MODES)}.")


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", *, value_bytes: int = 2, mask_bytes: int = 1) -> float:
    """Bytes one transformer layer keeps for its backward (Korthikanti et al. 2022, section 4).

    With 16-bit values (``value_bytes`` = 2) and 1-byte dropout masks the paper's totals are

        no parallelism:                       s b h (34 + 5 a s / h)
        tensor parallel t:                    s b h (10 + 24/t + 5 a s / (h t))
        tensor + sequence parallel:           s b h (34/t + 5 a s / (h t))

    and selective recomputation (the attention core, softmax and its dropout, is recomputed) drops the
    5 a s / h term. The parts: LayerNorm inputs 4sbh, the inputs of the QKV and first MLP GEMMs 2sbh
    each and two dropout masks 2sbh are replicated over TP ranks (10sbh, split only by sequence
    parallelism); Q, K, V, the output-projection input, the GeLU input and the second MLP GEMM's input
    (24sbh) are split by tp; the attention scores' softmax, its dropout mask and the dropout's output
    (5as^2b) are split by tp. For value width v and mask width m the same parts give 4v + 2m, 12v and
    2v + m (torch keeps bool masks on CUDA, m = 1, but masks of the input's dtype on CPU, m = v).
    ``recompute="full"`` keeps only the layer's input: v s b h (divided by t with sequence parallelism).
    """
    _check_recompute(recompute)
    v, m = value_bytes, mask_bytes
    if recompute == "full":
        return v * s * b * h / (t if sequence_parallel else 1)
    replicated = (4 * v + 2 * m) * s * b * h
    split = 12 * v * s * b * h
    per_layer = (replicated / t if sequence_parallel else replicated) + split / t
    if recompute == "none":
        per_layer += attention_scores_bytes(s, b, a, t, value_bytes=v, mask_bytes=m)
    return per_layer


def attention_scores_bytes(s: int, b: int, a: int, t: int = 1, *, value_bytes: int = 2,
                           mask_bytes: int = 1) -> float:
    """The 5 a s^2 b / t of one layer in 16-bit: softmax output, dropout mask, dropout output,
    (2v + m) a s^2 b / t. Selective recomputation does not keep them, nor does a fused attention kernel
    (SDPA's flash or memory-efficient attention, which zoo's layers call): that kernel keeps the
    output and a log-sum-exp per row instead."""
    return (2 * value_bytes + mask_bytes) * a * s * s * b / t


def activation_bytes(s: int, b: int, h: int, a: int, L: int, t: int = 1, sequence_parallel: bool = False,
                     recompute: str = "none", *, value_bytes: int = 2, mask_bytes: int = 1) -> float:
    """Bytes the L transformer layers hold at the peak of a micro-batch's backward.

    Without recomputation or with selective recomputation: L times :func:`layer_activation_bytes`.
    With full recomputation every layer keeps its input (2 s b h L in 16-bit) and the layer being
    recomputed briefly holds its whole working set again, one layer's activations without
    recomputation: L v s b h + s b h (34 + 5 a s / h) at t = 1 in 16-bit.
    """
    widths = {"value_bytes": value_bytes, "mask_bytes": mask_bytes}
    kept = L * layer_activation_bytes(s, b, h, a, t, sequence_parallel, recompute, **widths)
    if recompute != "full":
        return kept
    return kept + layer_activation_bytes(s, b, h, a, t, sequence_parallel, "none", **widths)


def output_activation_bytes(s: int, b: int, h: int, vocab: int, t: int = 1, sequence_parallel: bool = False, *,
                            value_bytes: int = 2, mask_bytes: int = 1, mlm_transform: bool = False) -> float:
    """Bytes outside the layers that a micro-batch keeps for backward: embeddings, final LayerNorm, LM head.

    - the embedding dropout mask, m s b h bytes (Korthikanti section 4.3: s b h);
    - the final LayerNorm's input and the LM-head GEMM's input, v s b h each (section 4.3's 4sbh in 16-bit);
    - with ``mlm_transform`` (BERT's MLM head: dense, GeLU, LayerNorm before the decoder) their three
      inputs, 3 v s b h;
    these are replicated over TP ranks unless sequence parallelism splits them by t. And the logits,
    vocab-parallel (this rank's V/t columns), :func:`logits_bytes_per_element` each: s b V / t times v in
    16-bit, 2v in fp32; Korthikanti counts the 4 s b V / t of fp32 logits.
    The embedding lookups themselves keep only the token ids.
    """
    hidden_terms = mask_bytes * s * b * h + 2 * value_bytes * s * b * h
    if mlm_transform:
        hidden_terms += 3 * value_bytes * s * b * h
    if sequence_parallel:
        hidden_terms /= t
    logits = logits_bytes_per_element(value_bytes) * s * b * vocab / t
    return hidden_terms + logits


def logits_bytes_per_element(value_bytes: int) -> int:
    """Bytes per logit that a micro-batch keeps until backward: the logits in the compute dtype (zoo's forward
    returns them, and in 16-bit the fused cross-entropy recomputes its softmax from them in backward) and, for
    fp32 logits, the buffer the cross-entropy fills in forward with exp(z - m), which backward finishes in
    place as the gradient. Per-token statistics are left out, as for the norms."""
    return value_bytes if value_bytes < 4 else 2 * value_bytes


def norm_bytes_per_token(shape, value_bytes: int) -> int:
    """Bytes one norm of ``shape`` keeps per token for backward: a LayerNorm its input, v h; an RMSNorm
    (normalised in float32, :class:`zoo.models.llama.layers.LlamaRMSNorm`) its input in float32 and the
    normalised input before the weight, (4 + v) h. Per-row statistics (LayerNorm's mean and rstd, RMSNorm's
    1/rms: 4 or 8 bytes a token) are left out, as in Korthikanti et al."""
    if shape.norm == "rmsnorm":
        return (4 + value_bytes) * shape.hidden
    return value_bytes * shape.hidden


def layer_activation_bytes_of(shape, s: int, b: int, t: int = 1, sequence_parallel: bool = False,
                              recompute: str = "none", *, value_bytes: int = 2, mask_bytes: int = 1) -> float:
    """Bytes one transformer layer of a family's :class:`~zoo.models.families.ModelShape` keeps for its
    backward, part by part (Korthikanti et al. 2022, section 4, for any layer); for GPT-2's and BERT's shape
    it is :func:`layer_activation_bytes`. With value width v, mask width m, n query and n_kv key/value heads
    of width d and MLP width f:

    - replicated over TP ranks (split by sequence parallelism): the two norms' kept tensors
      (:func:`norm_bytes_per_token`), the input of the q/k/v GEMMs and of the MLP's first GEMMs, v h each,
      and ``layer_dropouts`` masks, m h each, per token (the q/k/v GEMMs keep their input once, and under
      sequence parallelism only this rank's s/t tokens: :func:`zoo.parallel.layers.column_parallel_linears`);
    - split by tp: the attention core and the output projection's input. Counted as Korthikanti does
      (``fused_attention`` False): Q, K, V and the projection input, v (2 n d + 2 n_kv d), plus the scores
      (:func:`attention_scores_bytes`) without recomputation. Through SDPA's fused kernel: Q, K and V as the
      kernel reads them (K and V repeated to every query head), its output, which is the projection input,
      4 v n d, and its float32 log-sum-exp, 4 n; under selective recomputation the checkpoint holds Q, K, V
      before the repeat instead, v (n d + 2 n_kv d), plus the projection input;
    - split by tp: the MLP, 2 v f (the GeLU input and the second GEMM's input) with 2 GEMMs, 4 v f with
      SwiGLU's 3 (the gate and up outputs, SiLU(gate) and the product, the down GEMM's input).

    ``recompute="full"`` keeps only the layer's input, v s b h (divided by t with sequence parallelism).
    """
    _check_recompute(recompute)
    v, m, h = value_bytes, mask_bytes, shape.hidden
    if recompute == "full":
        return v * s * b * h / (t if sequence_parallel else 1)
    replicated = (2 * norm_bytes_per_token(shape, v) + 2 * v * h + shape.layer_dropouts * m * h) * s * b
    attention, key_value = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if shape.fused_attention and recompute == "none":
        core = 4 * v * attention + 4 * shape.heads
    else:
        core = v * (2 * attention + 2 * key_value)
    mlp = v * shape.ffn_hidden * (2 if shape.ffn_matrices == 2 else 4)
    split = (core + mlp) * s * b
    per_layer = (replicated / t if sequence_parallel else replicated) + split / t
    if recompute == "none" and not shape.fused_attention:
        per_layer += attention_scores_bytes(s, b, shape.heads, t, value_bytes=v, mask_bytes=m)
    return per_layer


def attention_scores_bytes_of(shape, s: int, b: int, t: int = 1, *, value_bytes: int = 2,
                              mask_bytes: int = 1) -> float:
    """The part of a layer's bytes without recomputation that a fused attention kernel does not keep: the
    scores of :func:`attention_scores_bytes` where ``shape`` is counted that way, else 0."""
    if shape.fused_attention:
        return 0
    return attention_scores_bytes(s, b, shape.heads, t, value_bytes=value_bytes, mask_bytes=mask_bytes)


def activation_bytes_of(shape, s: int, b: int, t: int = 1, sequence_parallel: bool = False,
                        recompute: str = "none", *, value_bytes: int = 2, mask_bytes: int = 1) -> float:
    """:func:`activation_bytes` for a family's shape: its L layers at the peak of a micro-batch's backward
    (with full recomputation the layers' inputs plus one layer's whole working set)."""
    widths = {"value_bytes": value_bytes, "mask_bytes": mask_bytes}
    kept = shape.layers * layer_activation_bytes_of(shape, s, b, t, sequence_parallel, recompute, **widths)
    if recompute != "full":
        return kept
    return kept + layer_activation_bytes_of(shape, s, b, t, sequence_parallel, "none", **widths)


def embedding_activation_bytes(shape, s: int, b: int, t: int = 1, sequence_parallel: bool = False, *,
                               mask_bytes: int = 1) -> float:
    """The embeddings' share of a micro-batch: their dropout mask, m s b h (split by sequence parallelism),
    where the family has one; the lookups keep only the token ids."""
    per_token = mask_bytes * shape.hidden if shape.embedding_dropout else 0
    return per_token * s * b / (t if sequence_parallel else 1)


def head_activation_bytes(shape, s: int, b: int, vocab: int, t: int = 1, sequence_parallel: bool = False, *,
                          value_bytes: int = 2, mlm_transform: bool = False) -> float:
    """The final norm's and the LM head's share: the norm's kept tensors and the head GEMM's input, split by
    sequence parallelism, and the logits (see :func:`output_activation_bytes`)."""
    v, h = value_bytes, shape.hidden
    per_token = norm_bytes_per_token(shape, v) + v * h + (3 * v * h if mlm_transform else 0)
    return per_token * s * b / (t if sequence_parallel else 1) + logits_bytes_per_element(v) * s * b * vocab / t


def output_activation_bytes_of(shape, s: int, b: int, vocab: int, t: int = 1, sequence_parallel: bool = False, *,
                               value_bytes: int = 2, mask_bytes: int = 1, mlm_transform: bool = False) -> float:
    """:func:`output_activation_bytes` for a family's shape: the embedding dropout mask where it has one, the
    final norm's kept tensors (:func:`norm_bytes_per_token`) and the head GEMM's input, and the logits.
    Llama's rotary cos/sin tables (2 v s d, shared by the layers) are left out, as the token ids are."""
    v, h = value_bytes, shape.hidden
    per_token = (mask_bytes * h if shape.embedding_dropout else 0) + norm_bytes_per_token(shape, v) + v * h
    if mlm_transform:
        per_token += 3 * v * h
    hidden_terms = per_token * s * b
    if sequence_parallel:
        hidden_terms /= t
    return hidden_terms + logits_bytes_per_element(value_bytes) * s * b * vocab / t


# ---------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParameterCount:
    total: int        # the whole model, padded vocabulary included (tied embeddings counted once)
    per_rank: int     # TP-sharded parameters / tp + replicated ones
    largest_layer_per_rank: int = 0   # the most parameters one module holds itself, on one TP rank


def count_parameters(model_config, tp: int) -> ParameterCount:
    """Exact counts of the model built on the meta device at tensor-parallel size ``tp`` (nothing allocated).

    The model is built as TP rank 0 of a grid with no process groups: on the meta device no layer
    communicates, and every TP rank holds the same number of parameters (the vocabulary is padded to a
    multiple of 128 tp).
    """
    # local: torch import cost; the planner's arithmetic and plan --help run without torch
    import torch

    from zoo.models.families import build_model  # local: torch and transformers import cost
    from zoo.parallel.layers import is_tensor_parallel  # local: torch import cost
    from zoo.parallel.state import ParallelState  # local: torch import cost

    grid = ParallelState(tp_size=tp, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp, rank=0)
    with torch.device("meta"):
        model = build_model(model_config, grid)
    sharded = sum(p.numel() for p in model.parameters() if is_tensor_parallel(p))
    replicated = sum(p.numel() for p in model.parameters() if not is_tensor_parallel(p))
    largest = max((sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()), default=0)
    return ParameterCount(total=sharded * tp + replicated, per_rank=sharded + replicated, largest_layer_per_rank=largest)


# ---------------------------------------------------------------------------------------------- the plan
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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def zero_stage_of(ds_config: Mapping[str, Any]) -> int:
    """The ZeRO stage the DeepSpeed config enables (0 when it has no ``zero_optimization`` block)."""
    block = ds_config.get("zero_optimization") or {}
    stage = block.get("stage", 0) if isinstance(block, dict) else 0
    if stage not in (0, 1, 2, 3):
        raise UserError(f"zero_optimization.stage {stage!r} is not a ZeRO stage; use 0, 1, 2 or 3.")
    return stage


def accumulates_in_fp32(ds_config: Mapping[str, Any]) -> bool:
    """Whether the ds_config asks DeepSpeed to accumulate gradients in fp32 (``data_types.grad_accum_dtype``)."""
    return str((ds_config.get("data_types") or {}).get("grad_accum_dtype", "")).lower() in ("fp32", "float32", "float")


def state_bytes(params_per_rank: int, dtype: str, zero_stage: int, dp: int,
                fp32_grad_accumulation: bool = False) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per rank for Adam, at the peak of the optimizer step.

    bf16 at ZeRO stage 1 with ``data_types.grad_accum_dtype`` fp32 (``fp32_grad_accumulation``) runs
    DeepSpeed 0.19's BF16_Optimizer instead of its ZeRO optimizer: 2-byte weights, the module's bf16
    gradients plus a whole (unpartitioned) fp32 gradient buffer they are accumulated into, 6 bytes a
    parameter, and the fp32 master partition and moments, 12/dp: 8 + 12/dp bytes a parameter.

    Without ZeRO: fp16/bf16 (mixed precision) keeps 2-byte weights and gradients, and an fp32 master copy
    plus two fp32 Adam moments, 12 bytes a parameter (ZeRO's 16 bytes a parameter, Rajbhandari et al.
    2020, section 3.1); fp32 keeps 4-byte weights and gradients and 8 bytes of moments. DeepSpeed's fp16
    optimizer also builds fp32 gradients for a moment during its step, after the activations are freed;
    that transient is not counted.

    ZeRO stages 1 and 2, as DeepSpeed 0.19's stage-1/2 optimizer holds them (measured by
    ``benchmarks/bench_zero_states.py``, every live tensor at dp = 2 and 4, with and without gradient
    accumulation): the weights stay whole; the gradients are reduced during backward into this rank's
    partition at stage 1 as at stage 2, ``value``/dp bytes a parameter; the step turns that partition into
    an fp32 gradient partition (4/dp: a cast in mixed precision, a flat copy in fp32) that lives beside
    the fp32 master partition (4/dp, kept in fp32 training too) and the moments (8/dp). Mixed precision:
    2 + 18/dp bytes a parameter, DeepSpeed's own estimator's figure; fp32: 4 + 20/dp. The fp32 gradient
    partition is counted with the gradients, so the total with activations is an upper bound by that
    much (it lives only during the step). Stage 3 divides the weights too (its gathered-layer buffers are
    not counted; not measured).
    """
    value = DTYPE_BYTES[dtype]
    weights = value * params_per_rank
    if dtype == "bf16" and zero_stage == 1 and fp32_grad_accumulation:
        return weights, (value + 4) * params_per_rank, -(-12 * params_per_rank // dp)
    if zero_stage == 0:
        gradients = value * params_per_rank
        optimizer = (12 if value == 2 else 8) * params_per_rank
        return weights, gradients, optimizer
    gradients = -(-(value + 4) * params_per_rank // dp)      # the reduced partition and its fp32 form
    optimizer = -(-12 * params_per_rank // dp)               # fp32 master partition and two moments
    if zero_stage >= 3:
        weights = -(-weights // dp)
    return weights, gradients, optimizer


def deepspeed_estimate(params_per_rank: int, largest_layer_per_rank: int, zero_stage: int, dp: int) -> int | None:
    """DeepSpeed's own estimate of the model-state bytes per rank (no offload), or None at stage 0, for
    which it has none: ``estimate_zero2_model_states_mem_needs`` at stages 1 and 2 (DeepSpeed has no
    stage-1 estimator; its stage-1 optimizer is the stage-2 one), ``estimate_zero3_model_states_mem_needs``
    at stage 3. Its estimators know no tensor parallelism: they are given this TP rank's parameters over
    the dp ranks. DeepSpeed's start-up log lines go to stderr, so that ``--json`` stays one JSON object."""
    if zero_stage == 0:
        return None
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.zero import stage3, stage_1_and_2  # local: DeepSpeed costs seconds to import
    if zero_stage < 3:
        return int(stage_1_and_2.estimate_zero2_model_states_mem_needs(params_per_rank, num_gpus_per_node=dp,
                                                                       cpu_offload=False)[1])
    return int(stage3.estimate_zero3_model_states_mem_needs(params_per_rank, largest_layer_per_rank,
                                                            num_gpus_per_node=dp, cpu_offload=False,
                                                            cpu_offload_params=False)[1])


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
    """tp x pp divides the world, else one sentence naming the layout, the devices and the fix."""
    tp, pp, world = config.tensor_parallel_size, config.pipeline_model_parallel_size, num_gpus * num_nodes
    if world % (tp * pp) != 0:
        layout = f"tensor_parallel_size {tp}" + (f" x pipeline_model_parallel_size {pp}" if pp > 1 else "")
        raise UserError(f"{layout} of {config.ds_config_path} does not divide the {world} devices ({num_gpus} per "
                         f"node x {num_nodes} nodes); plan a multiple of {tp * pp} devices.")


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
    model, tp, seq_length, checkpoint_activations and, in model_overrides, sequence_parallel and
    recompute_granularity; the DeepSpeed part the batch sizes, fp16/bf16/fp32 and the ZeRO stage).
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

    dp = world // (tp * pp)
    dtype, zero_stage = config.dtype_name, zero_stage_of(config.ds_config)
    check_precision_on(spec, dtype, config.ds_config_path)
    fp32_accumulation = accumulates_in_fp32(config.ds_config)
    recompute = recompute_mode(model_config) or "none"
    sequence_parallel = bool(model_config.sequence_parallel) and tp > 1
    params = count_parameters(model_config, tp)
    weights, gradients, optimizer = state_bytes(params.per_rank, dtype, zero_stage, dp, fp32_accumulation)

    s, b, h, heads = config.seq_length, config.ds_config["train_micro_batch_size_per_gpu"], shape.hidden, shape.heads
    padded_vocab = model_config.padded_vocab_size(tp)
    # torch keeps dropout masks as bool on GPUs and in the input's dtype on CPU (its unfused dropout)
    widths = {"value_bytes": DTYPE_BYTES[dtype], "mask_bytes": DTYPE_BYTES[dtype] if spec is None else 1}
    layers_bytes = activation_bytes_of(shape, s, b, tp, sequence_parallel, recompute, **widths)
    output_bytes = output_activation_bytes_of(shape, s, b, padded_vocab, tp, sequence_parallel, **widths,
                                              mlm_transform=family.lm_head_transform)
    scores_held = {"none": shape.layers, "selective": 0, "full": 1}[recompute]   # full: the recomputed layer's
    scores_bytes = scores_held * attention_scores_bytes_of(shape, s, b, tp, **widths)
    activations = round(layers_bytes + output_bytes)
    total = weights + gradients + optimizer + activations
    stages: tuple = ()
    params_per_rank = params.per_rank
    if pp > 1:
        stages = plan_stages(
            model_config, config.pipeline_partition_method, tp, pp, gas, recompute,
            layer_bytes=lambda mode: layer_activation_bytes_of(shape, s, b, tp, sequence_parallel, mode, **widths),
            embedding_bytes=embedding_activation_bytes(shape, s, b, tp, sequence_parallel,
                                                       mask_bytes=widths["mask_bytes"]),
            head_bytes=head_activation_bytes(shape, s, b, padded_vocab, tp, sequence_parallel,
                                             value_bytes=widths["value_bytes"], mlm_transform=family.lm_head_transform),
            model_state_bytes=lambda params: state_bytes(params, dtype, zero_stage, dp, fp32_accumulation))
        heaviest = max(stages, key=lambda stage: stage.total)
        weights, gradients, optimizer = heaviest.weights, heaviest.gradients, heaviest.optimizer
        activations, total, params_per_rank = heaviest.activations, heaviest.total, heaviest.params_per_rank
        layers_bytes = heaviest.activations   # per stage, the layers' and the ends' share are not told apart
        output_bytes = 0.0
    deepspeed_states = (deepspeed_estimate(params_per_rank, params.largest_layer_per_rank, zero_stage, dp)
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
                ffn_hidden=shape.ffn_hidden, ffn_matrices=shape.ffn_matrices)


# ---------------------------------------------------------------------------------------------- CLI
def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def format_plan(p: Plan) -> str:
    """The readable table of ``launch/plan.py``."""
    lines = [
        f"plan: {p.model} from {p.config}: {p.world_size} x {p.device} on {p.num_nodes} node"
        f"{'s' if p.num_nodes > 1 else ''}, tp={p.tp} " + (f"pp={p.pp} " if p.pp > 1 else "") +
        f"dp={p.dp}, {p.dtype}, ZeRO stage {p.zero_stage}, recompute {p.recompute}"
        f"{', sequence parallel' if p.sequence_parallel else ''}",
        f"  batch: micro {p.micro_batch} x seq {p.seq_length}, global {p.global_batch} "
        f"({p.gradient_accumulation_steps} accumulation steps)",
        f"  model: {p.layers} layers, hidden {p.hidden}, {p.heads} heads"
        + (f" ({p.kv_heads} key/value heads)" if p.kv_heads != p.heads else "")
        + f", MLP {p.ffn_hidden} x {p.ffn_matrices} GEMMs, vocab {p.vocab} padded to {p.padded_vocab}",
        f"  parameters: {p.params_total:,} total ({p.params_total / 1e9:.2f}B), {p.params_per_rank:,} per rank",
        "  bytes per rank:",
        f"    weights      {gb(p.weights):>12}",
        f"    gradients    {gb(p.gradients):>12}",
        f"    optimizer    {gb(p.optimizer):>12}",
        f"    model states {gb(p.model_states):>12}   DeepSpeed's estimate: "
        + (gb(p.deepspeed_model_states) if p.deepspeed_model_states is not None else "none at ZeRO stage 0"),
        f"    activations  {gb(p.activations):>12}   per micro-batch: layers {gb(p.activations_layers)}, "
        f"embeddings/head/logits {gb(p.activations_output)}",
        f"{'':32}(attention scores {gb(p.activations_attention_scores)} of it, which a fused attention "
        "kernel does not keep)",
        f"    total        {gb(p.total):>12}",
    ]
    if p.pp > 1:
        lines[4] = "  bytes per rank (the heaviest pipeline stage):"
        lines[9] = (f"    activations  {gb(p.activations):>12}   the micro-batches in flight under 1F1B (up to "
                    f"{p.pp} on the first stage)")
        del lines[10]
        lines.append(f"  pipeline: {p.pp} stages, {p.gradient_accumulation_steps} micro-batches per step: "
                     f"bubble {100 * p.bubble_fraction:.1f} % of the step")
        for stage in p.stages:
            lines.append(f"    stage {stage['stage']}: {stage['layers']:>3} layers, {stage['params_per_rank']:,} "
                         f"parameters, model states {gb(stage['weights'] + stage['gradients'] + stage['optimizer'])}, "
                         f"activations {gb(stage['activations'])}, total {gb(stage['total'])}")
    if p.memory is not None:
        verdict = "fits" if p.fits else "does NOT fit"
        lines.append(f"  memory: {verdict} in {gb(p.memory)}, margin {gb(p.margin)} "
                     f"({100 * p.margin / p.memory:.0f} %)")
    compute = f"  compute: {p.flops_per_iteration / 1e15:.2f} PFLOP per iteration"
    if p.seconds_per_iteration is not None:
        compute += (f", {p.seconds_per_iteration:.2f} s per iteration at {100 * p.mfu:g} % MFU of "
                    f"{p.peak_tflops:g} TFLOP/s x {p.world_size}" + (" with the bubble" if p.pp > 1 else ""))
    else:
        compute += f" (no peak for {p.device}: no time estimate)"
    lines.append(compute)
    return "\n".join(lines)


__all__ = ["GPUS", "GpuSpec", "Plan", "activation_bytes", "activation_bytes_of", "attention_scores_bytes",
           "attention_scores_bytes_of", "count_parameters", "deepspeed_estimate", "embedding_activation_bytes",
           "head_activation_bytes", "layer_activation_bytes", "layer_activation_bytes_of", "norm_bytes_per_token",
           "output_activation_bytes", "output_activation_bytes_of", "parse_memory", "peak_tflops_of", "plan",
           "state_bytes"]
