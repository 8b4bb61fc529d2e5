"""Finetuning heads vs transformers at tp = 1, 2, 4, both layer orders:
BertForSequenceClassification, BertForMultipleChoice, BertForQuestionAnswering against transformers'
(MegatronBert|Bert)For{SequenceClassification,MultipleChoice,QuestionAnswering}; heads added to a
pretraining checkpoint start identical on every TP rank; save_pretrained at tp = 2 loads in transformers.

Tolerances (dropout off): float32 outputs and loss max|zoo - ref| / max|ref| <= 1e-5; float64 outputs,
loss and merged gradients <= 1e-9 relative (see ``_parity`` for why gradients are not compared in float32).
"""

from __future__ import annotations

import pytest
import torch

from tests.checks import FP64_TOL, float64_grad_errors, rel_err, tolerance_failures
from tests.helpers.bert_parity import BATCH, SEQ, VOCAB, bert_batch
from tests.spawn import spawn

REL_TOL = 1e-5
# Gradients that are zero in exact arithmetic, so both sides hold only rounding noise; in float64 they
# are held to being negligible (<= 1e-9) against the largest gradient. The key bias: softmax ignores q.b_k (the same for
# every key). A multiple-choice score bias or a start/end bias shifts every logit of one softmax alike,
# and so does the bias of the LayerNorm feeding qa_outputs (the final one: encoder.ln in pre-norm, the
# last layer's output.LayerNorm in post-norm; the test models have 2 layers).
ANALYTICALLY_ZERO = {"ForSequenceClassification": ("attention.self.key.bias",),
                     "ForMultipleChoice": ("attention.self.key.bias", "classifier.bias"),
                     "ForQuestionAnswering": ("attention.self.key.bias", "qa_outputs.bias", "encoder.ln.bias",
                                              "encoder.layer.1.output.LayerNorm.bias")}
HEADS = ("ForSequenceClassification", "ForMultipleChoice", "ForQuestionAnswering")
CHOICES = 4


def _hf_class(layout: str, head: str):
    import transformers

    return getattr(transformers, ("MegatronBert" if layout == "pre-norm" else "Bert") + head)


