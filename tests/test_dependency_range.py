"""zoo's families work with whichever transformers and DeepSpeed of setup.cfg's ranges are installed.

``make test`` runs this module against the newest releases, ``make test-oldest`` against the oldest the ranges
allow (with the model and interop tests named there), so both ends of each declared range are tested.

- Every family (GPT-2, pre-norm and post-norm BERT, Llama with Llama-3 rope scaling and a non-default theta) is
  built, run forward with labels, saved, reloaded by zoo (bit-equal loss and logits) and loaded by transformers'
  own class: logits and loss max|zoo - ref| / max|ref| <= 1e-5 (fp32, dropout off, tests/checks.py).
- The key/value cache comes back under the field name the installed transformers declares, decodes, and no zoo
  forward, cache read or generation touches transformers' deprecated alias (nothing logged about it, in a
  process where transformers has logged nothing yet).
- One DeepSpeed step of each family through zoo's engine path (``setup_engine``, zoo's ``backward``, AdamW with
  clipping) at tp = 2 lowers the loss of its batch.
- The bundled GPT-2 tokenizer decodes to exactly the text it encoded (transformers 4 would "clean up" " ,").
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.checks import rel_err
from tests.helpers.llama_reference import hf_llama_config
from tests.spawn import spawn

REL_TOL = 1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
# family -> (zoo preset, overrides, transformers class)
FAMILIES = {
    "gpt2": ("gpt2-tiny", {}, "GPT2LMHeadModel"),
    "bert-pre-norm": ("bert-tiny", {"pre_norm": True}, "MegatronBertForPreTraining"),
    "bert-post-norm": ("bert-tiny", {"pre_norm": False}, "BertForPreTraining"),
    "llama": ("llama-tiny", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}, "LlamaForCausalLM"),
}
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
              "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "llama": {}}


def family_model(name: str, parallel=None, dropout: bool = True):
    """zoo's pretraining model of ``name`` (FAMILIES), seeded, optionally without dropout."""
    from zoo.models import model_config
    from zoo.models.families import build_model

    preset, overrides, _ = FAMILIES[name]
    if not dropout:
        overrides = {**overrides, **NO_DROPOUT[name.split("-")[0]]}
    torch.manual_seed(0)
    return build_model(model_config(preset, **overrides), parallel)


def family_batch(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A labelled batch of 2 x 16 tokens for the family's forward (BERT: MLM labels and sentence order)."""
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(seed))
    if not name.startswith("bert"):
        return {"input_ids": ids, "labels": ids}
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
            "labels": ids, "next_sentence_label": torch.tensor([0, 1])}


def logits_of(output) -> torch.Tensor:
    return output.logits if getattr(output, "logits", None) is not None else output.prediction_logits


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_saves_reloads_and_loads_in_transformers(name, tmp_path):
    import transformers

    from zoo.models.families import family_of

    model = family_model(name).eval()
    batch = family_batch(name)
    with torch.no_grad():
        out = model(**batch, gather_output=True)
    assert out.loss is not None and torch.isfinite(out.loss)
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path)
    assert family_of(again.config) is family_of(model.config)
    with torch.no_grad():
        reloaded = again(**batch, gather_output=True)
    assert torch.equal(reloaded.loss, out.loss) and torch.equal(logits_of(reloaded), logits_of(out))
    ref = getattr(transformers, FAMILIES[name][2]).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = ref(**batch)
    assert rel_err(logits_of(out), logits_of(theirs)) <= REL_TOL, transformers.__version__
    assert rel_err(out.loss, theirs.loss) <= REL_TOL, transformers.__version__


