"""Tensor-parallel transformer layer (Shoeybi et al. 2019, Figure 3), shared by GPT-2 and BERT.

Per layer, forward: f -> [QKV column-parallel] -> attention on local heads -> [row-parallel out] -> g,
then f -> [column-parallel up] -> GeLU -> [row-parallel down] -> g. Two all-reduces forward (the g's)
and two backward (the f's). LayerNorm, residuals and residual dropout are replicated on every TP rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.parallel import ColumnParallelLinear, RowParallelLinear, tp_rng_fork
from zoo.parallel.state import ParallelState, tp_size_of
from zoo.parallel.utils import divide


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with heads split across TP ranks.

    QKV = f(X) [W_q | W_k | W_v] is column-parallel with stride 3, so rank i holds q, k and v of
    heads i*n/p ... (i+1)*n/p - 1 and attends with them alone; O = g(softmax(QK^T/sqrt(d)) V W_o) is
    row-parallel. Attention-probability dropout draws from the TP-rank-specific RNG stream.
    """

    def __init__(self, hidden_size: int, num_heads: int, attn_dropout: float, *,
                 parallel: ParallelState | None, init_std: float, output_init_std: float):
        super().__init__()
        tp = tp_size_of(parallel)
        self.parallel = parallel
        self.head_dim = divide(hidden_size, num_heads, "hidden size")
        self.local_heads = divide(num_heads, tp, "number of attention heads")
        self.local_hidden = self.local_heads * self.head_dim
        self.attn_dropout = attn_dropout
        self.c_attn = ColumnParallelLinear(hidden_size, 3 * hidden_size, stride=3, parallel=parallel,
                                           init_std=init_std)
        self.c_proj = RowParallelLinear(hidden_size, hidden_size, parallel=parallel, init_std=output_init_std)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None, causal: bool) -> torch.Tensor:
        b, s, _ = x.shape                                                   # (b, s, h)
        qkv = self.c_attn(x)                                                # (b, s, 3 * h/p)
        q, k, v = qkv.split(self.local_hidden, dim=-1)                      # 3 x (b, s, h/p)
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # q, k, v: (b, heads_local, s, d)
        dropout_p = self.attn_dropout if self.training else 0.0
        use_causal_flag = causal and attn_bias is None
        if dropout_p > 0.0:
            with tp_rng_fork(self.parallel):
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p,
                                                   is_causal=use_causal_flag)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, is_causal=use_causal_flag)
        y = y.transpose(1, 2).reshape(b, s, self.local_hidden)              # (b, s, h/p)
        return self.c_proj(y)                                               # (b, s, h)


class ParallelMLP(nn.Module):
    """Y = g(GeLU(f(X) A) B): A column-parallel (GeLU runs locally on X A_i), B row-parallel."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, gelu_approximate: str, *,
                 parallel: ParallelState | None, init_std: float, output_init_std: float):
        super().__init__()
        self.gelu_approximate = gelu_approximate
        self.c_fc = ColumnParallelLinear(hidden_size, ffn_hidden_size, parallel=parallel, init_std=init_std)
        self.c_proj = RowParallelLinear(ffn_hidden_size, hidden_size, parallel=parallel,
                                        init_std=output_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)                                                    # (b, s, 4h/p)
        x = F.gelu(x, approximate=self.gelu_approximate)
        return self.c_proj(x)                                               # (b, s, h)


class TransformerLayer(nn.Module):
    """One transformer layer; ``pre_norm`` picks the paper's Figure 7b (LN inside the residual branch,
    GPT-2 and Megatron BERT) or Figure 7a (post-norm, the original BERT).

        pre-norm:   x = x + drop(attn(ln_1(x)));   x = x + drop(mlp(ln_2(x)))
        post-norm:  x = ln_1(x + drop(attn(x)));   x = ln_2(x + drop(mlp(x)))
    """

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int, *, layer_norm_eps: float,
                 attn_dropout: float, hidden_dropout: float, gelu_approximate: str,
                 parallel: ParallelState | None, init_std: float, output_init_std: float,
                 pre_norm: bool = True):
        super().__init__()
        self.pre_norm = pre_norm
        self.ln_1 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.attn = ParallelSelfAttention(hidden_size, num_heads, attn_dropout, parallel=parallel,
                                          init_std=init_std, output_init_std=output_init_std)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=layer_norm_eps)
        self.mlp = ParallelMLP(hidden_size, ffn_hidden_size, gelu_approximate, parallel=parallel,
                               init_std=init_std, output_init_std=output_init_std)
        self.dropout = nn.Dropout(hidden_dropout)  # replicated activations: default RNG stream

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.dropout(self.attn(self.ln_1(x), attn_bias, causal))
            x = x + self.dropout(self.mlp(self.ln_2(x)))
        else:
            x = self.ln_1(x + self.dropout(self.attn(x, attn_bias, causal)))
            x = self.ln_2(x + self.dropout(self.mlp(x)))
        return x                                                            # (b, s, h)


def attention_bias(attention_mask: torch.Tensor | None, seq_len: int, causal: bool,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """Additive attention bias (b, 1, s, s) from a (b, s) keep-mask, or None when nothing is masked
    beyond causality (SDPA's ``is_causal`` then does it). Masked entries get dtype's minimum, not
    -inf, so a fully masked row gives a uniform distribution rather than NaN (as transformers does).
    """
    if attention_mask is None:
        return None
    keep = attention_mask.to(torch.bool)[:, None, None, :]                  # (b, 1, 1, s)
    if causal:
        tril = torch.ones(seq_len, seq_len, dtype=torch.bool, device=attention_mask.device).tril()
        keep = keep & tril                                                  # (b, 1, s, s)
    bias = torch.zeros(keep.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill(~keep, torch.finfo(dtype).min)


def run_layers(layers, x: torch.Tensor, attn_bias: torch.Tensor | None, causal: bool,
               checkpoint: bool) -> torch.Tensor:
    """Apply the layers in order; with ``checkpoint`` (and grad enabled) each layer's activations are
    recomputed in backward by DeepSpeed's activation checkpointing, which also restores the RNG
    states (default and TP tracker) so recomputed dropout masks match."""
    checkpoint = checkpoint and torch.is_grad_enabled()
    for layer in layers:
        if checkpoint:
            import deepspeed

            x = deepspeed.checkpointing.checkpoint(layer, x, attn_bias, causal)
        else:
            x = layer(x, attn_bias, causal)                                          # (b, s, h)
    return x
