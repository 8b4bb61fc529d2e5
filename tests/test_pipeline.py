"""GPT-2 pipeline stages (DeepSpeed's PipelineModule and PipelineEngine over zoo's tensor-parallel layers)
against the one-process GPT2LMHeadModel of the same seed.

* The init of a P-stage model at any tp equals the one-stage model's, parameter by parameter, exactly
  (each stage replays the draws of the layers before it).
* One step of DeepSpeed's pipeline engine (1F1B over m = 4 micro-batches) leaves gradients equal to the
  reference's mean micro-batch gradients, in float64, <= 1e-9 relative per parameter: tp1 x pp2 (2 ranks),
  tp2 x pp2 and tp1 x pp4 (4 ranks), tp2 x pp2 with sequence parallelism, tp1 x pp2 with full and tp2 x pp2
  with selective recomputation;
  data parallelism is covered in fp32 through the launcher
  (tests/test_pipeline_training.py). The tied word embedding's gradient
  (first stage's lookup + last stage's head, all-reduced between them by DeepSpeed) is checked on both copies.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.checks import rel_err
from tests.spawn import spawn

SEED = 1234
MICRO = 2          # micro-batch size
M = 4              # micro-batches per step
SEQ = 16
GRAD_RTOL = 1e-9   # float64: only summation order differs


def tiny_config(**extra):
    from zoo.models import gpt2_config

    return gpt2_config("gpt2-tiny", n_layer=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **extra)


def batches(dp_size: int):
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 50257, (dp_size * M, MICRO, SEQ), generator=generator)
    return ids   # (dp * m, b, s): rank d takes micro-batches d*m ... d*m + m - 1


def reference(dtype=torch.float64):
    """The one-process model of SEED (master weights), and its mean micro-batch gradients over dp x m batches."""
    from zoo.models import GPT2LMHeadModel
    from zoo.parallel import model_parallel_seed

    model_parallel_seed(SEED, None)
    model = GPT2LMHeadModel(tiny_config())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return model.to(dtype), params


def reference_grads(dp_size: int) -> dict[str, torch.Tensor]:
    model, _ = reference()
    ids = batches(dp_size)
    for micro in ids:
        (model(micro, labels=micro).loss / len(ids)).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _stage(rank, world_size, tp, pp, dtype, step, method="uniform", extra=None):
    os.environ["LOCAL_RANK"] = str(rank)   # PipelineModule reads it (the launcher sets it)
    import deepspeed

    from zoo.models.families import param_groups
    from zoo.models.gpt2.pipeline import gpt2_pipeline_module, hf_names
    from zoo.parallel import ParallelState, model_parallel_seed
    from zoo.parallel.partition import partition_specs
    from zoo.training.pipeline import pipeline_ds_dict

    deepspeed.init_distributed(dist_backend="gloo")   # DeepSpeed's comm wraps the harness's process group
    ps = ParallelState.initialize(tp, pp_size=pp)
    model_parallel_seed(SEED, ps)
    config = tiny_config(**(extra or {}))
    if config.activation_checkpointing or config.recompute_granularity:
        deepspeed.checkpointing.configure(ps, num_checkpoints=config.n_layer)
    module = gpt2_pipeline_module(config, ps, SEED, partition_method=method)
    names = hf_names(module)
    specs = partition_specs(module)
    result = {"tp_rank": ps.tp_rank, "pp_rank": ps.pp_rank, "dp_rank": ps.dp_rank, "parts": list(module.parts),
              "init": {names[n]: (p.detach().clone(), specs[n]) for n, p in module.named_parameters()}}
    if not step:
        return result
    module.to(dtype)
    ds = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": M,
          "train_batch_size": MICRO * M * ps.dp_size, "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    ds, _ = pipeline_ds_dict(ds, config.sequence_parallel)   # under SP: no partitioning of stage activations
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=param_groups(module, 0.01), config=ds)
    grads = {}

    def capture(optimizer, args, kwargs):
        for name, p in module.named_parameters():
            grads[name] = p.grad.detach().clone()

    engine.optimizer.register_step_pre_hook(capture)
    # dp = 1: nothing to average over replicas, and DeepSpeed's bucketed all-reduce refuses float64 tensors
    # (the tied embedding's all-reduce between the first and last stage is a plain one and still runs).
    engine.pipeline_enable_backward_allreduce = False
    ids = batches(ps.dp_size)[ps.dp_rank * M:(ps.dp_rank + 1) * M]
    loss = engine.train_batch(iter([(micro, micro) for micro in ids]))
    result["loss"] = float(loss)
    result["grads"] = {n: (names[n], g, specs[n]) for n, g in grads.items()}
    return result


def merged(results, key):
    """Every GPT2LMHeadModel name -> the tensor merged over tp from the first dp replica, per stage copy."""
    by_name: dict[str, dict[int, dict[int, torch.Tensor]]] = {}
    spec_of = {}
    for r in results:
        if r["dp_rank"] != 0:
            continue
        entries = r[key]
        for pipe_name, entry in entries.items():
            name, tensor, spec = entry if key == "grads" else (pipe_name, *entry)
            by_name.setdefault(name, {}).setdefault(r["pp_rank"], {})[r["tp_rank"]] = tensor
            spec_of[name] = spec
    out = {}
    for name, stages in by_name.items():
        out[name] = [spec_of[name].merge([shards[t] for t in sorted(shards)]) for _, shards in sorted(stages.items())]
    return out


def unpad(name, tensor, like):
    return tensor[:like.shape[0]] if tensor.shape[0] != like.shape[0] and name.endswith("wte.weight") else tensor


def _grid(rank, world_size, tp, pp):
    import torch.distributed as dist

    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(tp, pp_size=pp)
    groups = [dist.get_process_group_ranks(g) for g in (ps.tp_group, ps.dp_group, ps.pp_group)]
    return (ps.tp_rank, ps.dp_rank, ps.pp_rank), groups


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 2)])
def test_grid_follows_the_documented_rank_formula(tp, pp):
    """tp_rank = r mod t, dp_rank = (r div t) mod d, pp_rank = r div (t d), groups = the ranks varying on one axis."""
    world = 4
    dp = world // (tp * pp)
    for rank, (coords, (tp_ranks, dp_ranks, pp_ranks)) in enumerate(spawn(_grid, world, tp, pp)):
        assert coords == (rank % tp, (rank // tp) % dp, rank // (tp * dp)), rank
        first = rank - rank % tp
        assert tp_ranks == list(range(first, first + tp))
        assert dp_ranks == [r for r in range(world) if r % tp == rank % tp and r // (tp * dp) == coords[2]]
        assert pp_ranks == [r for r in range(world) if r % (tp * dp) == rank % (tp * dp)]


@pytest.mark.parametrize("tp,pp,method", [(1, 2, "parameters"), (2, 2, "uniform")])
def test_stage_init_equals_one_stage_model(tp, pp, method):
    """Also: the planner's stage bounds are the ones DeepSpeed's PipelineModule computed."""
    from zoo.models import GPT2LMHeadModel
    from zoo.parallel import ParallelState
    from zoo.planning.pipeline_plan import entry_parameters, stage_bounds

    results = spawn(_stage, tp * pp, tp, pp, torch.float32, False, method)
    grid = ParallelState(tp_size=tp, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp, rank=0)
    with torch.device("meta"):
        meta = GPT2LMHeadModel(tiny_config(), grid).transformer
    counts = [sum(p.numel() for p in m.parameters()) for m in (meta.wte, meta.wpe, meta.h[0], meta.ln_f)]
    planned = [int(b) for b in stage_bounds(entry_parameters(*counts, 4), pp, method)]
    assert all(r["parts"] == planned for r in results), (planned, results[0]["parts"])
    _, params = reference()
    init = merged(results, "init")
    assert sorted(init) == sorted(n for n in params if n != "lm_head.weight")
    for name, copies in init.items():
        for copy in copies:
            copy = unpad(name, copy, params[name])
            assert torch.equal(copy, params[name]), name


@pytest.mark.parametrize("tp,pp,extra", [(1, 2, None), (2, 2, None), (1, 4, None),
                                         (2, 2, {"sequence_parallel": True}), (1, 2, {"activation_checkpointing": True}),
                                         (2, 2, {"recompute_granularity": "selective"})])
def test_one_pipeline_step_gradients_equal_reference_fp64(tp, pp, extra):
    """Also with sequence parallelism (each TP rank sends its own tokens between stages), full and selective
    recomputation."""
    results = spawn(_stage, tp * pp, tp, pp, torch.float64, True, "uniform", extra)
    expected = reference_grads(1)
    got = merged(results, "grads")
    assert sorted(got) == sorted(n for n in expected if n != "lm_head.weight")
    worst = {}
    for name, copies in got.items():
        for copy in copies:
            worst[name] = max(worst.get(name, 0.0), rel_err(unpad(name, copy, expected[name]), expected[name]))
    bad = {n: e for n, e in worst.items() if e > GRAD_RTOL}
    assert not bad, bad
    assert len(got["transformer.wte.weight"]) == (2 if pp > 1 else 1)   # both tied copies were checked


def _pretrained_stage(rank, world_size, tp, pp, directory):
    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed

    from zoo.models.gpt2.pipeline import gpt2_pipeline_module, hf_names, load_stage_weights
    from zoo.parallel import ParallelState, model_parallel_seed
    from zoo.parallel.partition import partition_specs

    deepspeed.init_distributed(dist_backend="gloo")
    ps = ParallelState.initialize(tp, pp_size=pp)
    model_parallel_seed(SEED, ps)
    module = gpt2_pipeline_module(tiny_config(), ps, SEED)
    with torch.no_grad():
        load_stage_weights(module, directory, ps)
    names, specs = hf_names(module), partition_specs(module)
    return {"tp_rank": ps.tp_rank, "pp_rank": ps.pp_rank, "dp_rank": ps.dp_rank,
            "init": {names[n]: (p.detach().clone(), specs[n]) for n, p in module.named_parameters()}}


def test_stages_load_transformers_weights(tmp_path):
    """--pretrained into stages: a transformers GPT-2 directory (another seed's weights) fills every stage's
    slices exactly, both copies of the tied embedding included."""
    import transformers

    from zoo.checkpoint.hf.hf_io import hf_state_dict

    model, _ = reference(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))   # not the init any stage would draw itself
        model.transformer.wte.weight[model.config.vocab_size:] = 0.0   # padded rows stay zero, as in zoo
    theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**model.hf_config_dict()))
    theirs.load_state_dict(hf_state_dict(model, None), strict=False)
    theirs.save_pretrained(tmp_path)
    loaded = merged(spawn(_pretrained_stage, 4, 2, 2, str(tmp_path)), "init")
    expected = dict(model.named_parameters())
    assert sorted(loaded) == sorted(n for n in expected if n != "lm_head.weight")
    for name, copies in loaded.items():
        for copy in copies:
            assert torch.equal(unpad(name, copy, expected[name]), expected[name].detach()), name


def test_a_pipeline_run_takes_its_shapes_from_the_pretrained_directory(tmp_path):
    """--pretrained with stages: the directory's config (here 3 layers of width 64) with the run's dropout,
    recomputation and sequence-parallel fields, as a one-stage run takes it."""
    from zoo.config.run_config import RunConfig
    from zoo.models import GPT2LMHeadModel, gpt2_config
    from zoo.training.pipeline import pipeline_model_config

    GPT2LMHeadModel(gpt2_config("gpt2-tiny", n_layer=3, n_embd=64, n_head=4)).save_pretrained(tmp_path)
    config = RunConfig(model="gpt2-tiny", pretrained=str(tmp_path), pipeline_model_parallel_size=2,
                       sequence_parallel=True, recompute_granularity="selective",
                       model_overrides={"resid_pdrop": 0.0})
    built = pipeline_model_config(config)
    assert (built.n_layer, built.n_embd, built.resid_pdrop) == (3, 64, 0.0)
    assert built.sequence_parallel and built.recompute_granularity == "selective"



def _fp16_step(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from zoo.models.families import param_groups
    from zoo.models.gpt2.pipeline import gpt2_pipeline_module
    from zoo.parallel import ParallelState, model_parallel_seed
    from zoo.training.grad_norm import current_loss_scale
    from zoo.training.pipeline import pipeline_ds_dict

    # This CPU lacks native fp16 and DeepSpeed refuses it; torch still computes fp16 here, and the override runs
    # DeepSpeed's real fp16 optimizer with dynamic loss scaling (DESIGN.md, "fp16 on this CPU").
    get_accelerator().is_fp16_supported = lambda: True
    deepspeed.init_distributed(dist_backend="gloo")
    ps = ParallelState.initialize(1, pp_size=2)
    model_parallel_seed(SEED, ps)
    module = gpt2_pipeline_module(tiny_config(), ps, SEED)
    ds = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": M, "train_batch_size": MICRO * M,
          "steps_per_print": 10 ** 9, "fp16": {"enabled": True, "initial_scale_power": 8},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    ds, clip = pipeline_ds_dict(ds, False)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=param_groups(module, 0.01), config=ds)
    loss = engine.train_batch(iter([(micro, micro) for micro in batches(1)]))
    return {"loss": float(loss), "clip_by_zoo": clip, "dtype": str(next(module.parameters()).dtype),
            "scale": current_loss_scale(engine.optimizer)}


def test_an_fp16_pipeline_step_runs_deepspeeds_loss_scaling():
    """fp16 with stages: DeepSpeed's fp16 optimizer (its own clipping, so zoo does not clip) and loss scale; the
    first step's loss equals the fp32 reference's to fp16 rounding (<= 1e-3 relative)."""
    results = spawn(_fp16_step, 2)
    model, _ = reference(torch.float32)
    with torch.no_grad():
        expected = sum(model(micro, labels=micro).loss.item() for micro in batches(1)) / M
    for result in results:
        assert result["dtype"] == "torch.float16" and result["clip_by_zoo"] == 0.0 and result["scale"] == 2.0 ** 8
        assert rel_err(result["loss"], expected) <= 1e-3, (result, expected)
