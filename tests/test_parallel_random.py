"""Model-parallel RNG: ``model_parallel_seed`` and ``tp_rng_fork`` (Shoeybi et al. 2019, "dropout").

Dropout masks outside the fork come from the default generator and are the same on every TP rank;
inside the fork they come from DeepSpeed's tracker, seeded with seed + 2718 + tp_rank, so they differ
across the ranks of a TP group and agree between ranks of different TP groups with the same tp_rank.
One world-4 spawn at tp 2 covers both. DeepSpeed's tracker is process-global, so the "fork before
seeding" check runs first thing in that fresh process.

Activation checkpointing (DeepSpeed's, which saves and restores both RNG streams) must reproduce the
dropout masks when it recomputes a layer: a GPT-2 at tp 2 with dropout 0.1 gives the same loss and
grads with and without it, to max|a - b| / max|b| <= 1e-6 (fp32); it runs in the same world-4 spawn.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.spawn import spawn

SEED = 123
REL_TOL = 1e-6


def _mask() -> tuple[bool, ...]:
    """A dropout mask drawn from the current default generator, as plain Python values: tensors returned
    through spawn's queue are shared by file descriptor and can vanish with the exiting child."""
    return tuple((F.dropout(torch.ones(512), p=0.5, training=True) != 0).tolist())


def _rng_worker(rank, world_size):
    from zoo.parallel import ParallelState, model_parallel_seed, tp_rng_fork

    ps = ParallelState.initialize(2)
    out = {"tp_rank": ps.tp_rank}

    # 1. Fresh process, nothing seeded yet: at tp 2 the fork must refuse, at tp 1 it is a no-op.
    try:
        tp_rng_fork(ps)
        out["unseeded_error"] = None
    except ValueError as err:
        out["unseeded_error"] = str(err)
    try:
        for single in (None, ParallelState.single()):
            with tp_rng_fork(single):
                _mask()
        out["unseeded_tp1_ok"] = True
    except Exception as err:  # noqa: BLE001 - reported to the parent
        out["unseeded_tp1_ok"] = repr(err)

    # 2. Seeded: outside, inside, outside again.
    model_parallel_seed(SEED, ps)
    out["outside_1"] = _mask()
    with tp_rng_fork(ps):
        out["inside_1"] = _mask()
    out["outside_2"] = _mask()
    with tp_rng_fork(ps):
        out["inside_2"] = _mask()

    # 3. Reseeding reproduces both streams; the fork leaves the default stream where it was.
    model_parallel_seed(SEED, ps)
    out["outside_1_again"] = _mask()
    out["outside_2_no_fork"] = _mask()
    model_parallel_seed(SEED, ps)
    with tp_rng_fork(ps):
        out["inside_1_again"] = _mask()

    # 4. The TP stream is seed + 2718 + tp_rank.
    torch.manual_seed(SEED + 2718 + ps.tp_rank)
    out["inside_expected"] = _mask()

    # 5. Activation checkpointing at tp 2 (same spawn, to pay the 4-process start-up once).
    out["checkpointing"] = _checkpoint_checks(ps)
    return out


@pytest.fixture(scope="module")
def rng_results():
    return spawn(_rng_worker, 4)           # tp 2: TP groups {0, 1} and {2, 3}


def test_fork_before_seeding_is_refused_at_tp2(rng_results):
    for rank, out in enumerate(rng_results):
        assert out["unseeded_error"] is not None, f"rank {rank}: tp_rng_fork at tp 2 without a seed did not raise"
        assert "model_parallel_seed" in out["unseeded_error"], out["unseeded_error"]
        assert out["unseeded_tp1_ok"] is True, f"rank {rank}: tp_rng_fork at tp 1 without a seed: {out['unseeded_tp1_ok']}"


def test_masks_outside_the_fork_are_identical_on_all_ranks(rng_results):
    for key in ("outside_1", "outside_2"):
        for rank, out in enumerate(rng_results):
            assert out[key] == rng_results[0][key], f"{key}: rank {rank} drew a different mask than rank 0"
    assert rng_results[0]["outside_1"] != rng_results[0]["outside_2"], "the default stream did not advance"


def test_masks_inside_the_fork_differ_across_tp_ranks(rng_results):
    for key in ("inside_1", "inside_2"):
        assert rng_results[0][key] != rng_results[1][key], f"{key}: ranks 0 and 1 (one TP group) drew the same mask"
        assert rng_results[2][key] != rng_results[3][key], f"{key}: ranks 2 and 3 (one TP group) drew the same mask"
        # Same tp_rank in different TP groups (different dp_rank): same TP-stream mask.
        assert rng_results[0][key] == rng_results[2][key], f"{key}: ranks 0 and 2 (tp_rank 0) differ"
        assert rng_results[1][key] == rng_results[3][key], f"{key}: ranks 1 and 3 (tp_rank 1) differ"
    for rank, out in enumerate(rng_results):
        assert out["inside_1"] != out["outside_1"], f"rank {rank}: the fork drew from the default stream"
        assert out["inside_1"] != out["inside_2"], f"rank {rank}: the TP stream did not advance"


