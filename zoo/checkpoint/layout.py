"""The model behind a zoo DeepSpeed checkpoint, as layout only: config, names, local shapes and
partition tags at a given tp degree, built on the meta device without processes or memory.

A checkpoint is GPT-2 (``GPT2LMHeadModel``) or BERT (``BertForPreTraining``, pre-norm or post-norm):
the pretraining models of :mod:`zoo.models.families`. Each parameter's ``partition_dim`` and
``partition_stride`` and its ``hf_param_map()`` entry (transformers key, vocab rows) say how its
shards merge and split; that is all the exporter and the tp resharder need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zoo.models.config import BertConfig, GPT2Config
from zoo.models.families import build_model, family_of, param_groups
from zoo.parallel.state import ParallelState

ModelConfig = GPT2Config | BertConfig


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
        raise ValueError(f"the {family_name(config)} model recorded in {path} cannot be laid out at "
                         f"tp={tp_size} ({str(err).rstrip('.')}).") from None


def recover_config(states: dict[str, Any], tp_size: int, path: Path) -> tuple[ModelConfig, str]:
    """The model config of a checkpoint and where it came from.

    zoo's pretrain stores the full config (``model_config``, transformers' field names, with its
    ``model_type``). For older checkpoints without it, start from the ``zoo_model`` preset; for GPT-2
    read every size the shapes reveal (n_layer, n_embd, n_positions, n_inner; n_head is not visible
    in the shapes and stays the preset's).
    """
    from zoo.models.presets import model_config

    module = states["module"]
    recorded = states.get("model_config")
    if isinstance(recorded, dict):
        config = config_from_dict(recorded, states.get("zoo_model"), path)
        source = "client_state['model_config']"
    else:
        try:
            config = model_config(states["zoo_model"])
        except ValueError:
            raise ValueError(f"{path} names model preset {states['zoo_model']!r}, which zoo does not know, and "
                             "stores no model_config; use the zoo version that trained it.") from None
        source = f"preset {states['zoo_model']!r}"
        if isinstance(config, GPT2Config):
            config = _gpt2_sizes_from_shapes(config, module, tp_size, path)
            source += " with n_layer/n_embd/n_positions/n_inner read from the weight shapes"
    return _match_vocab_padding(config, module, tp_size, path), source


def config_from_dict(values: dict[str, Any], preset: str | None, path: Path) -> ModelConfig:
    """A recorded transformers-style config dict: its ``model_type`` picks the family."""
    model_type = values.get("model_type")
    if model_type in ("bert", "megatron-bert"):
        return BertConfig.from_dict(values)
    if model_type == "gpt2":
        return GPT2Config.from_dict(values)
    if model_type is None and preset is not None:   # an older zoo client state: the preset's family decides
        from zoo.models.presets import model_config

        family = type(model_config(preset))
        return family.from_dict({**values, "model_type": "megatron-bert"}) if family is BertConfig \
            else GPT2Config.from_dict(values)
    raise ValueError(f"{path} records model_type {model_type!r}, which is neither 'gpt2', 'bert' nor "
                     "'megatron-bert'; it is not a checkpoint of a zoo model.")


def _gpt2_sizes_from_shapes(config: GPT2Config, module: dict[str, torch.Tensor], tp_size: int,
                            path: Path) -> GPT2Config:
    try:
        n_positions, n_embd = module["transformer.wpe.weight"].shape
        n_layer = len({k.split(".")[2] for k in module if k.startswith("transformer.h.")})
        ffn = module["transformer.h.0.mlp.c_fc.weight"].shape[0] * tp_size
    except (KeyError, ValueError):
        raise ValueError(f"{path} lacks zoo GPT-2 parameters such as transformer.wpe.weight; it is not a zoo GPT-2 "
                         "checkpoint.") from None
    return config.replace(n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                          n_inner=None if ffn == 4 * n_embd else ffn)


def _match_vocab_padding(config: ModelConfig, module: dict[str, torch.Tensor], tp_size: int,
                         path: Path) -> ModelConfig:
    """config.json does not carry zoo's ``make_vocab_size_divisible_by``; take the padding the weights have."""
    key = embedding_key(config)
    embedding = module.get(key)
    if embedding is None:
        raise ValueError(f"{path} has no {key}; it is not a zoo {family_name(config)} checkpoint.")
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
        raise ValueError(f"{path} does not have the parameters of a zoo {family} ({example}); it is not a zoo "
                         f"{family} checkpoint of the recorded model config.")
    for name, shape in expected.items():
        if tuple(module[name].shape) != shape:
            raise ValueError(f"{path} holds {name} of shape {tuple(module[name].shape)} but the recorded model "
                             f"config at tp={layout.parallel.tp_size} gives {shape}; the "
                             "checkpoint's client state does not match its weights.")
