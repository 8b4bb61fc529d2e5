"""User errors raise zoo.errors.UserError (a ValueError) or MissingInput (a FileNotFoundError) with one sentence that names the offending value
and the fix (DESIGN.md, "Errors"): bad configs, unknown presets, impossible tp layouts, and broken
checkpoint directories. Everything runs in the pytest process; the checkpoints are tiny transformers
GPT-2s written with ``save_pretrained`` and then damaged.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from zoo.models import GPT2_PRESETS, GPT2Config, GPT2LMHeadModel, gpt2_config
from zoo.parallel import ParallelState


def _one_sentence(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, f"not one sentence: {message!r}"
    assert message.rstrip().endswith("."), f"not a sentence: {message!r}"
    return message


def _fake_tp(tp: int):
    """A tp-degree grid built by hand: valid as long as nothing issues a collective on it."""
    return ParallelState(tp_size=tp, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp, rank=0)


# ---------------------------------------------------------------- configs and presets
def test_hidden_size_not_divisible_by_heads():
    with pytest.raises(ValueError, match=r"n_embd=64 is not divisible by n_head=5") as err:
        GPT2Config(n_embd=64, n_head=5).validate()
    _one_sentence(err)


def test_heads_not_divisible_by_tp():
    config = GPT2Config(vocab_size=100, n_positions=16, n_embd=64, n_layer=1, n_head=4)
    with pytest.raises(ValueError, match=r"n_head=4 is not divisible by tensor-parallel size 3") as err:
        config.validate(tp_size=3)
    _one_sentence(err)
    # The model checks it before building anything (so before any collective).
    with pytest.raises(ValueError, match=r"n_head=4 is not divisible by tensor-parallel size 3"):
        GPT2LMHeadModel(config, parallel=_fake_tp(3))


def test_mlp_size_not_divisible_by_tp():
    with pytest.raises(ValueError, match=r"MLP size 102 is not divisible by tensor-parallel size 4"):
        GPT2Config(n_embd=64, n_head=4, n_inner=102).validate(tp_size=4)


def test_unsupported_activation_and_hf_fields():
    with pytest.raises(ValueError, match=r"activation_function 'relu' is not supported"):
        GPT2Config(activation_function="relu").validate()
    with pytest.raises(ValueError, match=r"scale_attn_by_inverse_layer_idx=True is not supported"):
        GPT2Config.from_dict({"scale_attn_by_inverse_layer_idx": True}).validate()


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown model preset 'nope'; choose one of .*'gpt2-tiny'") as err:
        gpt2_config("nope")
    _one_sentence(err)
    assert gpt2_config("gpt2-tiny").n_embd == GPT2_PRESETS["gpt2-tiny"]["n_embd"]


def test_sequence_longer_than_n_positions():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=8, n_embd=32, n_layer=1, n_head=4))
    with pytest.raises(ValueError, match=r"sequence length 9 exceeds n_positions=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ---------------------------------------------------------------- checkpoint directories
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=1, n_head=4)
    path = tmp_path_factory.mktemp("hf_tiny_gpt2")
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.fixture
def damaged(hf_dir, tmp_path):
    """A fresh copy of the good checkpoint, to be damaged by the test."""
    target = tmp_path / "ckpt"
    shutil.copytree(hf_dir, target)
    return target


def test_good_checkpoint_loads(hf_dir):
    # The baseline the damaged copies start from: any error below is the damage's.

    model = GPT2LMHeadModel.from_pretrained(hf_dir)
    assert model.config.n_embd == 32


def test_missing_directory(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing)) + r" does not exist") as err:
        GPT2LMHeadModel.from_pretrained(missing)
    _one_sentence(err)


def test_directory_without_config_json(damaged):
    (damaged / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no config\.json") as err:
        GPT2LMHeadModel.from_pretrained(damaged)
    _one_sentence(err)


def test_config_json_not_json(damaged):
    (damaged / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        GPT2LMHeadModel.from_pretrained(damaged)


def test_config_of_another_model_type(damaged):
    config = json.loads((damaged / "config.json").read_text())
    config["model_type"] = "bert"
    (damaged / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model_type 'bert', not 'gpt2'") as err:
        GPT2LMHeadModel.from_pretrained(damaged)
    _one_sentence(err)


def test_no_safetensors_file(damaged):
    (damaged / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        GPT2LMHeadModel.from_pretrained(damaged)


@pytest.mark.parametrize("keep", [0.5, 0.001], ids=["truncated-data", "truncated-header"])
def test_truncated_safetensors(damaged, keep):
    path = damaged / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:max(int(len(data) * keep), 4)])
    with pytest.raises(ValueError, match=re.escape(str(path)) + r" is truncated or corrupt") as err:
        GPT2LMHeadModel.from_pretrained(damaged)
    _one_sentence(err)


def test_config_disagrees_with_weights(damaged):
    config = json.loads((damaged / "config.json").read_text())
    config["n_embd"] = 16                     # the weights are 32 wide
    (damaged / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"tensor 'transformer\.\S+' has shape \[\d+, 32\] but the model expects "
                                         r"\[\d+, 16\]") as err:
        GPT2LMHeadModel.from_pretrained(damaged)
    _one_sentence(err)


def test_checkpoint_missing_a_tensor(damaged):
    path = damaged / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["transformer.h.0.mlp.c_fc.bias"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"has no tensor 'transformer\.h\.0\.mlp\.c_fc\.bias'"):
        GPT2LMHeadModel.from_pretrained(damaged)


def test_checkpoint_with_unknown_tensor(damaged):
    path = damaged / "model.safetensors"
    tensors = load_file(str(path))
    tensors["transformer.h.7.mlp.c_fc.bias"] = torch.zeros(4)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensors this model does not use, e\.g\. 'transformer\.h\.7\.mlp\.c_fc\.bias'"):
        GPT2LMHeadModel.from_pretrained(damaged)