def test_tp_stream_seed_is_seed_plus_2718_plus_tp_rank(rng_results):
    for rank, out in enumerate(rng_results):
        assert out["inside_1"] == out["inside_expected"], (
            f"rank {rank}: the TP stream is not torch.manual_seed({SEED} + 2718 + {out['tp_rank']})")


def test_reseeding_reproduces_masks_and_fork_restores_default_stream(rng_results):
    for rank, out in enumerate(rng_results):
        assert out["outside_1_again"] == out["outside_1"], f"rank {rank}: default stream not reproduced"
        assert out["inside_1_again"] == out["inside_1"], f"rank {rank}: TP stream not reproduced"
        assert out["outside_2_no_fork"] == out["outside_2"], (
            f"rank {rank}: drawing inside the fork moved the default stream")


# ---------------------------------------------------------------- activation checkpointing
def _checkpoint_checks(ps) -> dict:
    import deepspeed

    from zoo.models import GPT2Config, GPT2LMHeadModel
    from zoo.parallel import model_parallel_seed

    config = GPT2Config(vocab_size=1000, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config, parallel=ps).train()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 1000, (2, 16), generator=gen)

    layer_calls = []
    for layer in model.transformer.h:
        layer.register_forward_hook(lambda *args: layer_calls.append(1))
    checkpoint_calls = []
    real_checkpoint = deepspeed.checkpointing.checkpoint

    def counting_checkpoint(*args, **kwargs):
        checkpoint_calls.append(1)
        return real_checkpoint(*args, **kwargs)

    deepspeed.checkpointing.checkpoint = counting_checkpoint

    def step(checkpointing: bool, seed: int):
        model.config.activation_checkpointing = checkpointing
        model.zero_grad(set_to_none=True)
        layer_calls.clear()
        checkpoint_calls.clear()
        model_parallel_seed(seed, ps)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return loss.detach(), grads, len(layer_calls), len(checkpoint_calls)

    try:
        loss_plain, grads_plain, calls_plain, ckpt_plain = step(False, seed=99)
        loss_ckpt, grads_ckpt, calls_ckpt, ckpt_ckpt = step(True, seed=99)
        loss_other_seed = step(False, seed=100)[0]
    finally:
        deepspeed.checkpointing.checkpoint = real_checkpoint
    model.eval()
    with torch.no_grad():
        loss_eval = model(ids, labels=ids).loss
    grad_errors = {n: ((grads_ckpt[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item()
                   for n, g in grads_plain.items()}
    return {
        "loss_plain": loss_plain.item(), "loss_ckpt": loss_ckpt.item(), "loss_other_seed": loss_other_seed.item(),
        "loss_eval": loss_eval.item(), "grad_errors": grad_errors,
        "layer_calls": (calls_plain, calls_ckpt), "checkpoint_calls": (ckpt_plain, ckpt_ckpt),
    }


def test_activation_checkpointing_reproduces_dropout_at_tp2(rng_results):
    results = [out["checkpointing"] for out in rng_results]
    for rank, res in enumerate(results):
        # The checkpointed run really went through DeepSpeed's checkpoint and recomputed each layer.
        assert res["checkpoint_calls"] == (0, 2), f"rank {rank}: checkpoint() calls {res['checkpoint_calls']}"
        assert res["layer_calls"] == (2, 4), f"rank {rank}: layer forwards (plain, checkpointed) {res['layer_calls']}"
        # Dropout is on: another seed and eval mode give other losses.
        assert res["loss_other_seed"] != res["loss_plain"], f"rank {rank}: dropout had no effect"
        assert res["loss_eval"] != res["loss_plain"], f"rank {rank}: dropout had no effect"
        err = abs(res["loss_ckpt"] - res["loss_plain"]) / abs(res["loss_plain"])
        assert err <= REL_TOL, f"rank {rank}: loss {res['loss_ckpt']} with checkpointing vs {res['loss_plain']}"
        worst = max(res["grad_errors"], key=res["grad_errors"].get)
        assert res["grad_errors"][worst] <= REL_TOL, (
            f"rank {rank}: grad of {worst} differs by {res['grad_errors'][worst]:.3e} with checkpointing")
    # Replicated dropout draws the same masks on every rank, so all see the same loss.
    assert len({r["loss_plain"] for r in results}) == 1, [r["loss_plain"] for r in results]
