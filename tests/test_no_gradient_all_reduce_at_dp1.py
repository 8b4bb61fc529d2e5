"""No gradient all-reduce when the data-parallel group is one rank; dp = 2 still averages (zoo.training.lean_step).

DeepSpeed's engine all-reduces the gradients at every accumulation boundary, also over a data-parallel group of
one rank (a flatten, an all-reduce and a copy of every gradient: 4.2 ms of a gpt2-1.2b iteration on an H200). The
test counts the elements every all-reduce, reduce-scatter and all-gather of an iteration carries (at
``torch.distributed``, where DeepSpeed's communication ends), through zoo's ``setup_engine``, in fp32 (torch's
AdamW) and bf16 (DeepSpeed's BF16_Optimizer, whose fp32 gradient accumulation runs beside that all-reduce):
at dp = 1 only scalars (the clipping norm), at dp = 2 at least every gradient. The updates are checked too: fp32
against a single process's AdamW step on the whole batch (1e-5 relative), bf16 at dp = 2 against dp = 1.
"""

from __future__ import annotations

import gc

import torch

from tests.spawn import spawn

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
GLOBAL_BATCH, SEQ, VOCAB, LR, CLIP = 4, 16, 512, 1e-3, 1.0
# Adam's epsilon at the gradients' scale: the first step is then about g / (|g| + eps), not g / |g|, whose sign
# flips with the last bit of a gradient near zero (Adam's 1e-8 made six of 495k elements differ by 1e-6 absolute).
EPS = 1e-3
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter")
FP32_RTOL = 1e-5     # the fp32 update against one process's: summation order only
BF16_RTOL = 1e-5     # bf16 at dp = 2 against dp = 1: the same bf16 gradients, summed in fp32 in another order


class CountedElements:
    """Within the block, the elements each ``torch.distributed`` collective of :data:`COLLECTIVES` carries."""

    def __init__(self):
        self.elements = 0
        self.originals = {}

    def __enter__(self):
        import torch.distributed as dist

        for name in COLLECTIVES:
            original = self.originals[name] = getattr(dist, name)

            def counted(*args, _original=original, **kwargs):
                tensors = [a for a in list(args) + list(kwargs.values()) if torch.is_tensor(a)]
                self.elements += max((t.numel() for t in tensors), default=0)
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, original in self.originals.items():
            setattr(dist, name, original)


def masters(engine) -> torch.Tensor:
    """The fp32 weights the optimizer updates (the master copy in bf16), flattened in the module's order."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = [safe_get_full_fp32_param(p) if engine.bfloat16_enabled() else None for p in engine.module.parameters()]
    full = [p if master is None else master for p, master in zip(engine.module.parameters(), full)]
    return torch.cat([w.detach().double().flatten() for w in full])


def reference_update(model, ids) -> torch.Tensor:
    """One AdamW step of ``model`` (a single process) on the whole batch (DeepSpeed's clipping rule), flattened."""
    from zoo.models.families import param_groups

    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=LR, eps=EPS)
    before = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    model(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    return torch.cat([p.detach().double().flatten() for p in model.parameters()]) - before


def _one_iteration(rank, world_size):
    import deepspeed

    from zoo.models import GPT2LMHeadModel, gpt2_config
    from zoo.parallel import ParallelState, model_parallel_seed
    from zoo.training.loss_scaling import backward
    from zoo.training.startup import setup_engine

    deepspeed.init_distributed()
    gc.freeze()   # DeepSpeed's BF16_Optimizer runs gc.collect() nine times as it starts: over a frozen heap it is quick
    parallel = ParallelState.initialize(1)   # tp = 1: every rank is a data-parallel replica
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    per_rank = GLOBAL_BATCH // world_size
    def build():   # the same weights each time (the seed's TP-invariant init)
        model_parallel_seed(0, parallel)
        return GPT2LMHeadModel(gpt2_config("gpt2-tiny", vocab_size=VOCAB, **NO_DROPOUT), parallel=parallel)

    out = {"reference": reference_update(build(), ids)}
    for precision in ("fp32", "bf16"):
        model = build()
        config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": CLIP,
                  "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "torch_adam": True}}}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        engine = setup_engine(model, config, parallel, weight_decay=0.01, refresh_masters=False)
        before = masters(engine)
        with CountedElements() as counted:
            for row in range(rank * per_rank, (rank + 1) * per_rank):
                micro = ids[row:row + 1]
                backward(engine, engine(input_ids=micro, labels=micro).loss)
                engine.step()
        out[precision] = {"elements": counted.elements, "update": masters(engine) - before,
                          "optimizer": type(engine.optimizer).__name__, "steps": engine.global_steps}
    out["parameters"] = sum(p.numel() for p in model.parameters())
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_dp1_all_reduces_no_gradient_and_dp2_averages_them():
    (alone,) = spawn(_one_iteration, 1)
    pair = spawn(_one_iteration, 2)
    parameters = alone["parameters"]
    for precision, optimizer in (("fp32", "AdamW"), ("bf16", "BF16_Optimizer")):
        assert alone[precision]["optimizer"] == optimizer and alone[precision]["steps"] == 1, alone[precision]
        assert alone[precision]["elements"] <= 8, (precision, alone[precision]["elements"])   # the norm's scalars
        for out in pair:
            assert out[precision]["steps"] == 1 and out[precision]["elements"] >= parameters, (precision, out)
    for out in [alone, *pair]:
        assert _relative(out["fp32"]["update"], out["reference"]) <= FP32_RTOL
    for out in pair:
        assert _relative(out["bf16"]["update"], alone["bf16"]["update"]) <= BF16_RTOL
