"""Model FLOPs of a training iteration: what the planner's time estimate, the training log's TFLOP/s and the
GPU acceptance run's MFU all divide by, so the three agree."""

from __future__ import annotations


def megatron_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                                 recompute: bool = False) -> float:
    """Model FLOPs of one training iteration of a GPT (Narayanan et al. 2021, section 5.1).

    A layer's forward does 24 B s h^2 (the four GEMMs) + 4 B s^2 h (QK^T and PV) FLOPs, the LM head
    2 B s h V. Backward costs twice the forward; activation recomputation adds one more forward of
    the layers (not of the LM head). So with k = 3 passes (4 with recomputation):

        F = 24 k B s l h^2 (1 + s / (6 h)) + 6 B s h V

    which is the paper's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) for k = 4, and
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)) without recomputation. The paper's closed form for GPT-shaped
    models; :func:`model_flops_per_iteration` counts any family's shape.
    """
    k = 4 if recompute else 3
    return 24.0 * k * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden)) + 6.0 * batch * seq * hidden * vocab


def model_flops_per_iteration(batch: int, seq: int, shape, vocab: int, recompute: bool = False) -> float:
    """Model FLOPs of one training iteration, GEMM by GEMM, for any family's
    :class:`~zoo.models.families.ModelShape` (Narayanan et al. 2021, section 5.1, generalised).

    With T = B s tokens, n query heads and n_kv key/value heads of width d, MLP width f with m GEMMs, a
    layer's forward does

        2 T h (n d + 2 n_kv d)    Q, K, V
        4 B s^2 n d               Q K^T and P V (every pair counted, as Megatron does)
        2 T n d h                 the output projection
        2 T h f m                 the MLP

    and the LM head 2 T h V. Backward costs twice the forward; activation recomputation adds one more
    forward of the layers (not of the LM head): k = 3 passes, 4 with recomputation. For GPT-2's shape
    (n d = h, n_kv = n, f = 4h, m = 2) this is :func:`megatron_flops_per_iteration`; Llama's has m = 3
    (SwiGLU) and n_kv < n under grouped-query attention.
    """
    tokens, attention = batch * seq, shape.heads * shape.head_dim
    key_value = shape.kv_heads * shape.head_dim
    gemms = 2 * tokens * shape.hidden * (attention + 2 * key_value + attention + shape.ffn_matrices * shape.ffn_hidden)
    scores = 4 * batch * seq * seq * attention
    passes = 4 if recompute else 3
    return float(passes * shape.layers * (gemms + scores) + 6 * tokens * shape.hidden * vocab)
