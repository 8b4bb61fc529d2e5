"""Llama parity with transformers' ``LlamaForCausalLM`` at tp = 1, 2, 4, its checkpoint round trip, greedy
generation, TP-invariant init, the refusal of a layout that splits a key/value group, and the presets.

Two random transformers models (fixed seed, fp32, attention_dropout 0), vocabulary 1000 (padded at every tp):
- "gqa8x4-llama3": 8 query heads, 4 KV heads, Llama-3 rope scaling whose wavelengths fall in all three of its
  regions (kept, interpolated, divided), checked at tp 1, 2 and 4;
- "gqa4x2": 4 query heads, 2 KV heads, rope_theta 500000, at tp 1 and 2; at tp 4 it is refused.

Tolerances (dropout off; tests/checks.py says why each measure is rounding-proof):
- float32: logits and loss max|zoo - ref| / max|ref| <= 1e-5; each gradient max|zoo - ref| <= 1e-5 x the
  largest reference gradient of its layer (model.layers.N, or the top module);
- float64, both models cast, the same shifted loss on both sides' gathered logits: logits, loss and every
  gradient relative error <= 1e-9;
- save_pretrained -> transformers: every tensor bit-equal to the source's, logits <= 1e-5;
- greedy generation: token ids equal; the reference's every step wins by >= 1e-4 of max|logits| (asserted).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from tests.checks import decision_margin, rel_err, tolerance_failures
from tests.helpers.llama_reference import hf_llama_config
from tests.spawn import spawn

# The test checkpoints carry no tokenizer files; the bundled one standing in for them is what this warns about.
pytestmark = pytest.mark.filterwarnings("ignore::zoo.models.pretrained.BundledTokenizerWarning")
REL_TOL = 1e-5
GREEDY_MARGIN = 10 * REL_TOL
VOCAB = 1000
SEQ = 12
BATCH = 3
NEW = 10
PROMPTS = [[5, 17, 300, 42, 7, 11, 600], [9, 8, 123]]       # different lengths: left padding in zoo
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
SHAPES = {
    "gqa8x4-llama3": dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4,
                          max_position_embeddings=128, rope_parameters={**LLAMA3_ROPE, "rope_theta": 10000.0}),
    "gqa4x2": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
}
SHAPES_AT_TP = {1: ("gqa8x4-llama3", "gqa4x2"), 2: ("gqa8x4-llama3", "gqa4x2"), 4: ("gqa8x4-llama3",)}
REFUSAL = ("num_attention_heads=4 and num_key_value_heads=2 must both be divisible by tensor-parallel size 4 so "
           "that every rank holds whole heads and whole key/value groups; use a tp degree that divides 2.")


def hf_config(shape: str):
    fields = {k: v for k, v in SHAPES[shape].items() if k != "rope_parameters"}
    return hf_llama_config(SHAPES[shape]["rope_parameters"], vocab_size=VOCAB, num_hidden_layers=2,
                           attention_dropout=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, **fields)


def save_random_llama(path, shape: str, seed: int, matrix_std: float | None = None) -> str:
    """A transformers Llama with seeded random weights, RMSNorm weights randomised too (1 + 0.1 N(0, 1))."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(shape))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
            elif matrix_std is not None:
                param.normal_(0.0, matrix_std)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    dirs = {shape: save_random_llama(tmp_path_factory.mktemp(shape), shape, seed=1234 + i)
            for i, shape in enumerate(SHAPES)}
    # Generation needs weights large enough for varied, clearly decided greedy tokens.
    dirs["generate"] = save_random_llama(tmp_path_factory.mktemp("generate"), "gqa4x2", seed=7, matrix_std=0.3)
    return dirs


def batch(seed: int, padded: bool):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels, mask = ids.clone(), None
    if padded:  # right padding, masked and ignored by the loss
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, SEQ - 4:] = 0
        mask[2, SEQ - 7:] = 0
        labels = labels.masked_fill(mask == 0, -100)
    return ids, mask, labels


def layer_of(name: str) -> str:
    block = re.match(r"(model\.layers\.\d+)\.", name)
    return block.group(1) if block else name.rsplit(".", 1)[0]


def layer_scaled_errors(grads: dict, ref_grads: dict) -> dict[str, float]:
    largest: dict[str, float] = {}
    for name, grad in ref_grads.items():
        largest[layer_of(name)] = max(largest.get(layer_of(name), 0.0), grad.abs().max().item())
    return {f"grad32:{name}": (grads[name].double() - ref.double()).abs().max().item() / largest[layer_of(name)]
            for name, ref in ref_grads.items()}


