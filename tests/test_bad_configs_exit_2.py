"""Hostile configs and inputs end in one sentence, exit 2, before anything is built or written.

ds_configs (valid JSON of the wrong shape, bad batch sizes, no optimizer, fp16 and bf16 together),
model directories' config.json (not an object, wrong types, non-positive or absurd sizes, a missing
shape field), input paths checked by the run-config validation (no engine), ``hub:`` over a directory
of GLUE's TSV files, a non-UTF-8 prompt file, a model directory without tokenizer files, and finetune
texts longer than :data:`zoo.finetune.examples.MAX_TEXT_CHARS`, skipped before they are tokenised.
Everything runs in the pytest process.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from tests.checks import launch_script, one_error_line

REPO = Path(__file__).resolve().parent.parent
DEMO_DS_CONFIG = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())
FINETUNE_DS_CONFIG = REPO / "ds_configs" / "finetune_cpu.json"
FIXTURES = Path(__file__).parent / "fixtures" / "finetune"




# ------------------------------------------------------------------ ds_configs
def _without(config: dict, key: str) -> dict:
    return {k: v for k, v in config.items() if k != key}


DS_CONFIG_CASES = {
    "a-list": ([1, 2, 3], "holds a list, not a JSON object"),
    "micro-batch-0": ({**DEMO_DS_CONFIG, "train_micro_batch_size_per_gpu": 0},
                      "train_micro_batch_size_per_gpu in DeepSpeed config {path} is 0, not a positive integer"),
    "batch-a-string": ({**DEMO_DS_CONFIG, "train_batch_size": "8"},
                       'train_batch_size in DeepSpeed config {path} is "8" (a string), not a positive integer'),
    "no-optimizer": (_without(DEMO_DS_CONFIG, "optimizer"), "{path} has no optimizer block"),
    "fp16-and-bf16": ({**DEMO_DS_CONFIG, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
                      "{path} enables both fp16 and bf16"),
    "fp16-not-an-object": ({**DEMO_DS_CONFIG, "fp16": True}, "'fp16' in DeepSpeed config {path} is true"),
}


@pytest.mark.parametrize("case", sorted(DS_CONFIG_CASES))
def test_pretrain_refuses_bad_ds_configs_before_anything_is_written(case, tmp_path, capsys):
    content, needle = DS_CONFIG_CASES[case]
    assert_pretrain_refuses(content, needle, tmp_path, capsys)


def assert_pretrain_refuses(content, needle: str, tmp_path, capsys) -> None:
    """launch/pretrain.py on a ds_config of ``content`` exits 2 with ``needle`` ({path}: the file) and writes nothing."""
    from zoo.cli.pretrain import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    with pytest.raises(SystemExit) as exit_info:
        main(["--deepspeed_config", str(path), "--save", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert needle.format(path=path) in one_error_line(capsys, from_zoo=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json"]   # no --save directory left behind


@pytest.mark.parametrize("case", ["a-list", "micro-batch-0", "batch-a-string", "fp16-and-bf16"])
def test_finetune_reads_ds_configs_with_the_same_checks(case, tmp_path):
    from zoo.finetune.config import parse_args

    content, needle = DS_CONFIG_CASES[case]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError) as err:
        parse_args("mnli", ["--deepspeed_config", str(path), "--pretrained", str(tmp_path), "--data-dir", str(tmp_path)])
    assert needle.format(path=path) in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------ model directories' config.json
GPT2 = {"model_type": "gpt2", "vocab_size": 100, "n_positions": 16, "n_embd": 32, "n_layer": 1, "n_head": 4}
BERT = {"model_type": "megatron-bert", "vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128}
CONFIG_JSON_CASES = {
    "gpt2-a-list": ("gpt2", [], "holds a list, not a JSON object"),
    "gpt2-n_layer-a-string": ("gpt2", {**GPT2, "n_layer": "two"}, 'field n_layer is "two" (a string), not an integer'),
    "gpt2-n_positions-negative": ("gpt2", {**GPT2, "n_positions": -1}, "field n_positions is -1, not a positive integer"),
    "gpt2-vocab-1e12": ("gpt2", {**GPT2, "vocab_size": 1e12},
                        "field vocab_size is 1000000000000.0 (a number), not an integer"),
    "gpt2-vocab-10**12": ("gpt2", {**GPT2, "vocab_size": 10 ** 12},
                          "field vocab_size is 1000000000000, above zoo's bound of 10,000,000"),
    "gpt2-no-n_embd": ("gpt2", _without(GPT2, "n_embd"), "has no n_embd field, and zoo does not guess a model's shape"),
    "gpt2-dropout-a-string": ("gpt2", {**GPT2, "resid_pdrop": "0.1"}, 'field resid_pdrop is "0.1" (a string)'),
    "bert-a-list": ("bert", [], "holds a list, not a JSON object"),
    "bert-no-hidden_size": ("bert", _without(BERT, "hidden_size"), "has no hidden_size field"),
    "bert-heads-0": ("bert", {**BERT, "num_attention_heads": 0}, "field num_attention_heads is 0, not a positive"),
    "bert-positions-10**9": ("bert", {**BERT, "model_type": "bert",
                             "max_position_embeddings": 10 ** 9}, "above zoo's bound of 1,048,576"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_JSON_CASES))
def test_model_directory_config_json_is_refused_before_allocating(case, tmp_path, capsys):
    """GPT-2 directories through launch/generate.py, BERT ones through finetune/mnli.py: one sentence naming
    config.json and the field, exit 2, before any weight is read (the directories hold none)."""
    family, content, needle = CONFIG_JSON_CASES[case]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(content))
    with pytest.raises(SystemExit) as exit_info:
        if family == "gpt2":
            launch_script("generate").main(["--load", str(model), "--prompt", "x"])
        else:
            from zoo.cli.finetune import main

            main("mnli", ["--deepspeed_config", str(FINETUNE_DS_CONFIG), "--pretrained", str(model),
                          "--data-dir", str(FIXTURES / "mnli"), "--save", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    line = one_error_line(capsys, from_zoo=True)
    assert f"{model / 'config.json'} " in line and needle in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_model_config_refuses_non_positive_and_absurd_shapes():
    from zoo.models import BertConfig, GPT2Config

    with pytest.raises(ValueError, match=r"GPT-2 config field n_head is 0, not a positive integer"):
        GPT2Config(n_head=0).validate()
    with pytest.raises(ValueError, match=r"BERT config field vocab_size is 1000000000000, above zoo's bound"):
        BertConfig(vocab_size=10 ** 12).validate()


# ------------------------------------------------------------------ input paths, checked by validation
def _run_config(tmp_path, *flags):
    from zoo.config.loading import load_run_config
    from zoo.config.run_config import build_parser

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DEMO_DS_CONFIG))
    args = build_parser("test").parse_args(["--deepspeed_config", str(path), "--save", str(tmp_path / "run"), *flags])
    return load_run_config(args)


def test_missing_data_path_is_reported_by_validation(tmp_path):
    """The run-config validation names the missing files itself: no process group, model or engine."""
    prefix = tmp_path / "corpus"
    with pytest.raises(FileNotFoundError, match=rf"--data-path {prefix} names no indexed dataset \({prefix}\.bin and "
                                                rf"{prefix}\.idx are missing\)"):
        _run_config(tmp_path, "--data-path", str(prefix))
    (tmp_path / "corpus.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"\({prefix}\.idx is missing\)"):
        _run_config(tmp_path, "--data-path", str(prefix))
    (tmp_path / "corpus.idx").write_bytes(b"")
    assert _run_config(tmp_path, "--data-path", str(prefix)).data_path == [str(prefix)]


def test_pretrained_config_json_and_load_file_are_checked_by_validation(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**GPT2, "n_layer": "two"}))
    with pytest.raises(ValueError, match=r"config\.json field n_layer is \"two\""):
        _run_config(tmp_path, "--pretrained", str(tmp_path / "hf"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"--load .*file is a file, not a directory"):
        _run_config(tmp_path, "--load", str(tmp_path / "file"))
    assert _run_config(tmp_path, "--load", str(tmp_path / "not-yet")).load == str(tmp_path / "not-yet")


# ------------------------------------------------------------------ hub: over the original files
def test_hub_prefix_over_a_glue_tsv_directory(tmp_path, monkeypatch, capsys):
    import datasets

    from zoo.cli.finetune import main

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "MNLI"
    shutil.copytree(FIXTURES / "mnli", data)   # train.tsv and dev_matched.tsv have different columns
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps(BERT))
    with pytest.raises(SystemExit) as exit_info:
        main("mnli", ["--deepspeed_config", str(FINETUNE_DS_CONFIG), "--pretrained", str(tmp_path / "bert"),
                      "--data-dir", f"hub:{data}", "--save", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    line = one_error_line(capsys, from_zoo=True)
    assert line == (f"error: --data-dir hub:{data} is a local directory of the task's original files (train.tsv, "
                    f"dev_matched.tsv, dev_mismatched.tsv), which hub: does not read (it loads Hugging Face datasets); "
                    f"pass --data-dir {data} without hub: to read them."), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["MNLI", "bert"]   # nothing cached, no run directory


# ------------------------------------------------------------------ generation inputs
def test_non_utf8_prompt_file_is_named(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("first prompt\nun caf\xe9\n".encode("latin-1"))
    with pytest.raises(SystemExit) as exit_info:
        launch_script("generate").main(["--load", str(tmp_path / "model"), "--prompt-file", str(prompts)])
    assert exit_info.value.code == 2
    assert one_error_line(capsys, from_zoo=True) == (f"error: prompt file '{prompts}' is not UTF-8 text (byte 0xe9 on line 2); "
                                       "convert it, e.g. iconv -f latin1 -t utf-8.")


def test_missing_vocab_json_warns_naming_the_bundled_tokenizer(tmp_path):
    import torch
    import transformers

    from zoo.assets import GPT2_TOKENIZER_DIR
    from zoo.models import GPT2LMHeadModel
    from zoo.models.pretrained import BundledTokenizerWarning

    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**{k: v for k, v in GPT2.items() if k != "model_type"})
                                 ).save_pretrained(tmp_path)
    with pytest.warns(BundledTokenizerWarning) as caught:
        model = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert model.tokenizer_dir == GPT2_TOKENIZER_DIR
    message = str(caught[0].message)
    assert f"{tmp_path} holds no tokenizer files" in message and str(GPT2_TOKENIZER_DIR) in message, message
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(GPT2_TOKENIZER_DIR / name, tmp_path / name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BundledTokenizerWarning)
        assert GPT2LMHeadModel.from_pretrained(tmp_path).tokenizer_dir == tmp_path


# ------------------------------------------------------------------ over-long finetune texts
def _race_file(path: Path, article: str, answers: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"id": path.name, "article": article, "questions": ["Why _?"] * len(answers),
                                "options": [["a", "b", "c", "d"]] * len(answers), "answers": answers}))


def test_race_article_over_the_limit_is_skipped_and_counted(tmp_path):
    from zoo.finetune.examples import MAX_TEXT_CHARS
    from zoo.finetune.race import read_race
    from zoo.finetune.skips import MalformedExampleWarning

    _race_file(tmp_path / "train" / "high" / "big.txt", "word " * (MAX_TEXT_CHARS // 5 + 20_000), ["A", "B"])
    _race_file(tmp_path / "train" / "high" / "small.txt", "A short article.", ["C"])
    with pytest.warns(MalformedExampleWarning) as caught:
        splits = read_race(tmp_path)
    assert [e.guid for e in splits["train"]] == ["train-high-small.txt-0"]
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'train'}: skipped 2 malformed example(s) (2 example(s) with a text longer than 1,000,000 "
        "characters (zoo.finetune.examples.MAX_TEXT_CHARS)); the first is id 'train-high-big.txt-0'."]


def test_squad_contexts_and_glue_rows_over_the_limit_are_skipped(tmp_path, monkeypatch):
    from zoo.finetune import examples
    from zoo.finetune.glue import read_mnli
    from zoo.finetune.skips import MalformedExampleWarning
    from zoo.finetune.squad import read_squad_json

    monkeypatch.setattr(examples, "MAX_TEXT_CHARS", 40)
    squad = tmp_path / "dev-v1.1.json"
    squad.write_text(json.dumps({"data": [{"paragraphs": [
        {"context": "Paris is the capital of France, a country.", "qas": [   # 42 characters
            {"id": "long", "question": "What?", "answers": [{"text": "Paris", "answer_start": 0}]}]},
        {"context": "Rome is in Italy.", "qas": [
            {"id": "short", "question": "What?", "answers": [{"text": "Rome", "answer_start": 0}]}]}]}]}))
    with pytest.warns(MalformedExampleWarning, match=r"skipped 1 .*longer than 40 characters.*id 'long'"):
        assert [e.qid for e in read_squad_json(squad)] == ["short"]
    monkeypatch.setattr(examples, "MAX_TEXT_CHARS", 200_000)   # above csv's 131,072-character field limit
    mnli = tmp_path / "mnli"
    mnli.mkdir()
    (mnli / "train.tsv").write_text("index\tsentence1\tsentence2\tgold_label\n"
                                    f"0\t{'x' * 150_000}\tb\tneutral\n1\t{'y' * 200_001}\tb\tneutral\n2\ta\tb\tentailment\n")
    with pytest.warns(MalformedExampleWarning, match=r"skipped 1 .*longer than 200,000 characters.*id '1'"):
        assert [e.guid for e in read_mnli(mnli)["train"]] == ["train-0", "train-2"]


# ------------------------------------------------------------------ pipeline layouts
PIPELINE_CASES = {
    "bert": ({"model": "bert-tiny", "pipeline_model_parallel_size": 2, "sample_prompts": [], "model_overrides": {}},
             "pipeline stages are built for GPT-2 and Llama only, and model 'bert-tiny' is BERT (model_type 'megatron-bert')"),
    "more-stages-than-layers": ({"pipeline_model_parallel_size": 3},
                                "--pipeline-model-parallel-size 3 asks for more stages than the 2 transformer layers"),
    "uniform-not-dividing": ({"pipeline_model_parallel_size": 2, "pipeline_partition_method": "uniform",
                              "model_overrides": {"n_layer": 3}},
                             "splits the 3 transformer layers of model 'gpt2-tiny' equally, which 2 stages cannot"),
    "unknown-partition": ({"pipeline_partition_method": "type:GPT2BlockPipe"},
                          "pipeline_partition_method 'type:GPT2BlockPipe' is not 'parameters' or 'uniform'"),
    "zero-2": ({"pipeline_model_parallel_size": 2, "zero": 2}, "ZeRO stage 2 in {path} partitions gradients"),
}


@pytest.mark.parametrize("case", sorted(PIPELINE_CASES))
def test_pretrain_refuses_impossible_pipeline_layouts(case, tmp_path, capsys):
    changes, needle = PIPELINE_CASES[case]
    changes = dict(changes)
    config = json.loads(json.dumps(DEMO_DS_CONFIG))
    if "zero" in changes:
        config["zero_optimization"] = {"stage": changes.pop("zero")}
    config["zoo"].update(changes)
    assert_pretrain_refuses(config, needle, tmp_path, capsys)


def test_pipeline_world_and_bubble_are_checked_at_launch():
    from zoo.config.run_config import RunConfig
    from zoo.config.validation import pipeline_bubble_warning, validate_for_world

    config = RunConfig(tensor_parallel_size=2, pipeline_model_parallel_size=2, ds_config=dict(DEMO_DS_CONFIG))
    with pytest.raises(ValueError, match=r"tensor-parallel size 2 x pipeline-parallel size 2 = 4 does not divide the "
                                         r"world size 6; launch a multiple of 4 processes"):
        validate_for_world(config, 6)
    gas = validate_for_world(config, 4)   # dp = 1: 8 samples / micro 4 = 2 micro-batches over 2 stages
    assert gas == 2 and pipeline_bubble_warning(config, gas) is None
    config.pipeline_model_parallel_size = 4
    assert validate_for_world(config, 8) == 2
    assert "idle 60% of the step" in pipeline_bubble_warning(config, 2)
