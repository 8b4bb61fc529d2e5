"""Model configurations: plain data with Hugging Face field names, validated in one place."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from zoo.errors import UserError
from zoo.parallel.utils import pad_vocab_size

# HF config.json fields of GPT-2 that change the maths; zoo implements only their defaults.
_GPT2_UNSUPPORTED = {
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "scale_attn_weights": True,
}
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
# zoo's own fields: they change how a model is run, never its parameters, and are not written to config.json.
ZOO_RUN_FIELDS = ("make_vocab_size_divisible_by", "activation_checkpointing", "sequence_parallel",
                  "recompute_granularity")
_GELU_APPROXIMATION = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}

# Upper bounds on a model's shape fields. They are sanity limits, far above any released model (vocabularies
# reach ~256k tokens, contexts ~1M positions, widths ~25k, depths ~200 layers), that stop a typo or a hostile
# config.json from asking for an embedding table of terabytes before anything is read: 10M vocabulary rows
# of a 65,536-wide model would already be 2.6 TB of fp32.
MAX_VOCAB_SIZE = 10_000_000
MAX_POSITIONS = 1_048_576
MAX_HIDDEN_SIZE = 65_536
MAX_LAYERS = 4_096
MAX_TOKEN_TYPES = 1_024
# field -> (upper bound, None allowed) of each family's integer shape fields; each must be at least 1.
GPT2_SHAPE_FIELDS = {"vocab_size": (MAX_VOCAB_SIZE, False), "n_positions": (MAX_POSITIONS, False),
                     "n_embd": (MAX_HIDDEN_SIZE, False), "n_layer": (MAX_LAYERS, False),
                     "n_head": (MAX_HIDDEN_SIZE, False), "n_inner": (4 * MAX_HIDDEN_SIZE, True)}
BERT_SHAPE_FIELDS = {"vocab_size": (MAX_VOCAB_SIZE, False), "hidden_size": (MAX_HIDDEN_SIZE, False),
                     "num_hidden_layers": (MAX_LAYERS, False), "num_attention_heads": (MAX_HIDDEN_SIZE, False),
                     "max_position_embeddings": (MAX_POSITIONS, False), "type_vocab_size": (MAX_TOKEN_TYPES, False),
                     "intermediate_size": (4 * MAX_HIDDEN_SIZE, True)}
# The fields a config.json must state: zoo never guesses the shape of a model it loads weights into.
GPT2_REQUIRED_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
BERT_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "max_position_embeddings")
GPT2_PROBABILITY_FIELDS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
BERT_PROBABILITY_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob")


@dataclass
class GPT2Config:
    """GPT-2 hyper-parameters, named as in ``transformers.GPT2Config``.

    ``make_vocab_size_divisible_by``, ``activation_checkpointing``, ``sequence_parallel`` and
    ``recompute_granularity`` are zoo's own (see :data:`ZOO_RUN_FIELDS`) and are not written to config.json.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    bos_token_id: int = 50256
    eos_token_id: int = 50256
    make_vocab_size_divisible_by: int = 128
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    model_type = "gpt2"

    # ---------------------------------------------------------------- derived values
    @property
    def ffn_hidden_size(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def gelu_approximate(self) -> str:
        return _GELU_APPROXIMATION[self.activation_function]

    def padded_vocab_size(self, tp_size: int) -> int:
        return pad_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by)

    def validate(self, tp_size: int = 1) -> GPT2Config:
        """Refuse impossible shapes with one sentence naming the numbers and the fix."""
        check_field_values(self, GPT2_SHAPE_FIELDS, GPT2_PROBABILITY_FIELDS, "GPT-2 config")
        validate_tp_shapes(self.n_embd, self.n_head, self.ffn_hidden_size, tp_size,
                           hidden_name="n_embd", heads_name="n_head")
        recompute_mode(self)
        if self.activation_function not in _GELU_APPROXIMATION:
            raise UserError(f"activation_function {self.activation_function!r} is not supported; "
                             f"use one of {sorted(_GELU_APPROXIMATION)}.")
        for key, value in _GPT2_UNSUPPORTED.items():
            if self.extra.get(key, value) != value:
                raise UserError(f"GPT-2 config field {key}={self.extra[key]!r} is not supported by zoo; "
                                 f"only {key}={value} is implemented.")
        return self

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GPT2Config:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in values.items() if k in names}
        extra = {k: v for k, v in values.items() if k not in names}
        return cls(**known, extra=extra)

    def to_hf_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("extra", *ZOO_RUN_FIELDS)}
        passthrough = {k: v for k, v in self.extra.items()
                       if k not in ("architectures", "model_type", "transformers_version")}
        return {**passthrough, **values, "model_type": self.model_type,
                "architectures": ["GPT2LMHeadModel"], "tie_word_embeddings": True}

    def replace(self, **changes) -> GPT2Config:
        return dataclasses.replace(self, **changes)


