"""A tensor-parallel Llama decoder layer (Touvron et al. 2023) built from zoo's Megatron layers.

    h = x + o_proj(Attention(RoPE(q_proj(n)), RoPE(k_proj(n)), v_proj(n))),   n = RMSNorm_1(x)
    y = h + down_proj(SiLU(gate_proj(m)) * up_proj(m)),                        m = RMSNorm_2(h)

Tensor parallelism (Shoeybi et al. 2019, section 3, with grouped-query attention): q, k and v are
column-parallel and share one f (:func:`zoo.parallel.layers.column_parallel_linears`), so rank i holds query heads i*n/p ... (i+1)*n/p - 1 and key/value heads
i*n_kv/p ... (i+1)*n_kv/p - 1, which are exactly the KV heads its query heads read (query head h reads
KV head h // (n/n_kv)); o_proj is row-parallel, followed by g. gate and up are one column-parallel GEMM
(``gate_up_proj``), down_proj is row-parallel, followed by g. A layer does 2 all-reduces forward and 2
backward, as GPT-2's. RMSNorm and the residuals are replicated on every rank.

Sequence parallelism (Korthikanti et al. 2022), ``sequence_parallel=True``: the layer's input and output are
this rank's tokens (b, s/p, h); RMSNorm and the residual adds run on them, the column-parallel GEMMs
all-gather their input along the sequence in place of f (q, k and v one all-gather together) and keep only
the s/p local tokens for backward, and the row-parallel GEMMs reduce-scatter their output in place of g.
RMSNorm weights then get their gradients summed over the TP group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo.errors import UserError
from zoo.models.llama.config import LlamaConfig
from zoo.models.llama.rope import apply_rotary
from zoo.models.transformer import LayerCache, check_context_call, recomputed
from zoo.parallel import ColumnParallelLinear, RowParallelLinear, scaled_init_std
from zoo.parallel.context import UlyssesAttention, check_context_heads
from zoo.parallel.layers import column_parallel_linears, mark_sequence_parallel, uses_sequence_parallel
from zoo.parallel.mappings import all_reduce_grads_of_replicated
from zoo.parallel.random import in_tp_stream
from zoo.parallel.state import ParallelState, as_state
from zoo.parallel.utils import divide


class LlamaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * w (Zhang & Sennrich 2019), normalised in float32 and scaled in the
    input's dtype, as transformers' ``LlamaRMSNorm``. Replicated; with sequence parallelism it runs on this
    rank's s/p tokens and dw = sum_i dw_i over the TP ranks (f applied to the weight)."""

    def __init__(self, hidden_size: int, eps: float, *, parallel: ParallelState | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.parallel = as_state(parallel)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        if sequence_parallel:
            mark_sequence_parallel(self.weight)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        weight = self.weight
        if uses_sequence_parallel(self.parallel, sequence_parallel):
            (weight,) = all_reduce_grads_of_replicated(self.parallel, weight)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)                     # (b, s, h)
        return weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with heads split across TP ranks.

    Q_i = f(X) W_q,i, K_i = f(X) W_k,i, V_i = f(X) W_v,i (column-parallel, one f shared by the three;
    rank i holds n/p query heads and n_kv/p key/value heads; with sequence parallelism f is one all-gather
    AG(X_i) and only X_i, (b, s/p, h), is kept for backward), RoPE on Q_i and K_i, each query head attends
    with its group's key/value head, softmax(Q K^T / sqrt(d) + mask) V, then O = g(A_i W_o,i) (row-parallel).
    Attention-probability dropout draws from the TP-rank stream. The key/value cache holds this rank's
    key/value heads after RoPE, (b, n_kv/p, P, d) each, and needs no communication.
    """

    def __init__(self, config: LlamaConfig, parallel: ParallelState | None, sequence_parallel: bool):
        super().__init__()
        self.parallel = parallel = as_state(parallel)
        tp = parallel.tp_size
        self.head_dim = d = config.attention_head_dim
        self.local_heads = divide(config.num_attention_heads, tp, "num_attention_heads")
        self.local_kv_heads = divide(config.kv_heads, tp, "num_key_value_heads")
        self.attention_dropout = config.attention_dropout
        hidden, std = config.hidden_size, config.initializer_range
        column = {"bias": False, "parallel": parallel, "init_std": std}
        self.q_proj = ColumnParallelLinear(hidden, config.num_attention_heads * d, **column)
        self.k_proj = ColumnParallelLinear(hidden, config.kv_heads * d, **column)
        self.v_proj = ColumnParallelLinear(hidden, config.kv_heads * d, **column)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, hidden, bias=False, parallel=parallel,
                                        init_std=scaled_init_std(std, config.num_hidden_layers),
                                        sequence_parallel=sequence_parallel)
        self.context_attention = None
        if parallel.cp_size > 1:
            check_context_heads(config.num_attention_heads, config.kv_heads, tp, parallel.cp_size)
            self.context_attention = UlyssesAttention(self._context_core, parallel, self.local_heads,
                                                      self.local_kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_bias: torch.Tensor | None, *,
                cache: LayerCache | None = None, sequence_parallel: bool = False,
                recompute_attention: bool = False) -> torch.Tensor:
        """(b, s, h) -> (b, s, h), or (b, s/p, h) -> (b, s/p, h) with ``sequence_parallel``; ``cos``/``sin``
        (b or 1, s, d) are the rotary angles of the s query positions. After a cached past a causal query
        of more than one token needs ``attn_bias`` with the offset causal mask."""
        weights = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        q, k, v = column_parallel_linears(x, weights, None, self.parallel, sequence_parallel)  # (b, s, {n, n_kv} d / p)
        b, s, _ = q.shape
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        # q: (b, heads_local, s, d); k, v: (b, kv_heads_local, s, d)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        has_past = cache is not None and cache.past is not None
        if has_past and attn_bias is None and s > 1:
            raise UserError(f"a causal query of {s} tokens after a key/value cache needs the offset causal "
                             "mask; pass attn_bias from attention_bias(..., past_length=...).")
        if cache is not None:
            k, v = cache.extend(k, v)                                              # (b, kv_heads_local, P + s, d)
        options = {"is_causal": attn_bias is None and not has_past,
                   "dropout_p": self.attention_dropout if self.training else 0.0}
        if self.context_attention is not None:   # every position of the sequence through DeepSpeed-Ulysses
            check_context_call(cache, attn_bias)
            y = self.context_attention(q, k, v, recompute=recompute_attention and torch.is_grad_enabled(),
                                       **options)                                  # (b, heads_local, s, d), s = S/c
        elif recompute_attention and torch.is_grad_enabled():
            y = recomputed(self._core, q, k, v, attn_bias, **options)
        else:
            y = self._core(q, k, v, attn_bias, **options)                          # (b, heads_local, s, d)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)      # (b, s, n d / p)
        return self.o_proj(y, sequence_parallel=sequence_parallel)                 # (b, s or s/p, h)

    def _context_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, recompute: bool,
                      **options) -> torch.Tensor:
        """The attention core of one context head group over the whole sequence, (b, heads_local/c, S, d)."""
        if recompute:
            return recomputed(self._core, q, k, v, None, **options)
        return self._core(q, k, v, None, **options)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None, *,
              is_causal: bool, dropout_p: float) -> torch.Tensor:
        """softmax(Q K^T / sqrt(d) + bias) V with each group of n/n_kv query heads reading its key/value head
        (repeated, as transformers' ``repeat_kv``): (b, heads, s, d), the heads this rank attends with."""
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)                                 # (b, heads_local, P + s, d)
            v = v.repeat_interleave(groups, dim=1)
        if dropout_p > 0.0:
            return in_tp_stream(self.parallel, F.scaled_dot_product_attention, q, k, v, attn_mask=attn_bias,
                                dropout_p=dropout_p, is_causal=is_causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, is_causal=is_causal)


