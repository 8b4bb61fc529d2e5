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
_GELU_APPROXIMATION = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


@dataclass
class GPT2Config:
    """GPT-2 hyper-parameters, named as in ``transformers.GPT2Config``.

    ``make_vocab_size_divisible_by`` and ``activation_checkpointing`` are zoo's own and are not
    written to config.json.
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
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"hidden size n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                             f"choose n_head that divides {self.n_embd}.")
        if self.n_head % tp_size != 0:
            raise ValueError(f"n_head={self.n_head} is not divisible by tensor-parallel size {tp_size}; "
                             f"use a tp degree that divides {self.n_head}.")
        if self.ffn_hidden_size % tp_size != 0:
            raise ValueError(f"MLP size {self.ffn_hidden_size} is not divisible by tensor-parallel size "
                             f"{tp_size}; use a tp degree that divides it.")
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
                  if f.name not in ("extra", "make_vocab_size_divisible_by", "activation_checkpointing")}
        passthrough = {k: v for k, v in self.extra.items()
                       if k not in ("architectures", "model_type", "transformers_version")}
        return {**passthrough, **values, "model_type": self.model_type,
                "architectures": ["GPT2LMHeadModel"], "tie_word_embeddings": True}

    def replace(self, **changes) -> "GPT2Config":
        return dataclasses.replace(self, **changes)
