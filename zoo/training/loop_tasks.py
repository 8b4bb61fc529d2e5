"""What a training job adds to the loop (:class:`zoo.training.loop.TrainingLoop`): the :class:`TrainTask`
protocol, and :class:`PretrainTask`, the pretraining task of every family (the forward and the objective's
metrics are :func:`zoo.training.pretraining_objectives.forward_with_metrics`)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from zoo.config.run_config import RunConfig
from zoo.planning.flops import model_flops_per_iteration
from zoo.training.grad_norm import current_loss_scale, deepspeed_reports_true_norm, unscaled_grad_norm
from zoo.training.log_window import LogWindow
from zoo.training.loop import LoopState
from zoo.training.metrics import format_log_line
from zoo.training.pretraining_data import PretrainingData
from zoo.training.pretraining_objectives import forward_with_metrics

__all__ = ["TrainTask", "PretrainTask", "format_log_line"]


class TrainTask(Protocol):
    """A job the loop trains: its length, its batches, its forward and its log events."""

    total_iterations: int
    samples_per_iteration: int     # global samples an iteration consumes
    log_interval: int

    def micro_batches(self, state: LoopState) -> list[dict[str, torch.Tensor]]:
        """The host micro-batches of the next iteration, already agreed across ranks (a bad sample on one
        rank raises the same sentence on every rank)."""

    def forward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
        """The output (with ``.loss``) of ``batch`` (on the device) and the device metrics to average over
        the log window ("loss" at least)."""

    def own_grad_norm(self, engine) -> torch.Tensor | None:
        """The task's grad norm of the iteration, taken before the step (a device tensor), or None where
        DeepSpeed's own is the one to log."""

    # Optional: ``train_iteration(engine, batches) -> (metric sums on the device, their count)`` runs the whole
    # iteration (forward, backward and step of every micro-batch) where the engine schedules it itself, as
    # DeepSpeed's pipeline engine does; without it the loop runs forward/backward/step per micro-batch.

    def log_event(self, state: LoopState, means: dict[str, float], window: LogWindow) -> dict[str, Any]:
        """The metrics.jsonl event of a log window (``means`` over its micro-batches and the DP ranks)."""

    def log_line(self, event: dict[str, Any]) -> str:
        """The console line of a log event."""


class PretrainTask:
    """Pretraining on ``data`` (any family; its objective's extra metrics are logged): ``gas`` micro-batches per iteration from the consumed-samples
    position, Megatron's throughput figures in each log event. Where DeepSpeed's grad norm is missing
    (fp32) or still carries the loss scale (unfused fp16), zoo's own unscaled norm is logged."""

    def __init__(self, config: RunConfig, data: PretrainingData, engine, parallel, gas: int, shape):
        self.config, self.data, self.engine, self.parallel, self.gas = config, data, engine, parallel, gas
        self.total_iterations = config.train_iters
        self.samples_per_iteration = engine.train_batch_size()
        self.log_interval = config.log_interval
        self.uses_own_norm = not deepspeed_reports_true_norm(engine)
        self.flops = model_flops_per_iteration(self.samples_per_iteration, config.seq_length, shape, shape.vocab,
                                               recompute=config.recompute == "full")

    def micro_batches(self, state: LoopState) -> list[dict[str, torch.Tensor]]:
        return self.data.train_micro_batches(state.consumed_samples, self.gas)

    def forward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
        return forward_with_metrics(engine, batch, self.data.objective.extra_metrics)

    def own_grad_norm(self, engine) -> torch.Tensor | None:
        return unscaled_grad_norm(engine, self.parallel) if self.uses_own_norm else None

    def log_event(self, state: LoopState, means: dict[str, float], window: LogWindow) -> dict[str, Any]:
        engine, config = self.engine, self.config
        grad_norm = window.grad_norm if self.uses_own_norm else engine.get_global_grad_norm()
        step_time = window.step_time
        return {
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            **means,
            "lr": engine.get_lr()[0],
            "loss_scale": current_loss_scale(engine.optimizer),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "step_time_s": step_time,
            "tokens_per_s": self.samples_per_iteration * config.seq_length / step_time,
            "tflops": self.flops / step_time / dist.get_world_size() / 1e12,
            "eta_s": step_time * (config.train_iters - state.iteration),
        }

    def log_line(self, event: dict[str, Any]) -> str:
        return " | ".join([format_log_line(event, self.config.train_iters), *self.data.objective.log_parts(event)])
