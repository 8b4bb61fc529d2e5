"""Llama checkpoints resume at any layout, and transformers' Llama weights load into pipeline stages, fp32, no
dropout, through the family registry (zoo.models.families) as GPT-2's do.

One spawn of 4 ranks (a tiny GQA Llama on the random-token corpus, micro-batches of 2 in a global batch of 8):
  pp2       tp2 x pp2, 4 iterations, checkpoints at 2 and 4;
  to-one    pp2's iteration-2 checkpoint resumed at tp1 x pp1 (dp 4) for iterations 3 and 4, checkpoint at 3;
  to-pp2    to-one's iteration-3 checkpoint resumed at tp2 x pp2 for iteration 4;
  tp2       tp2 x pp1 (dp 2), 4 iterations, checkpoint at 2;
  tp2-tp1   tp2's iteration-2 checkpoint resumed at tp1 (dp 4) for iterations 3 and 4;
  hf        a transformers LlamaForCausalLM save loaded with --pretrained into tp1 x pp2 and tp2 x pp2 stages
            (zoo.training.pipeline.build_pipeline_model, the run's path), scored by DeepSpeed's eval_batch.
Claims: each resumed run's losses, grad norms (clipping active) and learning rates equal those of the run it
continues uninterrupted, <= 1e-5 relative (fp32: only the reduction order differs between layouts; the loss of
iteration 4 follows the update of iteration 3, made from the moved Adam moments); the stages' loss equals
transformers' own on the same batch, <= 1e-5 relative. Seen failing: the move with the Adam moments zeroed
(losses 7.3e-4 relative off), the loader with gate and up swapped (1.3e-2 off).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.pretraining import run_config, train_events
from tests.helpers.random_corpus import VOCAB, make_corpus
from tests.helpers.zero_launch import rel
from tests.spawn import spawn

PARITY = 1e-5
ITERS, MICRO, GLOBAL = 4, 2, 8
# GQA (2 query heads per KV head) with every dimension divisible by tp 2; the vocabulary (1100) is padded
# differently at tp 1 and tp 2. The corpus's tokens are below 1100: bos/eos inside the vocabulary.
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)


def llama_run_config(data, save, tp, pp, load=None, save_interval=0, pretrained=None):
    """``LLAMA`` at tp x pp on 4 ranks, clipping to 0.5 (the grad norms here are above it: clipping acts), a
    constant learning rate of 0.01 from the first step (a warm-up from 0 would leave the weights at their init
    up to the checkpoint), so that every Adam update moves the loss well past 1e-5."""
    config = run_config(data, save, tp, MICRO, GLOBAL, train_iters=ITERS, model="llama-tiny",
                        model_overrides=dict(LLAMA), load=load, save_interval=save_interval, data_workers=0,
                        pipeline_model_parallel_size=pp, pipeline_partition_method="uniform", pretrained=pretrained)
    config.ds_config["gradient_clipping"] = 0.5
    config.ds_config["optimizer"]["params"]["lr"] = 0.01
    config.ds_config.pop("scheduler")
    return config


def saved_copy(root: Path, run: str, iteration: int, name: str, rank: int) -> str:
    """``run``'s checkpoint of ``iteration`` as run directory ``name`` of its own (what --load then resumes)."""
    import torch.distributed as dist

    if rank == 0:
        tag = root / run / "checkpoints" / f"iter_{iteration:07d}"
        shutil.copytree(tag, root / name / "checkpoints" / tag.name)
        (root / name / "checkpoints" / "latest").write_text(tag.name)
    dist.barrier()
    return str(root / name)


def pretrained_stage_loss(data, root: Path, hf_dir: str, tp: int, pp: int, ids: torch.Tensor) -> float:
    """The loss DeepSpeed's pipeline engine gives ``ids`` (every micro-batch of the iteration) on stages filled
    from ``hf_dir`` the way a --pretrained run fills them."""
    from zoo.parallel import ParallelState
    from zoo.training.pipeline import build_pipeline_model, pipeline_model_config, setup_pipeline_engine

    config = llama_run_config(data, str(root / f"hf-tp{tp}-pp{pp}"), tp, pp, pretrained=hf_dir)
    ps = ParallelState.initialize(tp, pp_size=pp)
    model_config = pipeline_model_config(config)
    module = build_pipeline_model(config, model_config, ps, "cpu")
    engine, _ = setup_pipeline_engine(module, config.ds_config, ps, 0.01, False)
    micro_batches = GLOBAL // (MICRO * ps.dp_size)
    return float(engine.eval_batch(iter([(ids, ids)] * micro_batches)))


