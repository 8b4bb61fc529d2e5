"""The model families zoo trains, as data: one :class:`ModelFamily` per family, looked up from a config,
a preset name or a transformers ``model_type``. This registry is the one place that knows which families
exist; training, planning, checkpoint export and resharding ask it instead of dispatching on config
classes or model-type strings themselves. A new family is its own folder under ``zoo/models/`` plus one
entry of :data:`FAMILIES`.

    family_of(config).pretraining_model(config, parallel=parallel)  # GPT2LMHeadModel / BertForPreTraining / ...
    model_config("llama-tiny", hidden_dropout=0.0)                # any family's preset, by name
    family_of(config).shape(config).ffn_matrices                  # for the FLOPs and memory formulas

What pretraining does with a family beyond its model (datasets, corpus, extra metrics) lives on the
training side, which is above this package: a family names its pretraining ``objective`` here and
:mod:`zoo.training.pretraining_objectives` holds the one table of objectives.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint.hf.hf_io import read_config_json
from zoo.errors import UserError
from zoo.models.bert.config import BertConfig, check_bert_config_values
from zoo.models.bert.model import BertForPreTraining
from zoo.models.bert.presets import BERT_PRESETS, bert_config
from zoo.models.gpt2.config import GPT2Config, check_gpt2_config_values
from zoo.models.gpt2.model import GPT2LMHeadModel
from zoo.models.gpt2.pipeline import entry_of as gpt2_entry_of
from zoo.models.gpt2.pipeline import entry_parameters as gpt2_entry_parameters
from zoo.models.gpt2.pipeline import gpt2_pipeline_module, hf_names, load_stage_weights, one_stage_name
from zoo.models.gpt2.pipeline import layer_entries as gpt2_layer_entries
from zoo.models.gpt2.presets import GPT2_PRESETS, gpt2_config
from zoo.models.llama import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM, llama_config
from zoo.models.llama.config import check_llama_config_values
from zoo.models.llama.pipeline import entry_of as llama_entry_of
from zoo.models.llama.pipeline import entry_parameters as llama_entry_parameters
from zoo.models.llama.pipeline import layer_entries as llama_layer_entries
from zoo.models.llama.pipeline import llama_pipeline_module, load_llama_stage_weights
from zoo.models.llama.pipeline import one_stage_name as llama_one_stage_name
from zoo.models.llama.pipeline import one_stage_names as llama_one_stage_names
from zoo.parallel.state import ParallelState

ModelConfig = GPT2Config | BertConfig | LlamaConfig

CAUSAL_LM = "causal_lm"     # next-token prediction on a stream of documents (GPT-2, Llama)
MLM_SOP = "mlm_sop"         # masked LM plus sentence-order prediction on sentence pairs (BERT)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs formula (:func:`zoo.planning.flops.model_flops_per_iteration`) and the planner's
    activation formulas (:mod:`zoo.planning.activations`) read of a model: its sizes and how its layer is built.

    Attention has ``heads`` query heads and ``kv_heads`` key/value heads (fewer: grouped-query attention) of
    width ``head_dim``; the MLP has ``ffn_matrices`` GEMMs of inner width ``ffn_hidden`` (2: up and down around
    GeLU; 3: SwiGLU's gate, up and down). ``norm`` is "layernorm" or "rmsnorm" (normalised in float32, as
    transformers' LlamaRMSNorm). ``layer_dropouts``: dropout masks a layer keeps for backward (after attention
    and after the MLP), ``embedding_dropout``: one after the embeddings. ``fused_attention``: the attention core
    keeps what SDPA's fused kernels keep (its inputs, output and log-sum-exp) rather than the attention
    scores of Korthikanti et al.'s count.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    max_positions: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    ffn_matrices: int
    norm: str
    layer_dropouts: int
    embedding_dropout: bool
    fused_attention: bool


def gpt2_shape(config: GPT2Config) -> ModelShape:
    """GPT-2: multi-head attention, a 2-GEMM GeLU MLP, LayerNorm, dropout after the embeddings and in each
    residual branch, attention counted as in Korthikanti et al. 2022."""
    return ModelShape(config.n_layer, config.n_embd, config.n_head, config.vocab_size, config.n_positions,
                      kv_heads=config.n_head, head_dim=config.n_embd // config.n_head,
                      ffn_hidden=config.ffn_hidden_size, ffn_matrices=2, norm="layernorm", layer_dropouts=2,
                      embedding_dropout=True, fused_attention=False)


def bert_shape(config: BertConfig) -> ModelShape:
    """BERT: the same layer as GPT-2's (its LayerNorm before or after the residual branch)."""
    return ModelShape(config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.vocab_size,
                      config.max_position_embeddings, kv_heads=config.num_attention_heads,
                      head_dim=config.hidden_size // config.num_attention_heads,
                      ffn_hidden=config.ffn_hidden_size, ffn_matrices=2, norm="layernorm", layer_dropouts=2,
                      embedding_dropout=True, fused_attention=False)