def _hf_config(layout: str, head: str):
    import transformers

    common = dict(num_labels=2 if head == "ForQuestionAnswering" else 3, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    return (transformers.MegatronBertConfig if layout == "pre-norm" else transformers.BertConfig)(**common)


def _randomise(model) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith(("query.weight", "key.weight")):
                param.mul_(10.0)


@pytest.fixture(scope="module")
def head_dirs(tmp_path_factory):
    """Random-weight transformers checkpoints of every head and layout, plus the pretraining ones."""
    import transformers

    dirs = {}
    for layout in ("pre-norm", "post-norm"):
        for head in HEADS + ("ForPreTraining",):
            torch.manual_seed(11)
            model = _hf_class(layout, head)(_hf_config(layout, head))
            _randomise(model)
            path = tmp_path_factory.mktemp(f"{layout}-{head}")
            model.save_pretrained(path)
            dirs[layout, head] = str(path)
    assert transformers  # imported for the classes above
    return dirs


def head_batch(head: str):
    ids, token_types, mask, _, _ = bert_batch()
    if head == "ForSequenceClassification":
        return dict(input_ids=ids, token_type_ids=token_types, attention_mask=mask, labels=torch.tensor([0, 2, 1]))
    if head == "ForMultipleChoice":
        gen = torch.Generator().manual_seed(5)
        choice_ids = torch.randint(0, VOCAB, (BATCH, CHOICES, SEQ), generator=gen)
        return dict(input_ids=choice_ids, token_type_ids=token_types[:, None].expand(-1, CHOICES, -1).contiguous(),
                    attention_mask=mask[:, None].expand(-1, CHOICES, -1).contiguous(), labels=torch.tensor([3, 0, 1]))
    return dict(input_ids=ids, token_type_ids=token_types, attention_mask=mask,
                start_positions=torch.tensor([1, 4, SEQ + 3]), end_positions=torch.tensor([2, 6, 7]))


def _zoo_class(head: str):
    import zoo.models.bert.heads as heads

    return getattr(heads, "Bert" + head)


def _parity(ps, directory: str, layout: str, head: str) -> dict[str, float]:
    """Outputs and loss in float32 and float64; merged gradients in float64 only. A loss read from one
    pooled token leaves some gradients (the last layer's query, the analytically zero biases) thousands of
    times below the rest, and whole layers' gradients far below the terms they cancel from: float32
    rounding reaches 1e-5 of a tensor's own size, and 4e-6 of the largest gradient of its layer (pre-norm
    multiple choice, layer 1), so no float32 gradient measure keeps a safe margin. The heads use
    F.cross_entropy in both dtypes, so the float64 run exercises the same code as a float32 one."""
    from zoo.checkpoint.hf.hf_io import hf_state_dict

    batch = head_batch(head)
    ref = _hf_class(layout, head).from_pretrained(directory).eval()
    model = _zoo_class(head).from_pretrained(directory, parallel=ps).eval()
    names = ("start_logits", "end_logits") if head == "ForQuestionAnswering" else ("logits",)
    errors = {}
    for tag, dtype in (("out", torch.float32), ("out64", torch.float64)):
        ref_out, out = ref.to(dtype)(**batch), model.to(dtype)(**batch)
        errors.update({f"{tag}:{name}": rel_err(getattr(out, name), getattr(ref_out, name)) for name in names})
        errors[f"{tag}:loss"] = rel_err(out.loss, ref_out.loss)
    ref_out.loss.backward()
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    grads = hf_state_dict(model, ps, {n: p.grad for n, p in model.named_parameters()})
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    errors.update(float64_grad_errors(grads, ref_grads, ANALYTICALLY_ZERO[head]))
    return errors


def _new_head(ps, directory: str, layout: str) -> dict[str, object]:
    """A classifier added to a pretraining checkpoint: encoder weights from the file, head from the seed."""
    from zoo.models.bert.heads import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(directory, parallel=ps, num_labels=3, head_seed=4).eval()
    batch = head_batch("ForSequenceClassification")
    ref = _hf_class(layout, "ForPreTraining").from_pretrained(directory).eval()
    ref_pooled = (ref.bert if hasattr(ref, "bert") else ref.bert)(
        batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"]).pooler_output
    pooled = model.bert(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).pooler_output
    return {"pooled": rel_err(pooled, ref_pooled), "head": model.classifier.weight.detach().clone(),
            "labels": model.config.extra["id2label"]}


def _heads_worker(rank, world_size, dirs, tps):
    from zoo.parallel import ParallelState

    results = {}
    for tp in tps:
        ps = ParallelState.initialize(tp) if world_size > 1 else None
        for layout in ("pre-norm", "post-norm"):
            for head in HEADS:
                results[tp, layout, head] = _parity(ps, dirs[layout, head], layout, head)
            results[tp, layout, "new-head"] = _new_head(ps, dirs[layout, "ForPreTraining"], layout)
    return results


@pytest.fixture(scope="module")
def parity_results(head_dirs):
    """tp = 1 in one process; tp = 4 and tp = 2 (with dp = 2) in one 4-process spawn."""
    results = {1: [_heads_worker(0, 1, head_dirs, (1,))]}
    per_rank = spawn(_heads_worker, 4, head_dirs, (4, 2))
    for tp in (4, 2):
        results[tp] = [{k[1:]: v for k, v in rank.items() if k[0] == tp} for rank in per_rank]
    results[1] = [{k[1:]: v for k, v in rank.items()} for rank in results[1]]
    return results


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("head", HEADS)
def test_head_equals_transformers(parity_results, tp, head):
    for rank, results in enumerate(parity_results[tp]):
        for layout in ("pre-norm", "post-norm"):
            errors = results[layout, head]
            assert len([k for k in errors if k.startswith("grad64:")]) > 30
            failures = tolerance_failures(errors, REL_TOL, FP64_TOL)
            assert not failures, f"at tp={tp}, {layout}, rank {rank}: {failures}"


def test_new_head_is_seeded_and_identical_on_every_rank(parity_results):
    for layout in ("pre-norm", "post-norm"):
        reference = parity_results[1][0][layout, "new-head"]["head"]
        assert reference.abs().max() > 0
        for tp in (1, 2, 4):
            for results in parity_results[tp]:
                entry = results[layout, "new-head"]
                assert entry["pooled"] <= REL_TOL
                assert torch.equal(entry["head"], reference), f"head differs at tp={tp} ({layout})"
                assert entry["labels"] == {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}


def _save_worker(rank, world_size, dirs, out_root):
    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(world_size)
    for layout in ("pre-norm", "post-norm"):
        for head in HEADS:
            model = _zoo_class(head).from_pretrained(dirs[layout, "ForPreTraining"], parallel=ps, head_seed=1)
            model.save_pretrained(f"{out_root}/{layout}-{head}")


def test_heads_save_pretrained_at_tp2_load_in_transformers(head_dirs, tmp_path):
    """zoo starts from the pretraining checkpoint (fresh heads), saves at tp = 2, and transformers'
    matching class loads it and computes the same outputs as zoo reloading it at tp = 1."""
    spawn(_save_worker, 2, head_dirs, str(tmp_path))
    for layout in ("pre-norm", "post-norm"):
        for head in HEADS:
            out = tmp_path / f"{layout}-{head}"
            loaded = _hf_class(layout, head).from_pretrained(out).eval()
            assert type(loaded).__name__ in __import__("json").loads((out / "config.json").read_text())["architectures"]
            zoo_model = _zoo_class(head).from_pretrained(out).eval()
            batch = {k: v for k, v in head_batch(head).items()
                     if k in ("input_ids", "token_type_ids", "attention_mask")}
            for name in ("start_logits", "end_logits") if head == "ForQuestionAnswering" else ("logits",):
                assert rel_err(getattr(zoo_model(**batch), name), getattr(loaded(**batch), name)) <= REL_TOL
