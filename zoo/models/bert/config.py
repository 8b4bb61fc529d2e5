"""BERT's configuration with transformers' ``BertConfig`` / ``MegatronBertConfig`` field names, validated in one
place, and the check of a BERT config.json's values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zoo.errors import UserError
from zoo.models.config import (
    MAX_HIDDEN_SIZE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_TOKEN_TYPES,
    MAX_VOCAB_SIZE,
    FamilyConfig,
    check_field_values,
    check_hf_fields,
    recompute_mode,
    validate_tp_shapes,
)

# field -> (upper bound, None allowed) of the integer shape fields; each must be at least 1.
BERT_SHAPE_FIELDS = {"vocab_size": (MAX_VOCAB_SIZE, False), "hidden_size": (MAX_HIDDEN_SIZE, False),
                     "num_hidden_layers": (MAX_LAYERS, False), "num_attention_heads": (MAX_HIDDEN_SIZE, False),
                     "max_position_embeddings": (MAX_POSITIONS, False), "type_vocab_size": (MAX_TOKEN_TYPES, False),
                     "intermediate_size": (4 * MAX_HIDDEN_SIZE, True)}
# The fields a config.json must state: zoo never guesses the shape of a model it loads weights into.
BERT_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "max_position_embeddings")
BERT_PROBABILITY_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob")
_BERT_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass
class BertConfig(FamilyConfig):
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

    shape_fields = BERT_SHAPE_FIELDS
    probability_fields = BERT_PROBABILITY_FIELDS

    @property
    def model_type(self) -> str:
        return "megatron-bert" if self.pre_norm else "bert"

    @property
    def ffn_hidden_size(self) -> int:
        return self.intermediate_size if self.intermediate_size is not None else 4 * self.hidden_size

    @property
    def gelu_approximate(self) -> str:
        return _BERT_ACTIVATIONS[self.hidden_act]

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
        known, extra = cls.split_hf_values(values, not_fields=("pre_norm",))
        model_type = values.get("model_type")
        if model_type not in ("bert", "megatron-bert"):
            raise UserError(f"model_type {model_type!r} is not a BERT; zoo's BERT reads 'bert' (post-norm) or "
                             "'megatron-bert' (pre-norm) checkpoints.")
        return cls(**known, pre_norm=model_type == "megatron-bert", extra=extra)

    def to_hf_dict(self, architecture: str) -> dict[str, Any]:
        values = {**self.hf_field_values(skip=("pre_norm",)), "intermediate_size": self.ffn_hidden_size}
        prefix = "MegatronBert" if self.pre_norm else "Bert"
        return {**self.passthrough(), **values, "model_type": self.model_type,
                "architectures": [prefix + architecture], "tie_word_embeddings": True}


def check_bert_config_values(values: Any, path: Any) -> None:
    """A BERT config.json ("bert" or "megatron-bert") states every shape field (:data:`BERT_REQUIRED_FIELDS`) as
    an integer within bounds and its dropouts as probabilities, else one sentence naming the file and the field."""
    check_hf_fields(values, path, BERT_REQUIRED_FIELDS, BERT_SHAPE_FIELDS, BERT_PROBABILITY_FIELDS)
