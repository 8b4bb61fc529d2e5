"""Bytes of activations a micro-batch keeps for its backward, per rank.

The activation formulas of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (section 4): :func:`layer_activation_bytes` and its relatives for GPT-2's and BERT's layer as the paper
counts it, and the ``*_of`` functions for any family's shape, read from the registry
(:class:`zoo.models.families.ModelShape`: heads and key/value heads, MLP width and GEMMs, norm, dropouts,
attention kernel), so GPT-2 and BERT get the paper's numbers and Llama its own.

Every ``*_of`` function takes the context-parallel size ``cp`` = c (DeepSpeed-Ulysses,
:mod:`zoo.parallel.context`): a rank holds s/c tokens of each sequence from the embedding to the loss, so
every per-token term is divided by c, and its attention core runs n/(t c) heads over all s positions.
"""

from __future__ import annotations

from zoo.errors import UserError
from zoo.planning.context_exchange import exchanged_kv_heads

RECOMPUTE_MODES = ("none", "selective", "full")


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_MODES:
        raise UserError(f"recompute {recompute!r} is not a mode; use one of {list(RECOMPUTE_MODES)}.")


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", *, value_bytes: int = 2, mask_bytes: int = 1) -> float:
    """Bytes one transformer layer keeps for its backward (Korthikanti et al. 2022, section 4).

    With 16-bit values (``value_bytes`` = 2) and 1-byte dropout masks the paper's totals are

        no parallelism:                       s b h (34 + 5 a s / h)
        tensor parallel t:                    s b h (10 + 24/t + 5 a s / (h t))
        tensor + sequence parallel:           s b h (34/t + 5 a s / (h t))

    and selective recomputation (the attention core, softmax and its dropout, is recomputed) drops the
    5 a s / h term. The parts: LayerNorm inputs 4sbh, the inputs of the QKV and first MLP GEMMs 2sbh
    each and two dropout masks 2sbh are replicated over TP ranks (10sbh, split only by sequence
    parallelism); Q, K, V, the output-projection input, the GeLU input and the second MLP GEMM's input
    (24sbh) are split by tp; the attention scores' softmax, its dropout mask and the dropout's output
    (5as^2b) are split by tp. For value width v and mask width m the same parts give 4v + 2m, 12v and
    2v + m (torch keeps bool masks on CUDA, m = 1, but masks of the input's dtype on CPU, m = v).
    ``recompute="full"`` keeps only the layer's input: v s b h (divided by t with sequence parallelism).
    """
    _check_recompute(recompute)
    v, m = value_bytes, mask_bytes
    if recompute == "full":
        return v * s * b * h / (t if sequence_parallel else 1)
    replicated = (4 * v + 2 * m) * s * b * h
    split = 12 * v * s * b * h
    per_layer = (replicated / t if sequence_parallel else replicated) + split / t
    if recompute == "none":
        per_layer += attention_scores_bytes(s, b, a, t, value_bytes=v, mask_bytes=m)
    return per_layer


def attention_scores_bytes(s: int, b: int, a: int, t: int = 1, *, value_bytes: int = 2,
                           mask_bytes: int = 1) -> float:
    """The 5 a s^2 b / t of one layer in 16-bit: softmax output, dropout mask, dropout output,
    (2v + m) a s^2 b / t. Selective recomputation does not keep them, nor does a fused attention kernel
    (SDPA's flash or memory-efficient attention, which zoo's layers call): that kernel keeps the
    output and a log-sum-exp per row instead."""
    return (2 * value_bytes + mask_bytes) * a * s * s * b / t


def activation_bytes(s: int, b: int, h: int, a: int, L: int, t: int = 1, sequence_parallel: bool = False,
                     recompute: str = "none", *, value_bytes: int = 2, mask_bytes: int = 1) -> float:
    """Bytes the L transformer layers hold at the peak of a micro-batch's backward.

    Without recomputation or with selective recomputation: L times :func:`layer_activation_bytes`.
    With full recomputation every layer keeps its input (2 s b h L in 16-bit) and the layer being
    recomputed briefly holds its whole working set again, one layer's activations without
    recomputation: L v s b h + s b h (34 + 5 a s / h) at t = 1 in 16-bit.
    """
    widths = {"value_bytes": value_bytes, "mask_bytes": mask_bytes}
    kept = L * layer_activation_bytes(s, b, h, a, t, sequence_parallel, recompute, **widths)
    if recompute != "full":
        return kept
    return kept + layer_activation_bytes(s, b, h, a, t, sequence_parallel, "none", **widths)


