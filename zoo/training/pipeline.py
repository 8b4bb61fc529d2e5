"""Pretraining with pipeline stages (``--pipeline-model-parallel-size P > 1``): the family's stage module
(its registry entry's ``pipeline``: :mod:`zoo.models.gpt2.pipeline`, :mod:`zoo.models.llama.pipeline`), DeepSpeed's
pipeline engine over it, the task that runs an iteration as
one ``engine.train_batch`` (the 1F1B schedule over the iteration's m micro-batches), and validation through
``engine.eval_batch``.

What zoo adds to DeepSpeed's engine:

* **Clipping in fp32.** DeepSpeed's fp32 clipping (``clip_grad_norm_``) counts a replicated parameter only
  on the rank whose model-parallel rank is 0, and with pipeline stages that rank is the first stage's first
  TP rank alone: the LayerNorms and biases of every other stage would be left out of the norm (and the tied
  embedding counted twice). A P > 1 fp32 run therefore hands DeepSpeed ``gradient_clipping`` 0 and clips
  in a step pre-hook of the optimizer with :func:`zoo.training.grad_norm.global_grad_norm` over every stage
  and TP rank, with DeepSpeed's rule (coefficient max_norm / (norm + 1e-6), applied when below 1); that norm
  is the one logged. fp16/bf16 and ZeRO-1 runs keep DeepSpeed's own clipping and its norm.
* **The fp16 loss scale, once.** DeepSpeed's pipeline engine calls its own ``backward`` on the last stage's
  loss, which (DeepSpeed 0.19, without ZeRO) leaves the loss scale S out while both fp16 optimizers divide by
  it: zoo hooks the loss function's losses to apply S where DeepSpeed did not
  (:func:`zoo.training.loss_scaling.scale_pipeline_losses_once`).
* **FP16_UnfusedOptimizer's clip norm over every stage and TP rank.** That optimizer measures its norm on
  the gradient tensors, so each gradient is tagged as its parameter is, whenever autograd accumulates into it
  (:func:`zoo.training.grad_norm.keep_gradients_tagged`): the tied embedding counted once, the sharded
  gradients of every TP rank counted. Its norm still carries S (DeepSpeed#8588): zoo logs it divided by S.
* **A lean step.** The non-finite check of the fp16 optimizers is one host synchronisation, and at dp = 1 the
  gradients are not all-reduced (:func:`zoo.training.lean_step.lighten_step`).
* **Sequence parallelism.** Under SP the activation sent between stages is this TP rank's own tokens, so
  DeepSpeed's partitioning of stage activations across the TP group (which assumes they are replicated)
  is turned off.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from zoo.config.run_config import RunConfig
from zoo.distributed import raise_on_any_rank
from zoo.operations.library_output import prints_dropped
from zoo.training.grad_norm import (
    current_loss_scale,
    deepspeed_reports_true_norm,
    global_grad_norm,
    keep_gradients_tagged,
)
from zoo.training.loop_tasks import PretrainTask
from zoo.training.loss_scaling import scale_pipeline_losses_once
from zoo.training.pretraining_data import PretrainingData

__all__ = ["pipeline_ds_dict", "build_pipeline_model", "setup_pipeline_engine", "StageGradClipping",
           "PipelinePretrainTask", "pipeline_validation_means", "is_pipeline_engine", "pipeline_grad_norm",
           "stage_pairs"]

CLIP_EPS = 1e-6   # DeepSpeed's clip_grad_norm_: coefficient max_norm / (norm + 1e-6)


def zoo_clips(ds: dict[str, Any]) -> bool:
    """Whether zoo, not DeepSpeed, clips a pipeline run of this ds_config (fp32 without ZeRO)."""
    mixed = any((ds.get(name) or {}).get("enabled") for name in ("fp16", "bf16"))
    zero = (ds.get("zero_optimization") or {}).get("stage", 0) > 0
    return not (mixed or zero)


def pipeline_ds_dict(ds: dict[str, Any], sequence_parallel: bool) -> tuple[dict[str, Any], float]:
    """(the ds_config a pipeline engine is given, the max norm zoo clips to: 0 where DeepSpeed clips)."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT  # local: DeepSpeed costs seconds

    ds = copy.deepcopy(ds)
    pipeline = ds.setdefault("pipeline", {})
    pipeline.setdefault("activation_checkpoint_interval", 0)   # zoo's layers recompute themselves
    if sequence_parallel:   # each TP rank sends its own tokens: nothing replicated to partition
        pipeline["pipe_partitioned"] = pipeline["grad_partitioned"] = False
    clip = 0.0
    if zoo_clips(ds):
        clip = float(ds.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT))
        ds["gradient_clipping"] = 0.0
    return ds, clip


