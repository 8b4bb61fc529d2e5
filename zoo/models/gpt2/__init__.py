"""GPT-2: its configuration with transformers' field names (:mod:`.config`), presets (:mod:`.presets`), the
tensor-parallel model with transformers' names and checkpoint layout (:mod:`.model`) and its DeepSpeed pipeline
stages (:mod:`.pipeline`)."""

from zoo.models.gpt2.model import GPT2LMHeadModel, GPT2Model

__all__ = ["GPT2LMHeadModel", "GPT2Model"]
