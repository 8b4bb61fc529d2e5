"""BERT presets as data: a name maps to the fields that differ from :class:`BertConfig`'s defaults. Any family's
preset is looked up through the registry (:func:`zoo.models.families.model_config`)."""

from __future__ import annotations

from zoo.errors import UserError
from zoo.models.bert.config import BertConfig

BERT_PRESETS: dict[str, dict] = {
    # The original sizes (post-norm in Devlin et al.; zoo builds them pre-norm unless pre_norm=False).
    "bert-base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12),
    "bert-large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16),
    # Megatron-LM's BERT scaling (Shoeybi et al. 2019, Table 4), pre-norm (Figure 7b).
    "bert-336m": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16),
    "bert-1.3b": dict(num_hidden_layers=24, hidden_size=2048, num_attention_heads=32),
    "bert-3.9b": dict(num_hidden_layers=48, hidden_size=2560, num_attention_heads=40),
    # A CPU-sized model for demos and tests.
    "bert-tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, max_position_embeddings=512),
}


def bert_config(preset: str, **overrides) -> BertConfig:
    """The :class:`BertConfig` of a preset name, with optional field overrides."""
    if preset not in BERT_PRESETS:
        raise UserError(f"unknown model preset {preset!r}; choose one of {sorted(BERT_PRESETS)}.")
    return BertConfig(**{**BERT_PRESETS[preset], **overrides})