def shifted_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)


# ---------------------------------------------------------------------------- checks run at each tp
def parity_errors(directory: str, ps, padded: bool, **overrides) -> dict[str, float]:
    """zoo (loaded at ps's tp) against transformers on one batch: fp32 with each model's own loss, then fp64."""
    import transformers

    from zoo.checkpoint.hf.hf_io import hf_state_dict
    from zoo.models import LlamaForCausalLM

    ids, mask, labels = batch(seed=7, padded=padded)
    ref = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="sdpa").eval()
    model = LlamaForCausalLM.from_pretrained(directory, parallel=ps, **overrides).eval()

    def grads():
        zoo = hf_state_dict(model, ps, {n: p.grad for n, p in model.named_parameters()})   # collective
        return zoo, {n: p.grad for n, p in ref.named_parameters()}

    ref_out = ref(ids, attention_mask=mask, labels=labels)
    ref_out.loss.backward()
    out = model(ids, attention_mask=mask, labels=labels, gather_output=True)
    out.loss.backward()
    zoo_grads, ref_grads = grads()
    assert set(zoo_grads) == set(ref_grads), sorted(set(zoo_grads) ^ set(ref_grads))
    errors = {"logits": rel_err(out.logits, ref_out.logits), "loss": rel_err(out.loss, ref_out.loss)}
    errors.update(layer_scaled_errors(zoo_grads, ref_grads))
    if overrides:                                  # the float64 pass checks the plain model only
        return errors
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        m.double()
    ref_logits = ref(ids, attention_mask=mask).logits
    logits = model(ids, attention_mask=mask, gather_output=True).logits
    shifted_loss(ref_logits, labels).backward()
    loss = shifted_loss(logits, labels)
    loss.backward()
    errors.update({"out64:logits": rel_err(logits, ref_logits),
                   "out64:loss": rel_err(loss, shifted_loss(ref_logits, labels))})
    zoo_grads, ref_grads = grads()
    errors.update({f"grad64:{n}": rel_err(zoo_grads[n], g) for n, g in ref_grads.items()})
    return errors


def round_trip(directory: str, out_dir: str, ps) -> dict[str, object] | None:
    """zoo loads ``directory`` at ps's tp and saves to ``out_dir``; transformers loads that (rank 0): its tensors
    against the source's, its logits against zoo's."""
    import transformers

    from zoo.models import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, parallel=ps).eval()
    ids, _, _ = batch(seed=3, padded=False)
    with torch.no_grad():
        logits = model(ids, gather_output=True).logits
    model.save_pretrained(out_dir)                                                   # collective
    if ps is not None and ps.tp_rank != 0:
        return None
    source = transformers.LlamaForCausalLM.from_pretrained(directory).state_dict()
    loaded = transformers.LlamaForCausalLM.from_pretrained(out_dir).eval()
    with torch.no_grad():
        hf_logits = loaded(ids).logits
    written = loaded.state_dict()
    return {"keys_equal": set(written) == set(source),
            "tensors_equal": all(torch.equal(written[k], source[k]) for k in source),
            "logits": rel_err(logits, hf_logits)}


def greedy_tokens(directory: str, ps) -> dict[bool, list[list[int]]]:
    """zoo's greedy generation of PROMPTS (one left-padded batch), with and without the key/value cache."""
    import dataclasses

    from zoo.inference import GenerationConfig, generate
    from zoo.models import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, parallel=ps)
    config = GenerationConfig(max_new_tokens=NEW, greedy=True, eod_token_id=None)
    return {cache: [c.tokens for c in generate(model, PROMPTS, dataclasses.replace(config, use_cache=cache), ps)]
            for cache in (True, False)}


def initial_weights(ps) -> dict[str, torch.Tensor]:
    """Merged weights of a freshly built (seeded) llama at ps's tp."""
    from zoo.checkpoint.hf.hf_io import hf_state_dict
    from zoo.models import LlamaForCausalLM, llama_config

    torch.manual_seed(42)
    config = llama_config("llama-tiny", vocab_size=VOCAB, num_attention_heads=8, num_key_value_heads=4,
                          intermediate_size=96)
    return hf_state_dict(LlamaForCausalLM(config, parallel=ps), ps)                   # collective


