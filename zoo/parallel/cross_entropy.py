"""Cross-entropy fused with vocab-parallel logits (Shoeybi et al. 2019, section 3).

Rank i holds the logits Z_i of its vocabulary slice. The loss of a token with target t is

    loss = log sum_v exp(z_v - M) - (z_t - M),   M = max_v z_v

and every term is a reduction over the vocabulary, so it is computed from per-rank partials, each rank
reading its logits once (m_i, s_i in one pass):

    m_i     = max_{v in V_i} z_v,   s_i = sum_{v in V_i} exp(z_v - m_i)
    M       = all-reduce-max_i ( m_i )
    s       = all-reduce-sum_i ( s_i exp(m_i - M) )
    z_t - M = all-reduce-sum_i ( z_t - M if t in V_i else 0 )

Only O(b*s) scalars cross the wire: per call, one MAX all-reduce of the n values m_i and one SUM
all-reduce of the 2n values [s, z_t - M], whatever the number of chunks; the b*s*V logits never do, and
backward communicates nothing: dZ_i = (exp(Z_i - M) / s - onehot_i(t)) * dloss.

Memory. The tokens go in chunks of ``chunk_tokens`` (default: as many as fit ``CHUNK_BYTES`` of this
shard's logits in fp32, ``CPU_CHUNK_BYTES`` on a CPU), and no fp32 tensor larger than one chunk is made
beyond these:
- bf16/fp16 logits: none. Backward keeps the logits themselves (the caller's tensor, no copy) and per
  token M and s (fp32), the target column and two masks (18 B a token); it recomputes exp(z - M) chunk
  by chunk and writes the gradient, rounded once, into a tensor of the logits' dtype. At gpt2-1.2b
  (8 x 1024 tokens x 50,304 columns) that is at most 64 MiB of fp32 at once, where the whole fp32
  softmax is 1.6 GB.
- fp32/fp64 logits with a gradient wanted: forward writes exp(z - m_i) into the buffer backward then
  scales in place and returns as the gradient (one exp per element instead of two). That buffer is the
  gradient backward would allocate anyway, so the step's peak does not grow; it is the only tensor of
  the logits' size that the loss makes, and backward keeps it, exp(m_i - M) / s (fp32), the target column
  and two masks (14 B a token), not the logits.
Without a gradient (evaluation) only the chunk buffer is made, whatever the dtype.

Padded vocabulary columns (ids >= vocab_size) are excluded from the softmax and get zero gradient; a
target that is a padded column gets an infinite loss. Targets equal to ``ignore_index`` give zero loss
and zero gradient. The arithmetic runs in fp32, or fp64 for fp64 logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zoo.errors import UserError
from zoo.parallel.state import ParallelState, as_state
from zoo.parallel.utils import real_vocab_columns

# The fp32 bytes of one chunk. On an accelerator, large enough that each chunk's few elementwise kernels are
# long next to their launch; on a CPU, small enough that a chunk stays in cache across its passes (measured
# on a 2-core EPYC, bf16 logits of 2,048 tokens: 2 MiB chunks ~30 % faster than 64 MiB ones).
CHUNK_BYTES = 64 * 2**20
CPU_CHUNK_BYTES = 2 * 2**20


def default_chunk_tokens(local_vocab: int, dtype: torch.dtype, device: torch.device | str) -> int:
    """How many tokens of a ``local_vocab``-wide logits shard fit the chunk budget of ``device`` (CPU:
    ``CPU_CHUNK_BYTES``, any accelerator: ``CHUNK_BYTES``) in the compute dtype (fp32, fp64 for fp64
    logits); at least one."""
    budget = CPU_CHUNK_BYTES if torch.device(device).type == "cpu" else CHUNK_BYTES
    itemsize = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    return max(1, budget // (max(local_vocab, 1) * itemsize))


def _token_rows(x: torch.Tensor) -> list[torch.Tensor]:
    """2-D views (tokens, V/p) of ``x`` (..., V/p) that cover its tokens in row-major order, without copying:
    one view when the leading dimensions merge, else one per index of the first dimension (a sliced
    sequence, as in ``logits[:, first:]``)."""
    if x.dim() == 1:
        return [x.unsqueeze(0)]
    try:
        return [x.view(-1, x.shape[-1])]
    except RuntimeError:
        return [rows for sub in x.unbind(0) for rows in _token_rows(sub)]


def _chunks(rows: list[torch.Tensor], chunk_tokens: int):
    """(first token, 2-D view of at most ``chunk_tokens`` tokens) over ``rows``, in token order."""
    first = 0
    for view in rows:
        for a in range(0, view.shape[0], chunk_tokens):
            block = view[a:a + chunk_tokens]
            yield first + a, block
        first += view.shape[0]


def _exp_shifted(block: torch.Tensor, out: torch.Tensor, m: torch.Tensor, find_max: bool) -> torch.Tensor:
    """``out`` (k, V) = exp(block - m[:, None]) in ``out``'s dtype, the block upcast exactly before the shift;
    with ``find_max``, ``m`` (k,) is first filled with the block's row maxima. No other tensor of the
    block's size is made: a mixed-dtype op would upcast its input into a hidden temporary on some devices,
    so the cast is a copy into ``out``."""
    if block.dtype == out.dtype:
        if find_max:
            torch.amax(block, dim=-1, out=m)
        torch.sub(block, m.unsqueeze(-1), out=out)
    else:
        out.copy_(block)
        if find_max:
            torch.amax(out, dim=-1, out=m)
        out.sub_(m.unsqueeze(-1))
    return out.exp_()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, parallel, vocab_size, ignore_index, chunk_tokens, grad_in_forward):
        tp = parallel.tp_size
        local_vocab = logits.shape[-1]
        start = parallel.tp_rank * local_vocab
        real = real_vocab_columns(local_vocab, parallel.tp_rank, vocab_size)
        compute = torch.promote_types(logits.dtype, torch.float32)     # fp32, fp64 stays fp64
        device = logits.device
        rows = _token_rows(logits)                                       # [(n_j, V/p)], views
        n = target.numel()

        t = target.reshape(-1)                                           # (n,)
        valid = t != ignore_index
        in_shard = valid & (t >= start) & (t < start + local_vocab)
        in_real = in_shard & (t < start + real)                          # a target that is a real column here
        local_target = torch.where(in_real, t - start, 0)                # (n,)
        z_t = torch.empty(n, dtype=compute, device=device)               # (n,) the target's logit, where owned
        first = 0
        for view in rows:
            k = view.shape[0]
            z_t[first:first + k] = view.gather(-1, local_target[first:first + k].unsqueeze(-1)).squeeze(-1)
            first += k

        # One pass over the chunks: the local row max m_i, then s_i = sum exp(z - m_i), into the
        # gradient-to-be (logits already in the compute dtype, gradient wanted) or one reused chunk buffer.
        m = torch.full((n,), float("-inf"), dtype=compute, device=device)  # (n,) max of this shard's real columns
        s = torch.zeros(n, dtype=compute, device=device)                 # (n,) sum of exp(z - m) over them
        exp_z = torch.empty(n, local_vocab, dtype=compute, device=device) if grad_in_forward else None  # (n, V/p)
        if real > 0:
            work = None if grad_in_forward else torch.empty(min(chunk_tokens, n), real, dtype=compute, device=device)
            for a, block in _chunks(rows, chunk_tokens):
                k = block.shape[0]
                out = exp_z[a:a + k, :real] if grad_in_forward else work[:k]   # (k, real)
                e = _exp_shifted(block[:, :real], out, m[a:a + k], find_max=True)
                torch.sum(e, dim=-1, out=s[a:a + k])
        if grad_in_forward and real < local_vocab:
            exp_z[:, real:] = 0                                          # padded columns: out of the softmax

        # Global max M, then s_i * exp(m_i - M) summed over the ranks (1 at tp = 1: m_i is M).
        local_max = m
        if tp > 1:
            m = local_max.clone()
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=parallel.tp_group)
            s = s * torch.exp(local_max - m)                             # 0 on a shard that is all padding
        target_logit = torch.where(in_real, z_t - m, 0.0)                # z_t - M, 0 off this shard
        target_logit = target_logit.masked_fill(in_shard & ~in_real, float("-inf"))
        if tp > 1:
            stats = torch.stack([s, target_logit])                       # (2, n): one all-reduce for both
            dist.all_reduce(stats, group=parallel.tp_group)
            s, target_logit = stats[0], stats[1]

        loss = (torch.log(s) - target_logit).masked_fill(~valid, 0.0)    # (n,)
        # exp_z holds exp(z - m_i); softmax = exp_z * exp(m_i - M) / s.
        # Backward needs, per token, exp(m_i - M) / s where it finishes exp_z, else M and s to recompute from
        # the logits (kept by reference, not copied).
        if grad_in_forward:
            ctx.save_for_backward(None, exp_z, torch.exp(local_max - m) / s, None, None, local_target, in_real, valid)
        else:
            ctx.save_for_backward(logits, None, None, m, s, local_target, in_real, valid)
        ctx.real, ctx.chunk_tokens, ctx.shape, ctx.compute = real, chunk_tokens, logits.shape, compute
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, exp_z, rescale, m, s, local_target, in_real, valid = ctx.saved_tensors
        real, chunk_tokens, compute = ctx.real, ctx.chunk_tokens, ctx.compute
        n = valid.numel()
        g = grad_loss.reshape(-1).to(compute).masked_fill(~valid, 0.0)  # (n,) dloss, 0 where ignored
        minus_g = torch.where(in_real, -g, 0.0).unsqueeze(-1)            # (n, 1): the one-hot's term
        target_column = local_target.unsqueeze(-1)                       # (n, 1)

        if exp_z is not None:                                            # computed in forward: finish in place
            grad = exp_z.mul_((rescale * g).unsqueeze(-1)).scatter_add_(-1, target_column, minus_g)
            return grad.view(ctx.shape), None, None, None, None, None, None

        scale = (g / s).unsqueeze(-1)                                    # (n, 1): softmax = exp(z - M) / s
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat = grad.view(-1, logits.shape[-1])                           # (n, V/p)
        if real < logits.shape[-1]:
            flat[:, real:] = 0                                           # padded columns: out of the softmax
        if real > 0:
            work = torch.empty(min(chunk_tokens, n), real, dtype=compute, device=logits.device)
            for a, block in _chunks(_token_rows(logits), chunk_tokens):
                k = block.shape[0]
                p = _exp_shifted(block[:, :real], work[:k], m[a:a + k], find_max=False)   # (k, real)
                p.mul_(scale[a:a + k]).scatter_add_(-1, target_column[a:a + k], minus_g[a:a + k])
                flat[a:a + k, :real].copy_(p)                            # rounded once, to the logits' dtype
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 parallel: ParallelState | None = None, vocab_size: int | None = None,
                                 ignore_index: int = -100, *, chunk_tokens: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy (shape of ``target``) from this rank's vocab shard of the logits.

    ``logits``: (..., V_padded / p), the local shard; ``target``: (...) global vocabulary ids or
    ``ignore_index``; ``vocab_size``: the unpadded vocabulary, columns at or beyond it are excluded.
    Ignored tokens get loss 0; average with ``loss.sum() / (target != ignore_index).sum()``.
    ``chunk_tokens``: tokens per chunk, the most whose logits exist in fp32 at once (default: those that
    fit ``CHUNK_BYTES``, ``CPU_CHUNK_BYTES`` on a CPU); the result does not depend on it beyond fp32 rounding.
    """
    if logits.shape[:-1] != target.shape:
        raise UserError(f"logits of shape {tuple(logits.shape)} do not match targets of shape "
                         f"{tuple(target.shape)}; pass logits (..., vocab_shard) and targets (...).")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(logits.shape[-1], logits.dtype, logits.device)
    elif chunk_tokens < 1:
        raise UserError(f"chunk_tokens {chunk_tokens} is invalid; pass a positive number of tokens or None.")
    # Logits already in the compute dtype (fp32, fp64) get their gradient's exp(z - m) in forward, in the
    # buffer backward returns: one exp per element instead of two, and no more memory at the step's peak
    # (that buffer is the gradient backward would allocate). Lower precision recomputes in backward, so
    # the gradient is rounded once and no fp32 tensor of the logits' size ever exists.
    grad_in_forward = (logits.requires_grad and torch.is_grad_enabled()
                       and logits.dtype == torch.promote_types(logits.dtype, torch.float32))
    return _VocabParallelCrossEntropy.apply(logits, target, as_state(parallel), vocab_size, ignore_index,
                                            chunk_tokens, grad_in_forward)
