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
``predictions/<split>.<ext>`` (of the best epoch), ``best/`` (transformers layout), ``loss.png``, ``dev.png``
(the main metric at each evaluation, beside the majority-class baseline when the task scores one). The writer
rank holds the directory's lock for the whole run; a directory another run holds, or one holding an earlier
run's ``metrics.jsonl`` or ``results.json``, is refused before the model is read
(:mod:`zoo.training.run_directory`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from zoo.data.tokenizers import load_bert_tokenizer
from zoo.distributed import host_group, raise_on_any_rank
from zoo.errors import MissingInput, UserError, alike_on_every_rank
from zoo.finetune.config import FinetuneConfig, deepspeed_dict
from zoo.finetune.dev_curve import DEV_CURVE_FILE, baseline_metric, plot_dev_curve
from zoo.finetune.task_catalog import Task, get_task
from zoo.finetune.task_evaluation import BestTracker, DevValidator, write_file
from zoo.finetune.task_training import FinetuneTask
from zoo.models.bert.config import BertConfig
from zoo.models.families import read_checked_config_json
from zoo.training import startup
from zoo.training.loop import LoopState, TrainingLoop
from zoo.training.metrics import MetricsLogger, plot_loss
from zoo.training.preflight import check_fp16_supported
from zoo.training.run_directory import claim_finetuning_directory
from zoo.training.startup import setup_engine

__all__ = ["finetune", "check_inputs_fit", "print_baseline_comparison"]


def check_inputs_fit(config: FinetuneConfig, model_config, tokenizer, tokenizer_source) -> None:
    """Errors for a tokenizer bigger than the embedding table and for sequences longer than the
    position table: both would index past a table."""
    if len(tokenizer) > model_config.vocab_size:
        raise UserError(f"the tokenizer in {tokenizer_source} has {len(tokenizer)} tokens but the checkpoint's "
                         f"vocab_size is {model_config.vocab_size}; use the vocab file the model was trained with.")
    if config.max_seq_length > model_config.max_position_embeddings:
        raise UserError(f"--max-seq-length {config.max_seq_length} exceeds the model's position table "
                         f"(max_position_embeddings={model_config.max_position_embeddings}); pass "
                         f"--max-seq-length {model_config.max_position_embeddings} or less.")


def finetune(config: FinetuneConfig) -> dict[str, Any]:
    """Run one finetuning job; returns the results also written to ``results.json``. Everything a user can
    get wrong in files and flags is checked before any process group starts."""
    task = get_task(config.task)
    with alike_on_every_rank():   # every rank reads the same files: the writer says what is wrong, once
        model_config, data = read_inputs(config, task)
        fp16 = (config.ds_config.get("fp16") or {}).get("enabled")
        check_fp16_supported("fp16" if fp16 else "", config.ds_config_path,
                             use_bf16=f'enable "bf16" in place of "fp16" in {config.ds_config_path}')
    parallel = startup.join(config.tensor_parallel_size, config.seed, config.distributed_timeout_minutes)
    is_writer = dist.get_rank() == 0
    # one run per directory, and never over an earlier run's results: checked before the model is read
    lock = raise_on_any_rank(lambda: claim_finetuning_directory(config.save, config.overwrite) if is_writer else None)
    try:
        return train_and_evaluate(config, task, data, model_config, parallel, is_writer)
    finally:
        if lock is not None:
            lock.release()


def read_inputs(config: FinetuneConfig, task: Task):
    """(model config, encoded task data) of ``--pretrained`` and ``--data-dir``, checked: the tokenizer
    and the sequences fit the model's tables, the training split exists when there are epochs to train,
    and the split of the main metric exists."""
    model_config = BertConfig.from_dict(read_checked_config_json(config.pretrained))
    tokenizer_dir = Path(config.pretrained) if (Path(config.pretrained) / "vocab.txt").is_file() else None
    tokenizer = load_bert_tokenizer(tokenizer_dir)
    check_inputs_fit(config, model_config, tokenizer, tokenizer_dir or "the bundled bert-base-uncased vocab")
    data = task.load(config.data_dir, tokenizer, config.max_seq_length, doc_stride=config.doc_stride,
                     max_query_length=config.max_query_length, version=config.squad_version)
    if config.epochs > 0 and data.train is None:
        raise MissingInput(f"no training split found in {config.data_dir} for {config.task}; add it, or pass "
                                "--epochs 0 to evaluate only.")
    main_split = task.main_metric.split("/")[0]
    if main_split not in {eval_set.name for eval_set in data.eval_sets}:
        raise MissingInput(f"no {main_split} split found in {config.data_dir} for {config.task}, and it gives "
                                f"the metric the best model is chosen by ({task.main_metric}); add it (the layouts "
                                "are listed in zoo/finetune/task_catalog.py and the README).")
    return model_config, data


def train_and_evaluate(config: FinetuneConfig, task: Task, data, model_config, parallel, is_writer: bool) -> dict[str, Any]:
    """The finetuning run proper, in a claimed run directory: the engine, the epochs through the training
    loop with a :class:`FinetuneTask` and a :class:`DevValidator`; returns the results."""
    engine, ds_config, steps_per_epoch, total_steps = build_engine(config, task, data, model_config, parallel)
    run_dir = Path(config.save)
    # the metrics agreements run on a gloo group of the host, never on the accelerator (collective: every rank)
    host = host_group(None if config.distributed_timeout_minutes is None
                      else timedelta(minutes=config.distributed_timeout_minutes))
    logger = raise_on_any_rank(lambda: MetricsLogger(run_dir, is_writer,
                                                     config.wandb_project or os.environ.get("WANDB_PROJECT"),
                                                     wandb_config={**config.to_dict(), "deepspeed": ds_config},
                                                     group=host), group=host)
    tracker = BestTracker(task, run_dir, is_writer, save_model=config.epochs > 0)
    validator = DevValidator(engine, data.eval_sets, task, parallel, logger, tracker, config.eval_batch_size, config.epochs,
                             steps_per_epoch, total_steps, is_writer)
    loop = TrainingLoop(engine, parallel, FinetuneTask(config, data.train, engine, parallel, steps_per_epoch, total_steps), logger,
                        validator, progress_desc=f"finetune {config.task}", is_writer=is_writer)
    state = loop.run(LoopState())
    if total_steps == 0:
        validator.evaluate(state)
    return report_results(config, task, run_dir, tracker, state, logger, is_writer)


def build_engine(config: FinetuneConfig, task: Task, data, model_config, parallel):
    """(engine, ds_config, steps per epoch, total steps): the head model from ``--pretrained`` (a missing
    head drawn from ``--seed``), its schedule, and the DeepSpeed engine (WarmupDecayLR over the steps)."""
    overrides = {"sequence_parallel": True} if config.sequence_parallel else {}
    if config.dropout is not None:
        overrides.update(hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.dropout,
                         extra={**model_config.extra, "classifier_dropout": config.dropout})
    model = task.model_class.from_pretrained(config.pretrained, parallel=parallel, head_seed=config.seed,
                                             **({"labels": list(task.labels)} if task.labels else {}), **overrides)
    num_train = 0 if data.train is None else next(iter(data.train.values())).shape[0]
    if config.epochs > 0 and num_train < config.batch_size:
        raise UserError(f"--batch-size {config.batch_size} exceeds the {num_train} training examples in "
                         f"{config.data_dir}; pass --batch-size {max(parallel.dp_size, num_train // parallel.dp_size * parallel.dp_size)} "
                         "or less.")
    steps_per_epoch = num_train // config.batch_size if config.epochs > 0 else 0
    total_steps = int(math.ceil(config.epochs * steps_per_epoch))
    ds_config = deepspeed_dict(config, parallel.dp_size, total_steps)
    # a guard: the weights were loaded before initialize, so the masters match them already
    engine = setup_engine(model, ds_config, parallel, config.weight_decay, refresh_masters=True)
    return engine, ds_config, steps_per_epoch, total_steps


def report_results(config: FinetuneConfig, task: Task, run_dir: Path, tracker: BestTracker, state: LoopState,
                   logger: MetricsLogger, is_writer: bool) -> dict[str, Any]:
    """results.json, loss.png and dev.png and the closing lines on the writer; the W&B summary; the results."""
    best, history = tracker.best, tracker.history
    results = {"task": config.task, "main_metric": task.main_metric, "best": best, "final": history[-1],
               "train_loss": state.last_event.get("loss"), "steps": state.iteration, "config": config.to_dict()}
    if is_writer:
        write_file(run_dir / "results.json", json.dumps(results, indent=2, default=str) + "\n")
        if state.iteration:
            plot_loss(run_dir)
        plot_dev_curve(run_dir, history, task.main_metric)
        print(f"best {task.main_metric} {best['score']:.4f} at epoch {best['epoch']:g}; results in "
              f"{run_dir / 'results.json'}, predictions in {run_dir / 'predictions'}"
              + (f", model in {run_dir / 'best'}" if config.epochs > 0 else "")
              + f", dev curve in {run_dir / DEV_CURVE_FILE}", flush=True)
        print_baseline_comparison(task.main_metric, best)
        print_wandb_location()
    logger.summary({"best/" + task.main_metric: best["score"], "best/epoch": best["epoch"]})
    logger.close()
    return results


def print_baseline_comparison(main_metric: str, best: dict[str, Any]) -> None:
    """One line: the best main metric beside the majority-class baseline, when the eval set scores one."""
    baseline = best["metrics"].get(baseline_metric(main_metric))
    if baseline is not None:
        print(f"{main_metric} {best['score']:.4f} (best epoch) vs majority-class baseline {baseline:.4f} "
              f"({best['score'] - baseline:+.4f})", flush=True)


def print_wandb_location() -> None:
    """Where this process's W&B run keeps its files, when one is running (offline: what to sync)."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    if run is not None:
        run_dir = Path(run.dir).parent   # run.dir is the run's files/ folder
        print(f"W&B run directory: {run_dir}" + (f" (offline; upload with `wandb sync {run_dir}`)" if run.offline
                                                 else ""), flush=True)
