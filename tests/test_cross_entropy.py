"""vocab_parallel_cross_entropy against F.cross_entropy(reduction='none') on the gathered logits.

Tolerance: per-token losses and logits grads agree to max|zoo - ref| / max|ref| <= 1e-5 in fp32; fp16
and bf16 inputs are compared with the fp32 reference of the same (rounded) logits at 1e-3 and 1e-2
(the grad is rounded to the input dtype once: at most the unit roundoff, 4.9e-4 for fp16 and 3.9e-3 for
bf16, of max|ref|, plus fp32 noise, so these bounds hold on any CPU). The fused loss computes in fp32
whatever the input dtype, so there is no float64 comparison; the fp32 errors sit ~70x below 1e-5 (the
softmax grad and the per-token losses are O(1) and not sums that cancel). Ignored tokens and padded
vocabulary columns must be exactly zero. tp = 1 runs in the pytest process; tp = 2 and 4 run in one world-4 spawn, which also
counts the collectives of one call at tp = 2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.checks import assert_named_checks, record_collectives, rel_err
from tests.spawn import spawn

REL_TOL = 1e-5
HALF_TOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
WORLD = 4
LOCAL = 16                 # logits columns per rank at tp 4; the full width is 64 at every tp
WIDTH = 64
N = 10                     # tokens, as (2, 5)
PADDED_VOCAB = 40          # < WIDTH: at tp 4 rank 2 holds 8 real + 8 padded columns, rank 3 only padding


def _case(name: str):
    """(logits (2, 5, WIDTH), targets (2, 5), vocab_size, upstream grad (2, 5)) of a named case."""
    gen = torch.Generator().manual_seed(CASES.index(name))  # same data in every process
    logits = torch.randn(2, 5, WIDTH, generator=gen) * 3
    vocab = None
    high = WIDTH
    if name == "padded":
        vocab, high = PADDED_VOCAB, PADDED_VOCAB
        logits[..., PADDED_VOCAB:] = 1e4            # garbage in padded columns must not count
    if name == "large":
        logits = logits + 1000.0                      # exp would overflow without the max shift
        logits[0, 0, 7] = 1030.0
    targets = torch.randint(0, high, (2, 5), generator=gen)
    # Targets on every rank's range at tp 4 (and a padded-vocab boundary id).
    targets[0, :4] = torch.tensor([0, LOCAL, 2 * LOCAL + 3, min(3 * LOCAL + 5, high - 1)])
    targets[1, 2] = -100
    targets[1, 4] = -100
    upstream = torch.rand(2, 5, generator=gen) + 0.5  # non-uniform: the grad must scale per token
    return logits, targets, vocab, upstream


CASES = ["plain", "padded", "large"]


def _reference(logits, targets, vocab, upstream):
    full = logits.detach().float().clone().requires_grad_()
    used = full if vocab is None else full[..., :vocab]
    loss = F.cross_entropy(used.reshape(-1, used.shape[-1]), targets.reshape(-1), reduction="none",
                           ignore_index=-100).view(targets.shape)
    (loss * upstream).sum().backward()
    return loss.detach(), full.grad


def _ce_checks(ps) -> dict:
    """All value checks at this rank's tp degree (``ps`` None: tp = 1 in this process)."""
    from zoo.parallel import vocab_parallel_cross_entropy

    tp = 1 if ps is None else ps.tp_size
    r = 0 if ps is None else ps.tp_rank
    width = WIDTH // tp
    cols = slice(r * width, (r + 1) * width)
    out = {}
    for name in CASES:
        logits, targets, vocab, upstream = _case(name)
        ref_loss, ref_grad = _reference(logits, targets, vocab, upstream)
        local = logits[..., cols].clone().requires_grad_()
        before = local.detach().clone()
        loss = vocab_parallel_cross_entropy(local, targets, ps, vocab_size=vocab)
        out[f"{name} loss"] = rel_err(loss, ref_loss)
        out[f"{name} loss dtype fp32"] = loss.dtype == torch.float32
        out[f"{name} logits untouched"] = torch.equal(local.detach(), before)
        out[f"{name} loss finite"] = bool(torch.isfinite(loss).all())
        (loss * upstream).sum().backward()
        out[f"{name} grad"] = rel_err(local.grad, ref_grad[..., cols])
        out[f"{name} ignored tokens: zero loss"] = bool((loss[targets == -100] == 0).all())
        out[f"{name} ignored tokens: zero grad"] = bool((local.grad[targets == -100] == 0).all())
        if vocab is not None:
            pad_cols = [c for c in range(r * width, (r + 1) * width) if c >= vocab]
            out[f"{name} padded columns: zero grad"] = bool(
                (local.grad[..., [c - r * width for c in pad_cols]] == 0).all()) if pad_cols else True

    # Half-precision input: grads come back in the input dtype; values match fp32 on the rounded logits.
    for dtype in (torch.float16, torch.bfloat16):
        logits, targets, vocab, upstream = _case("plain")
        rounded = logits.to(dtype)
        ref_loss, ref_grad = _reference(rounded, targets, vocab, upstream)
        local = rounded[..., cols].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(local, targets, ps)
        (loss * upstream).sum().backward()
        tag = str(dtype).replace("torch.", "")
        out[f"{tag} grad dtype"] = local.grad.dtype == dtype
        out[f"{tag} loss err"] = rel_err(loss, ref_loss)
        out[f"{tag} grad err"] = rel_err(local.grad, ref_grad[..., cols])
    return out


