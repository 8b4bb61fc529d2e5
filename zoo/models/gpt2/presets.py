"""GPT-2 presets as data: a name maps to the fields that differ from :class:`GPT2Config`'s defaults. Any family's
preset is looked up through the registry (:func:`zoo.models.families.model_config`)."""

from __future__ import annotations

from zoo.errors import UserError
from zoo.models.gpt2.config import GPT2Config

GPT2_PRESETS: dict[str, dict] = {
    # OpenAI's released sizes.
    "gpt2": dict(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": dict(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": dict(n_layer=48, n_embd=1600, n_head=25),
    # Megatron-LM's weak-scaling study (Shoeybi et al. 2019, Table 1), sequence length 1024.
    "gpt2-1.2b": dict(n_layer=40, n_embd=1536, n_head=16),
    "gpt2-2.5b": dict(n_layer=54, n_embd=1920, n_head=20),
    "gpt2-4.2b": dict(n_layer=64, n_embd=2304, n_head=24),
    "gpt2-8.3b-32h": dict(n_layer=72, n_embd=3072, n_head=32),   # Table 1's 8.3B
    "gpt2-8.3b": dict(n_layer=72, n_embd=3072, n_head=24),       # Table 2's 8.3B (the trained one)
    # A 20B-class shape (GPT-NeoX-20B's layers, width and heads) in GPT-2's architecture, for 3D layouts.
    "gpt2-20b": dict(n_layer=44, n_embd=6144, n_head=64, n_positions=2048),
    # A CPU-sized model for demos and tests.
    "gpt2-tiny": dict(n_layer=2, n_embd=128, n_head=4, n_positions=256),
}


def gpt2_config(preset: str, **overrides) -> GPT2Config:
    """The :class:`GPT2Config` of a preset name, with optional field overrides."""
    if preset not in GPT2_PRESETS:
        raise UserError(f"unknown model preset {preset!r}; choose one of {sorted(GPT2_PRESETS)}.")
    return GPT2Config(**{**GPT2_PRESETS[preset], **overrides})
