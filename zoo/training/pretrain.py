"""GPT-2 pretraining through DeepSpeed: zoo builds the tensor-parallel model and the data, DeepSpeed
does data parallelism, loss scaling, clipping, the optimizer, the LR schedule and checkpoint files.

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
from zoo.distributed import host_group, means_over_dp, process_group_left_on_success, raise_on_any_rank
from zoo.models.families import build_model, shape_of
from zoo.training.families import forward_with_metrics, pretrained_model
from zoo.training.grad_norm import current_loss_scale, deepspeed_reports_true_norm, unscaled_grad_norm
from zoo.training.loop import (LoopPlugins, LoopState, StopConditions, TrainingLoop, join, pin_memory_here,
                               setup_engine, to_device)
from zoo.training.pretraining_data import PretrainingData
from zoo.training.metrics import (MetricsLogger, megatron_flops_per_iteration, perplexity, plot_loss,
                                  truncate_metrics_after)
from zoo.checkpoint.files import CHECKPOINT_SUBDIR
from zoo.checkpoint.safe_load import weights_only_loads
from zoo.checkpoint.save import save_checkpoint
from zoo.training.resume import checkpoint_to_load
from zoo.training.run_directory import claim_pretraining_directory
from zoo.training.run_config import (RunConfig, build_parser, clipped_warmup_warning, deepspeed_dict, load_run_config,
                                     lr_schedule, schedule_change_warning, validate_for_world)
from zoo.errors import report_error



__all__ = ["pretrain", "main", "reseed_tp_rng"]

# (model, prompts, seed, parallel state) -> printable lines; collective over every rank.
# zoo.inference.sample_lines, handed in by launch/pretrain.py (inference sits beside training, not below it).
SampleText = Callable[[torch.nn.Module, Sequence[str], int, Any], list[str]]


def rng_state() -> dict[str, Any]:
    import deepspeed

    import random

    import numpy as np

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "accelerator": deepspeed.accelerator.get_accelerator().get_rng_state(),
            "tracker": deepspeed.checkpointing.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict[str, Any]) -> None:
    import deepspeed

    import random

    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    deepspeed.accelerator.get_accelerator().set_rng_state(state["accelerator"])
    deepspeed.checkpointing.get_cuda_rng_tracker().set_states(state["tracker"])


def reseed_tp_rng(seed: int, iteration: int, ps) -> None:
    """After a tp change, give the TP RNG tracker a fresh stream per TP rank.

    The tracker's stream is per TP rank (dropout inside TP regions); a checkpoint written at another tp
    has no stream for this rank's heads, so none can be carried over exactly. The new seed mixes the
    run's seed, the iteration and the TP rank, so the streams differ across ranks, across resumes at
    different iterations, and from the ones the run started with (``seed + 2718 + tp_rank``).
    """
    import deepspeed

    from zoo.parallel.random import TP_RNG_STATE_NAME, TP_SEED_OFFSET

    tracker = deepspeed.checkpointing.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(TP_RNG_STATE_NAME, seed + TP_SEED_OFFSET + ps.tp_rank + 7919 * (iteration + 1) * ps.tp_size)


def validation_means(engine, data: PretrainingData, config: RunConfig, ps) -> dict[str, float]:
    """Validation means over ``eval_iters`` micro-batches and the DP ranks: "loss", plus BERT's
    "mlm_loss", "sop_loss" and "sop_acc". Summed on the device, one synchronisation at the end."""
    engine.eval()
    sums: dict[str, torch.Tensor] = {}
    batches = data.valid_micro_batches(config.eval_iters)
    with torch.no_grad():
        for batch in batches:
            _, metrics = forward_with_metrics(engine, to_device(batch, engine.device))
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
    engine.train()
    return means_over_dp(sums, config.eval_iters, ps, engine.device)


def build_pretraining_model(config: RunConfig, ps, device: torch.device | str | None = None):
    """(model, model config, shape) of the run: ``--pretrained`` weights or the family's random init.

    A random init is built on ``device`` (by default the engine's accelerator device, set by
    :func:`zoo.training.loop.join` right after ``init_distributed``) under ``with torch.device(device)``:
    every parameter is allocated there and each master weight is drawn there, one tensor at a time
    (:func:`zoo.parallel.layers.init_sharded_` draws a master on the parameter's device, keeps this
    rank's slice and frees it), so no rank draws or holds the full model on the host.

    The draws come from the device's generator, which :func:`zoo.parallel.model_parallel_seed` seeds
    with the run's seed on every rank. A GPU init therefore differs from a CPU init of the same seed
    (CUDA's and the CPU's RNG streams differ), but each is identical across tp: every rank draws the
    same full masters in the same order and keeps its own slice. On CPU the device is "cpu" and the
    init is the one a plain ``build_model`` gives.
    """
    from zoo.models import model_config as build_model_config

    model_config = build_model_config(config.model, **{**config.model_run_fields(), **config.model_overrides})
    model = None
    if config.pretrained:  # the weights (and the shapes) of a transformers-layout directory, this rank's slices
        model = pretrained_model(config.pretrained, model_config, config.model, config.model_overrides, ps)
        model_config = model.config
    shape = shape_of(model_config)
    if config.seq_length > shape.max_positions:
        raise ValueError(f"seq_length {config.seq_length} exceeds the {config.model} model's position table of "
                         f"{shape.max_positions}; pass --seq-length {shape.max_positions} or less.")
    if model is None:
        with torch.device(accelerator_device() if device is None else device):
            model = build_model(model_config, ps)
    return model, model_config, shape


def accelerator_device() -> torch.device:
    """This rank's accelerator device as DeepSpeed names it ("cuda:3", or "cpu" on a CPU run)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def resume_state(engine, config: RunConfig, ds_config, ps, model, is_writer: bool) -> LoopState:
    """The loop state to start from: ``--load``'s checkpoint (RNG restored, the TP RNG reseeded after a tp
    change, a schedule change warned about), or a fresh start, said in one line when ``--load`` names a
    run without a checkpoint yet (so a job script can always pass ``--save X --load X``)."""
    if not config.load:
        return LoopState()
    if not has_checkpoint(config.load):
        if is_writer:
            print(f"--load {config.load}: no checkpoint yet, starting from iteration 0", flush=True)
        return LoopState()
    client = load_checkpoint(engine, config.load, ps, model.hf_config_dict())
    state = LoopState(iteration=client["iteration"], consumed_samples=client["consumed_samples"])
    set_rng_state(client["rng"])
    if "resharded_from" in client:
        reseed_tp_rng(client.get("seed", config.seed), state.iteration, ps)
    change = schedule_change_warning(client.get("lr_schedule"), lr_schedule(ds_config), state.iteration)
    if is_writer and "lr_schedule" in client and change:
        print(f"warning: {change}", file=sys.stderr)
    return state


def has_checkpoint(load: str) -> bool:
    """Whether ``--load`` names something to resume from: a run directory or checkpoints/ directory with a
    complete checkpoint (:func:`zoo.checkpoint.files.has_complete_checkpoint`). A path that does not exist
    yet, a run directory without checkpoints, or one whose only tag is a save that never finished, is a run
    to start (anything else is left to the loader's checks and their sentences)."""
    from zoo.checkpoint.files import has_complete_checkpoint

    path = Path(load)
    if not path.exists():
        return False
    if not path.is_dir():
        return True
    return has_complete_checkpoint(path)


def pretrain(config: RunConfig, sample_text: SampleText | None = None) -> dict[str, Any]:
    """Train as ``config`` says. The writer rank first claims ``--save`` (:mod:`zoo.training.run_directory`):
    a directory another run holds, or an earlier run's checkpoints under a run that does not continue
    that directory (``--load`` names it), end every rank with one sentence before the model or the engine is built and before
    anything is written there. The claim is held until this function returns or raises.

    A run that finishes with ``config.sample_prompts`` completes them with ``sample_text`` (every rank
    takes part) and the writer prints the lines after the validation perplexity."""
    if config.sample_prompts and sample_text is None:
        raise ValueError("sample_prompts are set but no text sampler was given; run launch/pretrain.py, or call "
                         "pretrain(config, sample_text=zoo.inference.sample_lines).")
    started = time.monotonic()   # --exit-duration-in-mins counts from here: the set-up is part of the job's time
    ps = join(config.tensor_parallel_size, config.seed, config.distributed_timeout_minutes)
    gas = validate_for_world(config, dist.get_world_size())
    is_writer = dist.get_rank() == 0
    lock = raise_on_any_rank(lambda: claim_pretraining_directory(
        config.save, resuming=continues_save_directory(config), overwrite=config.overwrite) if is_writer else None)
    try:
        return pretrain_in_claimed_directory(config, ps, gas, is_writer, started, sample_text)
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


def pretrain_in_claimed_directory(config: RunConfig, ps, gas: int, is_writer: bool, started: float,
                                  sample_text: SampleText | None = None) -> dict[str, Any]:
    import deepspeed

    model, model_config, shape = build_pretraining_model(config, ps)
    ds_config = deepspeed_dict(config, gas)
    if is_writer and clipped_warmup_warning(config):
        print(f"warning: {clipped_warmup_warning(config)}", file=sys.stderr)
    if config.recompute:   # full or selective: DeepSpeed's checkpointing restores the TP RNG on recompute
        deepspeed.checkpointing.configure(ps, num_checkpoints=shape.layers)
    weight_decay = ds_config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.01)
    engine = setup_engine(model, ds_config, ps, weight_decay, refresh_masters=bool(config.pretrained))
    micro, global_batch = engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()
    host = host_group(None if config.distributed_timeout_minutes is None
                      else timedelta(minutes=config.distributed_timeout_minutes))
    state = resume_state(engine, config, ds_config, ps, model, is_writer)

    data = PretrainingData(config, model_config, ps, micro, global_batch, config.data_workers,
                           pin_memory_here(), agreement_group=host)
    run_dir = Path(config.save)
    # every rank writes checkpoint files there: prove it can, before training
    raise_on_any_rank(lambda: check_writable_directory(run_dir, "--save"))
    resuming = continues_save_directory(config)
    logger = raise_on_any_rank(lambda: MetricsLogger(
        run_dir, is_writer, config.wandb_project, resume=resuming, group=host,
        wandb_config={"zoo": {k: v for k, v in vars(config).items() if k != "ds_config"}, "deepspeed": ds_config}))
    if resuming:   # events after the checkpoint are logged again; a torn last line goes (warned about)
        raise_on_any_rank(lambda: truncate_metrics_after(logger.path, state.iteration) if is_writer else None,
                          group=host)

    flops = megatron_flops_per_iteration(global_batch, config.seq_length, shape.layers, shape.hidden, shape.vocab,
                                         recompute=config.recompute == "full")
    validation: dict[str, float] = {}
    stop = StopConditions(exit_interval=config.exit_interval, exit_duration_minutes=config.exit_duration_in_mins,
                          handle_signals=config.exit_signal_handler, group=host, started=started)
    loop: TrainingLoop
    # zoo's own norm where DeepSpeed's is missing (fp32) or still carries the loss scale (unfused fp16)
    own_norm = None if deepspeed_reports_true_norm(engine) else (lambda engine: unscaled_grad_norm(engine, ps))

    def log(state: LoopState, means: dict[str, float], window) -> dict[str, Any]:
        grad_norm = engine.get_global_grad_norm() if own_norm is None else window.grad_norm
        step_time = window.step_time
        event = {
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            **means,
            "lr": engine.get_lr()[0],
            "loss_scale": current_loss_scale(engine.optimizer),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "step_time_s": step_time,
            "tokens_per_s": global_batch * config.seq_length / step_time,
            "tflops": flops / step_time / dist.get_world_size() / 1e12,
        }
        event["eta_s"] = step_time * (config.train_iters - state.iteration)
        logger.log(event)
        loop.write(format_log_line(event, config.train_iters))
        return event

    def evaluate(state: LoopState) -> None:
        validation.update(validation_means(engine, data, config, ps))
        val_loss = validation["loss"]
        extras = {f"val_{key}": value for key, value in validation.items() if key != "loss"}
        logger.log({"iteration": state.iteration, "split": "valid", "val_loss": val_loss,
                    "val_ppl": perplexity(val_loss), **extras})
        shown = "".join(f", {key} {value:.4f}" for key, value in extras.items())
        loop.write(f"iteration {state.iteration}: validation loss {val_loss:.4f}, "
                   f"perplexity {perplexity(val_loss):.2f}{shown}")

    def save(state: LoopState) -> None:
        save_checkpoint(engine, run_dir / CHECKPOINT_SUBDIR, f"iter_{state.iteration:07d}",
                        {"iteration": state.iteration, "consumed_samples": state.consumed_samples, "rng": rng_state(),
                         "zoo_model": config.model, "model_config": model.hf_config_dict(),
                         "tensor_parallel_size": ps.tp_size,
                         "seed": config.seed, "split": config.split, "seq_length": config.seq_length,
                         "lr_schedule": lr_schedule(ds_config)})

    plugins = LoopPlugins(
        total_iterations=config.train_iters, samples_per_iteration=global_batch, log_interval=config.log_interval,
        micro_batches=lambda state: data.train_micro_batches(state.consumed_samples, gas),
        forward=forward_with_metrics, log=log,
        is_evaluation_step=lambda it: bool(config.eval_interval) and (it % config.eval_interval == 0
                                                                     or it == config.train_iters),
        evaluate=evaluate,
        is_save_step=lambda it: bool(config.save_interval) and it % config.save_interval == 0
                                or it == config.train_iters,
        save=save,
        grad_norm_fallback=own_norm)
    loop = TrainingLoop(engine, ps, plugins, stop=stop, progress_desc="pretrain", is_writer=is_writer)
    try:
        state = loop.run(state)
    except RuntimeError as err:   # gloo's timeouts are RuntimeErrors, NCCL's DistBackendErrors (a subclass)
        converted = timeout_error(err, config, state)
        if converted is err:
            raise
        raise converted from err
    finally:
        data.close()
    if state.stopped_by is not None and is_writer:
        print(f"stopped by {state.stopped_by} after iteration {state.iteration}: checkpoint "
              f"{run_dir / CHECKPOINT_SUBDIR / f'iter_{state.iteration:07d}'}; resume with --load {run_dir}",
              flush=True)
    samples = []
    if config.sample_prompts and state.stopped_by is None:   # every rank decodes; the writer prints
        samples = sample_text(engine.module, config.sample_prompts, config.seed, ps)
    if logger.is_writer and state.stopped_by is None:
        print_summary(run_dir, state.iteration, state.last_event, validation.get("loss"), data, config, shape,
                      samples)
    logger.close()
    return {**state.last_event, "val_loss": validation.get("loss"), "stopped_by": state.stopped_by}