def llama_shape(config: LlamaConfig) -> ModelShape:
    """Llama: grouped-query attention through SDPA's fused kernel (no attention dropout in any preset), a
    SwiGLU MLP, RMSNorm, no dropout in the residual stream."""
    return ModelShape(config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.vocab_size,
                      config.max_position_embeddings, kv_heads=config.kv_heads, head_dim=config.attention_head_dim,
                      ffn_hidden=config.intermediate_size, ffn_matrices=3, norm="rmsnorm", layer_dropouts=0,
                      embedding_dropout=False, fused_attention=True)


@dataclass(frozen=True)
class PipelineStages:
    """How a family runs as DeepSpeed pipeline stages: ``build(config, parallel, seed, partition_method,
    replay_init)`` gives this rank's stage module, ``load_weights(module, directory, parallel)`` fills it from
    a transformers directory (this stage's tensors, this rank's slices). ``one_stage_names(module)`` maps a
    stage's parameters to the one-stage model's names, and ``entry_name(index, key, layers)`` a key of the
    checkpoint file of layer-sequence entry ``index`` (entries 0 ... layers + 2 hold every weight once);
    ``entry_of(name, layers)``, its inverse, the entry whose file holds one-stage parameter ``name``. For
    the planner: ``entry_parameters(config, tp)``, each entry's parameters per TP rank, and
    ``layer_entries(config)``, the indices of the layers (what ``uniform`` partitioning balances)."""

    build: Callable[..., torch.nn.Module]
    load_weights: Callable[[torch.nn.Module, str, ParallelState], None]
    one_stage_names: Callable[[torch.nn.Module], dict[str, str]]
    entry_name: Callable[[int, str, int], str]
    entry_parameters: Callable[[Any, int], list[int]]
    layer_entries: Callable[[Any], range]
    entry_of: Callable[[str, int], int]


