"""Validation during pretraining: the held-out split's loss (and BERT's MLM/SOP metrics) every
``--eval-interval`` iterations and at the last one, logged as a ``"split": "valid"`` event."""

from __future__ import annotations

import contextlib

import torch

from zoo.config.run_config import RunConfig
from zoo.distributed import weighted_means_over_dp
from zoo.training.device_batches import to_device
from zoo.training.loop import LoopState
from zoo.training.metrics import MetricsLogger, perplexity
from zoo.training.pipeline import is_pipeline_engine, pipeline_validation_means
from zoo.training.pretraining_data import PretrainingData
from zoo.training.pretraining_objectives import forward_with_metrics

__all__ = ["Validator", "validation_means"]


def validation_means(engine, data: PretrainingData, config: RunConfig, parallel) -> dict[str, float]:
    """The validation's means: "loss", plus BERT's "mlm_loss", "sop_loss" and "sop_acc", over the valid split's
    first ``eval_iters`` global batches (:meth:`PretrainingData.valid_iterations`).

    The same number at every layout: the same samples are evaluated at any tp, pp, dp and micro-batch size, each
    by one DP rank, and each metric is a mean over all their tokens (or pairs) together, each counted once (the
    objective's ``validation_weights``), not a mean of micro-batch means. Summed on the device in fp64, one
    synchronisation at the end. A pipeline engine evaluates through its own schedule
    (:func:`zoo.training.pipeline.pipeline_validation_means`)."""
    if is_pipeline_engine(engine):
        return pipeline_validation_means(engine, data, config)
    objective = data.objective
    sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    engine.eval()
    try:
        with torch.no_grad(), contextlib.closing(data.valid_iterations(config.eval_iters)) as iterations:
            for batches in iterations:
                for batch in batches:
                    batch = to_device(batch, engine.device)
                    _, metrics = forward_with_metrics(engine, batch, objective.extra_metrics)
                    for key, weight in objective.validation_weights(metrics, batch).items():
                        weight = weight.double()
                        total, count = sums.get(key, (0.0, 0.0))
                        sums[key] = (total + metrics[key].double() * weight, count + weight)
    finally:
        engine.train()
    means = weighted_means_over_dp(sums, parallel, engine.device)
    return {"loss": objective.validation_loss(means), **{k: v for k, v in means.items() if k != "loss"}}


class Validator:
    """Evaluates ``engine`` on ``data``'s validation split (collective: every rank); ``means`` holds the
    latest evaluation's means (empty before the first)."""

    def __init__(self, engine, data: PretrainingData, config: RunConfig, parallel, logger: MetricsLogger):
        self.engine, self.data, self.config, self.parallel, self.logger = engine, data, config, parallel, logger
        self.means: dict[str, float] = {}

    def is_evaluation_step(self, iteration: int) -> bool:
        interval = self.config.eval_interval
        return bool(interval) and (iteration % interval == 0 or iteration == self.config.train_iters)

    @property
    def loss(self) -> float | None:
        """The latest validation loss; None before any evaluation."""
        return self.means.get("loss")

    def evaluate(self, state: LoopState, write) -> None:
        self.means.update(validation_means(self.engine, self.data, self.config, self.parallel))
        val_loss = self.means["loss"]
        extras = {f"val_{key}": value for key, value in self.means.items() if key != "loss"}
        if "mlm_loss" in self.means:   # BERT: the perplexity of the MLM loss alone (val_ppl is of MLM + SOP)
            extras["val_mlm_ppl"] = perplexity(self.means["mlm_loss"])
        self.logger.log({"iteration": state.iteration, "split": "valid", "val_loss": val_loss,
                         "val_ppl": perplexity(val_loss), **extras})
        shown = "".join(f", {key} {value:.4f}" for key, value in extras.items() if key != "val_mlm_ppl")
        headline = (f"MLM perplexity {extras['val_mlm_ppl']:.2f}" if "val_mlm_ppl" in extras
                    else f"perplexity {perplexity(val_loss):.2f}")
        write(f"iteration {state.iteration}: validation loss {val_loss:.4f}, {headline}{shown}")