def timeout_error(err: Exception, config: RunConfig, state: LoopState) -> Exception:
    """A collective that timed out, said as what happened: another rank did not arrive in time."""
    if "timed out" not in str(err).lower():
        return err
    limit = (f"--distributed-timeout-minutes {config.distributed_timeout_minutes:g}"
             if config.distributed_timeout_minutes else "the default process-group timeout")
    return RuntimeError(f"rank {dist.get_rank()} waited longer than {limit} for the other ranks after iteration "
                        f"{state.iteration}: a rank did not arrive (it hangs or died; its own output says which), so "
                        "the job ends here instead of hanging.")


def print_summary(run_dir: Path, iteration: int, last: dict[str, Any], val_loss: float | None,
                  data: PretrainingData, config: RunConfig, shape, samples: Sequence[str] = ()) -> None:
    """The end of a run on the writer: loss.png and the lines the demo prints (``samples``: the
    end-of-run sample lines, printed after the validation perplexity)."""
    plot_loss(run_dir)
    if val_loss is not None:
        baseline = ""
        if data.is_bundled_corpus and "sop_acc" not in last:  # a GPT run on the small bundled corpus
            from zoo.training.baselines import unigram_perplexity

            baseline = (f" (unigram baseline of the corpus: "
                        f"{unigram_perplexity(data.indexed, config.split, shape.vocab):.1f})")
        print(f"validation loss {val_loss:.4f}, validation perplexity {perplexity(val_loss):.2f}{baseline}")
    for line in samples:
        print(line)
    if "sop_acc" in last:
        print(f"last logged window: MLM loss {last['mlm_loss']:.4f}, SOP loss {last['sop_loss']:.4f}, "
              f"SOP accuracy {last['sop_acc']:.3f}")
    print(f"done: {iteration} iterations, final train loss {last.get('loss', float('nan')):.4f}; "
          f"metrics in {run_dir / 'metrics.jsonl'}, plot in {run_dir / 'loss.png'}, "
          f"checkpoints in {run_dir / CHECKPOINT_SUBDIR}")