_BERT_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass
class BertConfig:
    """BERT hyper-parameters, named as in ``transformers.BertConfig`` / ``MegatronBertConfig``.

    ``pre_norm`` picks the layer order: True is the paper's Figure 7b (LayerNorm inside the residual
    branch plus a final LayerNorm; transformers' "megatron-bert"), False the original BERT
    (Figure 7a, post-norm with an embedding LayerNorm; transformers' "bert").
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int | None = None
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    pre_norm: bool = True
    make_vocab_size_divisible_by: int = 128
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def model_type(self) -> str:
        return "megatron-bert" if self.pre_norm else "bert"

    @property
    def ffn_hidden_size(self) -> int:
        return self.intermediate_size if self.intermediate_size is not None else 4 * self.hidden_size

    @property
    def gelu_approximate(self) -> str:
        return _BERT_ACTIVATIONS[self.hidden_act]

    def padded_vocab_size(self, tp_size: int) -> int:
        return pad_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by)

    def validate(self, tp_size: int = 1) -> BertConfig:
        check_field_values(self, BERT_SHAPE_FIELDS, BERT_PROBABILITY_FIELDS, "BERT config")
        validate_tp_shapes(self.hidden_size, self.num_attention_heads, self.ffn_hidden_size, tp_size,
                           hidden_name="hidden_size", heads_name="num_attention_heads")
        recompute_mode(self)
        if self.hidden_act not in _BERT_ACTIVATIONS:
            raise UserError(f"hidden_act {self.hidden_act!r} is not supported; use one of "
                             f"{sorted(_BERT_ACTIVATIONS)}.")
        if self.extra.get("position_embedding_type", "absolute") != "absolute":
            raise UserError(f"position_embedding_type {self.extra['position_embedding_type']!r} is not "
                             "supported; zoo implements 'absolute' only.")
        return self

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> BertConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "pre_norm"}
        known = {k: v for k, v in values.items() if k in names}
        extra = {k: v for k, v in values.items() if k not in names}
        model_type = values.get("model_type")
        if model_type not in ("bert", "megatron-bert"):
            raise UserError(f"model_type {model_type!r} is not a BERT; zoo's BERT reads 'bert' (post-norm) or "
                             "'megatron-bert' (pre-norm) checkpoints.")
        return cls(**known, pre_norm=model_type == "megatron-bert", extra=extra)

    def to_hf_dict(self, architecture: str) -> dict[str, Any]:
        skip = ("extra", "pre_norm", *ZOO_RUN_FIELDS)
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        values["intermediate_size"] = self.ffn_hidden_size
        passthrough = {k: v for k, v in self.extra.items()
                       if k not in ("architectures", "model_type", "transformers_version")}
        prefix = "MegatronBert" if self.pre_norm else "Bert"
        return {**passthrough, **values, "model_type": self.model_type,
                "architectures": [prefix + architecture], "tie_word_embeddings": True}

    def replace(self, **changes) -> BertConfig:
        return dataclasses.replace(self, **changes)


def recompute_mode(config: GPT2Config | BertConfig) -> str | None:
    """What is recomputed in backward (Korthikanti et al. 2022, section 5): None, "full" (every layer,
    DeepSpeed activation checkpointing; ``activation_checkpointing=True`` means this) or "selective"
    (only the attention core: QK^T, softmax, dropout, @V). Read at each forward, so it may be switched
    on a built model."""
    granularity = config.recompute_granularity
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise UserError(f"recompute_granularity {granularity!r} is not one of None, 'full', 'selective'; pick "
                         "one of those.")
    if config.activation_checkpointing and granularity == "selective":
        raise UserError("activation_checkpointing=True (full recomputation) contradicts recompute_granularity="
                         "'selective'; set activation_checkpointing=False to recompute only the attention core.")
    return "full" if config.activation_checkpointing else granularity


def validate_tp_shapes(hidden: int, heads: int, ffn: int, tp_size: int, *, hidden_name: str,
                       heads_name: str) -> None:
    """The shape rules every tensor-parallel transformer shares, as one-sentence errors."""
    if hidden % heads != 0:
        raise UserError(f"hidden size {hidden_name}={hidden} is not divisible by {heads_name}={heads}; "
                         f"choose {heads_name} that divides {hidden}.")
    if heads % tp_size != 0:
        raise UserError(f"{heads_name}={heads} is not divisible by tensor-parallel size {tp_size}; "
                         f"use a tp degree that divides {heads}.")
    if ffn % tp_size != 0:
        raise UserError(f"MLP size {ffn} is not divisible by tensor-parallel size {tp_size}; "
                         "use a tp degree that divides it.")


def shape_field_problem(value: Any, maximum: int, nullable: bool) -> str | None:
    """What is wrong with a shape field's value ("is -1, not a positive integer"), or None when it is fine."""
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"is {_shown(value)} ({_json_kind(value)}), not an integer"
    if value < 1:
        return f"is {value}, not a positive integer"
    if value > maximum:
        return (f"is {value}, above zoo's bound of {maximum:,} (a sanity limit far beyond any released model, which "
                "keeps a wrong value from allocating terabytes)")
    return None


