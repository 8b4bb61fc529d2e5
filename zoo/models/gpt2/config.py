"""GPT-2's configuration with transformers' ``GPT2Config`` field names, validated in one place, and the check of
a GPT-2 config.json's values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zoo.errors import UserError
from zoo.models.config import (
    MAX_HIDDEN_SIZE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB_SIZE,
    FamilyConfig,
    check_field_values,
    check_hf_fields,
    recompute_mode,
    validate_tp_shapes,
)

# HF config.json fields of GPT-2 that change the maths; zoo implements only their defaults.
_GPT2_UNSUPPORTED = {
    "scale_attn_by_inverse_layer_idx": False,
    "add_cross_attention": False,
    "scale_attn_weights": True,
}
_GELU_APPROXIMATION = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}
# field -> (upper bound, None allowed) of the integer shape fields; each must be at least 1.
GPT2_SHAPE_FIELDS = {"vocab_size": (MAX_VOCAB_SIZE, False), "n_positions": (MAX_POSITIONS, False),
                     "n_embd": (MAX_HIDDEN_SIZE, False), "n_layer": (MAX_LAYERS, False),
                     "n_head": (MAX_HIDDEN_SIZE, False), "n_inner": (4 * MAX_HIDDEN_SIZE, True)}
# The fields a config.json must state: zoo never guesses the shape of a model it loads weights into.
GPT2_REQUIRED_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
GPT2_PROBABILITY_FIELDS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")


@dataclass
class GPT2Config(FamilyConfig):
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
    shape_fields = GPT2_SHAPE_FIELDS
    probability_fields = GPT2_PROBABILITY_FIELDS

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
        known, extra = cls.split_hf_values(values)
        return cls(**known, extra=extra)

    def to_hf_dict(self) -> dict[str, Any]:
        return {**self.passthrough(), **self.hf_field_values(), "model_type": self.model_type,
                "architectures": ["GPT2LMHeadModel"], "tie_word_embeddings": True}


def check_gpt2_config_values(values: Any, path: Any) -> None:
    """A GPT-2 config.json states every shape field (:data:`GPT2_REQUIRED_FIELDS`) as an integer within bounds
    and its dropouts as probabilities, else one sentence naming the file and the field."""
    check_hf_fields(values, path, GPT2_REQUIRED_FIELDS, GPT2_SHAPE_FIELDS, GPT2_PROBABILITY_FIELDS)
