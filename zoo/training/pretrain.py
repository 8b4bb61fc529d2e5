"""GPT-2 pretraining through DeepSpeed: zoo builds the tensor-parallel model and the data, DeepSpeed
does data parallelism, loss scaling, clipping, the optimizer, the LR schedule and checkpoint files.

    deepspeed --num_gpus 8 launch/pretrain.py --deepspeed_config ds_configs/tp8.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zoo.atomic import check_writable_directory, write_text_atomic
from zoo.distributed import means_over_dp, raise_on_any_rank, share_cpu_threads
from zoo.models.families import build_model, param_groups, shape_of
from zoo.training.engine import refresh_fp32_master_weights
from zoo.training.families import build_dataset, default_corpus, forward_with_metrics, pretrained_model
from zoo.training.grad_norm import current_loss_scale, global_grad_norm
from zoo.training.metrics import MetricsLogger, megatron_flops_per_iteration, perplexity, plot_loss
from zoo.checkpoint.files import CHECKPOINT_SUBDIR
from zoo.training.resume import checkpoint_to_load
from zoo.training.run_config import (RunConfig, build_parser, clipped_warmup_warning, deepspeed_dict, load_run_config,
                                     lr_schedule, schedule_change_warning, validate_for_world)



__all__ = ["pretrain", "main", "reseed_tp_rng"]


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


class PretrainingData:
    """Train/valid datasets of the model's family and the rank's micro-batches at a given consumed-samples position.

    Global sample order is fixed by the seed; a global batch of ``G`` samples is split into ``gas``
    micro-steps of ``micro * dp`` samples, and DP rank r reads its own ``micro`` of each. TP ranks of a
    group share a DP rank and so read the same samples.
    """

    def __init__(self, config: RunConfig, model_config, ps, micro_batch: int, global_batch: int):
        prefix = config.data_path
        if prefix is None:  # bundled corpus: preprocess once on rank 0, the others wait for its outcome
            raise_on_any_rank(lambda: default_corpus(model_config, progress=True) if dist.get_rank() == 0 else None)
            prefix = default_corpus(model_config, progress=False)
        self.is_bundled_corpus = config.data_path is None
        self.ps = ps
        self.micro_batch = micro_batch
        self.indexed, self.train, self.valid = raise_on_any_rank(
            lambda: self._datasets(config, model_config, prefix, global_batch))

    def _datasets(self, config: RunConfig, model_config, prefix: str, global_batch: int):
        from zoo.data import IndexedDataset

        indexed = IndexedDataset(prefix)
        train = build_dataset(model_config, indexed, config.seq_length, config.seed, config.split, "train",
                              config.train_iters * global_batch)
        valid = None
        if config.eval_interval:
            valid = build_dataset(model_config, indexed, config.seq_length, config.seed, config.split, "valid",
                                  config.eval_iters * self.micro_batch * self.ps.dp_size)
        return indexed, train, valid

    def _stack(self, dataset, indices) -> dict[str, torch.Tensor]:
        samples = [dataset[i % len(dataset)] for i in indices]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

    def micro_batch_at(self, dataset, first_global_sample: int) -> dict[str, torch.Tensor]:
        start = first_global_sample + self.ps.dp_rank * self.micro_batch
        return self._stack(dataset, range(start, start + self.micro_batch))

    def micro_batches(self, dataset, first_global_sample: int, count: int) -> list[dict[str, torch.Tensor]]:
        """The ``count`` consecutive micro-batches of this rank from ``first_global_sample`` on, read on
        every rank before any of them is used: a bad sample (e.g. a token id outside the vocabulary) on
        one DP rank stops every rank with the same sentence instead of hanging the others' all-reduce."""
        per_step = self.micro_batch * self.ps.dp_size
        return raise_on_any_rank(lambda: [self.micro_batch_at(dataset, first_global_sample + k * per_step)
                                          for k in range(count)])


def validation_means(engine, data: PretrainingData, config: RunConfig, ps) -> dict[str, float]:
    """Validation means over ``eval_iters`` micro-batches and the DP ranks: "loss", plus BERT's
    "mlm_loss", "sop_loss" and "sop_acc"."""
    engine.eval()
    sums: dict[str, torch.Tensor] = {}
    batches = data.micro_batches(data.valid, 0, config.eval_iters)
    with torch.no_grad():
        for batch in batches:
            _, metrics = forward_with_metrics(engine, batch, engine.device)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value.cpu()
    engine.train()
    return means_over_dp(sums, config.eval_iters, ps, engine.device)


