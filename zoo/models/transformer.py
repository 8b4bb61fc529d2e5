"""Tensor-parallel transformer layer (Shoeybi et al. 2019, Figure 3), shared by GPT-2 and BERT.

Per layer, forward: f -> [QKV column-parallel] -> attention on local heads -> [row-parallel out] -> g,
then f -> [column-parallel up] -> GeLU -> [row-parallel down] -> g. Two all-reduces forward (the g's)
and two backward (the f's). LayerNorm, residuals and residual dropout are replicated on every TP rank.

Sequence parallelism (Korthikanti et al. 2022, Figure 5), ``sequence_parallel=True``: the layer's
input and output are this rank's tokens, (b, s/p, h), split along the sequence (dim 1). LayerNorm,
residual dropout and the residual adds run on those s/p tokens; each column-parallel GEMM all-gathers
its input along the sequence (backward: reduce-scatter) in place of f, and each row-parallel GEMM
reduce-scatters its output (backward: all-gather) in place of g. Per layer that is two all-gathers and
two reduce-scatters forward, two reduce-scatters and two all-gathers backward, plus two all-gathers
in backward that re-gather the column-parallel GEMMs' inputs (they keep only their s/p tokens, the
paper's section 4.2.2), and no activation all-reduce; the LayerNorm parameters and the row-parallel biases get their gradients summed over the
TP group (one small all-reduce each, in backward). Residual dropout then draws from the TP-rank
stream, since every rank holds other tokens. The option is a no-op at tp = 1 and is decided per call
(the models turn it off for key/value-cached decoding).

Selective recomputation (ibid., section 5): with ``recompute_attention`` the attention core
(QK^T, softmax, dropout, @V) is run under DeepSpeed's activation checkpointing: its s x s
activations are not kept but recomputed in backward, with the RNG states (default and TP tracker)
restored so the recomputed dropout mask is the same.

Incremental decoding: a layer's key/value cache is the pair ``(k, v)`` of this rank's heads, each
(b, heads_local, s_past, d) -- the cache is sharded exactly like the heads, so it needs no
communication. One forward path serves training, scoring and decoding: a :class:`KVCache` passed down
(one :class:`LayerCache` per layer) makes each attention append its new keys/values to the past and
attend to past + new keys; without one (training, BERT) nothing is cached.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zoo.errors import UserError
from zoo.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_tp_region,
    vocab_parallel_cross_entropy,
)
from zoo.parallel.context import UlyssesAttention, sum_over_context
from zoo.parallel.layers import SequenceParallelLayerNorm
from zoo.parallel.random import in_tp_stream, region_rng
from zoo.parallel.state import ParallelState, as_state
from zoo.parallel.utils import divide


@dataclass(frozen=True)
class LayerOptions:
    """The settings every transformer layer of one model shares, built once from the model's config and
    handed to each layer, which passes it on to its attention and MLP.

    Sizes: ``hidden_size`` h, ``num_heads``, ``ffn_hidden_size`` (the MLP's inner width). Dropout
    probabilities: ``attn_dropout`` on the attention probabilities, ``hidden_dropout`` on each residual
    branch. ``gelu_approximate``: F.gelu's ``approximate`` ("tanh" for GPT-2, "none" for BERT).
    ``init_std``: the normal init of the column-parallel GEMMs; ``output_init_std``: that of the
    row-parallel ones (scaled by depth). ``pre_norm``: Figure 7b (True) or 7a (False) of Shoeybi et al.
    ``sequence_parallel``: the layer may run sequence-parallel (its LayerNorm and row-parallel bias
    gradients are then summed over the TP group); each call still decides. How a checkpoint file stores
    the weights is no layer setting: the model's transformers name map says it (:mod:`zoo.checkpoint.hf.hf_io`).
    """

    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    layer_norm_eps: float
    attn_dropout: float
    hidden_dropout: float
    gelu_approximate: str
    init_std: float
    output_init_std: float
    pre_norm: bool = True
    sequence_parallel: bool = False


@dataclass
class LayerCache:
    """One layer's key/value cache: ``past`` (k, v) of this rank's heads, each (b, heads_local, P, d), or None
    (nothing cached yet), and ``present``, the (k, v) the layer's forward extended it to."""

    past: tuple[torch.Tensor, torch.Tensor] | None = None
    present: tuple[torch.Tensor, torch.Tensor] | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(past + new keys, past + new values), each (b, heads_local, P + s, d), kept as ``present``."""
        if self.past is not None:
            k = torch.cat((self.past[0], k), dim=2)
            v = torch.cat((self.past[1], v), dim=2)
        self.present = (k, v)
        return k, v


class KVCache:
    """The key/value cache of one decoding forward over every layer, built from transformers' tuple form
    (``past_key_values``: one (k, v) per layer, or None for a first call); :meth:`presents` gives the
    updated tuple back. An empty past (length 0) counts as none."""

    def __init__(self, past_key_values, num_layers: int):
        if past_key_values is not None and len(past_key_values) != num_layers:
            raise UserError(f"past_key_values holds {len(past_key_values)} layers but the model has {num_layers}; "
                             "pass the cache this model returned.")
        self.past_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        pasts = past_key_values if self.past_length > 0 else [None] * num_layers
        self.layers = [LayerCache(past) for past in pasts]

    def presents(self) -> tuple:
        return tuple(layer.present for layer in self.layers)


@torch._disable_dynamo   # a compiled block breaks here once; DeepSpeed's checkpoint is not traced either
def recomputed(function, *tensors, **options):
    """``function(*tensors, **options)`` with its activations recomputed in backward by DeepSpeed's activation
    checkpointing, which restores the RNG states (default and TP tracker) so recomputed dropout masks match.
    The tensors go positionally (the checkpoint saves and detaches them), everything else by keyword."""
    import deepspeed  # local: importing DeepSpeed costs ~1.5 s; only recomputation needs it

    bound = functools.partial(function, **options)
    bound.__name__ = getattr(function, "__name__", type(function).__name__)   # what the checkpoint runs, by name
    return deepspeed.checkpointing.checkpoint(bound, *tensors)


def lm_loss(local_logits: torch.Tensor, targets: torch.Tensor, parallel: ParallelState | None,
            vocab_size: int) -> torch.Tensor:
    """Mean token cross-entropy of vocab-parallel logits (b, s, V_padded / p) against ``targets`` (b, s), -100
    ignored, without gathering the logits (the fused vocab-parallel cross-entropy); 0 when nothing counts. With
    context parallelism the mean is over the tokens of every context rank (:func:`zoo.parallel.context.sum_over_context`)."""
    token_loss = vocab_parallel_cross_entropy(local_logits, targets, parallel, vocab_size=vocab_size)   # (b, s)
    total, count = token_loss.sum(), (targets != -100).sum()
    if parallel is not None and parallel.cp_size > 1:   # the whole sequence's mean; each rank's tokens' gradient
        total, count = sum_over_context(torch.stack([total, count.to(total.dtype)]), parallel).unbind()
    return total / count.clamp(min=1)


def causal_lm_head_outputs(local_logits: torch.Tensor, labels: torch.Tensor | None, parallel: ParallelState,
                           vocab_size: int, gather_output: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(loss, logits) of a causal LM from this rank's vocab-parallel logits (b, s, V_padded / p): the loss
    of position t predicting label t+1 (the labels are shifted, not the logits: no logits-sized copy), None
    without labels; the logits as :func:`user_logits` hands them out. ``labels`` are (b, s), or (b, s + 1) for a
    context shard (:func:`zoo.parallel.context.context_shard`), whose last label is the next shard's first token."""
    loss = None
    if labels is not None:
        if labels.shape[1] == local_logits.shape[1] + 1:   # a context shard's labels carry the next token
            targets = labels[:, 1:]                                            # (b, s)
        else:
            targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)   # (b, s)
        loss = lm_loss(local_logits, targets, parallel, vocab_size)
    return loss, user_logits(local_logits, parallel, vocab_size, gather_output)


