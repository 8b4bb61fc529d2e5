"""The fp16 loss scale is applied exactly once (zoo.training.loss_scaling).

DeepSpeed 0.19's ``engine.backward`` leaves the loss unscaled at ZeRO stage 0 while FP16_Optimizer /
FP16_UnfusedOptimizer still divide the gradients by S, so every fp16 ``tp*.json`` run would update S times
too little and never clip (a gpt2-medium run on a GPU logs grad norms of 3e-4). These tests
run DeepSpeed's real fp16 optimizer on CPU by overriding its capability check (DESIGN.md, "fp16 on this
CPU") and compare one step with fp32's; without zoo's scaling the fp16 grad norm would be the fp32 one
divided by S and the update a fraction of fp32's. Each fp16 test runs with oneDNN on and off: on CPUs with
native fp16 (avx512_fp16/AMX) oneDNN's fp16 kernels round differently, so every machine exercises both.
"""

from __future__ import annotations

import pytest
import torch

from tests.spawn import spawn

NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
GRAD_NORM_RTOL = 1e-2     # fp16 vs fp32 gradients of the same step: fp16 rounding (seen: <= 2e-3)
MIN_COSINE = 0.99         # each fp16 update's direction vs fp32's (seen: 0.9999; 0.9998 on a Xeon); the bug: 0.94, 0.26
# |fp16 update| / |fp32 update| - 1. Adam normalises each element, so fp16 rounding moves the size only where it
# takes a gradient near Adam's epsilon (seen: <= 4e-4 without native fp16); it is bounded by the updates'
# relative difference, 2e-2 with oneDNN's native fp16 kernels (cosine 0.9998). The bug: 0.63x at S = 2^8, 0.18x at 2^16.
SIZE_RTOL = 1e-2
# DeepSpeed's fp16 optimizers take one Adam step on zero gradients when they build their state, so their first
# real update is Adam's second (~0.74 of an Adam first step): the fp32 reference takes the same step first.


