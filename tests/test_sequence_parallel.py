"""Sequence parallelism and selective recomputation (Korthikanti et al. 2022), GPT-2 and both BERTs.

One spawn per tp (2 and 4) checks, with sequence_parallel=True set through ``from_pretrained``:
- parity with transformers, dropout off (the measures of tests/test_gpt2.py and tests/test_bert.py):
  float32 logits and loss max|zoo - ref| / max|ref| <= 1e-5 and gradients <= 1e-5 x their layer's
  largest; float64 logits, loss and every gradient <= 1e-9 relative;
- at tp = 2 only: the collectives of one GPT-2 training step (per layer two all-gathers and two
  reduce-scatters of b*s*h forward, the reverse backward plus the two all-gathers that re-gather the
  column-parallel GEMMs' saved s/p inputs, no activation all-reduce inside a layer; the LayerNorm /
  row-bias gradients cost one small all-reduce each); selective and full
  recomputation give bit-for-bit the losses of no recomputation over 5 AdamW steps with dropout on;
  a sequence length that tp does not divide is one ValueError; key/value-cached decoding (and
  ``logits_to_keep``) of an SP model gives the logits of the model without SP; the finetuning heads
  (sequence classification, QA) on an SP encoder give the float64 gradients of no SP (<= 1e-9).
At tp = 1 sequence parallelism is a no-op (same losses bit for bit, no spawn needed).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.checks import float64_grad_errors, layer_scaled_grad_errors, record_collectives, rel_err, tolerance_failures
from tests.helpers import bert_parity
from tests.helpers.bert_parity import bert_parity_errors, hf_grads, make_hf_bert, zoo_grads
from tests.helpers.gpt2_parity import causal_lm_loss, tiny_hf_config, tiny_zoo_config
from tests.spawn import spawn
from zoo.models.outputs import cache_of

REL_TOL = 1e-5
VOCAB = 1000
BATCH, SEQ = 3, 12     # 12 divides by 2 and 4
HIDDEN = 64


# ---------------------------------------------------------------- reference checkpoints
def _randomise_(model, sharpen=()):
    with torch.no_grad():  # LayerNorms and biases start at 1/0: randomise them so every one is tested
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith(sharpen):  # attention not uniform, so Q/K gradients carry signal
                param.mul_(10.0)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    import transformers

    dirs = {}
    torch.manual_seed(1234)
    gpt2 = transformers.GPT2LMHeadModel(tiny_hf_config())
    _randomise_(gpt2)
    dirs["gpt2"] = tmp_path_factory.mktemp("gpt2")
    gpt2.save_pretrained(dirs["gpt2"])
    for kind in ("pre-norm", "post-norm"):
        torch.manual_seed(7)
        bert = make_hf_bert(kind)
        _randomise_(bert, sharpen=("query.weight", "key.weight"))
        dirs[kind] = tmp_path_factory.mktemp(kind)
        bert.save_pretrained(dirs[kind])
    return {kind: str(path) for kind, path in dirs.items()}


def gpt2_batch():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 4:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def bert_batch():
    return bert_parity.bert_batch(SEQ, label_near_end=True)


# ---------------------------------------------------------------- parity with transformers
def _gpt2_parity(ps, directory):
    import transformers

    from zoo.models import GPT2LMHeadModel

    ids, mask, labels = gpt2_batch()
    ref = transformers.GPT2LMHeadModel.from_pretrained(directory, attn_implementation="sdpa").eval()
    model = GPT2LMHeadModel.from_pretrained(directory, parallel=ps, sequence_parallel=True).eval()
    assert model.transformer.uses_sequence_parallel(SEQ)
    ref_out = ref(ids, attention_mask=mask, labels=labels)
    ref_out.loss.backward()
    out = model(ids, attention_mask=mask, labels=labels, gather_output=True)
    out.loss.backward()
    errors = {"logits": rel_err(out.logits, ref_out.logits), "loss": rel_err(out.loss, ref_out.loss)}
    errors.update(layer_scaled_grad_errors(zoo_grads(model, ps), hf_grads(ref)))
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        m.double()
    ref_logits = ref(ids, attention_mask=mask).logits
    logits = model(ids, attention_mask=mask, labels=labels, gather_output=True).logits
    ref_loss, loss = causal_lm_loss(ref_logits, labels), causal_lm_loss(logits, labels)
    ref_loss.backward()
    loss.backward()
    errors.update({"out64:logits": rel_err(logits, ref_logits), "out64:loss": rel_err(loss, ref_loss)})
    errors.update(float64_grad_errors(zoo_grads(model, ps), hf_grads(ref)))
    return errors


def _bert_parity(ps, directory, kind):
    import transformers

    from zoo.models import BertForPreTraining

    ids, token_types, mask, labels, sop = bert_batch()
    ref_cls = transformers.MegatronBertForPreTraining if kind == "pre-norm" else transformers.BertForPreTraining
    ref = ref_cls.from_pretrained(directory).eval()
    model = BertForPreTraining.from_pretrained(directory, parallel=ps, sequence_parallel=True).eval()
    return bert_parity_errors(model, ref, ps, (ids, token_types, mask, labels, sop))


# ---------------------------------------------------------------- collectives of one step
@contextlib.contextmanager
def record_all_collectives():
    """tests.checks.record_collectives plus reduce-scatters, recorded as ("reduce_scatter", input elements, "")."""
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    real = getattr(dist, name)
    with record_collectives() as calls:
        def counting(output, input, *args, **kwargs):
            calls.append(("reduce_scatter", input.numel(), ""))
            return real(output, input, *args, **kwargs)

        setattr(dist, name, counting)
        try:
            yield calls
        finally:
            setattr(dist, name, real)


def _collectives(ps, n_layer):
    from zoo.models import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_zoo_config(n_layer).replace(sequence_parallel=True), parallel=ps)
    ids, _, labels = gpt2_batch()
    with record_all_collectives() as forward:
        loss = model(ids, labels=labels).loss
    with record_all_collectives() as backward:
        loss.backward()
    return {"forward": list(forward), "backward": list(backward)}


# ---------------------------------------------------------------- recomputation with dropout on
def _train_losses(ps, recompute, steps: int = 5):
    import deepspeed

    from zoo.models import GPT2Config, GPT2LMHeadModel
    from zoo.parallel import model_parallel_seed

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=HIDDEN, n_layer=2, n_head=4, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, sequence_parallel=True, recompute_granularity=recompute)
    torch.manual_seed(42)
    model = GPT2LMHeadModel(config, parallel=ps).train()
    model_parallel_seed(1234, ps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real_checkpoint, calls = deepspeed.checkpointing.checkpoint, []

    def counting_checkpoint(function, *args, **kwargs):
        calls.append(getattr(function, "__name__", type(function).__name__))
        return real_checkpoint(function, *args, **kwargs)

    deepspeed.checkpointing.checkpoint = counting_checkpoint
    losses = []
    try:
        for step in range(steps):
            ids, _, labels = gpt2_batch()
            loss = model(ids.roll(step, dims=1), labels=labels.roll(step, dims=1)).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        deepspeed.checkpointing.checkpoint = real_checkpoint
    return losses, calls


def _heads_with_and_without_sp(ps, directory):
    """The finetuning heads on an SP encoder: float64 loss and every gradient as without SP."""
    from zoo.models.bert.heads import BertForQuestionAnswering, BertForSequenceClassification

    ids, token_types, mask, _, _ = bert_batch()
    inputs = dict(attention_mask=mask, token_type_ids=token_types)
    errors = {}
    for cls, labels in ((BertForSequenceClassification, dict(labels=torch.tensor([0, 2, 1]))),
                        (BertForQuestionAnswering, dict(start_positions=torch.tensor([1, 11, 4]),
                                                        end_positions=torch.tensor([3, 11, 6])))):
        runs = []
        for sp in (False, True):
            model = cls.from_pretrained(directory, parallel=ps, num_labels=3, sequence_parallel=sp).double()
            model(ids, **inputs, **labels).loss.backward()
            runs.append(zoo_grads(model, ps))
        # The QA loss is a softmax over positions, so the gradients summed over positions vanish: the last
        # LayerNorm's bias gradient (and the key bias, as always) is zero in exact arithmetic.
        zero = ("attention.self.key.bias",) + (("layer.1.output.LayerNorm.bias",) if cls is BertForQuestionAnswering
                                               else ())
        errors.update({k.replace("grad64:", f"grad64:{cls.__name__}.", 1): v
                       for k, v in float64_grad_errors(runs[1], runs[0], analytically_zero=zero).items()})
    return errors


def _decoding_without_sp(ps):
    """An SP model decodes with a key/value cache (and scores with logits_to_keep) as one without SP."""
    from zoo.models import GPT2LMHeadModel

    ids = gpt2_batch()[0][:, :SEQ - 1]           # 11 tokens: not divisible by 2, fine without SP
    outs = []
    for sp in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(tiny_zoo_config().replace(sequence_parallel=sp), parallel=ps).eval()
        with torch.no_grad():
            first = model(ids, use_cache=True)
            step = model(ids[:, :1], past_key_values=cache_of(first), use_cache=True)
            last = model(torch.cat([ids, ids[:, :1]], dim=1), logits_to_keep=1)
        outs.append((first.logits, step.logits, last.logits))
    return max(rel_err(a, b) for a, b in zip(*outs))


def _indivisible_error(ps):
    from zoo.models import BertConfig, BertForPreTraining, GPT2LMHeadModel

    messages = []
    for model in (GPT2LMHeadModel(tiny_zoo_config().replace(sequence_parallel=True), parallel=ps),
                  BertForPreTraining(BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1,
                                                num_attention_heads=4, sequence_parallel=True), parallel=ps)):
        ids = torch.zeros(2, SEQ + 1, dtype=torch.long)
        try:
            model(ids, labels=ids)
        except ValueError as error:
            messages.append(str(error))
        else:
            messages.append(None)
    return messages


# ---------------------------------------------------------------- the spawns
def _worker(rank, world_size, dirs):
    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(world_size)
    results = {"gpt2": _gpt2_parity(ps, dirs["gpt2"])}
    for kind in ("pre-norm", "post-norm"):
        results[kind] = _bert_parity(ps, dirs[kind], kind)
    if world_size == 2:
        results["collectives"] = {n: _collectives(ps, n) for n in (1, 3)}
        results["recompute"] = {r: _train_losses(ps, r) for r in (None, "selective", "full")}
        results["indivisible"] = _indivisible_error(ps)
        results["decoding"] = _decoding_without_sp(ps)
        results["heads"] = _heads_with_and_without_sp(ps, dirs["post-norm"])
    return results


@pytest.fixture(scope="module")
def runs(hf_dirs):
    return {tp: spawn(_worker, tp, hf_dirs) for tp in (2, 4)}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", ["gpt2", "pre-norm", "post-norm"])
def test_sequence_parallel_equals_transformers(runs, tp, model):
    for rank, results in enumerate(runs[tp]):
        errors = results[model]
        failures = tolerance_failures(errors, REL_TOL)
        assert not failures, f"{model} at tp={tp} rank {rank}: {failures}"
        assert any(k.startswith("grad64:") and ("ln" in k or "LayerNorm" in k) for k in errors)


def _kinds(calls):
    b_s_h = BATCH * SEQ * HIDDEN
    summary: dict[tuple[str, int], int] = {}
    for kind, numel, _ in calls:
        size = "activation" if numel == b_s_h else numel
        summary[(kind, size)] = summary.get((kind, size), 0) + 1
    return summary


def test_collectives_per_layer(runs):
    """Two all-gathers + two reduce-scatters of b*s*h per layer forward, the reverse backward plus two
    re-gathers (and one all-reduce of the LayerNorm / row-bias gradients each, 2h or h elements); no
    activation all-reduce."""
    h, bs = HIDDEN, BATCH * SEQ
    for rank, results in enumerate(runs[2]):
        by_depth = results["collectives"]
        for phase in ("forward", "backward"):
            one, three = _kinds(by_depth[1][phase]), _kinds(by_depth[3][phase])
            per_layer = {key: (three.get(key, 0) - one.get(key, 0)) / 2 for key in set(one) | set(three)}
            per_layer = {key: n for key, n in per_layer.items() if n}
            if phase == "forward":
                expected = {("all_gather", "activation"): 2, ("reduce_scatter", "activation"): 2}
            else:   # the reverse + 2 re-gathers; ln_1, ln_2 (weight + bias in one) and the 2 row biases
                expected = {("reduce_scatter", "activation"): 2, ("all_gather", "activation"): 2 + 2,
                            ("all_reduce", 2 * h): 2, ("all_reduce", h): 2}
            assert per_layer == expected, f"rank {rank} {phase}: {per_layer}"
        # The whole step outside the layers: the embedding's vocab-parallel all-reduce (forward) is the only
        # activation all-reduce; the scatter after it, the gather before the LM head, the fused loss.
        one = _kinds(by_depth[1]["forward"])
        assert one == {("all_reduce", "activation"): 1, ("all_gather", "activation"): 2 + 1,
                       ("reduce_scatter", "activation"): 2, ("all_reduce", bs): 1, ("all_reduce", 2 * bs): 1}, one
        back = _kinds(by_depth[1]["backward"])   # + LM head (reduce-scatter, re-gather), scatter (all-gather)
        assert back == {("reduce_scatter", "activation"): 2 + 1, ("all_gather", "activation"): 4 + 2,
                        ("all_reduce", 2 * h): 2 + 1, ("all_reduce", h): 2}, back


def test_recomputation_is_bit_exact_with_dropout(runs):
    for rank, results in enumerate(runs[2]):
        (plain, plain_calls), (selective, selective_calls), (full, full_calls) = (
            results["recompute"][r] for r in (None, "selective", "full"))
        assert plain_calls == [] and len(selective_calls) == 2 * 5 and len(full_calls) == 2 * 5, (
            plain_calls, selective_calls, full_calls)
        assert set(selective_calls) == {"_core"}, selective_calls   # only the attention core
        assert plain[0] != plain[1], "dropout had no effect"
        assert selective == plain, f"rank {rank}: selective {selective} vs none {plain}"
        assert full == plain, f"rank {rank}: full {full} vs none {plain}"


def test_indivisible_sequence_is_one_sentence(runs):
    for message in runs[2][0]["indivisible"]:
        assert message is not None, "no ValueError"
        assert f"sequence length {SEQ + 1}" in message and "tensor-parallel size 2" in message, message
        assert message.count(". ") == 0 and message.endswith("."), message


def test_finetuning_heads_on_a_sequence_parallel_encoder(runs):
    for rank, results in enumerate(runs[2]):
        errors = results["heads"]
        assert any("qa_outputs" in k for k in errors) and any("classifier" in k for k in errors)
        failures = tolerance_failures(errors, REL_TOL)
        assert not failures, f"rank {rank}: {failures}"


def test_cached_decoding_runs_without_sequence_parallelism(runs):
    for rank, results in enumerate(runs[2]):
        assert results["decoding"] <= REL_TOL, f"rank {rank}: {results['decoding']:.3e}"


def test_tp1_is_a_no_op_and_config_stays_out_of_config_json():
    from zoo.models import GPT2LMHeadModel

    ids, _, labels = gpt2_batch()
    losses = []
    for sp in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(tiny_zoo_config().replace(sequence_parallel=sp))
        assert not model.transformer.uses_sequence_parallel(SEQ + 1)
        losses.append(model(ids, labels=labels).loss.item())
    assert losses[0] == losses[1]
    hf = model.config.replace(recompute_granularity="selective").to_hf_dict()
    assert "sequence_parallel" not in hf and "recompute_granularity" not in hf
    with pytest.raises(ValueError, match="recompute_granularity 'partial'"):
        model.config.replace(recompute_granularity="partial").validate()