def all_checks(ps, tp: int, dirs: dict[str, str], out_root: str) -> dict[str, object]:
    results: dict[str, object] = {}
    for shape in SHAPES_AT_TP[tp]:
        for padded in (False, True):
            results[f"parity:{shape}:padded={padded}"] = parity_errors(dirs[shape], ps, padded)
        results[f"round_trip:{shape}"] = round_trip(dirs[shape], f"{out_root}/{shape}-tp{tp}", ps)
    if tp > 1:
        results["sequence_parallel"] = parity_errors(dirs["gqa8x4-llama3"], ps, False, sequence_parallel=True)
    if tp <= 2:
        results["greedy"] = greedy_tokens(dirs["generate"], ps)
    else:
        from zoo.models import LlamaForCausalLM

        with pytest.raises(ValueError) as refused:
            LlamaForCausalLM.from_pretrained(dirs["gqa4x2"], parallel=ps)
        results["refusal"] = str(refused.value)
    results["init"] = initial_weights(ps)
    return results


def _worker(rank, world_size, dirs, out_root):
    from zoo.parallel import ParallelState

    results = all_checks(ParallelState.initialize(world_size), world_size, dirs, out_root)
    return results if rank == 0 else {k: v for k, v in results.items() if k.startswith("parity")}


@pytest.fixture(scope="module")
def runs(hf_dirs, tmp_path_factory):
    """Every check at tp = 1 (in this process, parallel=None), 2 and 4 (one spawn each); per tp, per rank."""
    out_root = str(tmp_path_factory.mktemp("saved"))
    by_tp = {1: [all_checks(None, 1, hf_dirs, out_root)]}
    for tp in (2, 4):
        by_tp[tp] = spawn(_worker, tp, hf_dirs, out_root)
    return by_tp


@pytest.fixture(scope="module")
def hf_greedy(hf_dirs):
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(hf_dirs["generate"]).eval()
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                   min_new_tokens=NEW, pad_token_id=VOCAB - 1, output_logits=True,
                                   return_dict_in_generate=True)
        margin = decision_margin(torch.cat(generated.logits))
        assert margin >= GREEDY_MARGIN, f"the reference's greedy steps nearly tie ({margin:.1e}): change the seed"
        out.append(generated.sequences[0, len(prompt):].tolist())
    return out


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_equals_transformers(runs, tp):
    """Logits, loss and merged gradients at fp32 and fp64, without and with a (right-)padding mask, every rank."""
    for rank, results in enumerate(runs[tp]):
        checked = [name for name in results if name.startswith("parity:")]
        assert len(checked) == 2 * len(SHAPES_AT_TP[tp])
        for name in checked:
            errors = results[name]
            assert len([k for k in errors if k.startswith("grad32:")]) == 3 + 9 * 2   # embed, norm, head + 9/layer
            failures = tolerance_failures(errors, REL_TOL)
            assert not failures, f"tp={tp}, rank {rank}, {name}: {failures}"


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_equals_transformers(runs, tp):
    failures = tolerance_failures(runs[tp][0]["sequence_parallel"], REL_TOL)
    assert not failures, f"tp={tp}: {failures}"


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_save_pretrained_loads_in_transformers_exactly(runs, tp):
    for shape in SHAPES_AT_TP[tp]:
        result = runs[tp][0][f"round_trip:{shape}"]
        assert result["keys_equal"] and result["tensors_equal"], (tp, shape, result)
        assert result["logits"] <= REL_TOL, (tp, shape, result)


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_generation_equals_transformers(runs, hf_greedy, tp):
    assert any(len(set(tokens)) > 3 for tokens in hf_greedy), "the reference is degenerate"
    greedy = runs[tp][0]["greedy"]
    assert greedy[True] == hf_greedy, "with the key/value cache"
    assert greedy[False] == hf_greedy, "without the cache"


def test_init_is_tp_invariant(runs):
    reference = runs[1][0]["init"]
    for tp in (2, 4):
        merged = runs[tp][0]["init"]
        assert merged.keys() == reference.keys()
        for key in reference:
            assert torch.equal(merged[key], reference[key]), f"init of {key} differs between tp=1 and tp={tp}"
    std = reference["model.layers.0.mlp.gate_proj.weight"].std().item()
    scaled = reference["model.layers.0.mlp.down_proj.weight"].std().item()
    assert abs(std - 0.02) < 0.002 and abs(scaled - 0.01) < 0.001    # residual outputs scaled by 1/sqrt(2 * 2)


