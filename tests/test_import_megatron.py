"""Importing Megatron-LM GPT checkpoints (launch/import_megatron.py) into zoo's transformers GPT-2 layout.

A helper writes, from a random transformers GPT-2, the files Megatron-LM writes: ``iter_XXXXXXX/mp_rank_XX
[_YYY]/model_optim_rng.pt`` with its nested ``model`` dict, each generation's names, the fused QKV in the row
order of its ``checkpoint_version`` per tp rank, the word embeddings padded to 128 * tp rows (the padding
rows random, so a padding row left in would show), an argparse Namespace holding Megatron enums in ``args``,
numpy and torch RNG states and an optimizer state, and the tracker file.

* tp=2 x pp=2 (version 3.0, newest names), tp=2 (version 1.0) and tp=1 (version 0, oldest names, release/)
  and a Megatron Core GPTModel (tp=2 x pp=2, its flat names, Transformer Engine's fused LayerNorm names and
  extra states) import to exactly the weights of zoo's own save_pretrained of the same model (bit-equal), and
  transformers' and zoo's GPT2LMHeadModel logits on the import equal the original's.
* A file naming an unknown pickled global, a missing rank file, a non-empty --out: one sentence each,
  nothing written, the CLI exits 2.

Tolerance: logits max|a - b| / max|b| <= 1e-6 (fp32; the weights are bit-equal, so the forwards agree).
"""

from __future__ import annotations

import argparse
import enum
import io
import json
import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.checks import rel_err

REL_TOL = 1e-6
VOCAB = 50257
SHAPE = dict(n_embd=32, n_head=4, n_layer=4, n_positions=16)
OLDEST_NAMES = dict(stack="transformer", attention="attention", input_norm="input_layernorm",
                    post_norm="post_attention_layernorm", final_norm="final_layernorm")
NEWEST_NAMES = dict(stack="encoder", attention="self_attention", input_norm="input_norm",
                    post_norm="post_attention_norm", final_norm="final_norm")


# ----------------------------------------------------------------------------- Megatron's layout, from GPT-2
@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """A random transformers GPT-2 (random biases and LayerNorms too, so every tensor matters), saved."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **SHAPE)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    directory = tmp_path_factory.mktemp("original")
    model.save_pretrained(directory)
    return model, directory


@pytest.fixture(scope="module")
def zoo_reference(original, tmp_path_factory):
    """zoo's save_pretrained of the original weights: what an import must write."""
    from safetensors.torch import load_file

    from zoo.models import GPT2LMHeadModel

    directory = tmp_path_factory.mktemp("zoo_reference") / "hf"
    GPT2LMHeadModel.from_pretrained(original[1]).save_pretrained(directory)
    return load_file(directory / "model.safetensors")


def megatron_qkv(rows: torch.Tensor, tp: int, tp_rank: int, version: float) -> torch.Tensor:
    """GPT-2's fused QKV as one Megatron rank stores it: ``rows`` is [q | k | v] over all heads (3h, *rest)."""
    heads, rest = SHAPE["n_head"], tuple(rows.shape[1:])
    local = heads // tp
    blocks = rows.reshape(3, heads, -1, *rest)[:, tp_rank * local:(tp_rank + 1) * local]   # (3, heads/tp, d, *rest)
    if version == 0:
        ordered = blocks                                      # (3, heads, d)
    elif version == 1.0:
        ordered = blocks.movedim(0, 2)                        # (heads, d, 3)
    else:
        ordered = blocks.transpose(0, 1)                      # (heads, 3, d)
    return ordered.reshape(-1, *rest).clone()


