"""Next-token choice from full-vocabulary logits: temperature, top-k, top-p (nucleus), sampling.

Filters take logits (b, V) and return logits of the same shape with the removed tokens set to
-inf, so they compose in the order transformers applies them (temperature, then top-k, then top-p)
and a softmax afterwards renormalises over the kept tokens:

    temperature T:  z / T                      (T < 1 sharpens, T > 1 flattens)
    top-k k:        keep z_i >= the k-th largest z (ties at the boundary are all kept)
    top-p p:        sort p_i = softmax(z)_i descending; keep the shortest prefix whose mass is >= p
                    (token i is kept iff the mass strictly before it is < p; the top token always is)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / T for T > 0 (T = 1 returns ``logits`` itself)."""
    if temperature <= 0:
        raise ValueError(f"temperature {temperature} must be positive; use greedy decoding for temperature 0.")
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row (and any tied with the k-th); k = 0 or k >= V keeps all."""
    if k < 0:
        raise ValueError(f"top-k {k} must be >= 0 (0 disables it).")
    if k == 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]                    # (b, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose probability mass is >= p; p = 1 keeps all."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top-p {p} must be in (0, 1]; 1 disables it.")
    if p == 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)     # (b, V)
    probs = torch.softmax(sorted_logits.float(), dim=-1)                   # (b, V)
    mass_before = torch.cumsum(probs, dim=-1) - probs                      # (b, V) exclusive prefix sums
    drop_sorted = mass_before >= p                                         # the top token: mass 0 < p, kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)   # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as transformers orders its logits warpers."""
    return top_p_filter(top_k_filter(apply_temperature(logits, temperature), top_k), top_p)


def sample(logits: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of (filtered) logits (b, V), row i drawn with ``generators[i]``.

    Each sequence owns its generator, so its tokens do not depend on which other sequences share
    its batch; every TP rank holds identical logits and identically seeded generators, so every
    rank draws the same tokens. Returns int64 (b,).
    """
    probs = torch.softmax(logits.float(), dim=-1)                          # (b, V)
    return torch.cat([torch.multinomial(probs[i], 1, generator=gen) for i, gen in enumerate(generators)])
