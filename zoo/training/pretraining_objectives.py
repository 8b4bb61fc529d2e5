"""What pretraining needs of a model family beyond the model itself (which the registry,
:mod:`zoo.models.families`, builds): ``--pretrained`` weights, and its objective's bundled corpus, datasets
and extra metrics.

The data and metrics cannot live in the registry: ``zoo.models`` sits below ``zoo.data`` and
``zoo.training`` in the package layers. A family therefore names its pretraining objective there
(``ModelFamily.objective``: causal LM or MLM + SOP, a fact about its pretraining head), and this module holds
the one table of objectives, :data:`OBJECTIVES`, read through one lookup, :func:`objective_of`. Keying the
table by objective, not by family, means a new family with an existing objective (a decoder such as Llama)
adds nothing here; only a new kind of pretraining adds a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from zoo.data import BertDataset, GPTDataset, default_bert_corpus_prefix, default_corpus_prefix
from zoo.errors import UserError
from zoo.models.config import ZOO_RUN_FIELDS
from zoo.models.families import (
    CAUSAL_LM,
    MLM_SOP,
    ModelConfig,
    family_of,
    family_of_model_type,
    read_checked_config_json,
)
from zoo.training.baselines import causal_lm_validation_line, mlm_sop_validation_line

Metrics = dict[str, torch.Tensor]


def no_extra_metrics(output, batch: dict[str, torch.Tensor]) -> Metrics:
    """A causal LM logs its loss alone."""
    return {}


def mlm_sop_metrics(output, batch: dict[str, torch.Tensor]) -> Metrics:
    """BERT's MLM and SOP losses and SOP accuracy from its output and the batch it was given (on the
    output's device)."""
    sop_logits = getattr(output, "seq_relationship_logits", None)
    if sop_logits is None or "next_sentence_label" not in batch:
        return {}
    labels = batch["next_sentence_label"].view(-1)
    sop_loss = F.cross_entropy(sop_logits.detach().float(), labels)
    return {"mlm_loss": output.loss.detach().float() - sop_loss, "sop_loss": sop_loss,
            "sop_acc": (sop_logits.argmax(-1) == labels).float().mean()}


def causal_lm_weights(metrics: Metrics, batch: dict[str, torch.Tensor]) -> Metrics:
    """What a causal LM's loss on ``batch`` is a mean over: the labels it scores (shifted by one, -100 ignored)."""
    return {"loss": (batch["labels"][:, 1:] != -100).sum()}


def mlm_sop_weights(metrics: Metrics, batch: dict[str, torch.Tensor]) -> Metrics:
    """What BERT's metrics on ``batch`` are means over: the masked tokens (MLM loss) and the sentence pairs (SOP
    loss and accuracy); without SOP metrics the loss is the MLM loss alone."""
    masked = (batch["labels"] != -100).sum()
    if "sop_loss" not in metrics:
        return {"loss": masked}
    pairs = torch.tensor(batch["next_sentence_label"].numel(), device=masked.device)
    return {"mlm_loss": masked, "sop_loss": pairs, "sop_acc": pairs}


def mlm_sop_validation_loss(means: dict[str, float]) -> float:
    """BERT's loss over a validation: the mean MLM loss over every masked token plus the mean SOP loss over every
    pair (each part weighted as the model's own loss weights it within a micro-batch)."""
    return means["loss"] if "loss" in means else means["mlm_loss"] + means["sop_loss"]


def mlm_sop_log_parts(event: dict[str, Any]) -> list[str]:
    """The MLM/SOP fields of a training log line (none where the event lacks them)."""
    if "sop_acc" not in event:
        return []
    return [f"MLM {event['mlm_loss']:.4f}", f"SOP {event['sop_loss']:.4f}", f"SOP acc {event['sop_acc']:.3f}"]


def mlm_sop_closing_line(last: dict[str, Any]) -> str | None:
    """The last log window's MLM and SOP figures, printed at the end of a run."""
    if "sop_acc" not in last:
        return None
    return (f"last logged window: MLM loss {last['mlm_loss']:.4f}, SOP loss {last['sop_loss']:.4f}, "
            f"SOP accuracy {last['sop_acc']:.3f}")


def gpt_dataset(config, indexed, seq_length: int, seed: int, split: str, which: str, num_samples: int):
    return GPTDataset(indexed, seq_length, seed, split=split, which=which, num_samples=num_samples,
                      vocab_size=config.vocab_size)


def bert_dataset(config, indexed, seq_length: int, seed: int, split: str, which: str, num_samples: int):
    return BertDataset(indexed, max_seq_length=seq_length, seed=seed, split=split, which=which,
                       num_samples=num_samples, vocab_size=config.vocab_size,
                       max_position_embeddings=config.max_position_embeddings)


