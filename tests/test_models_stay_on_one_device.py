"""Device discipline of the models, proven without a GPU, and the fully-masked attention rows.

PyTorch refuses to mix ``meta`` and ``cpu`` tensors in most ops exactly as it refuses ``cuda`` and
``cpu`` (0-dim CPU tensors excepted in both cases), so a model whose parameters and inputs sit on
``meta`` raises wherever a host tensor slips into device maths (``torch.arange`` without
``device=``, a Python-side ``torch.tensor``...), which on CPU-only runs is otherwise invisible. The
meta kernels of the indexing ops (embedding, index_select, gather) skip that check, so the runs also
go through :class:`OneDevice`, a dispatch mode that refuses any aten op mixing devices (copies
excepted). Every family and task runs forward, loss and backward that way at tp = 1.

Collectives get the analogous check at tp = 2: inside the test, the ``torch.distributed``
collectives are replaced by stand-ins that assert every tensor handed to them is on the model's
device (``meta``), and then do nothing (meta tensors hold no data to move).

Fully-masked rows: ``attention_bias`` must leave every query row at least one key (CUDA's
memory-efficient SDPA kernel can return NaN for a row without one), and left padding must change
nothing at real positions, also under an SDPA that does return NaN there. Tolerance: max|a - b| /
max|b| <= 1e-5 (fp32).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.checks import rel_err
from tests.spawn import spawn
from zoo.models.outputs import cache_of

META = torch.device("meta")
REL_TOL = 1e-5
VOCAB = 1000            # not a multiple of 128: the padded vocab columns are in play
NO_DROPOUT_GPT2 = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, vocab_size=VOCAB)
NO_DROPOUT_BERT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, vocab_size=VOCAB)


def on_meta(*shape, high: int = VOCAB) -> torch.Tensor:
    """A long tensor of ``shape`` on the meta device (values are never read there)."""
    return torch.empty(shape, dtype=torch.long, device=META).random_(0, high)


class OneDevice(TorchDispatchMode):
    """Refuses any aten op whose tensors sit on more than one device (0-dim CPU scalars aside, as CUDA
    allows them); copies between devices are what ``.to`` is for and pass."""

    TRANSFERS = ("aten::copy_", "aten::_to_copy")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.name().split(".")[0] not in self.TRANSFERS:
            devices = {str(t.device) for t in tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)}
            if len(devices) > 1:
                raise RuntimeError(f"{func.name()} mixes tensors on the devices {sorted(devices)}")
        return func(*args, **kwargs)


def build_on_meta(cls, config, parallel=None):
    with torch.device(META):
        model = cls(config, parallel) if parallel is not None else cls(config)
    assert all(p.is_meta for p in model.parameters())
    return model


# ------------------------------------------------------------------ the premise
def test_meta_refuses_host_tensors_like_cuda():
    logits = torch.empty(2, 3, device=META)
    with pytest.raises(RuntimeError, match="device"):
        F.cross_entropy(logits, torch.zeros(2, dtype=torch.long))           # host labels with device logits
    with pytest.raises(RuntimeError, match="device"):
        logits + torch.arange(3)                                            # arange without device=
    F.embedding(torch.arange(2), logits)                                    # meta lets this one through
    with OneDevice(), pytest.raises(RuntimeError, match="mixes tensors"):
        F.embedding(torch.arange(2), logits)                                # OneDevice does not
    with OneDevice():
        torch.zeros(3).to(META), logits + torch.tensor(1.0)                 # copies and CPU scalars pass


# ------------------------------------------------------------------ forward, loss, backward on meta (tp = 1)
def _gpt2():
    from zoo.models import GPT2LMHeadModel, gpt2_config

    return build_on_meta(GPT2LMHeadModel, gpt2_config("gpt2-tiny", **NO_DROPOUT_GPT2))


def _bert(cls_name: str):
    from zoo.models import bert_config
    from zoo.models.bert import heads as bert_heads
    from zoo.models.bert import model as bert

    cls = getattr(bert, cls_name, None) or getattr(bert_heads, cls_name)
    return build_on_meta(cls, bert_config("bert-tiny", **NO_DROPOUT_BERT))


def _left_pad_mask(b: int, s: int) -> torch.Tensor:
    """Row r keeps its last s - r columns (left padding), built on meta as a device copy would be."""
    return torch.ones(b, s, dtype=torch.bool, device=META).triu()


def gpt2_lm_loss():
    ids = on_meta(2, 8)
    out = _gpt2()(ids, labels=ids, gather_output=True)
    return out.loss, out.logits


def gpt2_left_padded_forward():
    ids, mask = on_meta(3, 8), _left_pad_mask(3, 8)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = _gpt2()(ids, attention_mask=mask, position_ids=positions, labels=ids.masked_fill(~mask, -100))
    return out.loss, out.logits


def gpt2_cached_decoding_step():
    model = _gpt2()
    ids, mask = on_meta(3, 8), _left_pad_mask(3, 8)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    prefill = model(ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)          # (b, L + 1)
    step = model(on_meta(3, 1), attention_mask=mask, position_ids=positions[:, -1:] + 1,
                 past_key_values=cache_of(prefill), use_cache=True, logits_to_keep=1, gather_output=True)
    return step.logits.float().sum(), step.logits


def gpt2_cached_chunk_without_mask():
    """A 3-token chunk after the cache with no mask: the model builds the offset causal mask itself."""
    model = _gpt2()
    prefill = model(on_meta(1, 5), use_cache=True)
    out = model(on_meta(1, 3), past_key_values=cache_of(prefill), use_cache=True, labels=on_meta(1, 3))
    return out.loss, out.logits


def bert_encoder_defaults():
    """No mask, token types or positions given: the encoder makes them on the input's device."""
    out = _bert("BertModel")(on_meta(2, 8))
    return out.pooler_output.sum(), out.last_hidden_state


