"""Next-token choice from full-vocabulary logits: temperature, top-k, top-p (nucleus), sampling.

Filters take logits (b, V) and return logits of the same shape with the removed tokens set to
-inf, so they compose in the order transformers applies them (temperature, then top-k, then top-p)
and a softmax afterwards renormalises over the kept tokens:

    temperature T:  z / T                      (T < 1 sharpens, T > 1 flattens)
    top-k k:        keep z_i >= the k-th largest z (ties at the boundary are all kept)
    top-p p:        sort p_i = softmax(z)_i descending; keep the shortest prefix whose mass is >= p
                    (token i is kept iff the mass strictly before it is < p; the top token always is)

Top-k and top-p are transformers' own ``TopKLogitsWarper`` and ``TopPLogitsWarper``: generation
gathers the full vocabulary's logits before choosing (one (b, V) all-gather per step), so the
warpers apply unchanged. Temperature stays here: transformers' ``TemperatureLogitsWarper`` divides in
the logits' dtype, and an fp16/bf16 model or a small temperature would overflow to inf and NaN.

The settings are checked in one place (:func:`check_sampling_settings`, used by the filters and by
``GenerationConfig``): a NaN, an infinity or a value out of range would otherwise surface as
"probability tensor contains inf, nan or element < 0" at the first sampled token. Temperature
divides in float32 at least, and a temperature so small that z / T overflows divides the
row-max-shifted logits instead (softmax, top-k and top-p are unchanged by the shift), so any positive
finite temperature samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from zoo.errors import UserError


def check_temperature(temperature, allow_zero: bool = False) -> None:
    """A finite real T > 0 (or T = 0, greedy decoding, where ``allow_zero``); else one sentence."""
    floor = "0 (greedy decoding) or more" if allow_zero else "positive"
    if isinstance(temperature, bool) or not isinstance(temperature, Real) or not math.isfinite(temperature) \
            or temperature < 0 or (temperature == 0 and not allow_zero):
        greedy = "" if allow_zero else "; use greedy decoding for temperature 0"
        raise UserError(f"temperature {temperature!r} must be a finite number, {floor}, such as 0.8{greedy}.")


def check_top_k(k) -> None:
    """An integer k >= 0; else one sentence."""
    if isinstance(k, bool) or not isinstance(k, Integral) or k < 0:
        raise UserError(f"top-k {k!r} must be an integer >= 0 (0 disables it), such as 50.")


def check_top_p(p) -> None:
    """A real p in (0, 1]; else one sentence."""
    if isinstance(p, bool) or not isinstance(p, Real) or not 0.0 < p <= 1.0:
        raise UserError(f"top-p {p!r} must be a number in (0, 1], such as 0.95 (1 disables it).")


def check_sampling_settings(temperature, top_k, top_p, allow_zero_temperature: bool = True) -> None:
    """Every sampling setting at once, before any token is drawn (each message names the value and the fix)."""
    check_temperature(temperature, allow_zero=allow_zero_temperature)
    check_top_k(top_k)
    check_top_p(top_p)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / T for a finite T > 0 (T = 1 returns ``logits`` itself), in float32 at least; rows where z / T
    would overflow are shifted by their maximum first (the same distribution)."""
    check_temperature(temperature)
    if temperature == 1.0:
        return logits
    wide = logits if logits.dtype == torch.float64 else logits.float()
    scaled = wide / temperature
    overflow = torch.isposinf(scaled).any(dim=-1, keepdim=True) & ~torch.isposinf(wide).any(dim=-1, keepdim=True)
    if bool(overflow.any()):
        shifted = (wide - wide.amax(dim=-1, keepdim=True)) / temperature
        scaled = torch.where(overflow, shifted, scaled)
    return scaled


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th); k = 0 or k >= V keeps all.
    transformers' ``TopKLogitsWarper`` does the filtering."""
    check_top_k(k)
    if k == 0 or k >= logits.shape[-1]:
        return logits
    return TopKLogitsWarper(top_k=k)(None, logits)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose probability mass is >= p; p = 1 keeps all.
    transformers' ``TopPLogitsWarper`` does the filtering (in float32 at least, like the softmax after it)."""
    check_top_p(p)
    if p == 1.0:
        return logits
    wide = logits if logits.dtype == torch.float64 else logits.float()
    return TopPLogitsWarper(top_p=float(p))(None, wide).to(logits.dtype)


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as transformers orders its logits warpers."""
    check_sampling_settings(temperature, top_k, top_p, allow_zero_temperature=False)
    return top_p_filter(top_k_filter(apply_temperature(logits, temperature), top_k), top_p)


def sample(logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of (filtered) logits (b, V), row i drawn with ``generators[i]``.

    Each sequence owns its generator, so its tokens do not depend on which other sequences share
    its batch; every TP rank holds identical logits and identically seeded generators, so every
    rank draws the same tokens. Returns int64 (b,).
    """
    probs = torch.softmax(logits.float(), dim=-1)                          # (b, V)
    return torch.cat([torch.multinomial(probs[i], 1, generator=gen) for i, gen in enumerate(generators)])