def output_activation_bytes(s: int, b: int, h: int, vocab: int, t: int = 1, sequence_parallel: bool = False, *,
                            value_bytes: int = 2, mask_bytes: int = 1, mlm_transform: bool = False) -> float:
    """Bytes outside the layers that a micro-batch keeps for backward: embeddings, final LayerNorm, LM head.

    - the embedding dropout mask, m s b h bytes (Korthikanti section 4.3: s b h);
    - the final LayerNorm's input and the LM-head GEMM's input, v s b h each (section 4.3's 4sbh in 16-bit);
    - with ``mlm_transform`` (BERT's MLM head: dense, GeLU, LayerNorm before the decoder) their three
      inputs, 3 v s b h;
    these are replicated over TP ranks unless sequence parallelism splits them by t. And the logits,
    vocab-parallel (this rank's V/t columns), :func:`logits_bytes_per_element` each: s b V / t times v in
    16-bit, 2v in fp32; Korthikanti counts the 4 s b V / t of fp32 logits.
    The embedding lookups themselves keep only the token ids.
    """
    hidden_terms = mask_bytes * s * b * h + 2 * value_bytes * s * b * h
    if mlm_transform:
        hidden_terms += 3 * value_bytes * s * b * h
    if sequence_parallel:
        hidden_terms /= t
    logits = logits_bytes_per_element(value_bytes) * s * b * vocab / t
    return hidden_terms + logits


def logits_bytes_per_element(value_bytes: int) -> int:
    """Bytes per logit that a micro-batch keeps until backward: the logits in the compute dtype (zoo's forward
    returns them, and in 16-bit the fused cross-entropy recomputes its softmax from them in backward) and, for
    fp32 logits, the buffer the cross-entropy fills in forward with exp(z - m), which backward finishes in
    place as the gradient. Per-token statistics are left out, as for the norms."""
    return value_bytes if value_bytes < 4 else 2 * value_bytes


def norm_bytes_per_token(shape, value_bytes: int) -> int:
    """Bytes one norm of ``shape`` keeps per token for backward: a LayerNorm its input, v h; an RMSNorm
    (normalised in float32, :class:`zoo.models.llama.layers.LlamaRMSNorm`) its input in float32 and the
    normalised input before the weight, (4 + v) h. Per-row statistics (LayerNorm's mean and rstd, RMSNorm's
    1/rms: 4 or 8 bytes a token) are left out, as in Korthikanti et al."""
    if shape.norm == "rmsnorm":
        return (4 + value_bytes) * shape.hidden
    return value_bytes * shape.hidden


def layer_activation_bytes_of(shape, s: int, b: int, t: int = 1, sequence_parallel: bool = False,
                              recompute: str = "none", *, value_bytes: int = 2, mask_bytes: int = 1,
                              cp: int = 1) -> float:
    """Bytes one transformer layer of a family's :class:`~zoo.models.families.ModelShape` keeps for its
    backward, part by part (Korthikanti et al. 2022, section 4, for any layer); for GPT-2's and BERT's shape
    it is :func:`layer_activation_bytes`. With value width v, mask width m, n query and n_kv key/value heads
    of width d and MLP width f:

    - replicated over TP ranks (split by sequence parallelism): the two norms' kept tensors
      (:func:`norm_bytes_per_token`), the input of the q/k/v GEMMs and of the MLP's first GEMMs, v h each,
      and ``layer_dropouts`` masks, m h each, per token (the q/k/v GEMMs keep their input once, and under
      sequence parallelism only this rank's s/t tokens: :func:`zoo.parallel.layers.column_parallel_linears`);
    - split by tp: the attention core and the output projection's input. Counted as Korthikanti does
      (``fused_attention`` False): Q, K, V and the projection input, v (2 n d + 2 n_kv d), plus the scores
      (:func:`attention_scores_bytes`) without recomputation. Through SDPA's fused kernel: Q, K and V as the
      kernel reads them (K and V repeated to every query head), its output, which is the projection input,
      4 v n d, and its float32 log-sum-exp, 4 n; under selective recomputation the checkpoint holds Q, K, V
      before the repeat instead, v (n d + 2 n_kv d), plus the projection input;
    - split by tp: the MLP, 2 v f (the GeLU input and the second GEMM's input) with 2 GEMMs, 4 v f with
      SwiGLU's 3 (the gate and up outputs, SiLU(gate) and the product, the down GEMM's input).

    At context-parallel size c > 1 every term is divided by c: the rank's s/c tokens, and in the attention
    core n/(t c) heads over all s positions. The core's K and V are those the exchange hands over, n_kv'
    heads (:func:`~zoo.planning.context_exchange.exchanged_kv_heads`: n_kv, or n_kv repeated so that the c
    ranks get whole heads). Through the fused kernel the projection input is the returning all-to-all's
    output, a tensor apart from the kernel's output, so the core keeps 5 v n d + 4 n per token where c = 1
    keeps 4 v n d + 4 n; Korthikanti's count and selective recomputation keep what they keep at c = 1 with
    n_kv', divided by c.

    ``recompute="full"`` keeps only the layer's input, v s b h (divided by t with sequence parallelism, and by c).
    """
    _check_recompute(recompute)
    v, m, h = value_bytes, mask_bytes, shape.hidden
    if recompute == "full":
        return v * s * b * h / (t if sequence_parallel else 1) / cp
    replicated = (2 * norm_bytes_per_token(shape, v) + 2 * v * h + shape.layer_dropouts * m * h) * s * b
    attention = shape.heads * shape.head_dim
    key_value = exchanged_kv_heads(shape.kv_heads, t, cp) * shape.head_dim
    if shape.fused_attention and recompute == "none":
        core = 4 * v * attention + 4 * shape.heads + (v * attention if cp > 1 else 0)
    else:
        core = v * (2 * attention + 2 * key_value)
    mlp = v * shape.ffn_hidden * (2 if shape.ffn_matrices == 2 else 4)
    split = (core + mlp) * s * b
    per_layer = ((replicated / t if sequence_parallel else replicated) + split / t) / cp
    if recompute == "none" and not shape.fused_attention:
        per_layer += attention_scores_bytes(s, b, shape.heads, t * cp, value_bytes=v, mask_bytes=m)
    return per_layer