def pipeline_model_config(config: RunConfig):
    """The model config of a pipeline run: the preset's, or with ``--pretrained`` the directory's (checked as a
    one-stage run checks it), with the run's dropout, recomputation and sequence-parallel fields."""
    from zoo.models import model_config as build_model_config
    from zoo.models.families import family_of, pretrained_config
    from zoo.training.pretraining_objectives import pretrained_overrides

    preset = build_model_config(config.model, **{**config.model_run_fields(), **config.model_overrides})
    if not config.pretrained:
        return preset
    kept = pretrained_overrides(config.pretrained, preset, config.model, config.model_overrides)
    return pretrained_config(config.pretrained, family_of(preset)).replace(**kept)


def build_pipeline_model(config: RunConfig, model_config, parallel, device):
    """(this rank's stage module, model config): ``--pretrained`` weights (this stage's tensors, this rank's
    slices) or the one-stage model's random init of ``--seed``, built on ``device`` (the family's
    :class:`zoo.models.families.PipelineStages`)."""
    from zoo.models.families import family_of

    stages = family_of(model_config).pipeline
    with torch.device(device), prints_dropped():   # DeepSpeed's PipelineModule prints its seed settings
        module = stages.build(model_config, parallel, config.seed, config.pipeline_partition_method,
                              replay_init=not config.pretrained)
    if config.pretrained:
        with torch.no_grad():
            raise_on_any_rank(lambda: stages.load_weights(module, config.pretrained, parallel))
    return module


def setup_pipeline_engine(module, ds_config: dict[str, Any], parallel, weight_decay: float, sequence_parallel: bool):
    """DeepSpeed's pipeline engine over ``module`` (its mpu is the module's grid, built from ``parallel.topology``),
    bf16 gradients accumulated in fp32, zoo's fp32 clipping hooked to the optimizer, the fp16 loss scale applied
    once, the gradients tagged for FP16_UnfusedOptimizer's norm and the step lightened (see the module doc);
    returns (engine, clipping)."""
    import deepspeed  # local: DeepSpeed costs seconds to import

    from zoo.models.families import param_groups
    from zoo.operations.cuda_arch import fit_cuda_arch_list_for_deepspeed
    from zoo.training.engine import announce_fused_adam_build, refresh_fp32_master_weights
    from zoo.training.lean_step import lighten_step
    from zoo.training.startup import engine_ds_config

    ds, clip = pipeline_ds_dict(engine_ds_config(ds_config), sequence_parallel)
    fit_cuda_arch_list_for_deepspeed()
    announce_fused_adam_build(ds, torch.distributed.get_rank() == 0)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=param_groups(module, weight_decay),
                                           config=ds)
    check_same_grid(engine, parallel)
    lighten_step(engine)
    refresh_fp32_master_weights(engine)
    scale_pipeline_losses_once(engine)
    keep_gradients_tagged(engine)
    clipping = StageGradClipping(module, parallel, clip) if zoo_clips(ds) else None
    if clipping is not None:
        engine.optimizer.register_step_pre_hook(clipping)
    return engine, clipping


def check_same_grid(engine, parallel) -> None:
    """DeepSpeed's grid and zoo's ParallelState place this rank at the same (pp, dp, tp) coordinates."""
    grid = engine.grid
    mine = (parallel.pp_rank, parallel.dp_rank, parallel.tp_rank)
    theirs = (grid.get_stage_id(), grid.get_data_parallel_rank(), grid.get_slice_parallel_rank())
    if mine != theirs:
        raise RuntimeError(f"rank {parallel.rank}: zoo's grid says (pp, dp, tp) = {mine}, DeepSpeed's {theirs}; both are "
                           "built from one topology, so this is a bug: report it with the launch command.")