def user_logits(local_logits: torch.Tensor, parallel: ParallelState, vocab_size: int,
                gather_output: bool) -> torch.Tensor:
    """The ``.logits`` a model returns from this rank's vocab shard (..., V_padded / p): the real vocabulary
    (..., V), gathered over TP, with ``gather_output`` and always at tp = 1 (where the shard is the whole
    vocabulary, so no padding column, whose logit is a meaningless 0, ever reaches a softmax of the caller: a
    view, no copy); at tp > 1 without ``gather_output``, this rank's shard, padding included, for the
    vocab-parallel consumers (:func:`zoo.parallel.vocab_parallel_cross_entropy`,
    :func:`zoo.parallel.argmax.vocab_parallel_argmax`), which take ``vocab_size`` to leave it out."""
    if not gather_output and parallel.tp_size > 1:
        return local_logits                                                     # (..., V_padded / p)
    return gather_from_tp_region(local_logits, parallel)[..., :vocab_size]      # (..., V)


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with heads split across TP ranks.

    QKV = f(X) [W_q | W_k | W_v] is column-parallel with stride 3, so rank i holds q, k and v of
    heads i*n/p ... (i+1)*n/p - 1 and attends with them alone; O = g(softmax(QK^T/sqrt(d)) V W_o) is
    row-parallel. Attention-probability dropout draws from the TP-rank-specific RNG stream. With
    ``sequence_parallel`` the input and output are (b, s/p, h); the heads still see all s tokens.
    """

    def __init__(self, options: LayerOptions, *, parallel: ParallelState | None):
        super().__init__()
        self.parallel = parallel = as_state(parallel)
        tp = parallel.tp_size
        hidden_size = options.hidden_size
        self.head_dim = divide(hidden_size, options.num_heads, "hidden size")
        self.local_heads = divide(options.num_heads, tp, "number of attention heads")
        self.local_hidden = self.local_heads * self.head_dim
        self.attn_dropout = options.attn_dropout
        self.c_attn = ColumnParallelLinear(hidden_size, 3 * hidden_size, stride=3, parallel=parallel,
                                           init_std=options.init_std, sequence_parallel=options.sequence_parallel)
        self.c_proj = RowParallelLinear(hidden_size, hidden_size, parallel=parallel,
                                        init_std=options.output_init_std,
                                        sequence_parallel=options.sequence_parallel)
        self.context_attention = (UlyssesAttention(self._context_core, parallel, self.local_heads, self.local_heads)
                                  if parallel.cp_size > 1 else None)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None, causal: bool, *,
                cache: LayerCache | None = None, sequence_parallel: bool = False,
                recompute_attention: bool = False) -> torch.Tensor:
        """Attention output (b, s, h) (or (b, s/p, h) with ``sequence_parallel``). With a ``cache`` the new keys
        and values are appended to its past (its ``present`` becomes (b, heads_local, s_past + s, d) each); after
        a past, a causal query of more than one token needs ``attn_bias`` carrying the offset causal mask (SDPA's
        ``is_causal`` aligns the top-left corner, which is only right without a past)."""
        qkv = self.c_attn(x, sequence_parallel=sequence_parallel)          # (b, s, 3 * h/p), s all tokens
        b, s, _ = qkv.shape
        q, k, v = qkv.split(self.local_hidden, dim=-1)                      # 3 x (b, s, h/p)
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # q, k, v: (b, heads_local, s, d)
        has_past = cache is not None and cache.past is not None
        if has_past and causal and attn_bias is None and s > 1:
            raise UserError(f"a causal query of {s} tokens after a key/value cache needs the offset causal "
                             "mask; pass attn_bias from attention_bias(..., past_length=...).")
        if cache is not None:
            k, v = cache.extend(k, v)                                       # (b, heads_local, s_past + s, d)
        dropout_p = self.attn_dropout if self.training else 0.0
        is_causal = causal and attn_bias is None and not has_past
        if self.context_attention is not None:
            check_context_call(cache, attn_bias)
            y = self.context_attention(q, k, v, is_causal=is_causal, dropout_p=dropout_p,
                                       recompute=recompute_attention and torch.is_grad_enabled())  # (b, heads_local, s, d)
        elif recompute_attention and torch.is_grad_enabled():
            y = recomputed(self._core, q, k, v, attn_bias, is_causal=is_causal, dropout_p=dropout_p)
        else:
            y = self._core(q, k, v, attn_bias, is_causal=is_causal, dropout_p=dropout_p)  # (b, heads_local, s, d)
        y = y.transpose(1, 2).reshape(b, s, self.local_hidden)              # (b, s, h/p)
        return self.c_proj(y, sequence_parallel=sequence_parallel)          # (b, s, h) or (b, s/p, h)

    def _context_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, recompute: bool,
                      **options) -> torch.Tensor:
        """The attention core of one context head group over the whole sequence, (b, heads_local/c, S, d)."""
        if recompute:
            return recomputed(self._core, q, k, v, None, **options)
        return self._core(q, k, v, None, **options)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None, *,
              is_causal: bool, dropout_p: float) -> torch.Tensor:
        """softmax(QK^T / sqrt(d) + bias) with dropout, times V: (b, heads_local, s, d). The part selective
        recomputation recomputes (its activations grow with s^2, its FLOPs are a small share)."""
        if dropout_p > 0.0:
            return in_tp_stream(self.parallel, F.scaled_dot_product_attention, q, k, v, attn_mask=attn_bias,
                                dropout_p=dropout_p, is_causal=is_causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, is_causal=is_causal)


def check_context_call(cache, attn_bias) -> None:
    """One sentence for what attention does not do over a context-parallel split: decode from a key/value cache
    or take a padding mask (the shards are whole causal sequences)."""
    if cache is not None:
        raise UserError("key/value-cached decoding runs at context-parallel size 1; load the model with "
                         "context_parallel_size 1 to generate.")
    if attn_bias is not None:
        raise UserError("an attention mask is not supported with context parallelism (each sample is one causal "
                         "sequence split over the context ranks); pass attention_mask=None.")


class ParallelMLP(nn.Module):
    """Y = g(GeLU(f(X) A) B): A column-parallel (GeLU runs locally on X A_i), B row-parallel."""

    def __init__(self, options: LayerOptions, *, parallel: ParallelState | None):
        super().__init__()
        self.gelu_approximate = options.gelu_approximate
        self.c_fc = ColumnParallelLinear(options.hidden_size, options.ffn_hidden_size, parallel=parallel,
                                         init_std=options.init_std, sequence_parallel=options.sequence_parallel)
        self.c_proj = RowParallelLinear(options.ffn_hidden_size, options.hidden_size, parallel=parallel,
                                        init_std=options.output_init_std,
                                        sequence_parallel=options.sequence_parallel)

    def forward(self, x: torch.Tensor, sequence_parallel: bool = False) -> torch.Tensor:
        """(b, s, h) -> (b, s, h); with ``sequence_parallel`` (b, s/p, h) -> (b, s/p, h) (AG -> A -> B -> RS)."""
        x = self.c_fc(x, sequence_parallel=sequence_parallel)               # (b, s, 4h/p)
        x = F.gelu(x, approximate=self.gelu_approximate)
        return self.c_proj(x, sequence_parallel=sequence_parallel)          # (b, s, h) or (b, s/p, h)


class TransformerLayer(nn.Module):
    """One transformer layer; ``pre_norm`` picks the paper's Figure 7b (LN inside the residual branch,
    GPT-2 and Megatron BERT) or Figure 7a (post-norm, the original BERT).

        pre-norm:   x = x + drop(attn(ln_1(x)));   x = x + drop(mlp(ln_2(x)))
        post-norm:  x = ln_1(x + drop(attn(x)));   x = ln_2(x + drop(mlp(x)))

    Every setting comes from one :class:`LayerOptions`, built once per model from its config; the layer
    declares no file layout (how a format stores its weights is the format's reader's business).

    The computation is :meth:`layer_forward`; ``forward`` (and a pipeline stage's forward) calls it through the
    instance, so :func:`zoo.models.compiled.compile_transformer_blocks` can replace it with its compiled form in
    place, leaving the module tree and its state_dict keys as they are.
    """

    def __init__(self, options: LayerOptions, *, parallel: ParallelState | None = None):
        super().__init__()
        self.options = options
        self.pre_norm = options.pre_norm
        self.parallel = parallel = as_state(parallel)
        sp = options.sequence_parallel
        self.ln_1 = SequenceParallelLayerNorm(options.hidden_size, eps=options.layer_norm_eps, parallel=parallel,
                                              sequence_parallel=sp)
        self.attn = ParallelSelfAttention(options, parallel=parallel)
        self.ln_2 = SequenceParallelLayerNorm(options.hidden_size, eps=options.layer_norm_eps, parallel=parallel,
                                              sequence_parallel=sp)
        self.mlp = ParallelMLP(options, parallel=parallel)
        self.dropout = nn.Dropout(options.hidden_dropout)  # default stream, or the TP-rank stream under SP

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None = None, *, causal: bool = False,
                cache: LayerCache | None = None, sequence_parallel: bool = False,
                recompute_attention: bool = False) -> torch.Tensor:
        """:meth:`layer_forward`, compiled where the block was compiled."""
        return self.layer_forward(x, attn_bias, causal=causal, cache=cache, sequence_parallel=sequence_parallel,
                                  recompute_attention=recompute_attention)

    def layer_forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None = None, *, causal: bool = False,
                      cache: LayerCache | None = None, sequence_parallel: bool = False,
                      recompute_attention: bool = False) -> torch.Tensor:
        """The layer output (b, s, h), or (b, s/p, h) for a (b, s/p, h) input with ``sequence_parallel``; a
        ``cache`` gets this layer's updated keys and values (see :class:`ParallelSelfAttention`)."""
        sp = sequence_parallel

        def attn(h):
            return self.attn(h, attn_bias, causal, cache=cache, sequence_parallel=sp,
                             recompute_attention=recompute_attention)

        def drop(h):
            return region_dropout(self.dropout, h, self.parallel, sp)

        if self.pre_norm:
            x = x + drop(attn(self.ln_1(x, sequence_parallel=sp)))
            x = x + drop(self.mlp(self.ln_2(x, sequence_parallel=sp), sequence_parallel=sp))
        else:
            x = self.ln_1(x + drop(attn(x)), sequence_parallel=sp)
            x = self.ln_2(x + drop(self.mlp(x, sequence_parallel=sp)), sequence_parallel=sp)
        return x                                                            # (b, s, h) or (b, s/p, h)


def region_dropout(dropout: nn.Dropout, x: torch.Tensor, parallel: ParallelState | None,
                   sequence_parallel: bool) -> torch.Tensor:
    """Dropout on activations between the TP GEMMs: from the TP-rank stream when they are this rank's
    s/p tokens (sequence parallelism), else from the default stream (replicated activations, same mask
    on every rank). An inactive dropout (eval, p = 0) draws nothing and needs no stream. Only the TP-rank
    stream's dropout breaks a compiled block's graph (:func:`zoo.parallel.random.in_tp_stream`)."""
    if not (dropout.training and dropout.p > 0) or not sequence_parallel:
        return dropout(x)
    return _sequence_parallel_dropout(dropout, x, parallel)


@torch._disable_dynamo   # the TP-rank stream cannot be traced: see zoo.parallel.random.in_tp_stream
def _sequence_parallel_dropout(dropout: nn.Dropout, x: torch.Tensor, parallel: ParallelState | None) -> torch.Tensor:
    with region_rng(parallel, True):
        return dropout(x)


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


def run_layers(layers, x: torch.Tensor, attn_bias: torch.Tensor | None, *, causal: bool,
               recompute: str | None = None, cache: KVCache | None = None,
               sequence_parallel: bool = False) -> torch.Tensor:
    """Apply the layers in order. ``recompute`` is the granularity (:func:`zoo.models.config.recompute_mode`):
    "full", with grad enabled, recomputes each layer's activations in backward (:func:`recomputed`);
    "selective" recomputes only each layer's attention core the same way; None keeps every activation.
    With ``sequence_parallel`` ``x`` is (b, s/p, h), this rank's tokens. A ``cache`` (decoding) gives each
    layer its :class:`LayerCache`; nothing is recomputed there."""
    full = recompute == "full" and torch.is_grad_enabled()
    for index, layer in enumerate(layers):
        options = {"causal": causal, "cache": None if cache is None else cache.layers[index],
                   "sequence_parallel": sequence_parallel, "recompute_attention": recompute == "selective"}
        x = recomputed(layer, x, attn_bias, **options) if full else layer(x, attn_bias, **options)
    return x                                                                # (b, s, h) or (b, s/p, h)
