"""Pretraining of any registered model family (:mod:`zoo.models.families`) through DeepSpeed: zoo builds
the tensor-parallel model and the data, DeepSpeed does data parallelism, loss scaling, clipping, the
optimizer, the LR schedule and checkpoint files.

    deepspeed --num_gpus 8 launch/pretrain.py --deepspeed_config ds_configs/tp8.json
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zoo.atomic import check_writable_directory
from zoo.checkpoint.files import CHECKPOINT_SUBDIR
from zoo.config.deepspeed_dict import clipped_warmup_warning, deepspeed_dict
from zoo.config.run_config import RunConfig
from zoo.config.validation import pipeline_bubble_warning, pipeline_sampling_warning, validate_for_world
from zoo.distributed import host_group, raise_on_any_rank
from zoo.errors import UserError
from zoo.models import model_config as build_model_config
from zoo.models.compiled import compile_transformer_blocks
from zoo.models.families import build_model, shape_of
from zoo.operations.output_guard import keep_output_in
from zoo.operations.stop_requests import StopRequests
from zoo.training.baselines import unigram_perplexity
from zoo.training.checkpointer import Checkpointer
from zoo.training.device_batches import pin_memory_here
from zoo.training.effective_settings import record_effective_settings
from zoo.training.library_noise import library_noise_silenced
from zoo.training.loop import LoopState, TrainingLoop
from zoo.training.loop_tasks import PretrainTask
from zoo.training.metrics import MetricsLogger, plot_loss, truncate_metrics_after
from zoo.training.pipeline import (
    PipelinePretrainTask,
    build_pipeline_model,
    pipeline_model_config,
    setup_pipeline_engine,
)
from zoo.training.pretraining_data import PretrainingData
from zoo.training.pretraining_objectives import pretrained_model
from zoo.training.run_directory import claim_pretraining_directory
from zoo.training.startup import join, setup_engine
from zoo.training.stop_conditions import StopConditions
from zoo.training.validator import Validator

__all__ = ["pretrain"]

# (model, prompts, seed, parallel state) -> printable lines; collective over every rank.
# zoo.inference.sample_lines, handed in by launch/pretrain.py (inference sits beside training, not below it).
SampleText = Callable[[torch.nn.Module, Sequence[str], int, Any, str | None], list[str]]


def build_pretraining_model(config: RunConfig, parallel, device: torch.device | str | None = None):
    """(model, model config, shape) of the run: ``--pretrained`` weights or the family's random init.

    A random init is built on ``device`` (by default the engine's accelerator device, set by
    :func:`zoo.training.startup.join` right after ``init_distributed``) under ``with torch.device(device)``:
    every parameter is allocated there and each master weight is drawn there, one tensor at a time
    (:func:`zoo.parallel.layers.init_sharded_` draws a master on the parameter's device, keeps this
    rank's slice and frees it), so no rank draws or holds the full model on the host.

    The draws come from the device's generator, which :func:`zoo.parallel.model_parallel_seed` seeds
    with the run's seed on every rank. A GPU init therefore differs from a CPU init of the same seed
    (CUDA's and the CPU's RNG streams differ), but each is identical across tp: every rank draws the
    same full masters in the same order and keeps its own slice. On CPU the device is "cpu" and the
    init is the one a plain ``build_model`` gives.
    """
    model_config = build_model_config(config.model, **{**config.model_run_fields(), **config.model_overrides})
    model = None
    if config.pretrained:  # the weights (and the shapes) of a transformers-layout directory, this rank's slices
        model = pretrained_model(config.pretrained, model_config, config.model, config.model_overrides, parallel)
        model_config = model.config
    shape = shape_of(model_config)
    check_seq_length(config, shape)
    if model is None:
        with torch.device(accelerator_device() if device is None else device):
            model = build_model(model_config, parallel)
    return model, model_config, shape


def check_seq_length(config: RunConfig, shape) -> None:
    if config.seq_length > shape.max_positions:
        raise UserError(f"seq_length {config.seq_length} exceeds the {config.model} model's position table of "
                         f"{shape.max_positions}; pass --seq-length {shape.max_positions} or less.")


def accelerator_device() -> torch.device:
    """This rank's accelerator device as DeepSpeed names it ("cuda:3", or "cpu" on a CPU run)."""
    from deepspeed.accelerator import get_accelerator  # local: DeepSpeed costs seconds to import

    return torch.device(get_accelerator().current_device_name())


def pretrain(config: RunConfig, sample_text: SampleText | None = None,
             stop_requests: StopRequests | None = None) -> dict[str, Any]:
    """Train as ``config`` says. The writer rank first claims ``--save`` (:mod:`zoo.training.run_directory`):
    a directory another run holds, or an earlier run's checkpoints under a run that does not continue
    that directory (``--load`` names it), end every rank with one sentence before the model or the engine is built and before
    anything is written there. The claim is held until this function returns or raises.

    A run that finishes with ``config.sample_prompts`` completes them with ``sample_text`` (every rank
    takes part) and the writer prints the lines after the validation perplexity. The libraries' notes that
    say nothing about a zoo run are not printed (:func:`zoo.training.library_noise.library_noise_silenced`).

    ``stop_requests`` (:class:`zoo.operations.stop_requests.StopRequests`) records the signals and the launcher's
    stop from the run's start to its end, so none ends a rank in the middle of a collective: one that comes
    before or during the loop stops every rank at an iteration boundary with a checkpoint, one that comes after
    the last iteration's stop check lets the run finish. Either way the claim on ``--save`` is released and the
    writer prints how the run ended. None: the run installs its own until it returns (``zoo.cli.pretrain``
    installs one for the whole process)."""
    if config.sample_prompts and sample_text is None:
        raise UserError("sample_prompts are set but no text sampler was given; run launch/pretrain.py, or call "
                         "pretrain(config, sample_text=zoo.inference.sample_lines).")
    requests = StopRequests(config.exit_signal_handler) if stop_requests is None else stop_requests
    installed_here = requests.install()
    try:
        with library_noise_silenced():
            return pretrain_in_process_group(config, sample_text, requests)
    finally:
        if installed_here:
            requests.uninstall()


def pretrain_in_process_group(config: RunConfig, sample_text: SampleText | None,
                              requests: StopRequests) -> dict[str, Any]:
    """:func:`pretrain` once its arguments are checked: join, claim ``--save``, run."""
    started = time.monotonic()   # --exit-duration-in-mins counts from here: the set-up is part of the job's time
    parallel = join(config.tensor_parallel_size, config.seed, config.distributed_timeout_minutes,
              config.pipeline_model_parallel_size, config.context_parallel_size)
    requests.listen_to_watch()   # the launcher watch starts as the process joins
    gas = validate_for_world(config, dist.get_world_size())
    is_writer = dist.get_rank() == 0
    lock = raise_on_any_rank(lambda: claim_pretraining_directory(
        config.save, resuming=continues_save_directory(config), overwrite=config.overwrite) if is_writer else None)
    try:
        return pretrain_in_claimed_directory(config, parallel, gas, is_writer, started, sample_text, requests)
    finally:
        if lock is not None:
            lock.release()


def continues_save_directory(config: RunConfig) -> bool:
    """Whether ``--load`` names the ``--save`` run itself (the run directory or its checkpoints/): then this
    run continues that run's metrics.jsonl; any other run into a --save holding one is refused."""
    if not config.load:
        return False
    save = Path(config.save).resolve()
    return Path(config.load).resolve() in (save, save / CHECKPOINT_SUBDIR)


def pretrain_in_claimed_directory(config: RunConfig, parallel, gas: int, is_writer: bool, started: float,
                                  sample_text: SampleText | None = None,
                                  requests: StopRequests | None = None) -> dict[str, Any]:
    """The run proper, in a claimed ``--save``: the engine, the resumed state, the data, the metrics
    file, then the loop over a :class:`PretrainTask` with its :class:`Validator` and :class:`Checkpointer`."""
    engine, model, model_config, shape, ds_config, clipping = build_engine(config, parallel, gas, is_writer)
    host = host_group(None if config.distributed_timeout_minutes is None
                      else timedelta(minutes=config.distributed_timeout_minutes))
    checkpointer = Checkpointer(engine, config, ds_config, parallel, model_config.to_hf_dict() if parallel.pp_size > 1
                                else model.hf_config_dict(), is_writer)
    state = checkpointer.resume()
    data = PretrainingData(config, model_config, parallel, engine.train_micro_batch_size_per_gpu(), engine.train_batch_size(),
                           config.data_workers, pin_memory_here(), agreement_group=host)
    logger = open_metrics(config, ds_config, state.iteration, is_writer, host)
    # once the checkpoint and the data were accepted: a refused run leaves no config.json behind
    raise_on_any_rank(lambda: record_effective_settings(config, parallel.world_size, gas) if is_writer else None)
    stop = StopConditions(exit_interval=config.exit_interval, exit_duration_minutes=config.exit_duration_in_mins,
                          handle_signals=config.exit_signal_handler, group=host, started=started, requests=requests)
    validator = Validator(engine, data, config, parallel, logger)
    task = (PipelinePretrainTask(config, data, engine, parallel, gas, shape, clipping) if parallel.pp_size > 1
            else PretrainTask(config, data, engine, parallel, gas, shape))
    loop = TrainingLoop(engine, parallel, task, logger, validator, checkpointer, stop, progress_desc="pretrain",
                        is_writer=is_writer)
    state = run_loop(loop, state, config, data)
    if state.stopped_by is not None and is_writer:
        print(f"stopped by {state.stopped_by} after iteration {state.iteration}: checkpoint "
              f"{checkpointer.tag_directory(state.iteration)}; resume with --load {Path(config.save)}", flush=True)
    samples = []
    if config.sample_prompts and state.stopped_by is None and parallel.pp_size == 1 and parallel.cp_size == 1:   # every rank decodes; the writer prints
        samples = sample_text(engine.module, config.sample_prompts, config.seed, parallel, config.tokenizer)
    if logger.is_writer and state.stopped_by is None:
        if stop.received:   # too late to stop: the run is complete
            print(f"{stop.received[0]} came after the last stop check, as the run was finishing: it finished, and "
                  f"its last checkpoint is its end", flush=True)
        print_summary(Path(config.save), state.iteration, state.last_event, validator.means, data, config, shape,
                      samples)
    logger.close()
    return {**state.last_event, "val_loss": validator.loss, "stopped_by": state.stopped_by}


def build_engine(config: RunConfig, parallel, gas: int, is_writer: bool):
    """(engine, model, model config, shape, ds_config, clipping) of the run: the model
    (:func:`build_pretraining_model`, or this rank's pipeline stage), its blocks compiled with ``--compile``,
    DeepSpeed's activation checkpointing when ``--checkpoint-activations`` or ``--recompute-granularity`` asks
    for it, and the engine over both
    (DeepSpeed's pipeline engine with stages; ``clipping`` is then zoo's fp32 clipping hook, else None)."""
    import deepspeed  # local: DeepSpeed costs seconds to import

    ds_config = deepspeed_dict(config, gas)
    for warning in (clipped_warmup_warning(config), pipeline_bubble_warning(config, gas),
                    pipeline_sampling_warning(config)):
        if is_writer and warning:
            print(f"warning: {warning}", file=sys.stderr)
    weight_decay = ds_config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.01)
    if parallel.pp_size > 1:
        model_config = raise_on_any_rank(lambda: pipeline_model_config(config))
        shape = shape_of(model_config)
        check_seq_length(config, shape)
        if config.recompute:
            deepspeed.checkpointing.configure(parallel, num_checkpoints=shape.layers)
        model = build_pipeline_model(config, model_config, parallel, accelerator_device())
        compile_blocks(config, model)
        engine, clipping = setup_pipeline_engine(model, ds_config, parallel, weight_decay, config.sequence_parallel)
        return engine, model, model_config, shape, ds_config, clipping
    # agreed: a shape every rank refuses (heads that tp does not divide) is one sentence, printed once
    model, model_config, shape = raise_on_any_rank(lambda: build_pretraining_model(config, parallel))
    if config.recompute:   # full or selective: DeepSpeed's checkpointing restores the TP RNG on recompute
        deepspeed.checkpointing.configure(parallel, num_checkpoints=shape.layers)
    compile_blocks(config, model)
    engine = setup_engine(model, ds_config, parallel, weight_decay, refresh_masters=bool(config.pretrained))
    return engine, model, model_config, shape, ds_config, None