def _runs(rank, world_size, data, root, hf_dir, ids):
    os.environ["LOCAL_RANK"] = str(rank)   # what the launcher sets; DeepSpeed's PipelineModule reads it
    from zoo.training.pretrain import pretrain

    root = Path(root)
    pretrain(llama_run_config(data, str(root / "pp2"), 2, 2, save_interval=2))
    pretrain(llama_run_config(data, str(root / "to-one"), 1, 1, save_interval=3,
                              load=saved_copy(root, "pp2", 2, "pp2-at-2", rank)))
    pretrain(llama_run_config(data, str(root / "to-pp2"), 2, 2, load=saved_copy(root, "to-one", 3, "one-at-3", rank)))
    pretrain(llama_run_config(data, str(root / "tp2"), 2, 1, save_interval=2))
    pretrain(llama_run_config(data, str(root / "tp2-tp1"), 1, 1, load=saved_copy(root, "tp2", 2, "tp2-at-2", rank)))
    return {f"tp{tp}-pp{pp}": pretrained_stage_loss(data, root, hf_dir, tp, pp, ids) for tp, pp in ((1, 2), (2, 2))}


def transformers_llama(directory: Path):
    """A randomly initialised transformers LlamaForCausalLM of ``LLAMA``'s shape, saved to ``directory``. Its
    weights are drawn from N(0, 0.1), not transformers' N(0, 0.02): near 0.02 every logit is close to 0 and
    any loading, right or wrong, scores about ln(V) (gate and up swapped moved the loss by 3e-5 relative,
    at 0.1 by 1.3e-2)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                                      initializer_range=0.1)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_layout")
    data = make_corpus(root / "random")
    hf = transformers_llama(root / "hf")
    ids = torch.randint(0, VOCAB, (MICRO, 32), generator=torch.Generator().manual_seed(3))   # (b, s)
    with torch.no_grad():
        expected = hf(input_ids=ids, labels=ids).loss.item()
    per_rank = spawn(_runs, 4, data, str(root), str(root / "hf"), ids, timeout=600)
    return root, per_rank, expected


def assert_continues(resumed_run: Path, uninterrupted_run: Path, iterations: list[int]) -> None:
    uninterrupted = {e["iteration"]: e for e in train_events(uninterrupted_run)}
    resumed = train_events(resumed_run)
    assert [e["iteration"] for e in resumed] == iterations, resumed
    for event in resumed:
        reference = uninterrupted[event["iteration"]]
        for key in ("loss", "grad_norm", "lr"):
            assert rel(event[key], reference[key]) <= PARITY, (key, event, reference)


def test_a_tp2_pp2_llama_checkpoint_resumes_at_tp1_pp1(runs):
    root, _, _ = runs
    assert_continues(root / "to-one", root / "pp2", [3, 4])


def test_a_tp1_pp1_llama_checkpoint_resumes_at_tp2_pp2(runs):
    root, _, _ = runs
    assert_continues(root / "to-pp2", root / "pp2", [4])
    assert_continues(root / "to-pp2", root / "to-one", [4])


def test_a_one_stage_llama_checkpoint_resumes_at_another_tp(runs):
    root, _, _ = runs
    assert_continues(root / "tp2-tp1", root / "tp2", [3, 4])


@pytest.mark.parametrize("layout", ["tp1-pp2", "tp2-pp2"])
def test_pretrained_transformers_llama_loads_into_pipeline_stages(runs, layout):
    _, per_rank, expected = runs
    for result in per_rank:   # DeepSpeed hands every stage the last stage's loss
        assert rel(result[layout], expected) <= PARITY, (layout, result[layout], expected)
