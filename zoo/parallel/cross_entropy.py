"""Cross-entropy fused with vocab-parallel logits (Shoeybi et al. 2019, section 3).

Rank i holds the logits Z_i of its vocabulary slice. The loss of a token with target t is

    loss = log sum_v exp(z_v - m) - (z_t - m),   m = max_v z_v

and every term is a reduction over the vocabulary, so it is computed from per-rank partials:

    m       = all-reduce-max_i ( max_{v in V_i} z_v )
    s       = all-reduce-sum_i ( sum_{v in V_i} exp(z_v - m) )
    z_t - m = all-reduce-sum_i ( z_t - m if t in V_i else 0 )

Only O(b*s) scalars cross the wire (one MAX all-reduce and one SUM all-reduce of [s, z_t - m]);
the b*s*V logits never do. Backward is local: dZ_i = (softmax(Z)_i - onehot_i(t)) * dloss.
Padded vocabulary columns (ids >= vocab_size) are excluded from the softmax, and targets equal
to ``ignore_index`` give zero loss and zero gradient. The arithmetic runs in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zoo.errors import UserError
from zoo.parallel.state import ParallelState, as_state
from zoo.parallel.utils import real_vocab_columns


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, parallel, vocab_size, ignore_index):
        tp = parallel.tp_size
        local_vocab = logits.shape[-1]
        start = parallel.tp_rank * local_vocab
        end = start + local_vocab

        real = real_vocab_columns(local_vocab, parallel.tp_rank, vocab_size)
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # (..., V/p), at least fp32 (fp64 stays)
        if real > 0:
            z_max = z[..., :real].max(dim=-1).values                     # (...) padded columns excluded
        else:                                                            # this shard is all padding
            z_max = torch.full(z.shape[:-1], float("-inf"), dtype=z.dtype, device=z.device)
        if tp > 1:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=parallel.tp_group)
        z = z - z_max.unsqueeze(-1)                                      # new tensor, logits untouched
        if real < local_vocab:
            z[..., real:] = float("-inf")                                # exp(-inf) = 0: out of the softmax

        valid = target != ignore_index
        in_shard = valid & (target >= start) & (target < end)
        local_target = (target - start).clamp(0, local_vocab - 1)
        target_logit = torch.where(in_shard, z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)

        exp_z = z.exp_()                                                 # (..., V/p), in place
        sum_exp = exp_z.sum(dim=-1)
        if tp > 1:
            stats = torch.stack([sum_exp, target_logit])                 # one all-reduce for both
            dist.all_reduce(stats, group=parallel.tp_group)
            sum_exp, target_logit = stats[0], stats[1]

        loss = (torch.log(sum_exp) - target_logit).masked_fill(~valid, 0.0)
        softmax = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, in_shard, local_target, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, in_shard, local_target, valid = ctx.saved_tensors
        grad = softmax                                                   # reuse the buffer
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -in_shard.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss.to(grad.dtype) * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 parallel: ParallelState | None = None, vocab_size: int | None = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy (shape of ``target``) from this rank's vocab shard of the logits.

    ``logits``: (..., V_padded / p), the local shard; ``target``: (...) global vocabulary ids or
    ``ignore_index``; ``vocab_size``: the unpadded vocabulary, columns at or beyond it are excluded.
    Ignored tokens get loss 0; average with ``loss.sum() / (target != ignore_index).sum()``.
    """
    if logits.shape[:-1] != target.shape:
        raise UserError(f"logits of shape {tuple(logits.shape)} do not match targets of shape "
                         f"{tuple(target.shape)}; pass logits (..., vocab_shard) and targets (...).")
    return _VocabParallelCrossEntropy.apply(logits, target, as_state(parallel), vocab_size, ignore_index)
