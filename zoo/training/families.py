"""What the pretraining loop needs to know about a model family (GPT-2 or BERT): the model (random
init or ``--pretrained`` weights), its shape for the FLOPs formula, its datasets and its extra metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from zoo.models.config import BertConfig, GPT2Config


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    vocab: int
    max_positions: int


def shape_of(config: GPT2Config | BertConfig) -> ModelShape:
    if isinstance(config, BertConfig):
        return ModelShape(config.num_hidden_layers, config.hidden_size, config.vocab_size,
                          config.max_position_embeddings)
    return ModelShape(config.n_layer, config.n_embd, config.vocab_size, config.n_positions)


def build_model(config: GPT2Config | BertConfig, parallel) -> torch.nn.Module:
    from zoo.models import BertForPreTraining, GPT2LMHeadModel

    if isinstance(config, BertConfig):
        return BertForPreTraining(config, parallel=parallel)
    return GPT2LMHeadModel(config, parallel=parallel)


ZOO_ONLY_FIELDS = ("activation_checkpointing", "make_vocab_size_divisible_by")
FAMILY_OF_MODEL_TYPE = {"gpt2": "gpt2", "bert": "bert", "megatron-bert": "bert"}


def model_type_of(config: GPT2Config | BertConfig) -> str:
    return config.model_type


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
    from zoo.models import BertForPreTraining, GPT2LMHeadModel
    from zoo.models.hf_io import read_config_json

    values = read_config_json(directory)
    stored, wanted = values.get("model_type"), model_type_of(run_config)
    if FAMILY_OF_MODEL_TYPE.get(stored) != FAMILY_OF_MODEL_TYPE[wanted]:
        raise ValueError(f"--pretrained {directory} holds a model_type {stored!r} model but the run's preset "
                         f"{preset!r} builds {wanted!r}; pass a --model preset of the directory's family or another "
                         "directory.")
    for key, value in overrides.items():
        if "drop" in key or key in ZOO_ONLY_FIELDS or key == "pre_norm" or key not in values or values[key] == value:
            continue
        raise ValueError(f"model_overrides {key}={value!r} disagrees with {directory}/config.json ({key}="
                         f"{values[key]!r}); drop the override, since --pretrained takes the model's shape from the "
                         "directory.")
    # The layer order of a BERT comes from the directory too ("bert" post-norm, "megatron-bert" pre-norm);
    # an explicit pre_norm override is kept so that a contradicting one is refused by the loader.
    kept = {k: v for k, v in overrides.items() if "drop" in k or k in ZOO_ONLY_FIELDS or k == "pre_norm"}
    kept["activation_checkpointing"] = run_config.activation_checkpointing
    cls = BertForPreTraining if isinstance(run_config, BertConfig) else GPT2LMHeadModel
    return cls.from_pretrained(directory, parallel=parallel, **kept)


def default_corpus(config: GPT2Config | BertConfig, progress: bool) -> str:
    """The bundled Wikipedia sample, preprocessed once for this family's tokenizer."""
    if isinstance(config, BertConfig):
        from zoo.data import default_bert_corpus_prefix

        return default_bert_corpus_prefix(progress=progress)
    from zoo.data import default_corpus_prefix

    return default_corpus_prefix(progress=progress)


def build_dataset(config: GPT2Config | BertConfig, indexed, seq_length: int, seed: int, split: str, which: str,
                  num_samples: int):
    if isinstance(config, BertConfig):
        from zoo.data import BertDataset

        return BertDataset(indexed, max_seq_length=seq_length, seed=seed, split=split, which=which,
                           num_samples=num_samples, vocab_size=config.vocab_size,
                           max_position_embeddings=config.max_position_embeddings)
    from zoo.data import GPTDataset

    return GPTDataset(indexed, seq_length, seed, split=split, which=which, num_samples=num_samples,
                      vocab_size=config.vocab_size)


def extra_metrics(output, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-micro-batch sums to average over a logging window: BERT's MLM and SOP losses and SOP
    accuracy; nothing for GPT-2."""
    sop_logits = getattr(output, "seq_relationship_logits", None)
    if sop_logits is None or "next_sentence_label" not in batch:
        return {}
    labels = batch["next_sentence_label"].view(-1)
    sop_loss = F.cross_entropy(sop_logits.detach().float(), labels)
    return {"mlm_loss": output.loss.detach().float() - sop_loss, "sop_loss": sop_loss,
            "sop_acc": (sop_logits.argmax(-1) == labels).float().mean()}


def model_forward_kwargs(batch: dict[str, torch.Tensor], device) -> dict[str, Any]:
    return {key: value.to(device) for key, value in batch.items()}
