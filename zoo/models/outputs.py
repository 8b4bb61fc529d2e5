"""transformers' output classes for the models with a key/value cache, filled and read under the field name the
installed transformers declares.

transformers names that field ``past_key_values`` in some releases of the supported range and ``cache`` in
others; a release with ``cache`` still takes the old name but logs a deprecation warning for it, and a release
with ``past_key_values`` refuses ``cache`` outright. The name is read once per class, from the class's own
dataclass fields, so zoo's outputs are built and read without either failure on every version setup.cfg allows.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

CACHE_FIELD_NAMES = ("cache", "past_key_values")


def cache_field(output_class: type) -> str:
    """The name under which ``output_class`` (a transformers ModelOutput dataclass) declares its key/value cache."""
    names = {field.name for field in dataclasses.fields(output_class)}
    for name in CACHE_FIELD_NAMES:
        if name in names:
            return name
    raise TypeError(f"{output_class.__name__} declares none of {CACHE_FIELD_NAMES}; this transformers version "
                    "is outside the range setup.cfg allows.")


# output class -> its cache field in the installed transformers; read-only, computed at import.
CACHE_FIELDS = MappingProxyType({cls: cache_field(cls) for cls in (BaseModelOutputWithPast, CausalLMOutputWithPast)})


def with_cache(output_class: type, cache: Any, **fields: Any):
    """``output_class(**fields)`` with ``cache`` (None, or one (k, v) per layer) under the class's own field name."""
    return output_class(**fields, **{CACHE_FIELDS[output_class]: cache})


def cache_of(output) -> Any:
    """The key/value cache a zoo model returned with ``use_cache=True`` (None without it), read under the field
    name of the installed transformers, so no deprecated alias is touched."""
    return getattr(output, CACHE_FIELDS[type(output)])