def probability_problem(value: Any) -> str | None:
    """What is wrong with a dropout probability, or None when it is a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {_shown(value)} ({_json_kind(value)}), not a number"
    if not 0 <= value <= 1:
        return f"is {value}, not a probability in [0, 1]"
    return None


def check_field_values(config: GPT2Config | BertConfig, shape_fields: dict[str, tuple[int, bool]],
                       probability_fields: tuple[str, ...], what: str) -> None:
    """Shape fields are integers in [1, bound] and dropouts probabilities, else one sentence naming the field."""
    for name, (maximum, nullable) in shape_fields.items():
        problem = shape_field_problem(getattr(config, name), maximum, nullable)
        if problem:
            raise UserError(f"{what} field {name} {problem}; set it to a positive integer of at most {maximum:,}.")
    for name in probability_fields:
        problem = probability_problem(getattr(config, name))
        if problem:
            raise UserError(f"{what} field {name} {problem}; set it to a dropout probability such as 0.1.")


def check_hf_config_values(values: Any, path: Any) -> None:
    """A transformers config.json of a GPT-2 or BERT (``model_type`` "gpt2", "bert", "megatron-bert") states
    every shape field (:data:`GPT2_REQUIRED_FIELDS`, :data:`BERT_REQUIRED_FIELDS`) as an integer within the
    bounds above, and its dropouts as probabilities; anything else is one sentence naming the file and the
    field. Other model types are left to the loader that reads them, which names the type it expects."""
    if not isinstance(values, dict):
        raise UserError(f"{path} holds {_json_kind(values)}, not a JSON object; pass a model directory whose "
                         "config.json is the model's configuration as save_pretrained writes it.")
    model_type = values.get("model_type")
    if model_type == "gpt2":
        required, shape_fields, probabilities = GPT2_REQUIRED_FIELDS, GPT2_SHAPE_FIELDS, GPT2_PROBABILITY_FIELDS
    elif model_type in ("bert", "megatron-bert"):
        required, shape_fields, probabilities = BERT_REQUIRED_FIELDS, BERT_SHAPE_FIELDS, BERT_PROBABILITY_FIELDS
    else:
        return
    for name in required:
        if name not in values:
            raise UserError(f"{path} has no {name} field, and zoo does not guess a model's shape; add "
                             f"\"{name}\": <the model's value> (transformers' save_pretrained always writes it).")
    for name, (maximum, nullable) in shape_fields.items():
        problem = shape_field_problem(values[name], maximum, nullable) if name in values else None
        if problem:
            raise UserError(f"{path} field {name} {problem}; write the model's {name} there as a positive integer "
                             f"of at most {maximum:,}.")
    for name in probabilities:
        problem = probability_problem(values[name]) if name in values else None
        if problem:
            raise UserError(f"{path} field {name} {problem}; write a dropout probability such as 0.1.")


def _shown(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a JSON list",
            dict: "a JSON object"}.get(type(value), type(value).__name__)
