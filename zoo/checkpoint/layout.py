"""The model behind a zoo DeepSpeed checkpoint, as layout only: config, names, local shapes and
partition tags at a given tp degree, built on the meta device without processes or memory.

A checkpoint holds the pretraining model of one of the families of :mod:`zoo.models.families`
(``GPT2LMHeadModel``, ``BertForPreTraining`` pre-norm or post-norm, ``LlamaForCausalLM``, ...). Each parameter's partition spec, declared by its
layer (:func:`zoo.parallel.partition.partition_specs`: split dimension, stride, vocab rows), says how its
shards merge and split; with the model's transformers key names, that is all the exporter and the tp
resharder need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zoo.errors import UserError
from zoo.models.families import (
    ModelConfig,
    build_model,
    family_of,
    family_of_model_type,
    known_model_types,
    param_groups,
)
from zoo.parallel.state import ParallelState


def layout_only_state(tp_size: int, tp_rank: int = 0) -> ParallelState:
    """A grid position with no process groups: enough to build a model's shapes and partition tags,
    never to run it (any collective on it would fail)."""
    return ParallelState(tp_size=tp_size, tp_rank=tp_rank, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp_size, rank=tp_rank)


def family_name(config: ModelConfig) -> str:
    return family_of(config).display_name


def embedding_key(config: ModelConfig) -> str:
    """The vocab-parallel word embedding's name in the pretraining model's state dict."""
    return family_of(config).embedding_key


def layout_model(config: ModelConfig, tp_size: int, tp_rank: int = 0) -> torch.nn.Module:
    """The training model of one TP rank on the meta device: names, local shapes and partition tags."""
    with torch.device("meta"):
        return build_model(config, layout_only_state(tp_size, tp_rank))


def optimizer_groups(layout: torch.nn.Module) -> list[list[str]]:
    """Parameter names per optimizer group, in the order zoo hands them to DeepSpeed."""
    names = {id(param): name for name, param in layout.named_parameters()}
    return [[names[id(param)] for param in group["params"]] for group in param_groups(layout, 0.0)]


def checked_layout_model(config: ModelConfig, tp_size: int, path: Path | str) -> torch.nn.Module:
    """:func:`layout_model`, with an impossible layout (heads not divisible by tp, ...) as one sentence."""
    try:
        return layout_model(config, tp_size)
    except ValueError as err:
        raise UserError(f"the {family_name(config)} model recorded in {path} cannot be laid out at "
                         f"tp={tp_size} ({str(err).rstrip('.')}).") from None


def recover_config(states: dict[str, Any], tp_size: int, path: Path) -> tuple[ModelConfig, str]:
    """The model config a checkpoint records (``model_config``: transformers' field names with its
    ``model_type``, which zoo's pretraining stores) and where it came from."""
    recorded = states.get("model_config")
    if not isinstance(recorded, dict):
        raise UserError(f"{path} records no model_config, so its model cannot be rebuilt; it was not written by "
                         "zoo's pretraining (launch/pretrain.py), which records it in every checkpoint.")
    config = config_from_dict(recorded, path)
    return _match_vocab_padding(config, states["module"], tp_size, path), "client_state['model_config']"


def config_from_dict(values: dict[str, Any], path: Path) -> ModelConfig:
    """A recorded transformers-style config dict: its ``model_type`` picks the family."""
    family = family_of_model_type(values.get("model_type"))
    if family is None:
        raise UserError(f"{path} records model_type {values.get('model_type')!r}, which is {model_types_sentence()}; "
                         "it is not a checkpoint of a zoo model.")
    return family.config_from_hf(values)


def model_types_sentence() -> str:
    """"neither 'gpt2', 'bert' nor 'megatron-bert'": the model types zoo builds, for a refusal."""
    names = [repr(name) for name in known_model_types()]
    return f"neither {', '.join(names[:-1])} nor {names[-1]}"

def _match_vocab_padding(config: ModelConfig, module: dict[str, torch.Tensor], tp_size: int,
                         path: Path) -> ModelConfig:
    """config.json does not carry zoo's ``make_vocab_size_divisible_by``; take the padding the weights have."""
    key = embedding_key(config)
    embedding = module.get(key)
    if embedding is None:
        raise UserError(f"{path} has no {key}; it is not a zoo {family_name(config)} checkpoint.")
    rows = embedding.shape[0]
    if rows * tp_size == config.padded_vocab_size(tp_size) or rows * tp_size < config.vocab_size:
        return config   # the default padding matches, or nothing does (the shape check reports it)
    return config.replace(make_vocab_size_divisible_by=rows)   # one unit of rows * tp covers the vocab


def check_layout(layout: torch.nn.Module, module: dict[str, torch.Tensor], path: Path) -> None:
    """The rank's state dict has exactly the layout's names and local shapes."""
    family = family_name(layout.config)
    expected = {name: tuple(t.shape) for name, t in layout.state_dict().items()}
    unknown = sorted(set(module) - set(expected))
    missing = sorted(set(expected) - set(module))
    if unknown or missing:
        example = f"unexpected {unknown[0]!r}" if unknown else f"missing {missing[0]!r}"
        raise UserError(f"{path} does not have the parameters of a zoo {family} ({example}); it is not a zoo "
                         f"{family} checkpoint of the recorded model config.")
    for name, shape in expected.items():
        if tuple(module[name].shape) != shape:
            raise UserError(f"{path} holds {name} of shape {tuple(module[name].shape)} but the recorded model "
                             f"config at tp={layout.parallel.tp_size} gives {shape}; the "
                             "checkpoint's client state does not match its weights.")