def attention_scores_bytes_of(shape, s: int, b: int, t: int = 1, *, value_bytes: int = 2,
                              mask_bytes: int = 1, cp: int = 1) -> float:
    """The part of a layer's bytes without recomputation that a fused attention kernel does not keep: the
    scores of :func:`attention_scores_bytes` where ``shape`` is counted that way (per rank n/(t c) heads over
    s x s positions), else 0."""
    if shape.fused_attention:
        return 0
    return attention_scores_bytes(s, b, shape.heads, t * cp, value_bytes=value_bytes, mask_bytes=mask_bytes)


def activation_bytes_of(shape, s: int, b: int, t: int = 1, sequence_parallel: bool = False,
                        recompute: str = "none", *, value_bytes: int = 2, mask_bytes: int = 1,
                        cp: int = 1) -> float:
    """:func:`activation_bytes` for a family's shape: its L layers at the peak of a micro-batch's backward
    (with full recomputation the layers' inputs plus one layer's whole working set)."""
    widths = {"value_bytes": value_bytes, "mask_bytes": mask_bytes, "cp": cp}
    kept = shape.layers * layer_activation_bytes_of(shape, s, b, t, sequence_parallel, recompute, **widths)
    if recompute != "full":
        return kept
    return kept + layer_activation_bytes_of(shape, s, b, t, sequence_parallel, "none", **widths)


def embedding_activation_bytes(shape, s: int, b: int, t: int = 1, sequence_parallel: bool = False, *,
                               mask_bytes: int = 1, cp: int = 1) -> float:
    """The embeddings' share of a micro-batch: their dropout mask, m s b h (split by sequence parallelism, and
    by the context-parallel size), where the family has one; the lookups keep only the token ids."""
    per_token = mask_bytes * shape.hidden if shape.embedding_dropout else 0
    return per_token * s * b / (t if sequence_parallel else 1) / cp


def head_activation_bytes(shape, s: int, b: int, vocab: int, t: int = 1, sequence_parallel: bool = False, *,
                          value_bytes: int = 2, mlm_transform: bool = False, cp: int = 1) -> float:
    """The final norm's and the LM head's share: the norm's kept tensors and the head GEMM's input, split by
    sequence parallelism, and the logits (see :func:`output_activation_bytes`), all divided by the
    context-parallel size."""
    v, h = value_bytes, shape.hidden
    per_token = norm_bytes_per_token(shape, v) + v * h + (3 * v * h if mlm_transform else 0)
    hidden_terms = per_token * s * b / (t if sequence_parallel else 1)
    return (hidden_terms + logits_bytes_per_element(v) * s * b * vocab / t) / cp


def output_activation_bytes_of(shape, s: int, b: int, vocab: int, t: int = 1, sequence_parallel: bool = False, *,
                               value_bytes: int = 2, mask_bytes: int = 1, mlm_transform: bool = False,
                               cp: int = 1) -> float:
    """:func:`output_activation_bytes` for a family's shape: the embedding dropout mask where it has one, the
    final norm's kept tensors (:func:`norm_bytes_per_token`) and the head GEMM's input, and the logits, all of
    this rank's s/c tokens at context-parallel size c (logits (b, s/c, V/t)).
    Llama's rotary cos/sin tables (2 v s d / c, shared by the layers) are left out, as the token ids are."""
    v, h = value_bytes, shape.hidden
    per_token = (mask_bytes * h if shape.embedding_dropout else 0) + norm_bytes_per_token(shape, v) + v * h
    if mlm_transform:
        per_token += 3 * v * h
    hidden_terms = per_token * s * b
    if sequence_parallel:
        hidden_terms /= t
    return (hidden_terms + logits_bytes_per_element(value_bytes) * s * b * vocab / t) / cp



__all__ = ["RECOMPUTE_MODES", "activation_bytes", "activation_bytes_of", "attention_scores_bytes",
           "attention_scores_bytes_of", "embedding_activation_bytes", "head_activation_bytes",
           "layer_activation_bytes", "layer_activation_bytes_of", "logits_bytes_per_element", "norm_bytes_per_token",
           "output_activation_bytes", "output_activation_bytes_of"]
