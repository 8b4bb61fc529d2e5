"""What every family's configuration shares: the sanity bounds on shape fields, zoo's own run fields, the
recomputation setting, the tensor-parallel shape rules, and the checks of field values, on a config object and
in a transformers config.json, as one-sentence errors. Each family's config class lives in its folder
(:mod:`zoo.models.gpt2.config`, :mod:`zoo.models.bert.config`, :mod:`zoo.models.llama.config`)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Self

from zoo.checkpoint.hf.hf_io import check_json_object
from zoo.errors import UserError
from zoo.options import json_kind, shown
from zoo.parallel.utils import pad_vocab_size

RECOMPUTE_GRANULARITIES = (None, "full", "selective")
# zoo's own fields: they change how a model is run, never its parameters, and are not written to config.json.
ZOO_RUN_FIELDS = ("make_vocab_size_divisible_by", "activation_checkpointing", "sequence_parallel",
                  "recompute_granularity")

# config.json fields transformers keeps for itself; a config rewrites them, never passes them through.
HF_BOOKKEEPING_FIELDS = ("architectures", "model_type", "transformers_version")

# Upper bounds on a model's shape fields. They are sanity limits, far above any released model (vocabularies
# reach ~256k tokens, contexts ~1M positions, widths ~25k, depths ~200 layers), that stop a typo or a hostile
# config.json from asking for an embedding table of terabytes before anything is read: 10M vocabulary rows
# of a 65,536-wide model would already be 2.6 TB of fp32.
MAX_VOCAB_SIZE = 10_000_000
MAX_POSITIONS = 1_048_576
MAX_HIDDEN_SIZE = 65_536
MAX_LAYERS = 4_096
MAX_TOKEN_TYPES = 1_024

# Fields of any family that must be a positive, finite number: an epsilon added under a square root, the
# standard deviation of the initial weights, the base of the rotary frequencies.
POSITIVE_NUMBER_FIELDS = ("layer_norm_epsilon", "layer_norm_eps", "rms_norm_eps", "initializer_range", "rope_theta")


class FamilyConfig:
    """What every family's config dataclass shares: its fields named as in transformers' config.json, the
    fields zoo does not know kept in ``extra`` and written back, zoo's own run fields never written."""

    def padded_vocab_size(self, tp_size: int) -> int:
        return pad_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by)

    def replace(self, **changes) -> Self:
        return dataclasses.replace(self, **changes)

    @classmethod
    def split_hf_values(cls, values: dict[str, Any], not_fields: tuple[str, ...] = ()) -> tuple[dict, dict]:
        """(the values of this class's fields, the rest) of a config.json's ``values``; ``not_fields`` are
        fields config.json does not set."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", *not_fields}
        return ({k: v for k, v in values.items() if k in names}, {k: v for k, v in values.items() if k not in names})

    def hf_field_values(self, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """The fields config.json gets: all but ``extra``, zoo's run fields and ``skip``."""
        left_out = ("extra", *ZOO_RUN_FIELDS, *skip)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in left_out}

    def passthrough(self, not_written: tuple[str, ...] = HF_BOOKKEEPING_FIELDS) -> dict[str, Any]:
        """The fields of the read config.json that zoo does not know, written back as they were."""
        return {k: v for k, v in self.extra.items() if k not in not_written}


def recompute_mode(config: Any) -> str | None:
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
        return f"is {shown(value)} ({json_kind(value)}), not an integer"
    if value < 1:
        return f"is {value}, not a positive integer"
    if value > maximum:
        return (f"is {value}, above zoo's bound of {maximum:,} (a sanity limit far beyond any released model, which "
                "keeps a wrong value from allocating terabytes)")
    return None


def probability_problem(value: Any) -> str | None:
    """What is wrong with a dropout probability, or None when it is a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {shown(value)} ({json_kind(value)}), not a number"
    if not 0 <= value <= 1:
        return f"is {value}, not a probability in [0, 1]"
    return None


def positive_number_problem(value: Any) -> str | None:
    """What is wrong with an epsilon, a standard deviation or a rotary base, or None when it is a positive,
    finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"is {shown(value)} ({json_kind(value)}), not a number"
    if not 0 < value < math.inf:
        return f"is {value}, not a positive number"
    return None