def _collectives_at_tp2(ps) -> list:
    """Every all_reduce / all_gather of one forward + backward at tp 2, as (kind, numel, op)."""
    from zoo.parallel import vocab_parallel_cross_entropy

    logits, targets, vocab, upstream = _case("padded")
    width = WIDTH // 2
    local = logits[..., ps.tp_rank * width:(ps.tp_rank + 1) * width].clone().requires_grad_()
    with record_collectives() as calls:
        loss = vocab_parallel_cross_entropy(local, targets, ps, vocab_size=vocab)
        calls.append(("backward", 0, ""))
        (loss * upstream).sum().backward()
    return calls


def _ce_worker(rank, world_size):
    from zoo.parallel import ParallelState

    results = {}
    for tp in (2, 4):
        ps = ParallelState.initialize(tp)
        results[tp] = _ce_checks(ps)
        if tp == 2:
            results["calls"] = _collectives_at_tp2(ps)
    return results


@pytest.fixture(scope="module")
def ce_results():
    by_tp = {1: [_ce_checks(None)]}
    per_rank = spawn(_ce_worker, WORLD)
    for tp in (2, 4):
        by_tp[tp] = [results[tp] for results in per_rank]
    by_tp["calls"] = [results["calls"] for results in per_rank]
    return by_tp


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_cross_entropy_matches_torch(ce_results, tp, case):
    assert_named_checks(ce_results, tp, case, REL_TOL)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_input(ce_results, tp, dtype):
    assert_named_checks(ce_results, tp, str(dtype).replace("torch.", ""), HALF_TOL[dtype])


def test_collectives_at_tp2(ce_results):
    n = N
    for rank, calls in enumerate(ce_results["calls"]):
        forward = calls[:calls.index(("backward", 0, ""))]
        backward = calls[calls.index(("backward", 0, "")) + 1:]
        assert not [c for c in calls if c[0] == "all_gather"], f"rank {rank}: logits were gathered: {calls}"
        assert sorted(forward) == sorted([("all_reduce", n, "MAX"), ("all_reduce", 2 * n, "SUM")]), (
            f"rank {rank}: expected one MAX all-reduce of {n} and one SUM all-reduce of {2 * n}, got {forward}")
        assert backward == [], f"rank {rank}: the backward is local, but it issued {backward}"


def test_no_collective_without_tp(monkeypatch):
    import torch.distributed as dist

    from zoo.parallel import vocab_parallel_cross_entropy

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective was issued at tp = 1")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    monkeypatch.setattr(dist, "all_gather", no_collective)
    logits, targets, vocab, upstream = _case("plain")
    logits.requires_grad_()
    (vocab_parallel_cross_entropy(logits, targets) * upstream).sum().backward()


def test_all_tokens_ignored_gives_zero_loss_and_grad():
    from zoo.parallel import vocab_parallel_cross_entropy

    logits = torch.randn(3, WIDTH, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.full((3,), -100))
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros(3))
    assert torch.equal(logits.grad, torch.zeros(3, WIDTH))


def test_shape_mismatch_is_refused():
    from zoo.parallel import vocab_parallel_cross_entropy

    with pytest.raises(ValueError, match=r"logits of shape \(2, 5, 64\) do not match targets of shape \(2, 4\)"):
        vocab_parallel_cross_entropy(torch.zeros(2, 5, WIDTH), torch.zeros(2, 4, dtype=torch.long))
