"""Finetuning as a :class:`zoo.training.loop_tasks.TrainTask`: epochs of seeded global batches over the
task's encoded training rows, split over the data-parallel ranks, and the head's loss as the metric."""

from __future__ import annotations

from typing import Any

import torch

from zoo.finetune.config import FinetuneConfig
from zoo.training.log_window import LogWindow
from zoo.training.loop import LoopState
from zoo.training.metrics import format_breakdown

__all__ = ["FinetuneTask", "EpochBatches", "global_batches", "rank_micro_batches"]


def global_batches(num_examples: int, batch_size: int, epoch: int, seed: int) -> list[torch.Tensor]:
    """The epoch's global batches: a permutation seeded by (seed, epoch), cut into full batches."""
    generator = torch.Generator().manual_seed(seed * 1000 + epoch)
    order = torch.randperm(num_examples, generator=generator)
    return list(order[: (num_examples // batch_size) * batch_size].split(batch_size))


def rank_micro_batches(batch: torch.Tensor, parallel, micro: int) -> list[torch.Tensor]:
    """This DP rank's contiguous share of a global batch, cut into micro-batches."""
    share = batch.shape[0] // parallel.dp_size
    mine = batch[parallel.dp_rank * share: (parallel.dp_rank + 1) * share]
    return list(mine.split(micro))


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


class FinetuneTask:
    """``total_steps`` optimizer steps of ``--batch-size`` rows of ``train`` (the task's encoded training
    split, one tensor per model input), ``steps_per_epoch`` to an epoch; the TP ranks of a group read the
    same rows. DeepSpeed's grad norm is the one it keeps (none is logged)."""

    def __init__(self, config: FinetuneConfig, train: dict[str, torch.Tensor] | None, engine, parallel,
                 steps_per_epoch: int, total_steps: int):
        self.config, self.train, self.engine, self.parallel = config, train, engine, parallel
        self.steps_per_epoch = steps_per_epoch
        self.total_iterations = total_steps
        self.samples_per_iteration = config.batch_size
        self.log_interval = config.log_interval
        self.micro = engine.train_micro_batch_size_per_gpu()
        num_train = 0 if train is None else next(iter(train.values())).shape[0]
        self.batches = EpochBatches(num_train, config.batch_size, config.seed, steps_per_epoch)

    def micro_batches(self, state: LoopState) -> list[dict[str, torch.Tensor]]:
        return [{key: value[rows] for key, value in self.train.items()}
                for rows in rank_micro_batches(self.batches.at(state.iteration), self.parallel, self.micro)]

    def forward(self, engine, batch: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
        """A task head's forward on the device batch; its loss is the one metric, left on the device."""
        output = engine(**batch)
        return output, {"loss": output.loss.detach().float()}

    def own_grad_norm(self, engine) -> None:
        return None

    def log_event(self, state: LoopState, means: dict[str, float], window: LogWindow) -> dict[str, Any]:
        return {"iteration": state.iteration, "epoch": state.iteration / self.steps_per_epoch, "loss": means["loss"],
                "lr": self.engine.get_lr()[0], "step_time_s": window.step_time,
                "samples_per_s": self.config.batch_size * window.steps / window.seconds}

    def log_line(self, event: dict[str, Any]) -> str:
        """The console line of a log event, with where the iteration's time went where the event says it."""
        line = (f"step {event['iteration']}/{self.total_iterations} | loss {event['loss']:.4f} | "
                f"lr {event['lr']:.3e} | {event['samples_per_s']:.1f} samples/s")
        breakdown = format_breakdown(event)
        return f"{line} | {breakdown}" if breakdown else line
