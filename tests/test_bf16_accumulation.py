"""bf16 configs sum their micro-batches' gradients in fp32.

DeepSpeed accumulates in the model's dtype unless ``data_types.grad_accum_dtype`` says otherwise: summing
tens of micro-batches in bf16 (8 bits of mantissa) loses the small ones. Every bf16 config with
accumulation asks for fp32, and DeepSpeed 0.19 builds its fp32-accumulating BF16_Optimizer from that
config's precision and ZeRO blocks, for a pipeline engine and a plain one (bf16 with fp32 accumulation
needs ZeRO stage 1 there: without ZeRO it raises "unsupported mix")."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.spawn import spawn
from zoo.planning.planner import state_bytes

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
