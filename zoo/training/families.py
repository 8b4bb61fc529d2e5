"""What the pretraining loop needs of a model family beyond the model itself (which
:mod:`zoo.models.families` builds): ``--pretrained`` weights, the bundled corpus, the datasets and
the extra metrics. Each function dispatches on the family's name from the models' registry."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from zoo.data import BertDataset, GPTDataset, default_bert_corpus_prefix, default_corpus_prefix
from zoo.models.config import ZOO_RUN_FIELDS, BertConfig, GPT2Config
from zoo.models.families import family_of, family_of_model_type
from zoo.models.hf_io import read_config_json


def pretrained_model(directory: str, run_config: GPT2Config | BertConfig, preset: str,
                     overrides: dict[str, Any], parallel) -> torch.nn.Module:
    """The family's training model with the weights of a transformers-layout directory (``--pretrained``),
    this rank's slices only, at the run's tp.

    The directory decides the shapes and, for BERT, the layer order ("bert" post-norm, "megatron-bert"
    pre-norm); the run's preset only names the family (GPT-2 or BERT), which must match the directory's
    ``model_type``. Overrides may change dropout and zoo's own fields; any other override must agree
    with the directory's config.json. A bare BERT encoder (no pretraining heads, e.g. MiniLM) gets
    fresh MLM and SOP heads.
    """
    kept = pretrained_overrides(directory, run_config, preset, overrides)
    return family_of(run_config).pretraining_model.from_pretrained(directory, parallel=parallel, **kept)


def pretrained_overrides(directory: str, run_config: GPT2Config | BertConfig, preset: str,
                         overrides: dict[str, Any]) -> dict[str, Any]:
    """The config fields a run sets on ``--pretrained`` weights (dropout, zoo's run fields, BERT's explicit
    ``pre_norm``), after checking that the directory holds the run's family and that no other override
    contradicts its config.json."""
    values = read_config_json(directory)
    stored, family = values.get("model_type"), family_of(run_config)
    if family_of_model_type(stored) is not family:
        raise ValueError(f"--pretrained {directory} holds a model_type {stored!r} model but the run's preset "
                         f"{preset!r} builds {run_config.model_type!r}; pass a --model preset of the directory's "
                         "family or another directory.")
    for key, value in overrides.items():
        if "drop" in key or key in ZOO_RUN_FIELDS or key == "pre_norm" or key not in values or values[key] == value:
            continue
        raise ValueError(f"model_overrides {key}={value!r} disagrees with {directory}/config.json ({key}="
                         f"{values[key]!r}); drop the override, since --pretrained takes the model's shape from the "
                         "directory.")
    # The layer order of a BERT comes from the directory too ("bert" post-norm, "megatron-bert" pre-norm);
    # an explicit pre_norm override is kept so that a contradicting one is refused by the loader.
    kept = {k: v for k, v in overrides.items() if "drop" in k or k in ZOO_RUN_FIELDS or k == "pre_norm"}
    kept.update({name: getattr(run_config, name)
                 for name in ("activation_checkpointing", "sequence_parallel", "recompute_granularity")})
    return kept


def default_corpus(config: GPT2Config | BertConfig, progress: bool) -> str:
    """The bundled Wikipedia sample, preprocessed once for this family's tokenizer."""
    if family_of(config).name == "bert":
        return default_bert_corpus_prefix(progress=progress)
    return default_corpus_prefix(progress=progress)


def build_dataset(config: GPT2Config | BertConfig, indexed, seq_length: int, seed: int, split: str, which: str,
                  num_samples: int):
    if family_of(config).name == "bert":
        return BertDataset(indexed, max_seq_length=seq_length, seed=seed, split=split, which=which,
                           num_samples=num_samples, vocab_size=config.vocab_size,
                           max_position_embeddings=config.max_position_embeddings)
    return GPTDataset(indexed, seq_length, seed, split=split, which=which, num_samples=num_samples,
                      vocab_size=config.vocab_size)


def forward_with_metrics(model, inputs: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """One forward of ``model`` (the engine) on ``inputs`` (the batch's device copy), and the
    per-micro-batch metrics to average over a logging window, all computed on the device from that
    same copy and left there: "loss", plus BERT's MLM and SOP losses and SOP accuracy."""
    output = model(**inputs)
    return output, {"loss": output.loss.detach().float(), **extra_metrics(output, inputs)}


def extra_metrics(output, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BERT's MLM and SOP losses and SOP accuracy from its output and the batch it was given (on the
    output's device); nothing for GPT-2."""
    sop_logits = getattr(output, "seq_relationship_logits", None)
    if sop_logits is None or "next_sentence_label" not in batch:
        return {}
    labels = batch["next_sentence_label"].view(-1)
    sop_loss = F.cross_entropy(sop_logits.detach().float(), labels)
    return {"mlm_loss": output.loss.detach().float() - sop_loss, "sop_loss": sop_loss,
            "sop_acc": (sop_logits.argmax(-1) == labels).float().mean()}