def pretrain(config: RunConfig) -> dict[str, Any]:
    import deepspeed
    from tqdm import tqdm

    from zoo.models import model_config as build_model_config
    from zoo.parallel import ParallelState, model_parallel_seed

    deepspeed.init_distributed()
    share_cpu_threads()
    gas = validate_for_world(config, dist.get_world_size())
    ps = ParallelState.initialize(config.tensor_parallel_size)
    model_parallel_seed(config.seed, ps)

    model_config = build_model_config(config.model, activation_checkpointing=config.checkpoint_activations,
                                      **config.model_overrides)
    if config.pretrained:  # the weights (and the shapes) of a transformers-layout directory, this rank's slices
        model = pretrained_model(config.pretrained, model_config, config.model, config.model_overrides, ps)
        model_config = model.config
    shape = shape_of(model_config)
    if config.seq_length > shape.max_positions:
        raise ValueError(f"seq_length {config.seq_length} exceeds the {config.model} model's position table of "
                         f"{shape.max_positions}; pass --seq-length {shape.max_positions} or less.")
    if not config.pretrained:
        model = build_model(model_config, ps)
    ds_config = deepspeed_dict(config, gas)
    is_writer = dist.get_rank() == 0
    if is_writer and clipped_warmup_warning(config):
        print(f"warning: {clipped_warmup_warning(config)}", file=sys.stderr)
    if config.checkpoint_activations:
        deepspeed.checkpointing.configure(ps, num_checkpoints=shape.layers)
    weight_decay = ds_config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, weight_decay),
                                           config=ds_config, mpu=ps)
    micro, global_batch = engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()
    if config.pretrained:
        refresh_fp32_master_weights(engine)   # masters equal the loaded weights whatever the load order

    iteration, consumed = 0, 0
    if config.load:
        client = load_checkpoint(engine, config.load, ps, model.hf_config_dict())
        iteration, consumed = client["iteration"], client["consumed_samples"]
        set_rng_state(client["rng"])
        if "resharded_from" in client:
            reseed_tp_rng(client.get("seed", config.seed), iteration, ps)
        change = schedule_change_warning(client.get("lr_schedule"), lr_schedule(ds_config), iteration)
        if is_writer and "lr_schedule" in client and change:
            print(f"warning: {change}", file=sys.stderr)

    data = PretrainingData(config, model_config, ps, micro, global_batch)
    run_dir = Path(config.save) if config.save else None
    if run_dir is not None:  # every rank writes checkpoint files there: prove it can, before training
        raise_on_any_rank(lambda: check_writable_directory(run_dir, "--save"))
    logger = MetricsLogger(run_dir, is_writer and run_dir is not None, config.wandb_project,
                           wandb_config={"zoo": {k: v for k, v in vars(config).items() if k != "ds_config"},
                                         "deepspeed": ds_config},
                           resume=bool(config.load))
    if logger.is_writer and config.load:
        _truncate_metrics_after(logger.path, iteration)

    flops = megatron_flops_per_iteration(global_batch, config.seq_length, shape.layers, shape.hidden, shape.vocab,
                                         recompute=config.checkpoint_activations)
    progress = tqdm(total=config.train_iters, initial=iteration, disable=not is_writer, desc="pretrain",
                    unit="it", dynamic_ncols=True, file=sys.stdout)
    window, window_steps, window_time = {}, 0, 0.0
    last, val_loss, fp32_grad_norm = {}, None, None
    while iteration < config.train_iters:
        start = time.perf_counter()
        step_sums: dict[str, torch.Tensor] = {}
        for micro_step, batch in enumerate(data.micro_batches(data.train, consumed, gas)):
            output, metrics = forward_with_metrics(engine, batch, engine.device)
            engine.backward(output.loss)
            if micro_step == gas - 1 and not config_uses_mixed_precision(ds_config):
                fp32_grad_norm = global_grad_norm(engine.module, ps)  # DeepSpeed discards it in fp32
            engine.step()
            for key, value in metrics.items():
                step_sums[key] = step_sums.get(key, 0.0) + value.cpu()
        iteration += 1
        consumed += global_batch
        for key, value in means_over_dp(step_sums, gas, ps, engine.device).items():
            window[key] = window.get(key, 0.0) + value
        window_steps += 1
        window_time += time.perf_counter() - start
        progress.update(1)

        if iteration % config.log_interval == 0 or iteration == config.train_iters:
            step_time = window_time / window_steps
            grad_norm = engine.get_global_grad_norm()
            if grad_norm is None:
                grad_norm = fp32_grad_norm
            last = {
                "iteration": iteration,
                "consumed_samples": consumed,
                **{key: value / window_steps for key, value in window.items()},
                "lr": engine.get_lr()[0],
                "loss_scale": current_loss_scale(engine.optimizer),
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "step_time_s": step_time,
                "tokens_per_s": global_batch * config.seq_length / step_time,
                "tflops": flops / step_time / dist.get_world_size() / 1e12,
            }
            last["eta_s"] = step_time * (config.train_iters - iteration)
            logger.log(last)
            if is_writer:
                progress.write(format_log_line(last, config.train_iters))
            window, window_steps, window_time = {}, 0, 0.0

        if config.eval_interval and (iteration % config.eval_interval == 0 or iteration == config.train_iters):
            validation = validation_means(engine, data, config, ps)
            val_loss = validation["loss"]
            extras = {f"val_{key}": value for key, value in validation.items() if key != "loss"}
            logger.log({"iteration": iteration, "split": "valid", "val_loss": val_loss,
                        "val_ppl": perplexity(val_loss), **extras})
            if is_writer:
                shown = "".join(f", {key} {value:.4f}" for key, value in extras.items())
                progress.write(f"iteration {iteration}: validation loss {val_loss:.4f}, "
                               f"perplexity {perplexity(val_loss):.2f}{shown}")

        if run_dir and ((config.save_interval and iteration % config.save_interval == 0)
                        or iteration == config.train_iters):
            save_checkpoint(engine, run_dir / CHECKPOINT_SUBDIR, f"iter_{iteration:07d}",
                            {"iteration": iteration, "consumed_samples": consumed, "rng": rng_state(),
                             "zoo_model": config.model, "model_config": model.hf_config_dict(),
                             "tensor_parallel_size": ps.tp_size,
                             "seed": config.seed, "split": config.split, "seq_length": config.seq_length,
                             "lr_schedule": lr_schedule(ds_config)})
    progress.close()
    if logger.is_writer:
        plot_loss(run_dir)
        if val_loss is not None:
            baseline = ""
            if data.is_bundled_corpus and "sop_acc" not in last:  # a GPT run on the small bundled corpus
                from zoo.training.baselines import unigram_perplexity

                baseline = (f" (unigram baseline of the corpus: "
                            f"{unigram_perplexity(data.indexed, config.split, shape.vocab):.1f})")
            print(f"validation loss {val_loss:.4f}, validation perplexity {perplexity(val_loss):.2f}{baseline}")
        if "sop_acc" in last:
            print(f"last logged window: MLM loss {last['mlm_loss']:.4f}, SOP loss {last['sop_loss']:.4f}, "
                  f"SOP accuracy {last['sop_acc']:.3f}")
        print(f"done: {iteration} iterations, final train loss {last.get('loss', float('nan')):.4f}; "
              f"metrics in {run_dir / 'metrics.jsonl'}, plot in {run_dir / 'loss.png'}, "
              f"checkpoints in {run_dir / CHECKPOINT_SUBDIR}")
    logger.close()
    return {**last, "val_loss": val_loss}