class LlamaMLP(nn.Module):
    """SwiGLU (Shazeer 2020): Y = g((SiLU(f(X) G_i) * f(X) U_i) D_i), G and U column-parallel, D row-parallel.

    Gate and up are one column-parallel GEMM, ``gate_up_proj`` with stride 2: its master weight is
    [W_gate; W_up] (2I, h) and rank i's shard is [W_gate,i; W_up,i] (2I/p, h), its I/p gate rows then its I/p
    up rows, so SiLU(gate) * up runs locally on rank i's slice of the intermediate dimension. transformers'
    ``gate_proj`` and ``up_proj`` are its two blocks (see :mod:`zoo.models.llama.hf_names`).
    """

    def __init__(self, config: LlamaConfig, parallel: ParallelState | None, sequence_parallel: bool):
        super().__init__()
        hidden, ffn, std = config.hidden_size, config.intermediate_size, config.initializer_range
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * ffn, bias=False, stride=2, parallel=parallel,
                                                 init_std=std, sequence_parallel=sequence_parallel)
        self.down_proj = RowParallelLinear(ffn, hidden, bias=False, parallel=parallel,
                                           init_std=scaled_init_std(std, config.num_hidden_layers),
                                           sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """(b, s, h) -> (b, s, h); with ``sequence_parallel`` (b, s/p, h) -> (b, s/p, h)."""
        gate, up = self.gate_up_proj(x, sequence_parallel=sequence_parallel).chunk(2, dim=-1)  # 2 x (b, s, I/p)
        return self.down_proj(F.silu(gate) * up, sequence_parallel=sequence_parallel)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm decoder layer (see the module docstring); transformers' ``LlamaDecoderLayer`` names.

    The computation is :meth:`layer_forward`; ``forward`` (and a pipeline stage's forward) calls it through the
    instance, so :func:`zoo.models.compiled.compile_transformer_blocks` can replace it with its compiled form in
    place (RMSNorm, RoPE, SwiGLU and the residual adds then fuse), leaving the state_dict keys as they are.
    """

    def __init__(self, config: LlamaConfig, parallel: ParallelState | None):
        super().__init__()
        sp, eps = config.sequence_parallel, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps, parallel=parallel, sequence_parallel=sp)
        self.self_attn = LlamaAttention(config, parallel, sp)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps, parallel=parallel,
                                                     sequence_parallel=sp)
        self.mlp = LlamaMLP(config, parallel, sp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_bias: torch.Tensor | None = None,
                *, cache: LayerCache | None = None, sequence_parallel: bool = False,
                recompute_attention: bool = False) -> torch.Tensor:
        """:meth:`layer_forward`, compiled where the block was compiled."""
        return self.layer_forward(x, cos, sin, attn_bias, cache=cache, sequence_parallel=sequence_parallel,
                                  recompute_attention=recompute_attention)

    def layer_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attn_bias: torch.Tensor | None = None, *, cache: LayerCache | None = None,
                      sequence_parallel: bool = False, recompute_attention: bool = False) -> torch.Tensor:
        """(b, s, h) -> (b, s, h), or (b, s/p, h) -> (b, s/p, h) with ``sequence_parallel``."""
        sp = sequence_parallel
        x = x + self.self_attn(self.input_layernorm(x, sp), cos, sin, attn_bias, cache=cache, sequence_parallel=sp,
                               recompute_attention=recompute_attention)             # (b, s or s/p, h)
        return x + self.mlp(self.post_attention_layernorm(x, sp), sequence_parallel=sp)
