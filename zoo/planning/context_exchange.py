"""The planner's context-parallel arithmetic: the key/value heads DeepSpeed-Ulysses exchanges and the bytes its
all-to-alls send per layer (:mod:`zoo.parallel.context`).

At context-parallel size c each rank holds S/c tokens of every sample. A layer's attention sends four
all-to-alls over the context group forward (Q, K and V in, the output out) and four backward (their
gradients), each moving (c - 1)/c of its tensor: Q and the output are (b, S/c, n/t, d) per rank, K and V
(b, S/c, n_kv'/t, d), where n_kv' = n_kv, or c t where the n_kv/t key/value heads of a TP rank are fewer than
c and each is repeated c t / n_kv times before the exchange (:func:`zoo.parallel.context.kv_head_repeats`).
"""

from __future__ import annotations

__all__ = ["all_to_all_bytes", "exchanged_kv_heads"]


def exchanged_kv_heads(kv_heads: int, tp: int, cp: int) -> int:
    """n_kv': the key/value heads over all TP ranks as the context exchange sends them, n_kv times the repeats
    of each (1 at cp = 1 and wherever c divides the n_kv/t heads of a TP rank)."""
    if cp == 1:
        return kv_heads
    from zoo.parallel.context import kv_head_repeats  # local: torch import cost (plan --help runs without it)

    return kv_heads * kv_head_repeats(kv_heads // tp, cp)


def all_to_all_bytes(shape, s: int, b: int, tp: int, cp: int, recompute: str = "none", *,
                     value_bytes: int = 2) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends in one layer's all-to-alls for a micro-batch of b sequences of s
    tokens, with value width v, n query and n_kv' exchanged key/value heads of width d:

        forward  = (c - 1)/c x v b (s/c) d (2 n + 2 n_kv') / t
        backward = the same, plus the forward again under full recomputation (the layer's forward, all-to-alls
                   included, runs once more in backward; selective recomputation reruns only the attention
                   core, between the exchanges).

    Both are 0 at c = 1.
    """
    if cp == 1:
        return 0.0, 0.0
    heads = 2 * shape.heads + 2 * exchanged_kv_heads(shape.kv_heads, tp, cp)
    forward = (cp - 1) * value_bytes * b * s * shape.head_dim * heads / (cp * cp * tp)
    return forward, forward * (2 if recompute == "full" else 1)
