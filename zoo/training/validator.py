"""Validation during pretraining: the held-out split's loss (and BERT's MLM/SOP metrics) every
``--eval-interval`` iterations and at the last one, logged as a ``"split": "valid"`` event."""

from __future__ import annotations

import torch

from zoo.config.run_config import RunConfig
from zoo.distributed import means_over_dp
from zoo.training.families import forward_with_metrics
from zoo.training.loop import LoopState, to_device
from zoo.training.metrics import MetricsLogger, perplexity
from zoo.training.pipeline import is_pipeline_engine, pipeline_validation_means
from zoo.training.pretraining_data import PretrainingData

__all__ = ["Validator", "validation_means"]


def validation_means(engine, data: PretrainingData, config: RunConfig, parallel) -> dict[str, float]:
    """Validation means over ``eval_iters`` micro-batches and the DP ranks: "loss", plus BERT's
    "mlm_loss", "sop_loss" and "sop_acc". Summed on the device, one synchronisation at the end. A pipeline
    engine evaluates through its own schedule (:func:`zoo.training.pipeline.pipeline_validation_means`)."""
    if is_pipeline_engine(engine):
        return pipeline_validation_means(engine, data, config)
    engine.eval()
    sums: dict[str, torch.Tensor] = {}
    batches = data.valid_micro_batches(config.eval_iters)
    with torch.no_grad():
        for batch in batches:
            _, metrics = forward_with_metrics(engine, to_device(batch, engine.device), data.objective.extra_metrics)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
    engine.train()
    return means_over_dp(sums, config.eval_iters, parallel, engine.device)


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
