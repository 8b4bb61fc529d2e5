"""The model families zoo trains, as data: one :class:`ModelFamily` per family, looked up from a config
or from a transformers ``model_type``. Training, checkpoint export and resharding all ask this
registry instead of dispatching on config classes themselves.

    family_of(config).pretraining_model(config, parallel=ps)      # GPT2LMHeadModel / BertForPreTraining
    family_of(config).shape(config).layers                          # for the FLOPs formula
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zoo.models.bert import BertForPreTraining
from zoo.models.config import BertConfig, GPT2Config
from zoo.models.gpt2 import GPT2LMHeadModel
from zoo.models.llama import LlamaConfig, LlamaForCausalLM
from zoo.parallel.state import ParallelState

ModelConfig = GPT2Config | BertConfig


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    vocab: int
    max_positions: int


@dataclass(frozen=True)
class ModelFamily:
    name: str                                   # "gpt2" | "bert": the key the training side uses
    display_name: str                           # for messages: "GPT-2", "BERT"
    config_class: type
    pretraining_model: type                     # the model pretraining builds and checkpoints hold
    model_types: tuple[str, ...]                # transformers' model_type values of the family
    embedding_key: str                          # the vocab-parallel word embedding in the state dict
    shape: Callable[[Any], ModelShape]


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("gpt2", "GPT-2", GPT2Config, GPT2LMHeadModel, ("gpt2",), "transformer.wte.weight",
                lambda c: ModelShape(c.n_layer, c.n_embd, c.n_head, c.vocab_size, c.n_positions)),
    ModelFamily("bert", "BERT", BertConfig, BertForPreTraining, ("bert", "megatron-bert"),
                "bert.embeddings.word_embeddings.weight",
                lambda c: ModelShape(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.vocab_size,
                                     c.max_position_embeddings)),
    ModelFamily("llama", "Llama", LlamaConfig, LlamaForCausalLM, ("llama",), "model.embed_tokens.weight",
                lambda c: ModelShape(c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.vocab_size,
                                     c.max_position_embeddings)),
)


def family_of(config: ModelConfig) -> ModelFamily:
    """The family of a model config."""
    for family in FAMILIES:
        if isinstance(config, family.config_class):
            return family
    raise TypeError(f"{type(config).__name__} is not a zoo model config")


def family_of_model_type(model_type: str | None) -> ModelFamily | None:
    """The family a transformers ``model_type`` belongs to, or None for one zoo does not build."""
    return next((family for family in FAMILIES if model_type in family.model_types), None)


def build_model(config: ModelConfig, parallel: ParallelState | None) -> torch.nn.Module:
    """The family's pretraining model (random init, TP-invariant) on the grid position ``parallel``."""
    return family_of(config).pretraining_model(config, parallel=parallel)


def shape_of(config: ModelConfig) -> ModelShape:
    return family_of(config).shape(config)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: decoupled weight decay on matrices only, none on biases and
    LayerNorm weights (Megatron, GPT-2), each group in ``named_parameters`` order.

    Their order is also the index order of the optimizer state in DeepSpeed checkpoints, which the tp
    resharder (:mod:`zoo.checkpoint.reshard`) relies on; it is the same at every tp degree because the
    module structure is.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        (no_decay if param.dim() < 2 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
