"""Finetuning's evaluation: every eval set run over the DP ranks and scored, the event logged, and the
best evaluation by the task's main metric kept (its prediction files and the model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from zoo.atomic import write_text_atomic
from zoo.finetune.task_catalog import EvalSet, Task
from zoo.training.device_batches import to_device
from zoo.training.loop import LoopState
from zoo.training.metrics import MetricsLogger

__all__ = ["DevValidator", "BestTracker", "run_eval_set", "evaluate_all_sets"]


def write_file(path: Path, text: str) -> None:
    """``text`` into ``path`` atomically, its directory created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)


@torch.no_grad()
def run_eval_set(engine, eval_set: EvalSet, task: Task, parallel, batch_size: int) -> dict[str, np.ndarray]:
    """The model's outputs on every row, each DP rank running an interleaved share, gathered on all."""
    engine.eval()
    rows = torch.arange(len(eval_set))[parallel.dp_rank::parallel.dp_size]
    pieces: dict[str, list[np.ndarray]] = {name: [] for name in task.outputs}
    for chunk in rows.split(batch_size):
        output = engine(**to_device({key: value[chunk] for key, value in eval_set.inputs.items()}, engine.device))
        for name in task.outputs:
            pieces[name].append(getattr(output, name).float().cpu().numpy())
    local = {name: (np.concatenate(p) if p else None) for name, p in pieces.items()}
    engine.train()
    if parallel.dp_size == 1:
        return local
    gathered: list[Any] = [None] * parallel.dp_size
    dist.all_gather_object(gathered, (rows.numpy(), local), group=parallel.dp_group)
    outputs = {}
    for name in task.outputs:
        parts = [(r, out[name]) for r, out in gathered if out[name] is not None]
        full = np.empty((len(eval_set),) + parts[0][1].shape[1:], dtype=np.float32)
        for r, values in parts:
            full[r] = values
        outputs[name] = full
    return outputs


def evaluate_all_sets(engine, eval_sets: list[EvalSet], task: Task, parallel, batch_size: int):
    """Scores of every eval set (``"<set>/<metric>"``) and the prediction files (``"<set>.<ext>"``)."""
    metrics, files = {}, {}
    for eval_set in eval_sets:
        outputs = run_eval_set(engine, eval_set, task, parallel, batch_size)
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
                write_file(self.run_dir / "predictions" / name, text)
        if self.save_model:
            engine.module.save_pretrained(self.run_dir / "best")


class DevValidator:
    """Evaluates every eval set at the end of each epoch and at the last step (collective: every rank),
    logs the ``"split": "dev"`` event, prints it on the writer and hands it to ``tracker``."""

    def __init__(self, engine, eval_sets: list[EvalSet], task: Task, parallel, logger: MetricsLogger,
                 tracker: BestTracker, batch_size: int, epochs: float, steps_per_epoch: int, total_steps: int,
                 is_writer: bool):
        self.engine, self.eval_sets, self.task, self.parallel = engine, eval_sets, task, parallel
        self.logger, self.tracker, self.batch_size, self.is_writer = logger, tracker, batch_size, is_writer
        self.epochs, self.steps_per_epoch, self.total_steps = epochs, steps_per_epoch, total_steps

    def is_evaluation_step(self, step: int) -> bool:
        return step % self.steps_per_epoch == 0 or step == self.total_steps

    def evaluate(self, state: LoopState, write=None) -> None:
        """(``write`` is unused: the evaluation line is printed, flushed, on the writer.)"""
        step = state.iteration
        epoch = min(step / self.steps_per_epoch, self.epochs) if self.steps_per_epoch else 0
        metrics, files = evaluate_all_sets(self.engine, self.eval_sets, self.task, self.parallel, self.batch_size)
        event = {"iteration": step, "epoch": epoch, "split": "dev", **metrics}
        self.logger.log(event)
        if self.is_writer:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
            print(f"epoch {epoch:g} (step {step}): {shown}", flush=True)
        self.tracker.update(event, metrics, files, self.engine)
