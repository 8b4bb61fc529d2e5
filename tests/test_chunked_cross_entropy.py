"""The vocab-parallel cross-entropy works in chunks of tokens: it equals the plain loss, and no more than one
chunk of the logits ever exists in fp32.

Equality: per-token losses and the logits' gradient (with a non-uniform upstream gradient) against
F.cross_entropy in fp64 on the gathered full logits, for fp32 logits cut into chunks of 1 and 5 tokens (5
does not divide the 26 tokens) and one chunk: max|zoo - ref| / max|ref| <= 1e-6. The losses and gradients are
O(1) sums of 40-64 terms, so fp32 rounding sits near 1e-7. Cases: padded vocabulary columns holding
garbage, ignored targets, targets on every rank's range; a sliced sequence whose leading dimensions do not
merge; logits near 1000 (exp overflows without the shift). fp64 logits stay fp64 and agree to 1e-12.

Memory: bf16 and fp16 logits of 26 tokens x 512 columns per rank, chunks of 5 tokens, forward + backward, and
fp32 logits without a gradient (evaluation). The peak bytes of the fp32 tensors that the loss creates and
holds at once must be <= one chunk in fp32 (5 x 512 x 4 B) plus 64 B per token for the per-token statistics;
the bytes saved for backward, the logits themselves aside (they are saved by reference), must be <= 32 B per
token. The whole logits in fp32 are 53 KB a rank here. (fp32 logits with a gradient get one logits-sized
buffer, the gradient itself, made in forward: the equality checks cover that path.)

tp = 1 runs in the pytest process; tp = 2 and 4 run in one world-4 spawn.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.checks import assert_named_checks, rel_err
from tests.helpers.tensor_bytes import LiveTensorBytes, saved_tensor_bytes
from tests.spawn import spawn

WORLD = 4
TOKENS = (2, 13)           # 26 tokens: chunks of 5 leave a remainder
N = TOKENS[0] * TOKENS[1]
WIDTH = 64                 # full logits width (padded vocabulary) at every tp
PADDED_VOCAB = 40          # at tp 4 rank 2 holds 8 real + 8 padded columns, rank 3 only padding
CHUNKS = (1, 5, None)      # None: the default, one chunk at this size
REL_TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
MEM_LOCAL = 512            # columns per rank in the memory check
MEM_VOCAB = 4 * MEM_LOCAL - 37   # the last rank holds 37 padded columns
MEM_CHUNK = 5
STATS_BYTES_PER_TOKEN = 64       # per-token fp32 statistics alive at once (max, sums, loss, ...), generous
SAVED_BYTES_PER_TOKEN = 32       # what backward keeps besides the logits: 2 fp32 statistics, an index, 2 masks


def _case(name: str, width: int = WIDTH, vocab: int | None = PADDED_VOCAB):
    """(logits (2, 13, width) fp64, targets (2, 13), vocab_size, upstream grad (2, 13)) of a named case."""
    gen = torch.Generator().manual_seed(len(name) * 7919 + width)    # same data in every process
    base = TOKENS[1] + 3 if name == "sliced" else TOKENS[1]
    logits = torch.randn(TOKENS[0], base, width, generator=gen, dtype=torch.float64) * 3
    if name == "sliced":
        logits = logits[:, 3:]                     # (2, 13, width): leading dimensions that do not merge
    if name == "large":
        logits = logits + 1000.0
    high = vocab or width
    if vocab is not None:
        logits[..., vocab:] = 1e4                  # garbage in padded columns must not count
    targets = torch.randint(0, high, TOKENS, generator=gen)
    quarter = width // 4                           # a target on every rank's range at tp 4
    targets[0, :4] = torch.tensor([0, quarter, 2 * quarter + 3, min(3 * quarter + 5, high - 1)])
    targets[1, 2] = targets[1, 7] = targets[0, 12] = -100
    upstream = torch.rand(TOKENS, generator=gen, dtype=torch.float64) + 0.5
    return logits, targets, vocab, upstream


def _reference(logits, targets, vocab, upstream):
    """fp64 per-token loss and logits' gradient of the full logits."""
    full = logits.detach().double().clone().requires_grad_()
    used = full if vocab is None else full[..., :vocab]
    loss = F.cross_entropy(used.reshape(-1, used.shape[-1]), targets.reshape(-1), reduction="none")
    loss = loss.view(targets.shape)
    (loss * upstream).sum().backward()
    return loss.detach(), full.grad


def _shard(logits, ps):
    tp = 1 if ps is None else ps.tp_size
    r = 0 if ps is None else ps.tp_rank
    width = logits.shape[-1] // tp
    return logits[..., r * width:(r + 1) * width], slice(r * width, (r + 1) * width)