def megatron_layer(hf: dict, layer: int, tp: int, tp_rank: int, version: float, names: dict) -> dict:
    """One layer's tensors of one tp rank, by Megatron's local names (without the layer prefix)."""
    prefix = f"transformer.h.{layer}."

    def column(tensor):   # split along the output dimension (Linear's dim 0)
        return tensor.chunk(tp, dim=0)[tp_rank].clone()

    def row(tensor):      # split along the input dimension (Linear's dim 1)
        return tensor.chunk(tp, dim=1)[tp_rank].clone()

    attention = names["attention"]
    return {
        f"{names['input_norm']}.weight": hf[prefix + "ln_1.weight"].clone(),
        f"{names['input_norm']}.bias": hf[prefix + "ln_1.bias"].clone(),
        f"{attention}.query_key_value.weight": megatron_qkv(hf[prefix + "attn.c_attn.weight"].t(), tp, tp_rank, version),
        f"{attention}.query_key_value.bias": megatron_qkv(hf[prefix + "attn.c_attn.bias"], tp, tp_rank, version),
        f"{attention}.dense.weight": row(hf[prefix + "attn.c_proj.weight"].t()),
        f"{attention}.dense.bias": hf[prefix + "attn.c_proj.bias"].clone(),
        f"{names['post_norm']}.weight": hf[prefix + "ln_2.weight"].clone(),
        f"{names['post_norm']}.bias": hf[prefix + "ln_2.bias"].clone(),
        "mlp.dense_h_to_4h.weight": column(hf[prefix + "mlp.c_fc.weight"].t()),
        "mlp.dense_h_to_4h.bias": column(hf[prefix + "mlp.c_fc.bias"]),
        "mlp.dense_4h_to_h.weight": row(hf[prefix + "mlp.c_proj.weight"].t()),
        "mlp.dense_4h_to_h.bias": hf[prefix + "mlp.c_proj.bias"].clone(),
    }


