"""GPT-2 directories zoo writes carry generation_config.json as transformers writes it; BERT ones carry none.

* ``save_pretrained`` of a GPT-2 model writes the file transformers itself writes when it re-saves the same
  directory (bos_token_id = eos_token_id = 50256, no pad token), and ``GenerationConfig.from_pretrained``
  reads it.
* The export of a zoo DeepSpeed checkpoint (tp=2, DeepSpeed's file layout) carries the same file.
* ``save_pretrained`` of a BERT pretraining model writes none, as transformers writes none for it.
"""

from __future__ import annotations

import json

import torch

from tests.helpers.tp_checkpoint import write_tp_checkpoint

GPT2_TOKEN = 50256


def tiny_gpt2():
    from zoo.models import GPT2LMHeadModel, gpt2_config

    torch.manual_seed(0)
    return GPT2LMHeadModel(gpt2_config("gpt2-tiny", n_layer=1, n_embd=32, n_head=2, n_positions=16))


def check_gpt2_generation_config(directory) -> None:
    import transformers

    generation = transformers.GenerationConfig.from_pretrained(directory)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (GPT2_TOKEN, GPT2_TOKEN,
                                                                                           None)


def test_save_pretrained_writes_transformers_generation_config(tmp_path):
    import transformers

    tiny_gpt2().save_pretrained(tmp_path / "zoo")
    check_gpt2_generation_config(tmp_path / "zoo")
    transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "zoo").save_pretrained(tmp_path / "transformers")
    written = json.loads((tmp_path / "zoo" / "generation_config.json").read_text())
    expected = json.loads((tmp_path / "transformers" / "generation_config.json").read_text())
    assert written == expected


def test_export_writes_generation_config(tmp_path):
    from zoo.checkpoint.deepspeed_export import export_checkpoint

    write_tp_checkpoint(tmp_path / "run", 2, torch.float32)
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    check_gpt2_generation_config(tmp_path / "hf")


def test_bert_writes_no_generation_config_as_transformers(tmp_path):
    import transformers

    from zoo.models import BertForPreTraining, bert_config

    torch.manual_seed(0)
    BertForPreTraining(bert_config("bert-tiny", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                   max_position_embeddings=16)).save_pretrained(tmp_path / "zoo")
    transformers.AutoModelForPreTraining.from_pretrained(tmp_path / "zoo").save_pretrained(tmp_path / "transformers")
    assert not (tmp_path / "transformers" / "generation_config.json").exists()
    assert not (tmp_path / "zoo" / "generation_config.json").exists()
