"""Finetune a BERT on one task through DeepSpeed at any tp degree, evaluating on dev every epoch.

The flow: the task's data is read and encoded; the head model is built with ``from_pretrained``
(each rank reads only its slices; a missing head is drawn from ``--seed``); DeepSpeed gets the model,
the mpu, AdamW without decay on biases/LayerNorms and WarmupDecayLR (warmup fraction, then linear
decay); the fp32 master weights are refreshed from the loaded weights (the known fp16 pitfall).
Each global batch is a seeded permutation slice, split over the data-parallel ranks; the TP ranks of a
group read the same rows. After each epoch every eval set is run (rows split over DP ranks and
gathered), scored, logged to metrics.jsonl / W&B, and the best model (by the task's main metric) is
saved with ``save_pretrained`` next to its prediction files. ``--epochs 0`` evaluates only.

Run directory: ``metrics.jsonl``, ``results.json`` (best and final metrics, the settings),
``predictions/<split>.<ext>`` (of the best epoch), ``best/`` (transformers layout), ``loss.png``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zoo.atomic import write_text_atomic
from zoo.distributed import means_over_dp, share_cpu_threads, single_process_env
from zoo.finetune.config import FinetuneConfig, deepspeed_dict, parse_args
from zoo.finetune.tasks import EvalSet, Task, get_task


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


def global_batches(num_examples: int, batch_size: int, epoch: int, seed: int) -> list[torch.Tensor]:
    """The epoch's global batches: a permutation seeded by (seed, epoch), cut into full batches."""
    generator = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(num_examples, generator=generator)
    return list(order[: (num_examples // batch_size) * batch_size].split(batch_size))


def rank_micro_batches(batch: torch.Tensor, ps, micro: int) -> list[torch.Tensor]:
    """This DP rank's contiguous share of a global batch, cut into micro-batches."""
    share = batch.shape[0] // ps.dp_size
    mine = batch[ps.dp_rank * share: (ps.dp_rank + 1) * share]
    return list(mine.split(micro))


def _to_device(tensors: dict[str, torch.Tensor], rows, device) -> dict[str, torch.Tensor]:
    return {k: v[rows].to(device) for k, v in tensors.items()}


@torch.no_grad()
def run_eval_set(engine, eval_set: EvalSet, task: Task, ps, batch_size: int) -> dict[str, np.ndarray]:
    """The model's outputs on every row, each DP rank running an interleaved share, gathered on all."""
    engine.eval()
    rows = torch.arange(len(eval_set))[ps.dp_rank::ps.dp_size]
    pieces: dict[str, list[np.ndarray]] = {name: [] for name in task.outputs}
    for chunk in rows.split(batch_size):
        output = engine(**_to_device(eval_set.inputs, chunk, engine.device))
        for name in task.outputs:
            pieces[name].append(getattr(output, name).float().cpu().numpy())
    local = {name: (np.concatenate(p) if p else None) for name, p in pieces.items()}
    engine.train()
    if ps.dp_size == 1:
        return local
    gathered: list[Any] = [None] * ps.dp_size
    dist.all_gather_object(gathered, (rows.numpy(), local), group=ps.dp_group)
    outputs = {}
    for name in task.outputs:
        parts = [(r, out[name]) for r, out in gathered if out[name] is not None]
        full = np.empty((len(eval_set),) + parts[0][1].shape[1:], dtype=np.float32)
        for r, values in parts:
            full[r] = values
        outputs[name] = full
    return outputs


def check_inputs_fit(config: FinetuneConfig, model_config, tokenizer, tokenizer_source) -> None:
    """Errors for a tokenizer bigger than the embedding table and for sequences longer than the
    position table: both would index past a table."""
    if len(tokenizer) > model_config.vocab_size:
        raise ValueError(f"the tokenizer in {tokenizer_source} has {len(tokenizer)} tokens but the checkpoint's "
                         f"vocab_size is {model_config.vocab_size}; use the vocab file the model was trained with.")
    if config.max_seq_length > model_config.max_position_embeddings:
        raise ValueError(f"--max-seq-length {config.max_seq_length} exceeds the model's position table "
                         f"(max_position_embeddings={model_config.max_position_embeddings}); pass "
                         f"--max-seq-length {model_config.max_position_embeddings} or less.")


def finetune(config: FinetuneConfig) -> dict[str, Any]:
    """Run one finetuning job; returns the results also written to ``results.json``."""
    import deepspeed
    from tqdm import tqdm

    from zoo.data.tokenizers import load_bert_tokenizer
    from zoo.models.hf_io import read_config_json
    from zoo.models.bert import BertConfig
    from zoo.parallel import ParallelState, model_parallel_seed
    from zoo.models.families import param_groups
    from zoo.training.engine import refresh_fp32_master_weights
    from zoo.training.metrics import MetricsLogger, plot_loss

    task = get_task(config.task)
    # Everything a user can get wrong in files and flags is checked before any process group starts.
    model_config = BertConfig.from_dict(read_config_json(config.pretrained))
    tokenizer_dir = Path(config.pretrained) if (Path(config.pretrained) / "vocab.txt").is_file() else None
    tokenizer = load_bert_tokenizer(tokenizer_dir)
    check_inputs_fit(config, model_config, tokenizer, tokenizer_dir or "the bundled bert-base-uncased vocab")
    data = task.load(config.data_dir, tokenizer, config.max_seq_length, doc_stride=config.doc_stride,
                     max_query_length=config.max_query_length, version=config.squad_version)
    if config.epochs > 0 and data.train is None:
        raise FileNotFoundError(f"no training split found in {config.data_dir} for {config.task}; add it, or pass "
                                "--epochs 0 to evaluate only.")
    main_split = task.main_metric.split("/")[0]
    if main_split not in {eval_set.name for eval_set in data.eval_sets}:
        raise FileNotFoundError(f"no {main_split} split found in {config.data_dir} for {config.task}, and it gives "
                                f"the metric the best model is chosen by ({task.main_metric}); add it (the layouts "
                                "are listed in zoo/finetune/tasks.py and the README).")

    deepspeed.init_distributed()
    share_cpu_threads()
    ps = ParallelState.initialize(config.tensor_parallel_size or dist.get_world_size())
    model_parallel_seed(config.seed, ps)
    is_writer = dist.get_rank() == 0

    overrides = {}
    if config.dropout is not None:
        overrides = dict(hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.dropout,
                         extra={**model_config.extra, "classifier_dropout": config.dropout})
    model = task.model_class.from_pretrained(config.pretrained, parallel=ps, head_seed=config.seed,
                                             **({"labels": list(task.labels)} if task.labels else {}), **overrides)
    num_train = 0 if data.train is None else next(iter(data.train.values())).shape[0]
    if config.epochs > 0 and num_train < config.batch_size:
        raise ValueError(f"--batch-size {config.batch_size} exceeds the {num_train} training examples in "
                         f"{config.data_dir}; pass --batch-size {max(ps.dp_size, num_train // ps.dp_size * ps.dp_size)} "
                         "or less.")
    steps_per_epoch = num_train // config.batch_size if config.epochs > 0 else 0
    total_steps = int(math.ceil(config.epochs * steps_per_epoch))
    ds_config = deepspeed_dict(config, ps.dp_size, total_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, config.weight_decay), config=ds_config, mpu=ps)
    refresh_fp32_master_weights(engine)   # a guard: the weights were loaded before initialize, so masters match
    micro = engine.train_micro_batch_size_per_gpu()

    run_dir = Path(config.save)
    logger = MetricsLogger(run_dir, is_writer, config.wandb_project or os.environ.get("WANDB_PROJECT"),
                           wandb_config={**config.to_dict(), "deepspeed": ds_config})
    best: dict[str, Any] = {}
    history: list[dict[str, Any]] = []

    def evaluate(epoch: float, step: int) -> None:
        metrics, files = {}, {}
        for eval_set in data.eval_sets:
            outputs = run_eval_set(engine, eval_set, task, ps, config.eval_batch_size)
            scores, contents = eval_set.score(outputs)
            metrics.update({f"{eval_set.name}/{k}": v for k, v in scores.items()})
            files.update({f"{eval_set.name}.{ext}": text for ext, text in contents.items()})
        event = {"iteration": step, "epoch": epoch, "split": "dev", **metrics}
        logger.log(event)
        history.append(event)
        if is_writer:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
            print(f"epoch {epoch:g} (step {step}): {shown}", flush=True)
        score = metrics.get(task.main_metric)
        if not best or score > best["score"]:
            best.update(score=score, epoch=epoch, step=step, metrics=metrics)
            if is_writer:
                for name, text in files.items():
                    _atomic_write(run_dir / "predictions" / name, text)
            if config.epochs > 0:
                engine.module.save_pretrained(run_dir / "best")

    progress = tqdm(total=total_steps, disable=not is_writer, desc=f"finetune {config.task}", unit="step",
                    dynamic_ncols=True, file=sys.stdout)
    step, window, window_time = 0, [], 0.0
    last: dict[str, Any] = {}
    epoch = 0
    while step < total_steps:
        for batch in global_batches(num_train, config.batch_size, epoch, config.seed):
            if step >= total_steps:
                break
            start = time.perf_counter()
            losses = []
            for rows in rank_micro_batches(batch, ps, micro):
                output = engine(**_to_device(data.train, rows, engine.device))
                engine.backward(output.loss)
                engine.step()
                losses.append(output.loss.detach().float().cpu())
            loss = means_over_dp({"loss": torch.stack(losses).sum()}, len(losses), ps, engine.device)["loss"]
            step += 1
            window.append(loss)
            window_time += time.perf_counter() - start
            progress.update(1)
            if step % config.log_interval == 0 or step == total_steps:
                last = {"iteration": step, "epoch": step / steps_per_epoch, "loss": float(np.mean(window)),
                        "lr": engine.get_lr()[0], "step_time_s": window_time / len(window),
                        "samples_per_s": config.batch_size * len(window) / window_time}
                logger.log(last)
                if is_writer:
                    progress.write(f"step {step}/{total_steps} | loss {last['loss']:.4f} | lr {last['lr']:.3e} | "
                                   f"{last['samples_per_s']:.1f} samples/s")
                window, window_time = [], 0.0
        epoch += 1
        evaluate(min(step / steps_per_epoch, config.epochs), step)
    progress.close()
    if total_steps == 0:
        evaluate(0, 0)

    results = {"task": config.task, "main_metric": task.main_metric, "best": best, "final": history[-1],
               "train_loss": last.get("loss"), "steps": step, "config": config.to_dict()}
    if is_writer:
        _atomic_write(run_dir / "results.json", json.dumps(results, indent=2, default=str) + "\n")
        if step:
            plot_loss(run_dir)
        print(f"best {task.main_metric} {best['score']:.4f} at epoch {best['epoch']:g}; results in "
              f"{run_dir / 'results.json'}, predictions in {run_dir / 'predictions'}"
              + (f", model in {run_dir / 'best'}" if config.epochs > 0 else ""), flush=True)
    logger.summary({"best/" + task.main_metric: best["score"], "best/epoch": best["epoch"]})
    logger.close()
    return results


def main(task: str, argv=None) -> None:
    """Entry point of ``finetune/<task>.py``: user errors print one sentence and exit with code 2."""
    single_process_env()
    try:
        config = parse_args(task, argv)
        finetune(config)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