def compile_blocks(config: RunConfig, model: torch.nn.Module) -> int:
    """With ``--compile``, this rank's transformer blocks compiled in place (:mod:`zoo.models.compiled`), after the
    weights are in and before ``deepspeed.initialize`` sees the module (whose parameters and state_dict keys stay
    as they were); returns how many."""
    return compile_transformer_blocks(model) if config.compile else 0


def open_metrics(config: RunConfig, ds_config: dict[str, Any], iteration: int, is_writer: bool, host) -> MetricsLogger:
    """The run's metrics.jsonl (and W&B run), after every rank proved it can write into ``--save``. A run
    that continues its ``--save`` drops the events after the checkpoint's ``iteration`` (they are logged
    again) and a torn last line, warned about."""
    run_dir = Path(config.save)
    # every rank writes checkpoint files there: prove it can, before training
    raise_on_any_rank(lambda: check_writable_directory(run_dir, "--save"))
    keep_output_in(run_dir)      # where this rank's output goes if its launcher's pipes break
    resuming = continues_save_directory(config)
    logger = raise_on_any_rank(lambda: MetricsLogger(
        run_dir, is_writer, config.wandb_project, resume=resuming, group=host,
        tensorboard_dir=config.tensorboard_dir, resumed_at=iteration if resuming else 0,
        wandb_config={"zoo": {k: v for k, v in vars(config).items() if k != "ds_config"}, "deepspeed": ds_config}))
    if resuming:
        raise_on_any_rank(lambda: truncate_metrics_after(logger.path, iteration) if is_writer else None, group=host)
    return logger