@dataclass(frozen=True)
class PretrainingObjective:
    """The data and metrics of one kind of pretraining.

    ``default_corpus(progress)``: the bundled Wikipedia sample's indexed-dataset prefix, preprocessed once
    for the objective's tokenizer and sample layout. ``dataset(config, indexed, seq_length, seed, split,
    which, num_samples)``: the samples. ``extra_metrics(output, batch)``: device metrics beside "loss".
    ``log_parts(event)``: their fields on a training log line; ``closing_line(last)``: their line at the end
    of a run (None: nothing to add); ``validation_line(means, unigram)``: the closing validation line beside its
    baselines. ``validation_weights(metrics, batch)``: what each metric of a micro-batch is a mean over (its
    tokens or pairs), so that a validation weights every token or pair of its samples once, however they were
    cut into micro-batches; ``validation_loss(means)``: the validation's loss from the weighted means.
    """

    default_corpus: Callable[[bool], str]
    dataset: Callable[..., Any]
    extra_metrics: Callable[[Any, dict[str, torch.Tensor]], Metrics] = no_extra_metrics
    log_parts: Callable[[dict[str, Any]], list[str]] = lambda event: []
    closing_line: Callable[[dict[str, Any]], str | None] = lambda last: None
    validation_line: Callable[[dict[str, Any], float | None], str] = causal_lm_validation_line
    validation_weights: Callable[[Metrics, dict[str, torch.Tensor]], Metrics] = causal_lm_weights
    validation_loss: Callable[[dict[str, float]], float] = lambda means: means["loss"]


OBJECTIVES: dict[str, PretrainingObjective] = {
    CAUSAL_LM: PretrainingObjective(lambda progress: default_corpus_prefix(progress=progress), gpt_dataset),
    MLM_SOP: PretrainingObjective(lambda progress: default_bert_corpus_prefix(progress=progress), bert_dataset,
                                  mlm_sop_metrics, mlm_sop_log_parts, mlm_sop_closing_line, mlm_sop_validation_line,
                                  mlm_sop_weights, mlm_sop_validation_loss),
}


def objective_of(config: ModelConfig) -> PretrainingObjective:
    """The pretraining objective of a model config's family."""
    return OBJECTIVES[family_of(config).objective]


def pretrained_model(directory: str, run_config: ModelConfig, preset: str,
                     overrides: dict[str, Any], parallel) -> torch.nn.Module:
    """The family's training model with the weights of a transformers-layout directory (``--pretrained``),
    this rank's slices only, at the run's tp.

    The directory decides the shapes and, for BERT, the layer order ("bert" post-norm, "megatron-bert"
    pre-norm); the run's preset only names the family, which must match the directory's
    ``model_type``. Overrides may change dropout and zoo's own fields; any other override must agree
    with the directory's config.json. A bare BERT encoder (no pretraining heads, e.g. MiniLM) gets
    fresh MLM and SOP heads.
    """
    kept = pretrained_overrides(directory, run_config, preset, overrides)
    return family_of(run_config).pretraining_model.from_pretrained(directory, parallel=parallel, **kept)


def pretrained_overrides(directory: str, run_config: ModelConfig, preset: str,
                         overrides: dict[str, Any]) -> dict[str, Any]:
    """The config fields a run sets on ``--pretrained`` weights (dropout, zoo's run fields, the family's
    ``layout_fields`` such as BERT's explicit ``pre_norm``), after checking that the directory holds the run's
    family and that no other override contradicts its config.json."""
    values = read_checked_config_json(directory)
    stored, family = values.get("model_type"), family_of(run_config)
    if family_of_model_type(stored) is not family:
        raise UserError(f"--pretrained {directory} holds a model_type {stored!r} model but the run's preset "
                         f"{preset!r} builds {run_config.model_type!r}; pass a --model preset of the directory's "
                         "family or another directory.")
    for key, value in overrides.items():
        if kept_on_pretrained(key, family) or key not in values or values[key] == value:
            continue
        raise UserError(f"model_overrides {key}={value!r} disagrees with {directory}/config.json ({key}="
                         f"{values[key]!r}); drop the override, since --pretrained takes the model's shape from the "
                         "directory.")
    # The layer order (BERT's "bert" post-norm or "megatron-bert" pre-norm) comes from the directory too; an
    # explicit layout override is kept so that a contradicting one is refused by the loader.
    kept = {k: v for k, v in overrides.items() if kept_on_pretrained(k, family)}
    kept.update({name: getattr(run_config, name)
                 for name in ("activation_checkpointing", "sequence_parallel", "recompute_granularity")})
    return kept


def kept_on_pretrained(key: str, family) -> bool:
    """Whether a ``--pretrained`` run may set config field ``key`` whatever the directory says: a dropout,
    one of zoo's run fields or one of the family's layout fields (checked by its loader)."""
    return "drop" in key or key in ZOO_RUN_FIELDS or key in family.layout_fields


def default_corpus(config: ModelConfig, progress: bool) -> str:
    """The bundled Wikipedia sample, preprocessed once for this family's objective."""
    return objective_of(config).default_corpus(progress)


def build_dataset(config: ModelConfig, indexed, seq_length: int, seed: int, split: str, which: str,
                  num_samples: int):
    return objective_of(config).dataset(config, indexed, seq_length, seed, split, which, num_samples)


def forward_with_metrics(model, inputs: dict[str, torch.Tensor],
                         extra_metrics=no_extra_metrics) -> tuple[Any, Metrics]:
    """One forward of ``model`` (the engine) on ``inputs`` (the batch's device copy), and the
    per-micro-batch metrics to average over a logging window, all computed on the device from that
    same copy and left there: "loss", plus the objective's ``extra_metrics`` (BERT's MLM and SOP losses
    and SOP accuracy)."""
    output = model(**inputs)
    return output, {"loss": output.loss.detach().float(), **extra_metrics(output, inputs)}