def bert_pretraining():
    ids = on_meta(2, 8)
    out = _bert("BertForPreTraining")(ids, token_type_ids=on_meta(2, 8, high=2),
                                      attention_mask=_left_pad_mask(2, 8).flip(-1),
                                      labels=ids, next_sentence_label=on_meta(2, high=2), gather_output=True)
    return out.loss, out.prediction_logits


def bert_sequence_classification():
    out = _bert("BertForSequenceClassification")(on_meta(2, 8), attention_mask=_left_pad_mask(2, 8).flip(-1),
                                                 token_type_ids=on_meta(2, 8, high=2), labels=on_meta(2, high=2))
    return out.loss, out.logits


def bert_multiple_choice():
    out = _bert("BertForMultipleChoice")(on_meta(2, 4, 8), attention_mask=torch.ones(2, 4, 8, device=META),
                                         token_type_ids=on_meta(2, 4, 8, high=2), labels=on_meta(2, high=4))
    return out.loss, out.logits


def bert_question_answering():
    out = _bert("BertForQuestionAnswering")(on_meta(2, 8), attention_mask=_left_pad_mask(2, 8).flip(-1),
                                            token_type_ids=on_meta(2, 8, high=2),
                                            start_positions=on_meta(2, high=8), end_positions=on_meta(2, high=8))
    return out.loss, out.start_logits


@pytest.mark.parametrize("case", [gpt2_lm_loss, gpt2_left_padded_forward, gpt2_cached_decoding_step,
                                  gpt2_cached_chunk_without_mask, bert_encoder_defaults, bert_pretraining,
                                  bert_sequence_classification, bert_multiple_choice, bert_question_answering],
                         ids=lambda f: f.__name__)
def test_forward_loss_backward_stay_on_the_device(case):
    with OneDevice():
        loss, logits = case()
        assert loss.is_meta and logits.is_meta
        if loss.requires_grad:
            loss.backward()


# ------------------------------------------------------------------ collectives see only device tensors (tp = 2)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
               "isend", "irecv")


def _tensors_in(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors_in(value)


@contextlib.contextmanager
def collectives_checked_on(device: torch.device):
    """Within the block every torch.distributed collective asserts that all the tensors it is handed
    are on ``device``; on meta it then does nothing (there is no data to move), elsewhere it calls
    through. Yields the list of the collectives' names, in call order."""
    import torch.distributed as dist

    calls: list[str] = []
    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def checked(name, fn):
        def collective(*args, **kwargs):
            for tensor in _tensors_in([*args, *kwargs.values()]):
                assert tensor.device == device, f"dist.{name} got a tensor on {tensor.device}, not {device}"
            calls.append(name)
            return None if device.type == "meta" else fn(*args, **kwargs)
        return collective

    for name, fn in real.items():
        setattr(dist, name, checked(name, fn))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def _collectives_worker(rank, world_size):
    from zoo.models import BertForPreTraining, GPT2LMHeadModel, bert_config, gpt2_config
    from zoo.parallel import ParallelState

    ps = ParallelState.initialize(world_size)
    seen = {}
    with collectives_checked_on(META) as calls, OneDevice():
        model = build_on_meta(GPT2LMHeadModel, gpt2_config("gpt2-tiny", **NO_DROPOUT_GPT2), ps)
        ids = on_meta(2, 8)
        model(ids, labels=ids, gather_output=True).loss.backward()
        seen["gpt2"] = sorted(set(calls))
        calls.clear()
        model = build_on_meta(BertForPreTraining, bert_config("bert-tiny", **NO_DROPOUT_BERT), ps)
        model(ids, attention_mask=_left_pad_mask(2, 8).flip(-1), labels=ids,
              next_sentence_label=on_meta(2, high=2)).loss.backward()
        seen["bert"] = sorted(set(calls))
        calls.clear()
        try:                                                        # the check itself can fail
            torch.distributed.all_reduce(torch.zeros(2), group=ps.tp_group)
            seen["host_tensor_refused"] = False
        except AssertionError:
            seen["host_tensor_refused"] = True
    return seen


def test_collectives_are_handed_device_tensors_only_at_tp2():
    for rank, seen in enumerate(spawn(_collectives_worker, 2)):
        assert seen["gpt2"] == ["all_gather", "all_reduce"], f"rank {rank}: {seen['gpt2']}"
        assert seen["bert"] == ["all_reduce"], f"rank {rank}: {seen['bert']}"
        assert seen["host_tensor_refused"], f"rank {rank}: a host tensor passed the collective check"


# ------------------------------------------------------------------ no query row without a key
def _plain_keep(mask: torch.Tensor, s: int, causal: bool, past: int) -> torch.Tensor:
    """The keep-pattern of the mask and causality alone, (b, 1, s or 1, P + s)."""
    keep = mask.bool()[:, None, None, :]
    if causal:
        keep = keep & torch.ones(s, past + s, dtype=torch.bool).tril(diagonal=past)
    return keep


BIAS_CASES = {
    "left-padded causal": (torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]), 5, True, 0),
    "causal after a cache": (torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]), 3, True, 2),
    "decoding step": (torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]), 1, True, 4),
    "bert padding": (torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), 5, False, 0),
    "bert all-pad sample": (torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0]]), 4, False, 0),
    "causal all-pad sample": (torch.tensor([[0, 0, 0, 0], [0, 1, 1, 1]]), 4, True, 0),
}


