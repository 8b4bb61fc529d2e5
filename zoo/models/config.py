"""Model configurations: plain data with Hugging Face field names, validated in one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

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

    def validate(self, tp_size: int = 1) -> "GPT2Config":
        """Refuse impossible shapes with one sentence naming the numbers and the fix."""
        validate_tp_shapes(self.n_embd, self.n_head, self.ffn_hidden_size, tp_size,
                           hidden_name="n_embd", heads_name="n_head")
        recompute_mode(self)
        if self.activation_function not in _GELU_APPROXIMATION:
            raise ValueError(f"activation_function {self.activation_function!r} is not supported; "
                             f"use one of {sorted(_GELU_APPROXIMATION)}.")
        for key, value in _GPT2_UNSUPPORTED.items():
            if self.extra.get(key, value) != value:
                raise ValueError(f"GPT-2 config field {key}={self.extra[key]!r} is not supported by zoo; "
                                 f"only {key}={value} is implemented.")
        return self

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GPT2Config":
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

    def replace(self, **changes) -> "GPT2Config":
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

    def validate(self, tp_size: int = 1) -> "BertConfig":
        validate_tp_shapes(self.hidden_size, self.num_attention_heads, self.ffn_hidden_size, tp_size,
                           hidden_name="hidden_size", heads_name="num_attention_heads")
        recompute_mode(self)
        if self.hidden_act not in _BERT_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; use one of "
                             f"{sorted(_BERT_ACTIVATIONS)}.")
        if self.extra.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {self.extra['position_embedding_type']!r} is not "
                             "supported; zoo implements 'absolute' only.")
        return self

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "BertConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "pre_norm"}
        known = {k: v for k, v in values.items() if k in names}
        extra = {k: v for k, v in values.items() if k not in names}
        model_type = values.get("model_type")
        if model_type not in ("bert", "megatron-bert"):
            raise ValueError(f"model_type {model_type!r} is not a BERT; zoo's BERT reads 'bert' (post-norm) or "
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

    def replace(self, **changes) -> "BertConfig":
        return dataclasses.replace(self, **changes)


def recompute_mode(config: GPT2Config | BertConfig) -> str | None:
    """What is recomputed in backward (Korthikanti et al. 2022, section 5): None, "full" (every layer,
    DeepSpeed activation checkpointing; ``activation_checkpointing=True`` means this) or "selective"
    (only the attention core: QK^T, softmax, dropout, @V). Read at each forward, so it may be switched
    on a built model."""
    granularity = config.recompute_granularity
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity {granularity!r} is not one of None, 'full', 'selective'; pick "
                         "one of those.")
    if config.activation_checkpointing and granularity == "selective":
        raise ValueError("activation_checkpointing=True (full recomputation) contradicts recompute_granularity="
                         "'selective'; set activation_checkpointing=False to recompute only the attention core.")
    return "full" if config.activation_checkpointing else granularity


def validate_tp_shapes(hidden: int, heads: int, ffn: int, tp_size: int, *, hidden_name: str,
                       heads_name: str) -> None:
    """The shape rules every tensor-parallel transformer shares, as one-sentence errors."""
    if hidden % heads != 0:
        raise ValueError(f"hidden size {hidden_name}={hidden} is not divisible by {heads_name}={heads}; "
                         f"choose {heads_name} that divides {hidden}.")
    if heads % tp_size != 0:
        raise ValueError(f"{heads_name}={heads} is not divisible by tensor-parallel size {tp_size}; "
                         f"use a tp degree that divides {heads}.")
    if ffn % tp_size != 0:
        raise ValueError(f"MLP size {ffn} is not divisible by tensor-parallel size {tp_size}; "
                         "use a tp degree that divides it.")