@dataclass(frozen=True)
class ModelFamily:
    """Everything outside a family's folder needs to know about it.

    ``check_hf_config(values, path)`` refuses a transformers config.json of the family whose shape fields are
    missing or out of bounds (one sentence naming the file and the field); ``config_from_hf(values)`` builds
    the family's config from one (transformers' field names). ``objective`` names the pretraining objective
    (:data:`CAUSAL_LM` or :data:`MLM_SOP`) whose data and metrics :mod:`zoo.training.pretraining_objectives` provides.
    ``generates_text``: the pretraining model samples text (a run's ``sample_prompts``).
    ``pipeline``: None where the family has no pipeline stages. ``lm_head_transform``: the LM head runs a
    dense + GeLU + LayerNorm transform before the decoder (BERT's MLM head), which the planner counts.
    ``layout_fields``: config fields a ``--pretrained`` run keeps from its own overrides although they are
    no dropout or run field, because they pick the layer order the directory's weights must match.
    ``megatron_fields``: Megatron-LM's model-shape flag (its dest, e.g. ``num_layers``) -> the config field it
    sets; a flag the family has no field for is absent. ``no_dropout``: the config fields that turn every
    dropout off (a parity check's model).
    """

    name: str                                   # "gpt2" | "bert" | "llama"
    display_name: str                           # for messages: "GPT-2", "BERT", "Llama"
    config_class: type
    pretraining_model: type                     # the model pretraining builds and checkpoints hold
    model_types: tuple[str, ...]                # transformers' model_type values of the family
    embedding_key: str                          # the vocab-parallel word embedding in the state dict
    shape: Callable[[Any], ModelShape]
    presets: Mapping[str, dict]
    make_config: Callable[..., Any]             # (preset, **overrides) -> config
    config_from_hf: Callable[[dict], Any]
    check_hf_config: Callable[[dict, Any], None]
    objective: str
    generates_text: bool
    pipeline: PipelineStages | None = None
    lm_head_transform: bool = False
    layout_fields: tuple[str, ...] = ()
    megatron_fields: Mapping[str, str] = dataclasses.field(default_factory=dict)
    no_dropout: Mapping[str, float] = dataclasses.field(default_factory=dict)


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("gpt2", "GPT-2", GPT2Config, GPT2LMHeadModel, ("gpt2",), "transformer.wte.weight",
                gpt2_shape,
                GPT2_PRESETS, gpt2_config, GPT2Config.from_dict, check_gpt2_config_values, CAUSAL_LM,
                generates_text=True, pipeline=PipelineStages(
                    gpt2_pipeline_module, load_stage_weights, hf_names, one_stage_name, gpt2_entry_parameters,
                    gpt2_layer_entries, gpt2_entry_of),
                megatron_fields={"num_layers": "n_layer", "hidden_size": "n_embd", "num_attention_heads": "n_head",
                                 "ffn_hidden_size": "n_inner", "max_position_embeddings": "n_positions",
                                 "make_vocab_size_divisible_by": "make_vocab_size_divisible_by"},
                no_dropout={"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    ModelFamily("bert", "BERT", BertConfig, BertForPreTraining, ("bert", "megatron-bert"),
                "bert.embeddings.word_embeddings.weight",
                bert_shape,
                BERT_PRESETS, bert_config, BertConfig.from_dict, check_bert_config_values, MLM_SOP,
                generates_text=False, lm_head_transform=True, layout_fields=("pre_norm",),
                megatron_fields={"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
                                 "num_attention_heads": "num_attention_heads", "ffn_hidden_size": "intermediate_size",
                                 "max_position_embeddings": "max_position_embeddings",
                                 "make_vocab_size_divisible_by": "make_vocab_size_divisible_by"},
                no_dropout={"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}),
    ModelFamily("llama", "Llama", LlamaConfig, LlamaForCausalLM, ("llama",), "model.embed_tokens.weight",
                llama_shape,
                LLAMA_PRESETS, llama_config, LlamaConfig.from_hf_dict, check_llama_config_values, CAUSAL_LM,
                generates_text=True, pipeline=PipelineStages(
                    llama_pipeline_module, load_llama_stage_weights, llama_one_stage_names, llama_one_stage_name,
                    llama_entry_parameters, llama_layer_entries, llama_entry_of),
                megatron_fields={"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
                                 "num_attention_heads": "num_attention_heads", "ffn_hidden_size": "intermediate_size",
                                 "num_key_value_heads": "num_key_value_heads",
                                 "max_position_embeddings": "max_position_embeddings",
                                 "make_vocab_size_divisible_by": "make_vocab_size_divisible_by"},
                no_dropout={"attention_dropout": 0.0}),
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


def known_model_types() -> list[str]:
    """Every transformers ``model_type`` zoo builds, for messages."""
    return [model_type for family in FAMILIES for model_type in family.model_types]


def family_of_preset(preset: str) -> ModelFamily:
    """The family whose presets name ``preset``; an unknown name is one sentence listing them all."""
    for family in FAMILIES:
        if preset in family.presets:
            return family
    names = [name for family in FAMILIES for name in sorted(family.presets)]
    raise UserError(f"unknown model preset {preset!r}; choose one of {names}.")


def megatron_shape_overrides(preset: str, flags: Mapping[str, int | None]) -> dict[str, int]:
    """The ``model_overrides`` that Megatron-LM's model-shape flags ``flags`` (dest -> value, None: not given)
    make for ``preset``'s family, each under the family's own field name (``--num-layers`` is GPT-2's n_layer,
    Llama's num_hidden_layers). A value below 1, or a flag the family has no field for, is one sentence."""
    family = family_of_preset(preset)
    overrides = {}
    for name, value in flags.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if value < 1:
            raise UserError(f"{flag} {value} must be a positive integer; pass at least 1.")
        if name not in family.megatron_fields:
            others = [other.display_name for other in FAMILIES if name in other.megatron_fields]
            raise UserError(f"{flag} sets nothing of {family.display_name} (the preset {preset!r}); drop it, or pass "
                             f"a --model preset of {' or '.join(others)}.")
        overrides[family.megatron_fields[name]] = value
    return overrides


def model_config(preset: str, **overrides) -> ModelConfig:
    """The config of any zoo preset with optional field overrides; the family follows from the name."""
    return family_of_preset(preset).make_config(preset, **overrides)


def read_checked_config_json(directory: str | os.PathLike) -> dict:
    """config.json of a model directory, whose shape fields its family checked (one sentence naming the file and
    the field), so every reader of a model directory (loading, export, generation, evaluation, finetuning,
    planning) refuses a bad one before anything is allocated. A ``model_type`` zoo does not build is left to
    the reader, which names the type it expects."""
    values = read_config_json(directory)
    family = family_of_model_type(values.get("model_type"))
    if family is not None:
        family.check_hf_config(values, Path(directory) / "config.json")
    return values


def pretrained_config(directory: str, family: ModelFamily | None = None) -> ModelConfig:
    """The checked config of a transformers-layout directory's config.json, read as ``family``'s (by default
    the family of its ``model_type``, and a model type zoo does not build is one sentence). A directory of
    another zoo family than ``family`` is one sentence saying the families differ, before any field is read
    by the wrong family's checks."""
    path = f"{directory}/config.json"
    values = read_config_json(directory)
    stored = family_of_model_type(values.get("model_type"))
    if family is not None and stored is not None and stored is not family:
        raise UserError(f"{directory} holds a {stored.display_name} model (model_type {values['model_type']!r}) "
                         f"but the run's preset is {family.display_name}, and the families differ; pass a "
                         f"{stored.display_name} --model preset (one of {sorted(stored.presets)}) or a "
                         f"{family.display_name} directory.")
    family = family or stored
    if family is None:
        raise UserError(f"{path} has model_type {values.get('model_type')!r}, which zoo does not build; pass a "
                         f"directory of one of {known_model_types()}.")
    family.check_hf_config(values, path)
    return family.config_from_hf(values)


def text_model_family(directory: str | os.PathLike, purpose: str) -> ModelFamily:
    """The family of the transformers-layout ``directory`` for ``purpose`` (e.g. "generation"), which needs a model
    that generates text: one sentence for a model type zoo does not build, and for a family that generates no
    text (BERT), naming the families that do."""
    values = read_checked_config_json(directory)
    model_type = values.get("model_type")
    family = family_of_model_type(model_type)
    causal = " or ".join(f.display_name for f in FAMILIES if f.generates_text)
    if family is None:
        raise UserError(f"{Path(directory) / 'config.json'} has model_type {model_type!r}, which zoo does not build; "
                         f"pass a {causal} directory for {purpose}.")
    if not family.generates_text:
        raise UserError(f"{directory} holds a {family.display_name} model (model_type {model_type!r}), which "
                         f"generates no text, so {purpose} does not apply to it; pass a {causal} directory.")
    return family


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