class StageGradClipping:
    """Optimizer step pre-hook of an fp32 pipeline run: the norm of the gradients over every stage and TP rank
    (:func:`global_grad_norm`, after DeepSpeed averaged them over dp and summed the tied copies), kept as
    ``norm`` for the log, and the gradients scaled by min(1, max_norm / (norm + 1e-6)) when ``max_norm`` > 0."""

    def __init__(self, module, parallel, max_norm: float):
        self.module, self.parallel, self.max_norm = module, parallel, max_norm
        self.norm: torch.Tensor | None = None

    @torch.no_grad()
    def __call__(self, optimizer, args, kwargs) -> None:
        norm = global_grad_norm(self.module, self.parallel)
        self.norm = norm
        if self.max_norm <= 0:
            return
        coefficient = (self.max_norm / (norm + CLIP_EPS)).clamp(max=1.0)
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(coefficient.to(param.grad.dtype))


def is_pipeline_engine(engine) -> bool:
    return hasattr(engine, "train_batch") and hasattr(engine, "is_last_stage")


def stage_pairs(batches: list[dict[str, torch.Tensor]], device):
    """The iterator the pipeline engine reads: (inputs for the first stage, labels for the last), per micro-batch,
    already on the engine's ``device`` (:func:`on_device`): every copy is queued before the schedule starts."""
    return iter([(on_device(batch["input_ids"], device), on_device(batch["labels"], device)) for batch in batches])


def on_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """``tensor`` on ``device``: as it is when it is there; from the host to an accelerator through pinned memory
    and without blocking the host (the copy is ordered before the kernels that read it on the device)."""
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import

    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type != "cpu" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = get_accelerator().pin_memory(tensor)
    return tensor.to(device, non_blocking=True)


def pipeline_grad_norm(engine, clipping: StageGradClipping | None):
    """The last step's gradient norm over every stage and TP rank, unscaled: zoo's where zoo clips (fp32), else
    DeepSpeed's clipping norm, FP16_UnfusedOptimizer's divided by the loss scale it still carries
    (:func:`zoo.training.grad_norm.deepspeed_reports_true_norm`). None before the first step."""
    if clipping is not None:
        return clipping.norm
    norm = engine.get_global_grad_norm()
    if norm is None or deepspeed_reports_true_norm(engine):
        return norm
    return float(norm) / current_loss_scale(engine.optimizer)


class PipelinePretrainTask(PretrainTask):
    """GPT-2 pretraining over pipeline stages: an iteration is one ``engine.train_batch`` over its m
    micro-batches; the loss DeepSpeed returns is already the mean over them and over the DP replicas (and
    is the same on every stage). The logged grad norm is :func:`pipeline_grad_norm`."""

    def __init__(self, config: RunConfig, data: PretrainingData, engine, parallel, gas: int, shape,
                 clipping: StageGradClipping | None):
        super().__init__(config, data, engine, parallel, gas, shape)
        self.clipping = clipping
        self.uses_own_norm = clipping is not None or not deepspeed_reports_true_norm(engine)

    def train_iteration(self, engine, batches: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], int]:
        loss = engine.train_batch(stage_pairs(batches, engine.device))
        return {"loss": loss.detach().double()}, 1

    def own_grad_norm(self, engine):
        return pipeline_grad_norm(engine, self.clipping) if self.uses_own_norm else None


def pipeline_validation_means(engine, data: PretrainingData, config: RunConfig) -> dict[str, float]:
    """The validation loss over the valid split's first ``eval_iters`` global batches, through the pipeline: one
    ``engine.eval_batch`` per global batch, whose loss DeepSpeed averages over its micro-batches and the DP replicas.
    That is the mean over every scored token, as a one-stage engine computes it
    (:func:`zoo.training.validator.validation_means`), because the pipelined families are causal LMs whose samples
    all score ``seq_length - 1`` tokens: every micro-batch and every global batch weighs the same."""
    total = 0.0
    with contextlib.closing(data.valid_iterations(config.eval_iters)) as iterations:
        for batches in iterations:
            total += float(engine.eval_batch(stage_pairs(batches, engine.device), num_micro_batches=len(batches)))
    engine.train()
    return {"loss": total / config.eval_iters}