def test_kv_heads_not_divisible_by_tp_is_refused_in_one_sentence(runs):
    from zoo.models import LlamaConfig

    assert runs[4][0]["refusal"] == REFUSAL
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    config.validate(2)
    with pytest.raises(ValueError) as refused:
        config.validate(4)
    assert str(refused.value) == REFUSAL


def test_rope_frequencies_equal_transformers():
    """Default and Llama-3 scaled inverse frequencies, bit-equal to transformers' (float32)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from zoo.models.llama.config import LlamaConfig
    from zoo.models.llama.rope import inverse_frequencies

    for shape in SHAPES:
        values = hf_config(shape).to_dict()
        ours = inverse_frequencies(LlamaConfig.from_hf_dict(values))
        theirs = LlamaRotaryEmbedding(config=hf_config(shape)).inv_freq
        assert torch.equal(ours, theirs), shape
    scaled = ROPE_INIT_FUNCTIONS["llama3"](hf_config("gqa8x4-llama3"), None)[0]    # (config, device)
    unscaled = inverse_frequencies(LlamaConfig.from_hf_dict({**hf_config("gqa8x4-llama3").to_dict(),
                                                              "rope_parameters": {"rope_theta": 10000.0}}))
    assert torch.equal(inverse_frequencies(LlamaConfig.from_hf_dict(hf_config("gqa8x4-llama3").to_dict())), scaled)
    ratio = unscaled / scaled     # 1 (kept), between 1 and 8 (interpolated), 8 (divided): all three regions
    assert ratio[0] == 1 and 1 < ratio[1] < 8 and bool((ratio[2:] == 8).all()), ratio


def test_older_config_spelling_reads_the_same():
    """transformers 4's top-level rope_theta / rope_scaling read as transformers 5's rope_parameters."""
    from zoo.models.llama.config import LlamaConfig

    new = LlamaConfig.from_hf_dict(hf_config("gqa8x4-llama3").to_dict())
    old_values = {k: v for k, v in hf_config("gqa8x4-llama3").to_dict().items() if k != "rope_parameters"}
    old = LlamaConfig.from_hf_dict({**old_values, "rope_theta": 10000.0, "rope_scaling": dict(LLAMA3_ROPE)})
    assert (old.rope_theta, old.rope_scaling) == (new.rope_theta, new.rope_scaling) == (10000.0, LLAMA3_ROPE)
    with pytest.raises(ValueError, match=r"^rope_type 'yarn' is not supported; zoo's Llama implements "):
        LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0}).validate()


@pytest.mark.parametrize("preset, parameters", [("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248),
                                                ("llama3.1-8b", 8_030_261_248)])
def test_presets_have_the_released_shapes(preset, parameters):
    """Built on the meta device at tp = 1: the parameter counts of Meta's releases; valid at tp = 8."""
    from zoo.models import LlamaForCausalLM, llama_config
    from zoo.models.families import family_of

    config = llama_config(preset).validate(8)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert family_of(config).pretraining_model is LlamaForCausalLM


def test_tiny_preset_trains_on_cpu():
    """llama-tiny (the demo/test preset) learns two batches in 20 AdamW steps."""
    from zoo.models import LlamaForCausalLM, llama_config
    from zoo.models.families import family_of_model_type

    assert family_of_model_type("llama").config_class is type(llama_config("llama-tiny"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config("llama-tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(20):
        ids = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(step % 2))
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 2.0, losses


def test_bare_model_reads_and_writes_transformers_llama_model(hf_dirs, tmp_path):
    """zoo's LlamaModel loads a causal-LM checkpoint (``model.`` keys, ``lm_head`` ignored): its hidden states
    equal transformers' LlamaModel's (<= 1e-5); its save loads in transformers' LlamaModel with every tensor
    bit-equal."""
    import transformers

    from zoo.models import LlamaModel

    directory = hf_dirs["gqa8x4-llama3"]
    ids, mask, _ = batch(seed=11, padded=True)
    ref = transformers.LlamaForCausalLM.from_pretrained(directory).model.eval()
    model = LlamaModel.from_pretrained(directory).eval()
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).last_hidden_state
        theirs = ref(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()                                        # pad positions are not compared
    assert rel_err(ours[real], theirs[real]) <= REL_TOL
    model.save_pretrained(tmp_path / "bare")
    loaded = transformers.LlamaModel.from_pretrained(tmp_path / "bare").state_dict()
    source = ref.state_dict()
    assert set(loaded) == set(source)
    assert all(torch.equal(loaded[k], source[k]) for k in source)
