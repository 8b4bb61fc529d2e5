"""Llama hyper-parameters with transformers' ``LlamaConfig`` field names, validated in one place.

Derived values (head dim, query heads per KV head, padded vocabulary) are computed here and nowhere else.
config.json is read in both of transformers' spellings of the rotary settings: ``rope_parameters``
(``{"rope_theta": ..., "rope_type": ...}``, what transformers 5 writes) and the older top-level
``rope_theta`` plus ``rope_scaling`` (transformers 4). It is written in the spelling the installed
transformers' ``LlamaConfig`` takes, because each version reads only its own: transformers 4 ignores
``rope_parameters`` and would load an export with the default theta and no scaling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zoo.errors import UserError
from zoo.models.config import (
    MAX_HIDDEN_SIZE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB_SIZE,
    ZOO_RUN_FIELDS,
    FamilyConfig,
    check_field_values,
    check_positive_numbers,
    recompute_mode,
    shape_field_problem,
)

# field -> (upper bound, None allowed); every one must be at least 1.
LLAMA_SHAPE_FIELDS = {"vocab_size": (MAX_VOCAB_SIZE, False), "hidden_size": (MAX_HIDDEN_SIZE, False),
                      "intermediate_size": (4 * MAX_HIDDEN_SIZE, False), "num_hidden_layers": (MAX_LAYERS, False),
                      "num_attention_heads": (MAX_HIDDEN_SIZE, False),
                      "num_key_value_heads": (MAX_HIDDEN_SIZE, True), "head_dim": (MAX_HIDDEN_SIZE, True),
                      "max_position_embeddings": (MAX_POSITIONS, False)}
LLAMA_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads")
LLAMA_PROBABILITY_FIELDS = ("attention_dropout",)
ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# transformers fields that change the maths; zoo implements only these values.
_UNSUPPORTED = {"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "pretraining_tp": 1}
_NOT_WRITTEN = ("architectures", "model_type", "transformers_version", "rope_theta", "rope_scaling")


@dataclass
class LlamaConfig(FamilyConfig):
    """Llama hyper-parameters, named as in ``transformers.LlamaConfig``.

    ``rope_theta`` and ``rope_scaling`` hold the rotary settings (``rope_scaling`` None, or a dict with
    ``rope_type`` "llama3" and its four fields). ``make_vocab_size_divisible_by``,
    ``activation_checkpointing``, ``sequence_parallel`` and ``recompute_granularity`` are zoo's own run
    fields (:data:`zoo.models.config.ZOO_RUN_FIELDS`) and are not written to config.json.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_dropout: float = 0.0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    make_vocab_size_divisible_by: int = 128
    activation_checkpointing: bool = False
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    model_type = "llama"
    shape_fields = LLAMA_SHAPE_FIELDS
    probability_fields = LLAMA_PROBABILITY_FIELDS

    # ---------------------------------------------------------------- derived values
    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_key_value_heads``, or one per query head (plain multi-head attention)."""
        return self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads

    @property
    def attention_head_dim(self) -> int:
        """The width of one head: ``head_dim``, or hidden_size / num_attention_heads."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def ffn_hidden_size(self) -> int:
        return self.intermediate_size

    @property
    def n_positions(self) -> int:
        """The context length, under the name zoo's generation loop reads (``max_position_embeddings``)."""
        return self.max_position_embeddings

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))

    def validate(self, tp_size: int = 1) -> LlamaConfig:
        """Refuse impossible or unimplemented settings with one sentence naming the value and the fix."""
        check_field_values(self, LLAMA_SHAPE_FIELDS, LLAMA_PROBABILITY_FIELDS, "Llama config")
        recompute_mode(self)
        heads, kv_heads = self.num_attention_heads, self.kv_heads
        if self.head_dim is None and self.hidden_size % heads != 0:
            raise UserError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={heads}; "
                             "choose num_attention_heads that divides it, or set head_dim.")
        if heads % kv_heads != 0:
            raise UserError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}; "
                             "choose num_key_value_heads that divides num_attention_heads.")
        if self.attention_head_dim % 2 != 0:
            raise UserError(f"head dim {self.attention_head_dim} is odd, and rotary embeddings rotate pairs of "
                             "dimensions; choose an even head_dim.")
        check_tp_divides_heads(heads, kv_heads, self.intermediate_size, tp_size)
        if self.hidden_act != "silu":
            raise UserError(f"hidden_act {self.hidden_act!r} is not supported; zoo's Llama implements 'silu' "
                             "(SwiGLU) only.")
        for key, value in _UNSUPPORTED.items():
            if self.extra.get(key, value) != value:
                raise UserError(f"Llama config field {key}={self.extra[key]!r} is not supported by zoo; only "
                                 f"{key}={value} is implemented.")
        check_rope_scaling(self.rope_scaling)
        return self

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, values: dict[str, Any]) -> LlamaConfig:
        """The config of a transformers config.json (either spelling of the rotary settings)."""
        values = dict(values)
        rope = values.pop("rope_parameters", None)
        if isinstance(rope, dict):
            rope = dict(rope)
            values["rope_theta"] = rope.pop("rope_theta", values.get("rope_theta", 10000.0))
            values["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        known, extra = cls.split_hf_values(values, not_fields=ZOO_RUN_FIELDS)
        return cls(**known, extra=extra)

    def to_hf_dict(self, architecture: str = "LlamaForCausalLM") -> dict[str, Any]:
        """config.json as the installed transformers writes a Llama's (the rotary settings in its spelling,
        the explicit ``head_dim`` and ``num_key_value_heads``)."""
        values = self.hf_field_values(skip=("rope_theta", "rope_scaling"))
        values.update(head_dim=self.attention_head_dim, num_key_value_heads=self.kv_heads)
        if transformers_takes_rope_parameters():
            values["rope_parameters"] = {**(self.rope_scaling or {"rope_type": "default"}), "rope_theta": self.rope_theta}
        else:
            values.update(rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)
        return {**self.passthrough(_NOT_WRITTEN), **values, "model_type": self.model_type, "architectures": [architecture],
                "tie_word_embeddings": False}


def transformers_takes_rope_parameters() -> bool:
    """Whether the installed transformers' ``LlamaConfig`` takes the rotary settings as ``rope_parameters``
    (transformers 5) rather than as ``rope_theta`` and ``rope_scaling`` (transformers 4)."""
    import inspect

    import transformers  # local: slow to import, and only writing a config.json needs it

    return "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters


def check_tp_divides_heads(heads: int, kv_heads: int, intermediate_size: int, tp_size: int) -> None:
    """Each TP rank holds whole query heads and whole key/value groups, and an equal slice of the MLP."""
    if heads % tp_size != 0 or kv_heads % tp_size != 0:
        raise UserError(f"num_attention_heads={heads} and num_key_value_heads={kv_heads} must both be divisible "
                         f"by tensor-parallel size {tp_size} so that every rank holds whole heads and whole key/value "
                         f"groups; use a tp degree that divides {kv_heads}.")
    if intermediate_size % tp_size != 0:
        raise UserError(f"intermediate_size={intermediate_size} is not divisible by tensor-parallel size {tp_size}; "
                         "use a tp degree that divides it.")


def check_rope_scaling(rope_scaling: Any) -> None:
    """``rope_scaling`` is None, or Llama-3's: rope_type "llama3" with factor, low_freq_factor, high_freq_factor
    and original_max_position_embeddings; other rope types are refused (zoo implements these two exactly)."""
    if rope_scaling is None:
        return
    if not isinstance(rope_scaling, dict):
        raise UserError(f"rope_scaling {rope_scaling!r} is not a JSON object; write null or Llama-3's "
                         "{\"rope_type\": \"llama3\", ...}.")
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UserError(f"rope_type {rope_type!r} is not supported; zoo's Llama implements {list(ROPE_TYPES)}.")
    if rope_type == "llama3":
        absent = [name for name in LLAMA3_ROPE_FIELDS if name not in rope_scaling]
        if absent:
            raise UserError(f"rope_scaling of rope_type 'llama3' has no {absent[0]!r}; add it (Llama-3.1 uses "
                             "factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192).")


def check_llama_config_values(values: dict[str, Any], path: Any) -> None:
    """A Llama config.json states every shape field (:data:`LLAMA_REQUIRED_FIELDS`) as an integer within bounds,
    else one sentence naming the file and the field; zoo never guesses the shape of a model it loads."""
    for name in LLAMA_REQUIRED_FIELDS:
        if name not in values:
            raise UserError(f"{path} has no {name} field, and zoo does not guess a model's shape; add "
                             f"\"{name}\": <the model's value> (transformers' save_pretrained always writes it).")
    for name, (maximum, nullable) in LLAMA_SHAPE_FIELDS.items():
        problem = shape_field_problem(values[name], maximum, nullable) if name in values else None
        if problem:
            raise UserError(f"{path} field {name} {problem}; write the model's {name} there as a positive integer "
                             f"of at most {maximum:,}.")
    check_positive_numbers(values, str(path))
