"""Llama presets as data: a name maps to the fields that differ from :class:`LlamaConfig`'s defaults."""

from __future__ import annotations

from zoo.errors import UserError
from zoo.models.llama.config import LlamaConfig

LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}

LLAMA_PRESETS: dict[str, dict] = {
    # Meta's Llama 2 7B (Touvron et al. 2023): multi-head attention, 32k SentencePiece vocabulary.
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                      rms_norm_eps=1e-5),
    # Meta's Llama 3 8B: grouped-query attention (8 KV heads), 128k vocabulary, rope_theta 500k.
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
    # Llama 3.1 8B: the same shape with Llama-3's long-context rope scaling.
    "llama3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_SCALING,
                        bos_token_id=128000, eos_token_id=128001),
    # A CPU-sized model for demos and tests: GPT-2's BPE vocabulary (the bundled tokenizer, EOD 50256),
    # grouped-query attention with 2 query heads per KV head.
    "llama-tiny": dict(vocab_size=50257, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=50256, eos_token_id=50256),
}


def llama_config(preset: str, **overrides) -> LlamaConfig:
    """The :class:`LlamaConfig` of a preset name, with optional field overrides."""
    if preset not in LLAMA_PRESETS:
        raise UserError(f"unknown model preset {preset!r}; choose one of {sorted(LLAMA_PRESETS)}.")
    values = {**LLAMA_PRESETS[preset], **overrides}
    if isinstance(values.get("rope_scaling"), dict):
        values["rope_scaling"] = dict(values["rope_scaling"])   # a config never shares the preset's dict
    return LlamaConfig(**values)
