"""Rotary position embeddings (Su et al. 2021, "RoFormer"), as Llama applies them.

Query/key pair j of a head at position m is rotated by the angle m * theta_j, theta_j = rope_theta^(-2j/d):

    RoPE(x)_m = x_m * cos(m theta) + rotate_half(x_m) * sin(m theta),   rotate_half([a, b]) = [-b, a]

with the angles repeated over both halves of the head (Llama's "half-split" pairing, dimension j with
j + d/2). Rotation acts within each head, so it needs nothing from other TP ranks: every rank rotates its
own heads with the same cos/sin.

Llama-3's ``rope_scaling`` (rope_type "llama3", Meta's Llama 3.1 release) rescales the frequencies by
wavelength lambda_j = 2 pi / theta_j: kept above ``original_max_position_embeddings / high_freq_factor``
frequency, divided by ``factor`` below ``original / low_freq_factor``, and in between interpolated,
theta'_j = (1 - a) theta_j / factor + a theta_j with a = (original / lambda_j - low) / (high - low).

The frequencies are computed at each forward from the config (d/2 numbers): zoo's models hold no buffers,
so meta-device construction and ``to_empty`` leave nothing uninitialised.
"""

from __future__ import annotations

import math

import torch

from zoo.models.llama.config import LlamaConfig


def inverse_frequencies(config: LlamaConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """theta_j for j = 0 .. d/2 - 1 in float32, (d/2,), Llama-3 scaled where the config says so."""
    dim = config.attention_head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)                                    # (d/2,)
    if config.rope_type == "llama3":
        inv_freq = llama3_scaled(inv_freq, config.rope_scaling)
    return inv_freq


def llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3's wavelength-dependent frequency scaling (see the module docstring)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, interpolated, scaled)


def rotary_cos_sin(config: LlamaConfig, position_ids: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(m theta) and sin(m theta) for positions (b or 1, s), each (b or 1, s, d), computed in float32 and
    returned in ``dtype``."""
    inv_freq = inverse_frequencies(config, position_ids.device)                           # (d/2,)
    angles = position_ids[..., None].to(torch.float32) * inv_freq                         # (b, s, d/2)
    angles = torch.cat((angles, angles), dim=-1)                                          # (b, s, d)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[a, b] -> [-b, a] along the head dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of queries or keys (b, heads, s, d) with cos/sin (b or 1, s, d)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                                         # (b, 1, s, d)
    return x * cos + rotate_half(x) * sin