def load_checkpoint(engine, load: str, ps, model_config: dict[str, Any]) -> dict[str, Any]:
    """Resume ``engine`` from ``--load``: the checkpoint is located and checked on every rank (readable,
    same model), then loaded; the client state is returned. A failure on any rank is raised on all."""
    load_dir, tag = checkpoint_to_load(load, ps, model_config)

    def load_here() -> dict[str, Any]:
        _, client = engine.load_checkpoint(str(load_dir), tag=tag)
        if client is None:
            raise FileNotFoundError(f"the checkpoint under {load} could not be loaded; check its 'latest' tag "
                                    "file and its mp_rank_XX_model_states.pt files.")
        return client

    return raise_on_any_rank(load_here)


def config_uses_mixed_precision(ds_config: dict[str, Any]) -> bool:
    return bool(ds_config.get("fp16", {}).get("enabled") or ds_config.get("bf16", {}).get("enabled"))


def format_log_line(event: dict[str, Any], train_iters: int) -> str:
    grad_norm = "n/a" if event["grad_norm"] is None else f"{event['grad_norm']:.3f}"
    eta = time.strftime("%H:%M:%S", time.gmtime(event["eta_s"]))
    return (f"iteration {event['iteration']:>7d}/{train_iters} | loss {event['loss']:.4f} | lr {event['lr']:.3e} | "
            f"loss scale {event['loss_scale']:.0f} | grad norm {grad_norm} | {event['tokens_per_s']:.0f} tokens/s | "
            f"{event['tflops']:.3f} TFLOPs/device | ETA {eta}"
            + ("" if "sop_acc" not in event else
               f" | MLM {event['mlm_loss']:.4f} | SOP {event['sop_loss']:.4f} | SOP acc {event['sop_acc']:.3f}"))


def save_checkpoint(engine, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
    """DeepSpeed checkpoint under ``directory/tag``; ``latest`` is replaced atomically only after every
    rank has finished writing, so a crash mid-save leaves the previous checkpoint as ``latest``."""
    engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
    dist.barrier()
    if dist.get_rank() == 0:
        write_text_atomic(directory / "latest", tag, fsync=True)
    dist.barrier()


def _truncate_metrics_after(path: Path, iteration: int) -> None:
    """On resume, drop events logged after the checkpoint (they will be logged again)."""
    import json

    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("iteration", 0) <= iteration]
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def main(argv=None) -> None:
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    try:
        config = load_run_config(args)
        pretrain(config)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
