"""bf16 runs sum their micro-batches' gradients in fp32.

DeepSpeed accumulates in the model's dtype unless ``data_types.grad_accum_dtype`` says otherwise: summing
tens of micro-batches in bf16 (8 bits of mantissa) loses the small ones. Every bf16 config with
accumulation asks for fp32, and DeepSpeed 0.19 builds its fp32-accumulating BF16_Optimizer from that
config's precision and ZeRO blocks, for a pipeline engine and a plain one (bf16 with fp32 accumulation
needs ZeRO stage 1 there: without ZeRO it raises "unsupported mix"). A bf16 run of a config that asks for
neither (``--bf16`` on ds_configs/tp*.json) is resolved so by zoo
(:func:`zoo.config.deepspeed_overrides.accumulate_bf16_in_fp32`): the settings block states it, the planner
counts it, and 64 micro-batches are summed through zoo's engine as exactly as an fp32 sum."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.spawn import spawn
from zoo.planning.model_states import state_bytes

CONFIGS = Path(__file__).resolve().parent.parent / "ds_configs"


def bf16_configs() -> dict[str, dict]:
    configs = {path.name: json.loads(path.read_text()) for path in sorted(CONFIGS.glob("*.json"))}
    return {name: config for name, config in configs.items() if config.get("bf16", {}).get("enabled")}


def accumulates(config: dict) -> bool:
    """More than one micro-batch per rank and step at some data-parallel degree."""
    return config.get("gradient_accumulation_steps", 1) > 1 or (
        config["train_batch_size"] > config["train_micro_batch_size_per_gpu"])


def test_every_bf16_config_with_accumulation_accumulates_in_fp32():
    configs = {name: config for name, config in bf16_configs().items() if accumulates(config)}
    assert "gpt2_20b_tp8_pp4.json" in configs
    assert {name: config.get("data_types") for name, config in configs.items()
            if config.get("data_types", {}).get("grad_accum_dtype") != "fp32"} == {}
    assert {name: config.get("zero_optimization", {}).get("stage") for name, config in configs.items()
            if config.get("zero_optimization", {}).get("stage") != 1} == {}


def _run_config(*flags: str, data_types: dict | None = None, tmp_path: Path | None = None):
    """The RunConfig of ds_configs/tp1.json (an fp16 config at ZeRO stage 0) under ``flags``, its file given
    ``data_types`` where set."""
    from zoo.cli.pretrain import build_parser
    from zoo.config.loading import load_run_config

    path = CONFIGS / "tp1.json"
    if data_types is not None:
        path = tmp_path / "tp1.json"
        path.write_text(json.dumps({**json.loads((CONFIGS / "tp1.json").read_text()), "data_types": data_types}))
    return load_run_config(build_parser().parse_args(["--deepspeed_config", str(path), *flags]))


def test_bf16_on_an_fp16_config_accumulates_in_fp32_as_the_settings_and_the_plan_say(tmp_path):
    """``--bf16`` on ds_configs/tp1.json resolves to fp32 accumulation and reduction at ZeRO stage 1
    (BF16_Optimizer), which the effective-settings block states and the planner counts (its whole fp32 gradient
    buffer: 6 bytes a parameter of gradients); an explicit bf16 accumulation is kept, with a warning."""
    from zoo.planning.planner import plan
    from zoo.training.effective_settings import effective_settings, format_effective_settings

    config = _run_config("--bf16")
    ds = config.ds_config
    assert (ds.get("data_types"), ds.get("zero_optimization"), ds.get("communication_data_type")) == (
        {"grad_accum_dtype": "fp32"}, {"stage": 1}, "fp32")
    from zoo.config.deepspeed_overrides import bf16_accumulation_warning

    assert bf16_accumulation_warning(ds) is None
    settings = effective_settings(config, 8, 8)
    assert (settings["precision"]["grad_accum_dtype"], settings["precision"]["grad_reduce_dtype"]) == ("fp32", "fp32")
    assert "bf16 (gradients accumulated in fp32, all-reduced in fp32), ZeRO stage 1" in format_effective_settings(
        settings)
    planned = plan(config, 8, gpu="A100", with_deepspeed_estimate=False)
    assert planned.zero_stage == 1
    assert (planned.weights, planned.gradients, planned.optimizer) == state_bytes(
        planned.params_per_rank, "bf16", 1, 8, fp32_grad_accumulation=True)
    assert planned.gradients == 6 * planned.params_per_rank
    # fp16 keeps its own accumulation (and stage); an explicit bf16 accumulation is the user's choice, named
    fp16 = _run_config().ds_config
    assert "data_types" not in fp16 and "zero_optimization" not in fp16 and "communication_data_type" not in fp16
    kept = _run_config("--bf16", data_types={"grad_accum_dtype": "bf16"}, tmp_path=tmp_path).ds_config
    assert kept["data_types"] == {"grad_accum_dtype": "bf16"} and "zero_optimization" not in kept
    assert "summed in bf16" in bf16_accumulation_warning(kept)


def _engines_of_the_config(rank, world_size, blocks):
    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed()   # adopts the harness's group
    torch.manual_seed(0)
    config = {**blocks, "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0}
    found = {}
    for kind in ("pipeline", "plain"):
        layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
        model = (PipelineModule(layers, num_stages=1, loss_fn=lambda out, y: (out.float() - y).pow(2).mean())
                 if kind == "pipeline" else torch.nn.Sequential(*layers))
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                          config=config)
        data = [(torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(1, 8)) for _ in range(4)]
        if kind == "pipeline":
            engine.train_batch(iter(data))
        else:
            for x, y in data:
                engine.backward((engine(x).float() - y).pow(2).mean())
                engine.step()
        found[kind] = (type(engine.optimizer).__name__, str(engine.optimizer.grad_acc_dtype), engine.global_steps)
    found["held"] = bf16_optimizer_bytes(engine.optimizer)
    found["parameters"] = sum(p.numel() for p in model.parameters())
    return found


def bf16_optimizer_bytes(optimizer) -> dict[str, int]:
    """What DeepSpeed's BF16_Optimizer holds after a step: its fp32 gradient buffer (whole, every parameter),
    and its fp32 master partition with Adam's moments over it."""
    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    moments = [value for state in optimizer.optimizer.state.values() for value in state.values()
               if torch.is_tensor(value) and value.numel() > 1]
    return {"fp32_gradients": nbytes(optimizer.fp32_groups_gradients_flat),
            "masters_and_moments": nbytes(optimizer.fp32_groups_flat_partition) + nbytes(moments)}


