"""Tensor-parallel transformer layer (Shoeybi et al. 2019, Figure 3), shared by GPT-2 and BERT.

Per layer, forward: f -> [QKV column-parallel] -> attention on local heads -> [row-parallel out] -> g,
then f -> [column-parallel up] -> GeLU -> [row-parallel down] -> g. Two all-reduces forward (the g's)
and two backward (the f's). LayerNorm, residuals and residual dropout are replicated on every TP rank.

Incremental decoding: a layer's key/value cache is the tuple ``(k, v)`` of this rank's heads,
each (b, heads_local, s_past, d) -- the cache is sharded exactly like the heads, so it needs no
communication. With ``layer_past`` the new keys/values are appended and the queries attend to
past + new keys; without it (training, BERT) the code path is unchanged.
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

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None, causal: bool,
                layer_past: tuple[torch.Tensor, torch.Tensor] | None = None, use_cache: bool = False):
        """Attention output (b, s, h); with ``use_cache`` the pair (output, (k, v)) where k and v are
        (b, heads_local, s_past + s, d). With ``layer_past`` and a causal query of more than one token,
        ``attn_bias`` must carry the offset causal mask (SDPA's ``is_causal`` aligns the top-left corner,
        which is only right without a past)."""
        b, s, _ = x.shape                                                   # (b, s, h)
        qkv = self.c_attn(x)                                                # (b, s, 3 * h/p)
        q, k, v = qkv.split(self.local_hidden, dim=-1)                      # 3 x (b, s, h/p)
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # q, k, v: (b, heads_local, s, d)
        if layer_past is not None:
            if causal and attn_bias is None and s > 1:
                raise ValueError(f"a causal query of {s} tokens after a key/value cache needs the offset causal "
                                 "mask; pass attn_bias from attention_bias(..., past_length=...).")
            k = torch.cat((layer_past[0], k), dim=2)                        # (b, heads_local, s_past + s, d)
            v = torch.cat((layer_past[1], v), dim=2)                        # (b, heads_local, s_past + s, d)
        dropout_p = self.attn_dropout if self.training else 0.0
        use_causal_flag = causal and attn_bias is None and layer_past is None
        if dropout_p > 0.0:
            with tp_rng_fork(self.parallel):
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p,
                                                   is_causal=use_causal_flag)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, is_causal=use_causal_flag)
        y = y.transpose(1, 2).reshape(b, s, self.local_hidden)              # (b, s, h/p)
        y = self.c_proj(y)                                                  # (b, s, h)
        return (y, (k, v)) if use_cache else y


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

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None = None, causal: bool = False,
                layer_past: tuple[torch.Tensor, torch.Tensor] | None = None, use_cache: bool = False):
        """The layer output (b, s, h); with ``use_cache`` the pair (output, (k, v)) of this layer's
        updated key/value cache (see :class:`ParallelSelfAttention`)."""
        if layer_past is not None or use_cache:
            return self._forward_cached(x, attn_bias, causal, layer_past, use_cache)
        if self.pre_norm:
            x = x + self.dropout(self.attn(self.ln_1(x), attn_bias, causal))
            x = x + self.dropout(self.mlp(self.ln_2(x)))
        else:
            x = self.ln_1(x + self.dropout(self.attn(x, attn_bias, causal)))
            x = self.ln_2(x + self.dropout(self.mlp(x)))
        return x                                                            # (b, s, h)

    def _forward_cached(self, x, attn_bias, causal, layer_past, use_cache):
        """The same maths as :meth:`forward`, threading the key/value cache through the attention."""
        attn_in = self.ln_1(x) if self.pre_norm else x
        a, present = self.attn(attn_in, attn_bias, causal, layer_past=layer_past, use_cache=True)
        if self.pre_norm:
            x = x + self.dropout(a)
            x = x + self.dropout(self.mlp(self.ln_2(x)))
        else:
            x = self.ln_1(x + self.dropout(a))
            x = self.ln_2(x + self.dropout(self.mlp(x)))
        return (x, present) if use_cache else x                             # (b, s, h)


def attention_bias(attention_mask: torch.Tensor | None, seq_len: int, causal: bool,
                   dtype: torch.dtype, past_length: int = 0) -> torch.Tensor | None:
    """Additive attention bias from a (b, P + s) keep-mask, or None when nothing is masked beyond
    causality (SDPA's ``is_causal`` then does it). Masked entries get dtype's minimum.

    Causal: (b, 1, s, P + s). With ``past_length`` P > 0 (decoding after a key/value cache) the
    keep-mask covers past and new tokens, and new query i (absolute position P + i) may see key j
    iff j <= P + i, i.e. the causal triangle shifted right by P. Not causal (BERT): (b, 1, 1, s).

    No query row is left without a key. A row with none (the pad positions of a left-padded prompt,
    or every row of an all-pad sample) would make SDPA's softmax run over nothing but masked
    entries, and CUDA's memory-efficient kernel can return NaN there (pytorch#110213), which then
    reaches real rows through the pad keys and values (0 * NaN = NaN). Such a causal row keeps its
    own position; an all-pad sample of a non-causal bias (one row shared by every query) keeps all
    its keys. Only rows that had no key change, so the outputs at real positions are unchanged.
    """
    if attention_mask is None:
        return None
    device = attention_mask.device
    keep = attention_mask.to(torch.bool)[:, None, None, :]                  # (b, 1, 1, P + s)
    fallback: torch.Tensor | bool = True                                    # all keys (non-causal)
    if causal:
        key_pos = torch.arange(past_length + seq_len, device=device)        # (P + s,)
        query_pos = key_pos[past_length:, None]                             # (s, 1)
        keep = keep & (key_pos <= query_pos)                                # (b, 1, s, P + s)
        fallback = key_pos == query_pos                                     # (s, P + s): own position
    keyless = ~keep.any(dim=-1, keepdim=True)                               # (b, 1, s or 1, 1)
    keep = keep | (keyless & fallback)
    bias = torch.zeros(keep.shape, dtype=dtype, device=device)
    return bias.masked_fill(~keep, torch.finfo(dtype).min)


def run_layers(layers, x: torch.Tensor, attn_bias: torch.Tensor | None, causal: bool,
               checkpoint: bool, past_key_values=None, use_cache: bool = False):
    """Apply the layers in order; with ``checkpoint`` (and grad enabled) each layer's activations are
    recomputed in backward by DeepSpeed's activation checkpointing, which also restores the RNG
    states (default and TP tracker) so recomputed dropout masks match.

    ``past_key_values`` (one (k, v) per layer) and ``use_cache`` are for incremental decoding (no
    checkpointing there): with ``use_cache`` the result is (x, presents), presents holding each
    layer's updated (k, v), (b, heads_local, s_past + s, d).
    """
    if past_key_values is not None or use_cache:
        pasts = past_key_values if past_key_values is not None else [None] * len(layers)
        if len(pasts) != len(layers):
            raise ValueError(f"past_key_values holds {len(pasts)} layers but the model has {len(layers)}; "
                             "pass the cache this model returned.")
        presents = []
        for layer, layer_past in zip(layers, pasts):
            out = layer(x, attn_bias, causal, layer_past=layer_past, use_cache=use_cache)
            x, present = out if use_cache else (out, None)                  # (b, s, h)
            presents.append(present)
        return (x, tuple(presents)) if use_cache else x
    checkpoint = checkpoint and torch.is_grad_enabled()
    for layer in layers:
        if checkpoint:
            import deepspeed

            x = deepspeed.checkpointing.checkpoint(layer, x, attn_bias, causal)
        else:
            x = layer(x, attn_bias, causal)                                          # (b, s, h)
    return x