def test_a_transformers_llama_with_scaled_rope_loads_in_zoo(tmp_path):
    """The reverse direction for the one family whose config.json spelling differs between transformers 4 and 5."""
    import transformers

    from zoo.models import LlamaForCausalLM

    torch.manual_seed(0)
    config = hf_llama_config({**LLAMA3_ROPE, "rope_theta": 500000.0}, vocab_size=1000, hidden_size=64,
                             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    assert (model.config.rope_theta, model.config.rope_scaling) == (500000.0, LLAMA3_ROPE)
    batch = family_batch("llama")
    with torch.no_grad():
        assert rel_err(model(**batch).logits, ref(**batch).logits) <= REL_TOL


# ------------------------------------------------------------------------------------------- the cache
class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _cache_worker(rank, world_size):
    import dataclasses

    import transformers

    from zoo.inference.generate import GenerationConfig, generate
    from zoo.models.outputs import cache_of

    kept = _Kept()
    library = logging.getLogger("transformers")
    library.setLevel(logging.WARNING)     # this process only: the suite's TRANSFORMERS_VERBOSITY would hide warnings
    library.addHandler(kept)
    result = {"transformers": transformers.__version__}
    for name in FAMILIES:
        model = family_model(name, dropout=False).eval()
        batch = family_batch(name)
        with torch.no_grad():
            full = model(**batch, gather_output=True)
            if name.startswith("bert"):
                continue
            ids = batch["input_ids"]
            first = model(ids[:, :-1], use_cache=True, gather_output=True)
            cache = cache_of(first)
            step = model(ids[:, -1:], past_key_values=cache, use_cache=True, gather_output=True)
        declared = {field.name for field in dataclasses.fields(type(first))}
        result[name] = {
            "declared": sorted(declared & {"cache", "past_key_values"}),
            "cache_layers": len(cache), "cache_length": cache_of(step)[0][0].shape[2],
            "decoded": rel_err(step.logits[:, -1], full.logits[:, -1]),
            "generated": [c.tokens for c in generate(model, [[5, 6, 7]], GenerationConfig(max_new_tokens=4,
                                                                                          greedy=True))],
        }
    result["logged"] = [m for m in kept.messages if "deprecated" in m]
    return result


def test_the_cache_is_returned_under_the_installed_field_name_and_no_deprecated_name_is_used():
    (result,) = spawn(_cache_worker, 1)
    assert result["logged"] == [], result["logged"]
    for name in ("gpt2", "llama"):
        family = result[name]
        assert len(family["declared"]) == 1, family          # the output class declares exactly one of the names
        assert family["cache_layers"] == 2 and family["cache_length"] == 16, family
        assert family["decoded"] <= REL_TOL, family
        assert len(family["generated"][0]) == 4, family


# ------------------------------------------------------------------------------------ DeepSpeed's engine
def _engine_step_worker(rank, world_size):
    import deepspeed

    from zoo.parallel import ParallelState, model_parallel_seed
    from zoo.training.loss_scaling import backward
    from zoo.training.startup import setup_engine

    deepspeed.init_distributed()
    ps = ParallelState.initialize(world_size)
    losses = {"deepspeed": deepspeed.__version__}
    for name in FAMILIES:
        # A new dict for each engine: DeepSpeed pops "torch_adam" from the one it is given (and would then build
        # its fused Adam for the next).
        config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                  "steps_per_print": 10 ** 9,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}}
        model_parallel_seed(5, ps)
        engine = setup_engine(family_model(name, ps, dropout=False), config, ps, 0.01, refresh_masters=False)
        batch = family_batch(name)
        before = engine(**batch).loss
        backward(engine, before)
        engine.step()
        with torch.no_grad():
            losses[name] = (before.item(), engine(**batch).loss.item())
    return losses


def test_one_deepspeed_step_of_each_family_through_zoos_engine_path():
    for losses in spawn(_engine_step_worker, 2):
        for name in FAMILIES:
            before, after = losses[name]
            assert torch.isfinite(torch.tensor(before)) and after < before, (losses["deepspeed"], name, losses[name])


# ----------------------------------------------------------------------------------------------- text
def test_the_bundled_gpt2_tokenizer_decodes_exactly_what_it_encoded():
    from zoo.data.tokenizers import load_gpt2_tokenizer

    tokenizer = load_gpt2_tokenizer()
    text = "Hello , world . It 's n't - a test ; ok ?"
    assert tokenizer.decode(tokenizer.encode(text)) == text