@pytest.mark.parametrize("case", list(BIAS_CASES))
def test_attention_bias_leaves_no_query_without_a_key(case):
    from zoo.models.transformer import attention_bias

    mask, s, causal, past = BIAS_CASES[case]
    bias = attention_bias(mask, s, causal=causal, dtype=torch.float32, past_length=past)
    kept = bias > torch.finfo(torch.float32).min                           # (b, 1, s or 1, P + s)
    assert kept.any(dim=-1).all(), f"{case}: a query row has no key"
    plain = _plain_keep(mask, s, causal, past)
    had_key = plain.any(dim=-1, keepdim=True)
    assert torch.equal(kept & had_key, plain & had_key), f"{case}: a row that had keys changed"
    if causal:                                                              # a keyless row keeps its own position
        own = torch.arange(past + s)[None, :] == torch.arange(past, past + s)[:, None]
        assert torch.equal(kept & ~had_key, own.expand_as(kept) & ~had_key), case
    else:                                                                   # an all-pad sample keeps every key
        assert kept[~had_key.squeeze(-1)].all(), case


def _nan_on_keyless_rows(real_sdpa):
    """SDPA as CUDA's memory-efficient kernel can behave: NaN for a query row whose keys are all masked."""
    def sdpa(q, k, v, attn_mask=None, *args, **kwargs):
        out = real_sdpa(q, k, v, attn_mask, *args, **kwargs)
        if attn_mask is None:
            return out
        keyless = (attn_mask <= torch.finfo(attn_mask.dtype).min).all(dim=-1, keepdim=True)   # (b, 1, s, 1)
        return out.masked_fill(keyless, float("nan"))
    return sdpa


def test_left_padding_changes_no_real_position_even_if_keyless_rows_give_nan(monkeypatch):
    from zoo.models import GPT2LMHeadModel, gpt2_config

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", **NO_DROPOUT_GPT2)).eval()
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (7, 3, 1)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, True
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    new_tokens = torch.randint(0, VOCAB, (len(prompts), 1))
    with torch.no_grad():
        alone = [model(prompt[None]).logits[0] for prompt in prompts]                      # (n, V/p) each
        alone_next = [model(torch.cat((p, t))[None]).logits[0, -1] for p, t in zip(prompts, new_tokens)]
        monkeypatch.setattr(F, "scaled_dot_product_attention", _nan_on_keyless_rows(F.scaled_dot_product_attention))
        batched = model(ids, attention_mask=mask, position_ids=positions).logits             # (b, L, V/p)
        prefill = model(ids, attention_mask=mask, position_ids=positions, use_cache=True)
        step = model(new_tokens, attention_mask=torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1),
                     position_ids=positions[:, -1:] + 1, past_key_values=cache_of(prefill),
                     use_cache=True).logits[:, -1]                                          # (b, V/p)
    for row, prompt in enumerate(prompts):
        real = batched[row, width - len(prompt):]
        assert rel_err(real, alone[row]) <= REL_TOL, f"prompt {row}: real positions changed by padding"
        assert rel_err(prefill.logits[row, width - len(prompt):], alone[row]) <= REL_TOL, f"prefill {row}"
        assert rel_err(step[row], alone_next[row]) <= REL_TOL, f"prompt {row}: cached decoding step changed"
