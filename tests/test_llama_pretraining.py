"""Llama through the pretraining entry point, asking only the family registry: llama-tiny at tp=2 trains
on the bundled Wikipedia sample's first articles (GPT-2 BPE, the preset's vocabulary), resumes from its
checkpoint, and exports to transformers' LlamaForCausalLM layout. The exported model's loss on the
validation batch the resumed run evaluated after its last step equals that run's logged validation loss
(<= 1e-5 relative, fp32, no dropout), so the export holds the trained weights. The learning rate is high
(0.01 from the first step) so that five Adam steps move every weight past its N(0, 0.02) init: near the
init every logit is close to 0 and any export, right or wrong, scores about ln(V)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import torch

from tests.spawn import spawn

REPO = Path(__file__).resolve().parents[1]
SEQ = 64
GLOBAL = 8         # the demo config's global batch: a validation of --eval-iters 1 scores one global batch
SPLIT = "80,20,0"


def small_corpus(root: Path, articles: int = 12) -> str:
    """The first ``articles`` articles of the bundled Wikipedia sample, preprocessed with GPT-2 BPE."""
    from zoo.data import preprocess

    with gzip.open(REPO / "zoo" / "assets" / "corpora" / "wiki-sample.jsonl.gz", "rt") as src:
        lines = [next(src) for _ in range(articles)]
    (root / "small.jsonl").write_text("".join(lines))
    preprocess([str(root / "small.jsonl")], str(root / "small"), workers=1, progress=False)
    return str(root / "small")


def demo_config(path: Path) -> str:
    """ds_configs/llama_cpu_demo.json without the end-of-run samples (they cost seconds and test generation)
    and with a constant learning rate of 0.01 (no warm-up, which would start at 0)."""
    config = json.loads((REPO / "ds_configs" / "llama_cpu_demo.json").read_text())
    config["zoo"].pop("sample_prompts")
    config.pop("scheduler")
    config["optimizer"]["params"]["lr"] = 0.01
    path.write_text(json.dumps(config))
    return str(path)


def _pretrain_worker(rank, world_size, argv):
    from zoo.cli.pretrain import main

    main(argv)


def read_events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_llama_tiny_pretrains_at_tp2_resumes_and_exports_to_transformers(tmp_path):
    import transformers

    from zoo.cli.export import main as export_main
    from zoo.data import IndexedDataset
    from zoo.models import model_config
    from zoo.training.pretraining_objectives import build_dataset

    prefix = small_corpus(tmp_path)
    run = tmp_path / "run"
    flags = ["--deepspeed_config", demo_config(tmp_path / "ds.json"), "--data-path", prefix, "--save", str(run),
             "--seq-length", str(SEQ), "--split", SPLIT, "--log-interval", "1", "--data-workers", "0",
             "--skip-fit-check"]
    spawn(_pretrain_worker, 2, [*flags, "--train-iters", "3", "--eval-interval", "0"])
    spawn(_pretrain_worker, 2, [*flags, "--train-iters", "5", "--load", str(run), "--eval-interval", "5",
                                "--eval-iters", "1"])
    events = read_events(run)
    assert [e["iteration"] for e in events if "split" not in e] == [1, 2, 3, 4, 5]
    (valid,) = [e for e in events if e.get("split") == "valid"]
    assert valid["iteration"] == 5 and valid["val_loss"] < 0.9 * math.log(50257), valid   # it learned

    export_main(["--load", str(run), "--out", str(tmp_path / "hf")])
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    assert hf.config.num_key_value_heads == 2 and not hf.config.tie_word_embeddings

    dataset = build_dataset(model_config("llama-tiny"), IndexedDataset(prefix), SEQ, 1234, SPLIT, "valid", GLOBAL)
    batch = torch.stack([dataset[i]["input_ids"] for i in range(GLOBAL)])
    with torch.no_grad():
        expected = hf(input_ids=batch, labels=batch).loss.item()
    assert abs(valid["val_loss"] - expected) <= 1e-5 * expected, (valid["val_loss"], expected)


def test_llama_gpu_configs_fit_an_80gb_gpu_by_the_planner():
    """The Llama ds_configs the README points to plan on H100s (80 GB) without a refusal, and fit."""
    from zoo.planning.planner import plan

    for name, gpus, nodes in (("llama2_7b_tp8.json", 8, 1), ("llama3_8b_tp8_zero1.json", 8, 2)):
        result = plan(REPO / "ds_configs" / name, gpus, num_nodes=nodes, gpu="H100", with_deepspeed_estimate=False)
        assert result.fits and result.total < 0.5 * result.memory, (name, result.total)
    tiny = plan(REPO / "ds_configs" / "llama_cpu_demo.json", 2, gpu="cpu", with_deepspeed_estimate=False)
    assert tiny.params_total == 13_279_872   # embed_tokens and lm_head of 50432 padded rows, untied