def check_positive_numbers(values: dict[str, Any], what: str) -> None:
    """The :data:`POSITIVE_NUMBER_FIELDS` among ``values`` are positive, finite numbers, else one sentence."""
    for name in POSITIVE_NUMBER_FIELDS:
        problem = positive_number_problem(values[name]) if name in values else None
        if problem:
            raise UserError(f"{what} field {name} {problem}; set it to a positive number, the model's own.")


def check_field_values(config: Any, shape_fields: dict[str, tuple[int, bool]],
                       probability_fields: tuple[str, ...], what: str) -> None:
    """Shape fields are integers in [1, bound], dropouts probabilities and epsilons, initializer ranges and
    rotary bases positive numbers, else one sentence naming the field."""
    for name, (maximum, nullable) in shape_fields.items():
        problem = shape_field_problem(getattr(config, name), maximum, nullable)
        if problem:
            raise UserError(f"{what} field {name} {problem}; set it to a positive integer of at most {maximum:,}.")
    for name in probability_fields:
        problem = probability_problem(getattr(config, name))
        if problem:
            raise UserError(f"{what} field {name} {problem}; set it to a dropout probability such as 0.1.")
    check_positive_numbers({name: getattr(config, name) for name in POSITIVE_NUMBER_FIELDS if hasattr(config, name)},
                           what)


def type_allows(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as JSON gives it) has the type a config field is annotated with; an integer is a
    number, a boolean is no integer."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(type_allows(value, arm) for arm in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin is not None:
        return isinstance(value, origin)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def type_words(hint: Any) -> str:
    """A field's annotation in words, for messages: "an integer or null"."""
    arms = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return " or ".join(words.get(arm, words.get(typing.get_origin(arm)) or
                                 {dict: "a JSON object", list: "a list"}.get(typing.get_origin(arm), str(arm)))
                       for arm in arms)


def check_overrides(config: Any, overrides: dict[str, Any], what: str = "model_overrides") -> None:
    """``overrides`` (field -> value, already applied to ``config``) pass the checks a config.json's values
    pass: each has its field's type, shape fields are integers within their bounds, dropouts probabilities,
    epsilons positive (the family's ``shape_fields`` and ``probability_fields``); then the whole config passes
    its family's ``validate`` (at tp 1: the tp degree is
    checked where the layout is). One sentence naming the override and the fix."""
    hints = typing.get_type_hints(type(config))
    for name, value in overrides.items():
        if name in hints and not type_allows(value, hints[name]):
            raise UserError(f"{what} field {name} is {shown(value)} ({json_kind(value)}), not "
                             f"{type_words(hints[name])}; write {type_words(hints[name])} there.")
    check_field_values(config, {k: v for k, v in config.shape_fields.items() if k in overrides},
                       tuple(k for k in config.probability_fields if k in overrides), what)
    config.validate()


def check_hf_fields(values: dict, path: Any, required: tuple[str, ...], shape_fields: dict[str, tuple[int, bool]],
                    probability_fields: tuple[str, ...] = ()) -> None:
    """A transformers config.json states every ``required`` field, its shape fields as integers within their
    bounds and its dropouts as probabilities; anything else is one sentence naming the file and the field."""
    check_json_object(values, path)
    for name in required:
        if name not in values:
            raise UserError(f"{path} has no {name} field, and zoo does not guess a model's shape; add "
                             f"\"{name}\": <the model's value> (transformers' save_pretrained always writes it).")
    for name, (maximum, nullable) in shape_fields.items():
        problem = shape_field_problem(values[name], maximum, nullable) if name in values else None
        if problem:
            raise UserError(f"{path} field {name} {problem}; write the model's {name} there as a positive integer "
                             f"of at most {maximum:,}.")
    for name in probability_fields:
        problem = probability_problem(values[name]) if name in values else None
        if problem:
            raise UserError(f"{path} field {name} {problem}; write a dropout probability such as 0.1.")
    check_positive_numbers(values, str(path))