def test_deepspeed_builds_fp32_accumulation_from_the_20b_config():
    config = json.loads((CONFIGS / "gpt2_20b_tp8_pp4.json").read_text())
    blocks = {key: config[key] for key in ("bf16", "data_types", "zero_optimization") if key in config}
    found = spawn(_engines_of_the_config, 2, blocks)[0]   # dp = 2: what is partitioned and what is whole
    held, parameters = found.pop("held"), found.pop("parameters")
    assert found == {"pipeline": ("BF16_Optimizer", "torch.float32", 1),
                     "plain": ("BF16_Optimizer", "torch.float32", 2)}   # 4 micro-batches, 2 per step at dp = 2
    # The planner counts what that optimizer holds at dp = 2: the module's bf16 gradients plus the whole fp32
    # buffer, and half the fp32 masters and moments; DeepSpeed pads its flat buffers by at most 2 elements.
    _, gradients, optimizer = state_bytes(parameters, "bf16", 1, 2, fp32_grad_accumulation=True)
    assert abs(held["fp32_gradients"] - (gradients - 2 * parameters)) <= 2 * 4
    assert abs(held["masters_and_moments"] - optimizer) <= 2 * 12


# ------------------------------------------------------------------ 64 micro-batches, summed through zoo's engine

MICRO_BATCHES, SEQ, VOCAB = 64, 32, 512
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
# Adam's epsilon at the gradients' scale: the first step is about g / (|g| + eps), not g / |g|, whose sign flips
# with the last bit of a gradient near zero, which would hide the sum's accuracy behind it.
ADAM = {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.0, "torch_adam": True}}