def take_adams_startup_step(optimizer) -> None:
    """The step on zero gradients DeepSpeed's fp16 optimizers take when they build Adam's state."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    for param in params:
        param.grad = None


def _one_step_worker(rank, world_size, runs, onednn):
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from zoo.models import GPT2LMHeadModel, gpt2_config
    from zoo.models.families import param_groups
    from zoo.parallel import ParallelState, model_parallel_seed
    from zoo.training.grad_norm import deepspeed_reports_true_norm, unscaled_grad_norm
    from zoo.training.loss_scaling import backward

    torch.backends.mkldnn.enabled = onednn
    get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed()
    ps = ParallelState.initialize(world_size)
    out = {}
    for name, (power, micro, global_batch) in runs.items():
        model_parallel_seed(5, ps)
        model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", **NO_DROPOUT), parallel=ps)
        before = [p.detach().double().clone() for p in model.parameters()]
        config = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0,
                  "steps_per_print": 10 ** 9,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}}}
        if power is not None:
            config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": power}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model, 0.0), config=config,
                                               mpu=ps)
        if power is None:
            take_adams_startup_step(engine.optimizer)
        ids = torch.randint(0, 50257, (global_batch, 16), generator=torch.Generator().manual_seed(0))
        for start in range(0, global_batch, micro):
            micro_ids = ids[start:start + micro]
            backward(engine, engine(input_ids=micro_ids, labels=micro_ids).loss)
            if start + micro == global_batch:
                out[f"{name} norm"] = unscaled_grad_norm(engine, ps).item()
            engine.step()
        out[f"{name} deepspeed's norm is true"] = deepspeed_reports_true_norm(engine)
        update = [p.detach().double() - b for p, b in zip(engine.module.parameters(), before)]
        out[f"{name} update"] = torch.cat([u.flatten() for u in update])
    return out


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a @ b / (a.norm() * b.norm())).item()


def assert_close_to_fp32(out: dict, name: str) -> None:
    """The fp16 run ``name``'s norm, update direction and update size are the fp32 run's."""
    true, update, reference = out["fp32 norm"], out[f"{name} update"], out["fp32 update"]
    assert abs(out[f"{name} norm"] - true) <= GRAD_NORM_RTOL * true, (name, out[f"{name} norm"], true)
    cosine, size = _cosine(update, reference), (update.norm() / reference.norm()).item()
    assert cosine >= MIN_COSINE and abs(size - 1.0) <= SIZE_RTOL, (name, cosine, size)


ONEDNN = pytest.mark.parametrize("onednn", [False, True], ids=["onednn-off", "onednn-on"])


@ONEDNN
def test_each_fp16_scale_steps_as_fp32_at_tp2(onednn):
    """At S = 2^16 and 2^8 alike, the fp16 step's norm and update are fp32's (clipping at 1.0 active)."""
    runs = {"fp32": (None, 2, 2), "fp16 S=2^16": (16, 2, 2), "fp16 S=2^8": (8, 2, 2)}
    for out in spawn(_one_step_worker, 2, runs, onednn):
        assert out["fp32 norm"] > 1.0, out   # the clip at 1.0 fires: it is part of what is compared
        for name in ("fp16 S=2^16", "fp16 S=2^8"):
            assert_close_to_fp32(out, name)
            # torch_adam: FP16_UnfusedOptimizer, whose own norm still carries S (DeepSpeed#8588): zoo logs its own
            assert not out[f"{name} deepspeed's norm is true"]


@ONEDNN
def test_the_scale_is_applied_once_with_gradient_accumulation(onednn):
    runs = {"fp32": (None, 1, 2), "fp16": (16, 1, 2)}
    (out,) = spawn(_one_step_worker, 1, runs, onednn)
    assert_close_to_fp32(out, "fp16")


class _Optimizer:
    cur_scale = 1024.0


class _Engine:
    """What backward() reads of a DeepSpeed fp16 engine at ZeRO stage 0; ``scales`` says whether its
    backward multiplies by the loss scale (a DeepSpeed with #8393 fixed) or not (0.19)."""

    def __init__(self, scales: bool, accumulation: int = 2):
        self.scales, self.accumulation = scales, accumulation
        self.optimizer, self.global_rank = _Optimizer(), 0

    def fp16_enabled(self):
        return True

    def zero_optimization(self):
        return False

    def gradient_accumulation_steps(self):
        return self.accumulation

    def backward(self, loss):
        root = loss / self.accumulation
        (root * self.optimizer.cur_scale if self.scales else root).backward()
        return root


@pytest.mark.parametrize("deepspeed_scales", [False, True])
def test_gradients_carry_the_scale_exactly_once(deepspeed_scales, capsys):
    from zoo.training.loss_scaling import backward

    weight = torch.tensor([3.0], requires_grad=True)
    backward(_Engine(scales=deepspeed_scales), (weight * 2.0).sum())
    assert weight.grad.item() == 2.0 / 2 * 1024.0
    note = capsys.readouterr().err
    assert ("does not apply the fp16 loss scale" in note) == (not deepspeed_scales)


def test_bf16_fp32_and_zero_engines_are_left_alone():
    from zoo.training.loss_scaling import scale_deepspeed_leaves_out

    zero = _Engine(scales=True)
    zero.zero_optimization = lambda: True
    bf16 = _Engine(scales=False)
    bf16.fp16_enabled = lambda: False
    assert scale_deepspeed_leaves_out(zero) is None and scale_deepspeed_leaves_out(bf16) is None
    assert scale_deepspeed_leaves_out(_Engine(scales=False)) == 1024.0


@pytest.mark.parametrize("head", ["BertForSequenceClassification", "BertForMultipleChoice", "BertForQuestionAnswering",
                                  "BertForPreTraining"])
def test_fp16_models_return_an_fp32_loss_that_carries_the_scale(head):
    """An fp16 loss cannot carry S = 65,536 back (fp16 overflows at 65,504): the heads' losses were fp16,
    so every fp16 finetuning run skipped its first steps and each attempt to grow the scale."""
    import zoo.models
    from zoo.models import bert_config

    config = bert_config("bert-tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cls = getattr(zoo.models, head, None) or getattr(__import__("zoo.models.bert.heads", fromlist=[head]), head)
    if head == "BertForSequenceClassification":
        config = cls.configure_head(config, 3, None)
    torch.manual_seed(0)
    model = cls(config).half()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"BertForSequenceClassification": dict(input_ids=ids, labels=torch.tensor([0, 2])),
             "BertForMultipleChoice": dict(input_ids=ids.view(1, 2, 16), labels=torch.tensor([1])),
             "BertForQuestionAnswering": dict(input_ids=ids, start_positions=torch.tensor([1, 3]),
                                              end_positions=torch.tensor([2, 5])),
             "BertForPreTraining": dict(input_ids=ids, labels=ids, next_sentence_label=torch.tensor([0, 1]))}[head]
    loss = model(**batch).loss
    assert loss.dtype == torch.float32
    (loss * 65536.0).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
