"""Llama pipeline stages (DeepSpeed's PipelineModule and PipelineEngine over zoo's tensor-parallel layers)
against the one-process LlamaForCausalLM of the same seed, fp32, no dropout:

* the init of a 2-stage model (tp 1 and tp 2) equals the one-stage model's, parameter by parameter, exactly;
* one ``train_batch`` (1F1B over m = 4 micro-batches) gives the reference's mean micro-batch loss and
  gradients (so the same AdamW update), <= 1e-5 relative (``rel_err``: max|a - b| / max|b| per parameter).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.checks import rel_err
from tests.spawn import spawn

SEED = 1234
MICRO, M, SEQ = 2, 4, 16
RTOL = 1e-5


def tiny_config():
    from zoo.models.llama import llama_config

    return llama_config("llama-tiny", num_hidden_layers=4)


def batches():
    return torch.randint(0, 50257, (M, MICRO, SEQ), generator=torch.Generator().manual_seed(7))   # (m, b, s)


def reference():
    """The one-process model of SEED: its initial parameters, mean micro-batch loss and gradients."""
    from zoo.models.llama import LlamaForCausalLM
    from zoo.parallel import model_parallel_seed

    model_parallel_seed(SEED, None)
    model = LlamaForCausalLM(tiny_config())
    init = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = 0.0
    for micro in batches():
        step = model(micro, labels=micro).loss / M
        step.backward()
        loss += float(step.detach())
    return init, loss, {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _stage(rank, world_size, tp, pp):
    os.environ["LOCAL_RANK"] = str(rank)   # PipelineModule reads it (the launcher sets it)
    import deepspeed

    from zoo.models.families import param_groups
    from zoo.models.llama.pipeline import llama_pipeline_module, one_stage_names
    from zoo.parallel import ParallelState, model_parallel_seed
    from zoo.parallel.partition import partition_specs
    from zoo.training.pipeline import pipeline_ds_dict

    deepspeed.init_distributed(dist_backend="gloo")
    ps = ParallelState.initialize(tp, pp_size=pp)
    model_parallel_seed(SEED, ps)
    module = llama_pipeline_module(tiny_config(), ps, SEED, partition_method="uniform")
    names, specs = one_stage_names(module), partition_specs(module)
    init = {names[n]: (p.detach().clone(), specs[n]) for n, p in module.named_parameters()}
    ds = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": M, "train_batch_size": MICRO * M,
          "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    ds, _ = pipeline_ds_dict(ds, False)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=param_groups(module, 0.01), config=ds)
    grads = {}

    def capture(optimizer, args, kwargs):
        for name, p in module.named_parameters():
            grads[names[name]] = (p.grad.detach().clone(), specs[name])

    engine.optimizer.register_step_pre_hook(capture)
    loss = engine.train_batch(iter([(micro, micro) for micro in batches()]))
    return {"tp_rank": ps.tp_rank, "pp_rank": ps.pp_rank, "init": init, "grads": grads, "loss": float(loss)}


def merged(results, key):
    """Every LlamaForCausalLM name -> its tensor merged over the TP ranks of the stage that holds it."""
    shards, spec_of = {}, {}
    for result in results:
        for name, (tensor, spec) in result[key].items():
            shards.setdefault(name, {})[result["tp_rank"]] = tensor
            spec_of[name] = spec
    return {name: spec_of[name].merge([by_rank[t] for t in sorted(by_rank)]) for name, by_rank in shards.items()}


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_a_pipeline_step_equals_the_one_stage_models(tp, pp):
    results = spawn(_stage, tp * pp, tp, pp)
    init, loss, grads = reference()
    stage_init, stage_grads = merged(results, "init"), merged(results, "grads")
    assert sorted(stage_init) == sorted(init)
    for name, tensor in init.items():
        assert torch.equal(stage_init[name][:tensor.shape[0]], tensor), name   # padded vocab rows aside
    for result in results:   # DeepSpeed hands every stage the last stage's loss
        assert abs(result["loss"] - loss) <= RTOL * loss, (result["loss"], loss)
    for name, grad in grads.items():
        assert rel_err(stage_grads[name][:grad.shape[0]], grad) <= RTOL, name


def _pretrain_worker(rank, world_size, argv):
    from zoo.cli.pretrain import main

    main(argv)


def test_llama_tp1_pp2_pretrains_and_its_checkpoint_exports_to_transformers(tmp_path):
    """launch/pretrain.py's path at tp 1 x pp 2 (the registry's Llama stages, DeepSpeed's pipeline engine, its
    layer files), then launch/export.py: transformers' LlamaForCausalLM from the export scores the validation
    batch the run evaluated after its last step as the run did (<= 1e-5 relative, fp32, no dropout), so every
    stage's weights reached the export under their own names."""
    import json

    import transformers

    from tests.helpers.corpora import wiki_sample_corpus
    from tests.helpers.repo import REPO
    from zoo.cli.export import main as export_main
    from zoo.data import IndexedDataset
    from zoo.models import model_config
    from zoo.training.pretraining_objectives import build_dataset

    prefix = wiki_sample_corpus(tmp_path)
    config = json.loads((REPO / "ds_configs" / "llama_cpu_demo.json").read_text())
    config["zoo"].pop("sample_prompts")
    config.pop("scheduler")
    config["optimizer"]["params"]["lr"] = 0.01   # five-fold the demo's: the weights move well off their init
    (tmp_path / "ds.json").write_text(json.dumps(config))
    run, seq, split = tmp_path / "run", 64, "80,20,0"
    spawn(_pretrain_worker, 2, ["--deepspeed_config", str(tmp_path / "ds.json"), "--data-path", prefix, "--save",
                                str(run), "--seq-length", str(seq), "--split", split, "--tensor-parallel-size", "1",
                                "--pipeline-model-parallel-size", "2", "--train-iters", "3", "--eval-interval", "3",
                                "--eval-iters", "1", "--log-interval", "1", "--data-workers", "0",
                                "--skip-fit-check"])
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (valid,) = [e for e in events if e.get("split") == "valid"]
    export_main(["--load", str(run), "--out", str(tmp_path / "hf")])
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    samples = config["train_batch_size"]   # --eval-iters 1: one global batch
    dataset = build_dataset(model_config("llama-tiny"), IndexedDataset(prefix), seq, 1234, split, "valid", samples)
    batch = torch.stack([dataset[i]["input_ids"] for i in range(samples)])
    with torch.no_grad():
        expected = hf(input_ids=batch, labels=batch).loss.item()
    assert abs(valid["val_loss"] - expected) <= 1e-5 * expected, (valid["val_loss"], expected)


def test_the_llama3_8b_3d_config_plans_two_balanced_stages_on_h100s():
    """ds_configs/llama3_8b_tp8_pp2.json (tp 8 x pp 2 x dp 2 on 4 nodes of 8 H100s): the planner splits the
    32 decoder layers 16/16 (the embedding on the first stage, norm and untied head on the last) and fits."""
    from tests.helpers.repo import REPO
    from zoo.planning.planner import plan

    result = plan(REPO / "ds_configs" / "llama3_8b_tp8_pp2.json", 8, num_nodes=4, gpu="H100",
                  with_deepspeed_estimate=False)
    assert [stage["layers"] for stage in result.stages] == [16, 16]
    embedding = 129024 // 8 * 4096   # the padded vocabulary's rows of this TP rank
    layer = (result.stages[0]["params_per_rank"] - embedding) // 16
    assert result.stages[1]["params_per_rank"] == 16 * layer + 4096 + embedding   # norm and lm_head
    assert result.params_total == 8_036_552_704 and result.fits and result.total < 0.2 * result.memory
