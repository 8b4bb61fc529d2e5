"""One set of weights, validated during pretraining at several layouts, reports one number.

Each run starts from the same transformers-layout directory (``--pretrained``), trains one iteration at lr 0
(the weights stay as loaded) and validates at iteration 1 on ``eval_iters`` = 2 global batches of 8, i.e. the
valid split's first 16 samples at every layout:

* GPT-2 at tp2 x dp1 (micro 2, 4 micro-batches a global batch), tp1 x dp2 (micro 4, one) and tp1 x pp2 (the
  pipeline engine's ``eval_batch``) reports transformers' loss on those 16 samples, taken in one batch, the
  tp1 x dp1 number;
* BERT at tp2 x dp1 (micro 2) and tp1 x dp2 (micro 4) reports the MLM loss over every masked token of the 16
  samples, the SOP loss and accuracy over the 16 pairs, and their sum as the loss, computed here sample by
  sample in fp64 from the same directory: micro-batches of other sizes group the masked tokens differently,
  so a mean of micro-batch means would differ.

Tolerance: 1e-5 relative (fp32 forwards at different tp and batch shapes against an fp64 reference); the SOP
accuracy is a count of 16 and must be equal.
"""

from __future__ import annotations

import gzip
import os

import pytest
import torch

from tests.helpers.corpora import WIKI_SAMPLE
from tests.helpers.pretraining import ds_config, run_config
from tests.spawn import spawn

GLOBAL, EVAL_ITERS, SEQ = 8, 2, 32
SAMPLES = GLOBAL * EVAL_ITERS
RTOL = 1e-5
HF_GPT2 = dict(vocab_size=50257, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0)
GPT2_LAYOUTS = {"tp2xdp1": (2, 1, 2), "tp1xdp2": (1, 1, 4), "tp1xpp2": (1, 2, 2)}   # name: (tp, pp, micro)
BERT_LAYOUTS = {"tp2xdp1": (2, 1, 2), "tp1xdp2": (1, 1, 4)}


def frozen(micro: int) -> dict:
    """The tests' DeepSpeed config at lr 0: the one training step leaves the loaded weights as they are."""
    return ds_config(micro, GLOBAL, optimizer={"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.01,
                                                                            "torch_adam": True}})


def _validate_worker(rank, world_size, data_path, pretrained, root, model, layouts):
    os.environ["LOCAL_RANK"] = str(rank)   # what the launcher sets; DeepSpeed's PipelineModule reads it
    from zoo.training.pretrain import pretrain

    for name, (tp, pp, micro) in layouts.items():
        pretrain(run_config(data_path, f"{root}/{name}", tp, micro, GLOBAL, 1, model=model, pretrained=pretrained,
                            model_overrides={}, pipeline_model_parallel_size=pp, eval_interval=1,
                            eval_iters=EVAL_ITERS, ds_config=frozen(micro)))


def validation_event(run_dir) -> dict:
    from zoo.training.metrics import read_metrics

    (event,) = [e for e in read_metrics(run_dir) if e.get("split") == "valid"]
    return event


def valid_samples(model_config, prefix: str) -> list[dict[str, torch.Tensor]]:
    """The valid split's first ``SAMPLES`` samples, as the runs' datasets build them."""
    from zoo.data import IndexedDataset
    from zoo.training.pretraining_objectives import build_dataset

    dataset = build_dataset(model_config, IndexedDataset(prefix), SEQ, 1234, "80,20,0", "valid", SAMPLES)
    return [dataset[i] for i in range(SAMPLES)]


def test_gpt2_validation_is_the_same_at_every_layout(corpus_prefix, tmp_path):
    import transformers

    from zoo.models import GPT2Config

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**HF_GPT2)).eval()
    hf.save_pretrained(tmp_path / "hf")
    spawn(_validate_worker, 2, corpus_prefix, str(tmp_path / "hf"), str(tmp_path), "gpt2-tiny", GPT2_LAYOUTS)

    ids = torch.stack([s["input_ids"] for s in valid_samples(GPT2Config(**HF_GPT2), corpus_prefix)])   # (16, s)
    with torch.no_grad():
        expected = hf.double()(input_ids=ids, labels=ids).loss.item()   # every sample scores SEQ - 1 tokens
    for name in GPT2_LAYOUTS:
        event = validation_event(tmp_path / name)
        assert abs(event["val_loss"] - expected) <= RTOL * expected, (name, event, expected)


@pytest.fixture(scope="module")
def bert_corpus(tmp_path_factory):
    """The first 12 articles of the bundled Wikipedia sample, preprocessed for BERT (sentences, uncased WordPiece)."""
    from zoo.data import preprocess_bert

    root = tmp_path_factory.mktemp("bert-corpus")
    with gzip.open(WIKI_SAMPLE, "rt") as src:
        (root / "small.jsonl").write_text("".join(next(src) for _ in range(12)))
    preprocess_bert([str(root / "small.jsonl")], str(root / "small"), workers=1, progress=False)
    return str(root / "small")


def bert_reference(directory, samples) -> dict[str, float]:
    """The validation's definition, one sample at a time in fp64: the MLM loss over all masked tokens, the
    SOP loss and accuracy over all pairs, and the loss as their sum."""
    import torch.nn.functional as F

    from zoo.models import BertForPreTraining

    model = BertForPreTraining.from_pretrained(directory).double().eval()
    mlm_sum = masked = sop_sum = correct = 0.0
    with torch.no_grad():
        for sample in samples:
            batch = {key: value[None] for key, value in sample.items()}
            out = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], gather_output=True)
            labels = batch["labels"].view(-1)
            mlm_sum += F.cross_entropy(out.prediction_logits.view(labels.numel(), -1), labels, reduction="sum",
                                       ignore_index=-100).item()
            masked += int((labels != -100).sum())
            sop_sum += F.cross_entropy(out.seq_relationship_logits, batch["next_sentence_label"]).item()
            correct += int(out.seq_relationship_logits.argmax(-1).item() == batch["next_sentence_label"].item())
    means = {"mlm_loss": mlm_sum / masked, "sop_loss": sop_sum / len(samples), "sop_acc": correct / len(samples)}
    return {"loss": means["mlm_loss"] + means["sop_loss"], **means}


def test_bert_validation_is_the_same_at_every_layout(bert_corpus, tmp_path):
    from zoo.models import BertForPreTraining, bert_config

    torch.manual_seed(0)
    config = bert_config("bert-tiny", num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                         intermediate_size=128)
    BertForPreTraining(config).save_pretrained(tmp_path / "hf")
    spawn(_validate_worker, 2, bert_corpus, str(tmp_path / "hf"), str(tmp_path), "bert-tiny", BERT_LAYOUTS)

    expected = bert_reference(tmp_path / "hf", valid_samples(config, bert_corpus))
    for name in BERT_LAYOUTS:
        event = validation_event(tmp_path / name)
        got = {"loss": event["val_loss"], "mlm_loss": event["val_mlm_loss"], "sop_loss": event["val_sop_loss"]}
        for key, value in got.items():
            assert abs(value - expected[key]) <= RTOL * expected[key], (name, key, event, expected)
        assert event["val_sop_acc"] == expected["sop_acc"], (name, event, expected)