def summed_gradients(engine) -> torch.Tensor:
    """The gradient the step will read, summed over the iteration's micro-batches, in the module's parameter order:
    BF16_Optimizer's fp32 accumulation buffer, else the module's own gradients (what the other optimizers sum
    into)."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "fp32_groups_gradients"):
        held = {id(p): g for params, grads in zip(optimizer.bf16_groups, optimizer.fp32_groups_gradients)
                for p, g in zip(params, grads)}
        return torch.cat([held[id(p)].double().flatten() for p in engine.module.parameters()])
    return torch.cat([p.grad.double().flatten() for p in engine.module.parameters()])


def fp32_weights(engine) -> torch.Tensor:
    """The weights the optimizer updates in fp32 (the bf16 run's master copy), flattened in the module's order."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = [safe_get_full_fp32_param(p) if engine.bfloat16_enabled() else None for p in engine.module.parameters()]
    return torch.cat([(p if m is None else m).detach().double().flatten()
                      for p, m in zip(engine.module.parameters(), full)])


def _sixty_four_micro_batches(rank, world_size):
    import gc

    import deepspeed

    from zoo.models import GPT2LMHeadModel, gpt2_config
    from zoo.parallel import ParallelState, model_parallel_seed
    from zoo.training.loss_scaling import backward
    from zoo.training.startup import setup_engine

    deepspeed.init_distributed()
    gc.freeze()   # DeepSpeed's BF16_Optimizer runs gc.collect() nine times as it starts: over a frozen heap it is quick
    parallel = ParallelState.initialize(1)
    ids = torch.randint(0, VOCAB, (MICRO_BATCHES, SEQ), generator=torch.Generator().manual_seed(0))

    def build():   # the same weights each time (the seed's TP-invariant init)
        model_parallel_seed(0, parallel)
        return GPT2LMHeadModel(gpt2_config("gpt2-tiny", vocab_size=VOCAB, **NO_DROPOUT), parallel=parallel)

    # Each micro-batch's bf16 gradient of loss / 64 (what DeepSpeed's backward takes), summed three ways.
    model = build().bfloat16()
    sums = {"fp64": None, "fp32": None, "bf16": None}
    for row in range(MICRO_BATCHES):
        model.zero_grad(set_to_none=True)
        (model(input_ids=ids[row:row + 1], labels=ids[row:row + 1]).loss / MICRO_BATCHES).backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        for dtype, key in ((torch.float64, "fp64"), (torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            sums[key] = grad.to(dtype) if sums[key] is None else sums[key] + grad.to(dtype)

    out = {}
    for precision in ("fp32", "bf16"):
        config = {"train_batch_size": MICRO_BATCHES, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
                  "steps_per_print": 10 ** 9, "optimizer": ADAM}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}    # as --bf16 on ds_configs/tp1.json: no grad_accum_dtype, stage 0
        engine = setup_engine(build(), config, parallel, weight_decay=0.0, refresh_masters=False)
        before = fp32_weights(engine)
        for row in range(MICRO_BATCHES):
            backward(engine, engine(input_ids=ids[row:row + 1], labels=ids[row:row + 1]).loss)
            if row == MICRO_BATCHES - 1:
                out[f"{precision} summed"] = summed_gradients(engine)
            engine.step()
        out[f"{precision} update"] = fp32_weights(engine) - before
        out[f"{precision} optimizer"] = type(engine.optimizer).__name__
    reference = sums["fp64"]
    out.update({f"{key} sum error": ((sums[key].double() - reference).norm() / reference.norm()).item()
                for key in ("fp32", "bf16")})
    out["engine sum error"] = ((out["bf16 summed"] - reference).norm() / reference.norm()).item()
    return out


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a @ b / (a.norm() * b.norm())).item()


# The summed gradient against the fp64 sum of the same 64 bf16 micro-batch gradients, relative (L2): an fp32 sum
# (seen: 5.2e-9) and a bf16 sum, DeepSpeed's default for bf16 (seen: 9.6e-3).
FP32_SUM_RTOL = 1e-6
BF16_SUM_ERROR_AT_LEAST = 1e-3
MIN_COSINE = 0.999   # the bf16 update's direction against fp32 training's (seen: 0.99997)


def test_a_bf16_run_sums_64_micro_batches_in_fp32():
    """A bf16 run configured as ``--bf16`` on a ds_configs/tp*.json (stage 0, no grad_accum_dtype), through zoo's
    setup_engine: DeepSpeed's fp32-accumulating BF16_Optimizer sums the 64 micro-batches' bf16 gradients as
    exactly as an fp32 sum, where a bf16 sum is off by about 1 %; its first step points where fp32 training's does."""
    (out,) = spawn(_sixty_four_micro_batches, 1)
    assert out["bf16 sum error"] >= BF16_SUM_ERROR_AT_LEAST, out["bf16 sum error"]   # what fp32 accumulation avoids
    assert out["fp32 sum error"] <= FP32_SUM_RTOL, out["fp32 sum error"]
    cosine = _cosine(out["bf16 update"], out["fp32 update"])
    assert out["engine sum error"] <= FP32_SUM_RTOL, (out["engine sum error"], out["bf16 sum error"], cosine)
    assert out["bf16 optimizer"] == "BF16_Optimizer", out["bf16 optimizer"]
    assert cosine >= MIN_COSINE, cosine