def padded_embeddings(hf: dict, tp: int) -> torch.Tensor:
    """The word embeddings padded as Megatron pads them (to a multiple of 128 * tp), padding rows random."""
    padded = -(-VOCAB // (128 * tp)) * 128 * tp
    padding = torch.randn(padded - VOCAB, SHAPE["n_embd"], generator=torch.Generator().manual_seed(5))
    return torch.cat([hf["transformer.wte.weight"], padding])


def megatron_model(hf: dict, tp: int, tp_rank: int, pp: int, pp_rank: int, version: float, names: dict) -> dict:
    """``state['model']`` of one (tp, pp) rank: Megatron's nested dict, the stage's layers numbered from 0."""
    per_stage = SHAPE["n_layer"] // pp
    stack = {}
    for local in range(per_stage):
        layer = megatron_layer(hf, pp_rank * per_stage + local, tp, tp_rank, version, names)
        stack.update({f"layers.{local}.{name}": tensor for name, tensor in layer.items()})
    language_model = {names["stack"]: stack}
    word_embeddings = padded_embeddings(hf, tp).chunk(tp, dim=0)[tp_rank].clone()
    if pp_rank == 0:
        language_model["embedding"] = {"word_embeddings": {"weight": word_embeddings},
                                       "position_embeddings": {"weight": hf["transformer.wpe.weight"].clone()}}
    model = {"language_model": language_model}
    if pp_rank == pp - 1:
        stack[f"{names['final_norm']}.weight"] = hf["transformer.ln_f.weight"].clone()
        stack[f"{names['final_norm']}.bias"] = hf["transformer.ln_f.bias"].clone()
        if pp > 1:
            model["word_embeddings_for_head"] = {"weight": word_embeddings.clone()}
    return model


# Megatron Core's names of a layer (Transformer Engine's spec: each LayerNorm fused into the next linear layer).
MCORE_LAYER_NAMES = {
    "input_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_norm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "self_attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_norm.weight": "mlp.linear_fc1.layer_norm_weight",
    "post_attention_norm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
}


def mcore_model(hf: dict, tp: int, tp_rank: int, pp: int, pp_rank: int) -> dict:
    """``state['model']`` of one rank of a Megatron Core GPTModel (flat names, Transformer Engine's extra states,
    the last stage's tied ``output_layer.weight``), from the legacy layout of the same weights."""
    legacy = flat(megatron_model(hf, tp, tp_rank, pp, pp_rank, 3.0, NEWEST_NAMES))
    model = {}
    for name, tensor in legacy.items():
        name = name.removeprefix("language_model.").replace("encoder.", "decoder.")
        if name.startswith("decoder.layers."):
            _, _, layer, local = name.split(".", 3)
            model[f"decoder.layers.{layer}.{MCORE_LAYER_NAMES[local]}"] = tensor
            model[f"decoder.layers.{layer}.self_attention.core_attention._extra_state"] = io.BytesIO()
            model[f"decoder.layers.{layer}.mlp.linear_fc1._extra_state"] = io.BytesIO(b"fp8 meta\xff")
        elif name == "decoder.final_norm.weight" or name == "decoder.final_norm.bias":
            model[name.replace("final_norm", "final_layernorm")] = tensor
        else:
            model[name.replace("word_embeddings_for_head", "output_layer")] = tensor
    return model


def flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def fake_megatron_enums():
    """Megatron's enums under their module paths, as its args pickle them (Megatron is not installed)."""
    modules = {name: types.ModuleType(name) for name in ("megatron", "megatron.core", "megatron.core.enums")}
    model_type = enum.Enum("ModelType", "encoder_or_decoder encoder_and_decoder")
    model_type.__module__ = "megatron.core.enums"
    modules["megatron.core.enums"].ModelType = model_type
    return modules, model_type


def megatron_args(tp: int, pp: int, model_type) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=SHAPE["n_layer"], hidden_size=SHAPE["n_embd"], num_attention_heads=SHAPE["n_head"],
        ffn_hidden_size=4 * SHAPE["n_embd"], max_position_embeddings=SHAPE["n_positions"], seq_length=16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, padded_vocab_size=-(-VOCAB // (128 * tp)) * 128 * tp,
        make_vocab_size_divisible_by=128, tokenizer_type="GPT2BPETokenizer", openai_gelu=True,
        layernorm_epsilon=1e-5, hidden_dropout=0.1, attention_dropout=0.1, params_dtype=torch.float32,
        position_embedding_type="learned_absolute", untie_embeddings_and_output_weights=False,
        virtual_pipeline_model_parallel_size=None, model_type=model_type.encoder_or_decoder, iteration=10)


def write_megatron_checkpoint(root: Path, hf: dict, tp: int, pp: int, version: float, names: dict,
                              release: bool = False, mcore: bool = False, **args_changes) -> Path:
    """``root`` laid out as Megatron-LM's --save directory, one model_optim_rng.pt per (tp, pp) rank; the args
    Namespace takes ``args_changes``."""
    modules, model_type = fake_megatron_enums()
    saved = dict(sys.modules)
    sys.modules.update(modules)
    try:
        tag = "release" if release else "iter_0000010"
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                rank_dir = root / tag / (f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")
                rank_dir.mkdir(parents=True)
                args = megatron_args(tp, pp, model_type)
                vars(args).update(args_changes)
                state = {"args": args, "iteration": 10,
                         "model": mcore_model(hf, tp, tp_rank, pp, pp_rank) if mcore else
                                  megatron_model(hf, tp, tp_rank, pp, pp_rank, version, names),
                         "optimizer": {"optimizer": {"state": {}, "param_groups": [{"lr": 1e-4, "params": [0]}]},
                                       "grad_scaler": {"scale": torch.tensor(65536.0)}},
                         "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                                        "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]}
                if version:
                    state["checkpoint_version"] = version
                torch.save(state, rank_dir / "model_optim_rng.pt")
    finally:
        sys.modules.clear()
        sys.modules.update(saved)
    (root / "latest_checkpointed_iteration.txt").write_text("release" if release else "10")
    return root


def hf_weights(original) -> dict[str, torch.Tensor]:
    return {key: tensor.detach() for key, tensor in original[0].state_dict().items()}


# ----------------------------------------------------------------------------- round trips
LAYOUTS = [
    pytest.param(2, 2, 3.0, NEWEST_NAMES, False, False, id="tp2-pp2-v3"),
    pytest.param(2, 1, 1.0, NEWEST_NAMES, False, False, id="tp2-v1"),
    pytest.param(1, 1, 0, OLDEST_NAMES, True, False, id="tp1-v0-release"),
    pytest.param(2, 2, 3.0, None, False, True, id="tp2-pp2-mcore"),
]


@pytest.mark.parametrize("tp, pp, version, names, release, mcore", LAYOUTS)
def test_import_writes_zoo_export_of_the_same_weights(tmp_path, original, zoo_reference, tp, pp, version, names,
                                                      release, mcore):
    from safetensors.torch import load_file

    from zoo.checkpoint.megatron_import import import_megatron

    load = write_megatron_checkpoint(tmp_path / "megatron", hf_weights(original), tp, pp, version, names, release,
                                     mcore)
    result = import_megatron(load, tmp_path / "hf")
    assert (result.tp_size, result.pp_size, result.checkpoint_version) == (tp, pp, version)
    imported = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(imported) == set(zoo_reference)
    for key, tensor in zoo_reference.items():
        assert torch.equal(imported[key], tensor), key
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"], config["n_head"], config["n_positions"], config["vocab_size"],
            config["activation_function"]) == (4, 32, 4, 16, VOCAB, "gelu_new")
    assert {"generation_config.json", "vocab.json", "merges.txt"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging directories left behind"


def test_import_loads_in_transformers_and_zoo_with_the_original_logits(tmp_path, original):
    import transformers

    from zoo.checkpoint.megatron_import import import_megatron
    from zoo.models import GPT2LMHeadModel

    load = write_megatron_checkpoint(tmp_path / "megatron", hf_weights(original), 2, 2, 3.0, NEWEST_NAMES)
    import_megatron(load, tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original[0](ids).logits
        from_transformers = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()(ids).logits
        from_zoo = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()(ids, gather_output=True).logits
    assert rel_err(from_transformers, expected) <= REL_TOL
    assert rel_err(from_zoo, expected) <= REL_TOL


def test_megatron_exact_gelu_imports_as_gelu(tmp_path, original):
    """Megatron's default GeLU is the exact one (``--openai-gelu`` the tanh one GPT-2 uses)."""
    from zoo.checkpoint.megatron_import import import_megatron

    load = write_megatron_checkpoint(tmp_path / "megatron", hf_weights(original), 1, 1, 3.0, NEWEST_NAMES,
                                     openai_gelu=False)
    assert import_megatron(load, tmp_path / "hf").config.activation_function == "gelu"


# ----------------------------------------------------------------------------- bad inputs
class Unknown:
    """A class no allow-list names."""


def one_sentence(message: str) -> str:
    assert "\n" not in message and message.rstrip().endswith("."), message
    return message


def test_unknown_pickled_global_is_refused(tmp_path, original, capsys):
    from zoo.cli.import_megatron import main

    load = write_megatron_checkpoint(tmp_path / "megatron", hf_weights(original), 1, 1, 3.0, NEWEST_NAMES,
                                     extra=Unknown())
    path = load / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    with pytest.raises(SystemExit) as exit_info:
        main(["--load", str(load), "--out", str(tmp_path / "hf")])
    assert exit_info.value.code == 2
    message = one_sentence(capsys.readouterr().err.strip())
    assert f"{path} holds the pickled global tests.test_import_megatron.Unknown" in message
    assert not (tmp_path / "hf").exists()


def test_missing_rank_file_is_named(tmp_path, original, capsys):
    from zoo.cli.import_megatron import main

    load = write_megatron_checkpoint(tmp_path / "megatron", hf_weights(original), 2, 2, 3.0, NEWEST_NAMES)
    missing = load / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt"
    missing.unlink()
    with pytest.raises(SystemExit) as exit_info:
        main(["--load", str(load), "--out", str(tmp_path / "hf")])
    assert exit_info.value.code == 2
    message = one_sentence(capsys.readouterr().err.strip())
    assert f"{missing} is missing" in message and "tp=2 x pp=2" in message
    assert not (tmp_path / "hf").exists()


def test_non_empty_output_is_never_replaced(tmp_path, original):
    from zoo.checkpoint.megatron_import import import_megatron

    load = write_megatron_checkpoint(tmp_path / "megatron", hf_weights(original), 1, 1, 3.0, NEWEST_NAMES)
    import_megatron(load, tmp_path / "hf")
    before = sorted(p.name for p in (tmp_path / "hf").iterdir())
    with pytest.raises(ValueError, match="exists and is not a Megatron-LM import") as err:
        import_megatron(load, tmp_path / "hf")
    one_sentence(str(err.value))
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == before


def test_cli_imports_a_chosen_iteration(tmp_path, original, capsys):
    from zoo.cli.import_megatron import main

    load = write_megatron_checkpoint(tmp_path / "megatron", hf_weights(original), 2, 1, 3.0, NEWEST_NAMES)
    (load / "latest_checkpointed_iteration.txt").write_text("20")   # names an iteration that is not there
    main(["--load", str(load), "--out", str(tmp_path / "hf"), "--iteration", "10"])
    assert "tp=2, pp=1" in capsys.readouterr().out
    assert (tmp_path / "hf" / "model.safetensors").is_file()
