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

import contextlib
import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zoo.atomic import write_text_atomic
from zoo.distributed import host_group, process_group_left_on_success, raise_on_any_rank, single_process_env
from zoo.finetune.config import FinetuneConfig, deepspeed_dict, parse_args
from zoo.finetune.dev_curve import DEV_CURVE_FILE, baseline_metric, plot_dev_curve
from zoo.finetune.tasks import EvalSet, Task, get_task
from zoo.errors import report_error


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
    return {k: v[rows].to(device, non_blocking=True) for k, v in tensors.items()}


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
    from zoo.data.tokenizers import load_bert_tokenizer
    from zoo.models.hf_io import read_config_json
    from zoo.models.bert import BertConfig
    from zoo.training.loop import join
    from zoo.training.run_directory import claim_finetuning_directory

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

    ps = join(config.tensor_parallel_size, config.seed, config.distributed_timeout_minutes)
    is_writer = dist.get_rank() == 0
    # one run per directory, and never over an earlier run's results: checked before the model is read
    lock = raise_on_any_rank(lambda: claim_finetuning_directory(config.save, config.overwrite) if is_writer else None)
    try:
        return train_and_evaluate(config, task, data, model_config, ps, is_writer)
    finally:
        if lock is not None:
            lock.release()


def train_and_evaluate(config: FinetuneConfig, task: Task, data, model_config, ps, is_writer: bool) -> dict[str, Any]:
    """The finetuning run proper, in a claimed run directory: the model, the engine, the epochs and their
    evaluations; returns the results also written to ``results.json``."""
    from zoo.training.loop import LoopPlugins, LoopState, TrainingLoop, setup_engine
    from zoo.training.metrics import MetricsLogger, plot_loss

    overrides = {"sequence_parallel": True} if config.sequence_parallel else {}
    if config.dropout is not None:
        overrides.update(hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.dropout,
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
    # a guard: the weights were loaded before initialize, so the masters match them already
    engine = setup_engine(model, ds_config, ps, config.weight_decay, refresh_masters=True)
    micro = engine.train_micro_batch_size_per_gpu()

    run_dir = Path(config.save)
    # the metrics agreements run on a gloo group of the host, never on the accelerator (collective: every rank)
    host = host_group(None if config.distributed_timeout_minutes is None
                      else timedelta(minutes=config.distributed_timeout_minutes))
    logger = raise_on_any_rank(lambda: MetricsLogger(run_dir, is_writer,
                                                     config.wandb_project or os.environ.get("WANDB_PROJECT"),
                                                     wandb_config={**config.to_dict(), "deepspeed": ds_config},
                                                     group=host), group=host)
    tracker = BestTracker(task, run_dir, is_writer, save_model=config.epochs > 0)
    loop: TrainingLoop

    def evaluate(state: LoopState) -> None:
        step = state.iteration
        epoch = min(step / steps_per_epoch, config.epochs) if steps_per_epoch else 0
        metrics, files = evaluate_all_sets(engine, data.eval_sets, task, ps, config.eval_batch_size)
        event = {"iteration": step, "epoch": epoch, "split": "dev", **metrics}
        logger.log(event)
        if is_writer:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
            print(f"epoch {epoch:g} (step {step}): {shown}", flush=True)
        tracker.update(event, metrics, files, engine)

    def log(state: LoopState, means: dict[str, float], window) -> dict[str, Any]:
        event = {"iteration": state.iteration, "epoch": state.iteration / steps_per_epoch, "loss": means["loss"],
                 "lr": engine.get_lr()[0], "step_time_s": window.step_time,
                 "samples_per_s": config.batch_size * window.steps / window.seconds}
        logger.log(event)
        loop.write(f"step {state.iteration}/{total_steps} | loss {event['loss']:.4f} | lr {event['lr']:.3e} | "
                   f"{event['samples_per_s']:.1f} samples/s")
        return event

    batches = EpochBatches(num_train, config.batch_size, config.seed, steps_per_epoch)
    plugins = LoopPlugins(
        total_iterations=total_steps, samples_per_iteration=config.batch_size, log_interval=config.log_interval,
        micro_batches=lambda state: [{k: v[rows] for k, v in data.train.items()}
                                     for rows in rank_micro_batches(batches.at(state.iteration), ps, micro)],
        forward=forward_with_loss, log=log,
        is_evaluation_step=lambda step: step % steps_per_epoch == 0 or step == total_steps,
        evaluate=evaluate)
    loop = TrainingLoop(engine, ps, plugins, progress_desc=f"finetune {config.task}", is_writer=is_writer)
    state = loop.run(LoopState())
    if total_steps == 0:
        evaluate(state)

    best, history = tracker.best, tracker.history
    results = {"task": config.task, "main_metric": task.main_metric, "best": best, "final": history[-1],
               "train_loss": state.last_event.get("loss"), "steps": state.iteration, "config": config.to_dict()}
    if is_writer:
        _atomic_write(run_dir / "results.json", json.dumps(results, indent=2, default=str) + "\n")
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


def forward_with_loss(engine, inputs: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """A task head's forward on the device batch; its loss is the one metric, left on the device."""
    output = engine(**inputs)
    return output, {"loss": output.loss.detach().float()}


class EpochBatches:
    """Global batch ``step`` of the run: batch ``step % steps_per_epoch`` of epoch ``step // steps_per_epoch``
    (:func:`global_batches`, drawn once per epoch)."""

    def __init__(self, num_examples: int, batch_size: int, seed: int, steps_per_epoch: int):
        self.num_examples, self.batch_size, self.seed = num_examples, batch_size, seed
        self.steps_per_epoch = steps_per_epoch
        self.epoch, self.batches = None, []

    def at(self, step: int) -> torch.Tensor:
        epoch = step // self.steps_per_epoch
        if epoch != self.epoch:
            self.epoch, self.batches = epoch, global_batches(self.num_examples, self.batch_size, epoch, self.seed)
        return self.batches[step % self.steps_per_epoch]


def evaluate_all_sets(engine, eval_sets: list[EvalSet], task: Task, ps, batch_size: int):
    """Scores of every eval set (``"<set>/<metric>"``) and the prediction files (``"<set>.<ext>"``)."""
    metrics, files = {}, {}
    for eval_set in eval_sets:
        outputs = run_eval_set(engine, eval_set, task, ps, batch_size)
        scores, contents = eval_set.score(outputs)
        metrics.update({f"{eval_set.name}/{k}": v for k, v in scores.items()})
        files.update({f"{eval_set.name}.{ext}": text for ext, text in contents.items()})
    return metrics, files


class BestTracker:
    """The evaluation history and the best evaluation by the task's main metric: on a new best, its
    prediction files (writer) and the model (``save_pretrained``, collective) are saved."""

    def __init__(self, task: Task, run_dir: Path, is_writer: bool, save_model: bool):
        self.task, self.run_dir, self.is_writer, self.save_model = task, run_dir, is_writer, save_model
        self.best: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []

    def update(self, event: dict[str, Any], metrics: dict[str, Any], files: dict[str, str], engine) -> None:
        self.history.append(event)
        score = metrics.get(self.task.main_metric)
        if self.best and not score > self.best["score"]:
            return
        self.best = {"score": score, "epoch": event["epoch"], "step": event["iteration"], "metrics": metrics}
        if self.is_writer:
            for name, text in files.items():
                _atomic_write(self.run_dir / "predictions" / name, text)
        if self.save_model:
            engine.module.save_pretrained(self.run_dir / "best")


def main(task: str, argv=None, leave_process_group: bool = True) -> None:
    """Entry point of ``finetune/<task>.py``: user errors print one sentence and exit with code 2. A
    process group the run creates is destroyed after it succeeds, unless ``leave_process_group`` is False
    (an in-process sweep keeps one group for all its runs)."""
    single_process_env()
    try:
        config = parse_args(task, argv)
        with process_group_left_on_success() if leave_process_group else contextlib.nullcontext():
            finetune(config)
    except (ValueError, FileNotFoundError) as err:
        report_error(err)
        sys.exit(2)
