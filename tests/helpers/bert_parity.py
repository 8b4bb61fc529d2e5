"""zoo's BERT against transformers' on one tiny batch: the reference models, the batch, and the errors of
outputs, loss and merged gradients that the parity tests bound (tolerances: tests/test_bert.py)."""

from __future__ import annotations

import torch

from tests.checks import float64_grad_errors, layer_scaled_grad_errors, rel_err

VOCAB = 1000
BATCH, SEQ = 3, 10


def make_hf_bert(kind: str):
    """A random transformers BERT with pretraining heads, dropout off: MegatronBertForPreTraining for
    ``kind`` "pre-norm", BertForPreTraining otherwise (2 layers, hidden 64, 4 heads, vocab ``VOCAB``)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0)
    if kind == "pre-norm":
        return transformers.MegatronBertForPreTraining(transformers.MegatronBertConfig(**common))
    return transformers.BertForPreTraining(transformers.BertConfig(**common))


def bert_batch(seq: int = SEQ, label_near_end: bool = False):
    """ids, token types, attention mask, MLM labels and SOP labels of BATCH sequences of ``seq`` tokens;
    ``label_near_end`` also masks position seq - 2 (so the last TP rank's tokens carry a label under
    sequence parallelism)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    token_types = torch.zeros_like(ids)
    token_types[:, seq // 2:] = 1
    mask = torch.ones_like(ids)
    mask[1, seq - 3:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, 2:5] = ids[:, 2:5]
    if label_near_end:
        labels[:, seq - 2] = ids[:, seq - 2]
    sop = torch.tensor([0, 1, 1])
    return ids, token_types, mask, labels, sop


def pretraining_loss(prediction_logits, seq_relationship_logits, labels, sop) -> torch.Tensor:
    """The MLM + SOP loss of (MegatronBert|Bert)ForPreTraining, in the logits' dtype."""
    import torch.nn.functional as F

    mlm = F.cross_entropy(prediction_logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    return mlm + F.cross_entropy(seq_relationship_logits, sop)


def bert_parity_errors(model, ref, ps, batch) -> dict[str, float]:
    """zoo's BertForPreTraining against transformers' on one batch, dropout off: fp32 outputs, loss and
    layer-scaled gradients with each model's own loss, then both models in float64 (outputs, a loss of
    the same formula on both sides, every merged gradient). Leaves both models in float64."""
    ids, token_types, mask, labels, sop = batch
    # float32, each model's own loss.
    ref_out = ref(ids, attention_mask=mask, token_type_ids=token_types, labels=labels, next_sentence_label=sop)
    ref_out.loss.backward()
    out = model(ids, token_type_ids=token_types, attention_mask=mask, labels=labels, next_sentence_label=sop,
                gather_output=True)
    out.loss.backward()
    ref_grads, grads = hf_grads(ref), zoo_grads(model, ps)
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    errors = {"prediction_logits": rel_err(out.prediction_logits, ref_out.prediction_logits),
              "seq_relationship_logits": rel_err(out.seq_relationship_logits, ref_out.seq_relationship_logits),
              "loss": rel_err(out.loss, ref_out.loss)}
    errors.update(layer_scaled_grad_errors(grads, ref_grads))

    # float64: the fused cross-entropy computes in float32 by design, so the loss is taken from the
    # gathered logits, by the same formula on both sides (the fused loss is checked in float32 above).
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        m.double()
    ref_out = ref(ids, attention_mask=mask, token_type_ids=token_types)
    out = model(ids, token_type_ids=token_types, attention_mask=mask, gather_output=True)
    ref_loss = pretraining_loss(ref_out.prediction_logits, ref_out.seq_relationship_logits, labels, sop)
    loss = pretraining_loss(out.prediction_logits, out.seq_relationship_logits, labels, sop)
    ref_loss.backward()
    loss.backward()
    errors.update({"out64:prediction_logits": rel_err(out.prediction_logits, ref_out.prediction_logits),
                   "out64:seq_relationship_logits": rel_err(out.seq_relationship_logits,
                                                            ref_out.seq_relationship_logits),
                   "out64:loss": rel_err(loss, ref_loss)})
    # The key bias gradient is zero in exact arithmetic: softmax ignores q.b_k, the same for every key.
    errors.update(float64_grad_errors(zoo_grads(model, ps), hf_grads(ref),
                                      analytically_zero=("attention.self.key.bias",)))
    return errors


def hf_grads(model) -> dict[str, torch.Tensor]:
    """transformers' gradients by parameter name (parameters without a gradient left out)."""
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def zoo_grads(model, ps) -> dict[str, torch.Tensor]:
    """zoo's gradients merged over the TP ranks under transformers' names (a collective)."""
    from zoo.checkpoint.hf.hf_io import hf_state_dict

    return hf_state_dict(model, ps, {n: p.grad for n, p in model.named_parameters()})