def _equality_checks(ps) -> dict:
    from zoo.parallel import vocab_parallel_cross_entropy

    out = {}
    runs = [(case, torch.float32, chunk) for case in ("padded", "sliced", "large") for chunk in CHUNKS]
    runs.append(("padded", torch.float64, 5))
    for case, dtype, chunk in runs:
        logits, targets, vocab, upstream = _case(case)
        logits = logits.to(dtype)                  # the reference sees the same (rounded) values
        ref_loss, ref_grad = _reference(logits, targets, vocab, upstream)
        piece, cols = _shard(logits, ps)
        local = piece.detach().requires_grad_()    # keeps the slice's strides
        loss = vocab_parallel_cross_entropy(local, targets, ps, vocab_size=vocab, chunk_tokens=chunk)
        (loss * upstream.to(loss.dtype)).sum().backward()
        tag = f"{str(dtype)[6:]} {case} chunk={chunk}"
        out[f"{tag} loss"] = rel_err(loss, ref_loss)
        out[f"{tag} grad"] = rel_err(local.grad, ref_grad[..., cols])
        out[f"{tag} dtypes kept"] = loss.dtype == dtype and local.grad.dtype == dtype
        out[f"{tag} ignored and padded: exactly zero"] = bool(
            (loss[targets == -100] == 0).all() and (local.grad[targets == -100] == 0).all()
            and (local.grad[..., [c - cols.start for c in range(cols.start, cols.stop) if c >= vocab]] == 0).all())
    return out


def _memory_checks(ps) -> dict:
    from zoo.parallel import vocab_parallel_cross_entropy

    tp = 1 if ps is None else ps.tp_size
    logits, targets, vocab, upstream = _case("padded", width=MEM_LOCAL * tp, vocab=MEM_VOCAB - MEM_LOCAL * (4 - tp))
    out = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        piece, _ = _shard(logits.to(dtype), ps)
        train = dtype != torch.float32              # fp32 logits: evaluation, no gradient
        local = piece.contiguous().requires_grad_(train)
        chunk_bytes = MEM_CHUNK * local.shape[-1] * 4
        with LiveTensorBytes({torch.float32}) as live, saved_tensor_bytes(local) as saved, torch.set_grad_enabled(train):
            loss = vocab_parallel_cross_entropy(local, targets, ps, vocab_size=vocab, chunk_tokens=MEM_CHUNK)
            if train:
                (loss * upstream.float()).sum().backward()
        tag = "memory " + (str(dtype)[6:] if train else "float32 eval")
        out[f"{tag} peak fp32 bytes"] = (live.peak, chunk_bytes + STATS_BYTES_PER_TOKEN * N)
        out[f"{tag} saved bytes"] = (sum(b for _, b in saved), SAVED_BYTES_PER_TOKEN * N)
        out[f"{tag} whole fp32 logits"] = local.numel() * 4
    return out


def _worker(rank, world_size):
    from zoo.parallel import ParallelState

    results = {}
    for tp in (2, 4):
        ps = ParallelState.initialize(tp)
        results[tp] = {**_equality_checks(ps), **_memory_checks(ps)}
    return results


@pytest.fixture(scope="module")
def results():
    by_tp = {1: [{**_equality_checks(None), **_memory_checks(None)}]}
    per_rank = spawn(_worker, WORLD)
    for tp in (2, 4):
        by_tp[tp] = [r[tp] for r in per_rank]
    return by_tp


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_chunked_loss_equals_the_fp64_reference(results, tp, dtype):
    assert_named_checks(results, tp, str(dtype)[6:], REL_TOL[dtype])


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32 eval"])
def test_at_most_one_chunk_of_fp32_logits(results, tp, dtype):
    for rank, checks in enumerate(results[tp]):
        peak, peak_bound = checks[f"memory {dtype} peak fp32 bytes"]
        saved, saved_bound = checks[f"memory {dtype} saved bytes"]
        whole = checks[f"memory {dtype} whole fp32 logits"]
        assert peak <= peak_bound < whole, (f"rank {rank}: {peak:,} B of fp32 tensors alive at once, more than one "
                                            f"chunk and the statistics ({peak_bound:,} B); the whole logits: {whole:,} B")
        assert saved <= saved_bound, f"rank {rank}: {saved:,} B saved for backward besides the logits (> {saved_bound:,})"


def test_default_chunk_fits_the_byte_budget():
    from zoo.parallel.cross_entropy import CHUNK_BYTES, CPU_CHUNK_BYTES, default_chunk_tokens

    fp32, bf16, fp64 = torch.float32, torch.bfloat16, torch.float64
    for device, budget in (("cuda", CHUNK_BYTES), ("cpu", CPU_CHUNK_BYTES)):
        for width in (50304, 12576, 6400):
            assert 1 <= default_chunk_tokens(width, fp32, device) and default_chunk_tokens(width, fp32, device) * width * 4 <= budget
        assert default_chunk_tokens(50304, fp64, device) == budget // (50304 * 8)
        assert default_chunk_tokens(50304, bf16, device) == default_chunk_tokens(50304, fp32, device)  # computed in fp32
        assert default_chunk_tokens(budget, fp32, device) == 1          # wider than the budget: one token at a time