def load_checkpoint(engine, load: str, ps, model_config: dict[str, Any]) -> dict[str, Any]:
    """Resume ``engine`` from ``--load``: the checkpoint is located and checked on every rank (readable,
    same model), then loaded; the client state is returned. A failure on any rank is raised on all."""
    load_dir, tag = checkpoint_to_load(load, ps, model_config)

    def load_here() -> dict[str, Any]:
        with weights_only_loads(engine):   # DeepSpeed's own reads use the weights-only unpickler too
            _, client = engine.load_checkpoint(str(load_dir), tag=tag)
        if client is None:
            raise FileNotFoundError(f"the checkpoint under {load} could not be loaded; check its 'latest' tag "
                                    "file and its mp_rank_XX_model_states.pt files.")
        return client

    return raise_on_any_rank(load_here)


def format_log_line(event: dict[str, Any], train_iters: int) -> str:
    grad_norm = "n/a" if event["grad_norm"] is None else f"{event['grad_norm']:.3f}"
    eta = time.strftime("%H:%M:%S", time.gmtime(event["eta_s"]))
    return (f"iteration {event['iteration']:>7d}/{train_iters} | loss {event['loss']:.4f} | lr {event['lr']:.3e} | "
            f"loss scale {event['loss_scale']:.0f} | grad norm {grad_norm} | {event['tokens_per_s']:.0f} tokens/s | "
            f"{event['tflops']:.3f} TFLOPs/device | ETA {eta}"
            + ("" if "sop_acc" not in event else
               f" | MLM {event['mlm_loss']:.4f} | SOP {event['sop_loss']:.4f} | SOP acc {event['sop_acc']:.3f}"))


def main(argv=None, sample_text: SampleText | None = None) -> None:
    """The CLI; ``sample_text`` (zoo.inference.sample_lines) completes the config's ``sample_prompts``."""
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    try:
        config = load_run_config(args)
        with process_group_left_on_success():
            pretrain(config, sample_text)
    except (ValueError, FileNotFoundError) as err:
        report_error(err)
        sys.exit(2)