def run_loop(loop: TrainingLoop, state: LoopState, config: RunConfig, data: PretrainingData) -> LoopState:
    """``loop.run(state)``, a timed-out collective said as what happened (:func:`timeout_error`); the data
    loader's workers end either way."""
    try:
        return loop.run(state)
    except RuntimeError as err:   # gloo's timeouts are RuntimeErrors, NCCL's DistBackendErrors (a subclass)
        converted = timeout_error(err, config, state)
        if converted is err:
            raise
        raise converted from err
    finally:
        data.close()


def timeout_error(err: Exception, config: RunConfig, state: LoopState) -> Exception:
    """A collective that timed out, said as what happened: another rank did not arrive in time."""
    if "timed out" not in str(err).lower():
        return err
    limit = (f"--distributed-timeout-minutes {config.distributed_timeout_minutes:g}"
             if config.distributed_timeout_minutes else "the default process-group timeout")
    return RuntimeError(f"rank {dist.get_rank()} waited longer than {limit} for the other ranks after iteration "
                        f"{state.iteration}: a rank did not arrive (it hangs or died; its own output says which), so "
                        "the job ends here instead of hanging.")


def print_summary(run_dir: Path, iteration: int, last: dict[str, Any], validation: dict[str, float],
                  data: PretrainingData, config: RunConfig, shape, samples: Sequence[str] = ()) -> None:
    """The end of a run on the writer: loss.png and the lines the demo prints (``validation``: the last
    validation's means, said by the objective's ``validation_line``; ``samples``: the end-of-run sample
    lines, printed after it). The unigram baseline is computed on the small bundled corpus only."""
    plot_loss(run_dir)
    if "loss" in validation:
        unigram = unigram_perplexity(data.indexed, config.split, shape.vocab) if data.is_bundled_corpus else None
        print(data.objective.validation_line(validation, unigram))
    for line in samples:
        print(line)
    if closing := data.objective.closing_line(last):
        print(closing)
    print(f"done: {iteration} iterations, final train loss {last.get('loss', float('nan')):.4f}; "
          f"metrics in {run_dir / 'metrics.jsonl'}, plot in {run_dir / 'loss.png'}, "
          f"checkpoints in {run_dir / CHECKPOINT_SUBDIR}")
