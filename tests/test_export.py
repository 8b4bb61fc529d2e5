"""Exporting zoo DeepSpeed training checkpoints to transformers' layout (GPT-2, BERT), in one process.

* Real 2-iteration DeepSpeed pretraining runs at tp=2, GPT-2 and pre-norm BERT (one spawn), are exported;
  transformers' logits on the export (GPT2LMHeadModel, MegatronBertForPreTraining) equal those of the
  zoo model that DeepSpeed's ``load_checkpoint`` fills from the same files.
* A post-norm BERT checkpoint at tp=4 exports to transformers' BertForPreTraining layout, whose logits
  equal the same model built at tp=1.
* A tp=4 checkpoint in DeepSpeed's file layout, without ``model_config`` in its client state, exports to
  exactly the weights of the same model built at tp=1 (TP-invariant init), in bf16 and fp16.
* Every bad input gives its one-sentence error, writes nothing, and the CLI exits 2.

Tolerance: logits max|a - b| / max|b| <= 1e-5 (fp32); weights are compared bit-exactly.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checks import rel_err
from tests.helpers.tp_checkpoint import FAKE_MODEL, layout_state, write_tp_checkpoint
from tests.spawn import spawn

REPO = Path(__file__).resolve().parent.parent
REL_TOL = 1e-5
TINY_MODEL = dict(n_layer=2, n_embd=64, n_head=4)


def input_ids() -> torch.Tensor:
    return torch.randint(0, 50257, (2, 10), generator=torch.Generator().manual_seed(11))


def one_sentence(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message.rstrip().endswith("."), message
    return message


# ----------------------------------------------------------------------------- a real tp=2 DeepSpeed run
@pytest.fixture(scope="module")
def random_corpus_prefix(tmp_path_factory):
    """A small random-token corpus in the indexed format (the export does not care what was learned)."""
    import numpy as np

    from zoo.data.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path_factory.mktemp("corpus") / "random"
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, vocab_size=50257) as builder:
        for _ in range(16):
            builder.add_document(rng.integers(0, 50257, size=80))
    return str(prefix)


@pytest.fixture(scope="module")
def bert_corpus_prefix(tmp_path_factory):
    """Random BERT word-piece ids (no special tokens) in documents of sentences, the layout
    preprocess_bert writes: enough for SOP pairs and whole-word masking."""
    import numpy as np

    from zoo.data.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path_factory.mktemp("bert_corpus") / "random"
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, vocab_size=30522) as builder:
        for _ in range(12):
            for _ in range(6):
                builder.add_item(rng.integers(1000, 30000, size=int(rng.integers(6, 14))))
            builder.end_document()
    return str(prefix)


BERT_MODEL = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4)


def bert_inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(12)
    return {"input_ids": torch.randint(0, 30522, (2, 10), generator=generator),
            "token_type_ids": torch.randint(0, 2, (2, 10), generator=generator)}


def _pretrain_config(data_path: str, save: str):
    from zoo.config.run_config import RunConfig
    from zoo.config.validation import validate_static

    ds_config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                 "steps_per_print": 10 ** 9,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}}
    return validate_static(RunConfig(
        tensor_parallel_size=2, model="gpt2-tiny", seq_length=16, train_iters=2, data_path=data_path,
        split="80,20,0", save=save, log_interval=1, eval_interval=0, eval_iters=1,
        model_overrides=dict(TINY_MODEL), ds_config=ds_config, ds_config_path="<test>"))


def _train_then_reload_worker(rank, world_size, data_path, run_dir, bert_data_path, bert_run_dir):
    """Pretrain GPT-2 and then BERT 2 iterations at tp=2; after each, let DeepSpeed load the checkpoint into
    a fresh zoo model and return its gathered logits: the references the exports must reproduce."""
    from zoo.models import GPT2LMHeadModel, gpt2_config
    from zoo.parallel import ParallelState
    from zoo.training.pretrain import pretrain

    pretrain(_pretrain_config(data_path, run_dir))
    ps = ParallelState.initialize(2)
    gpt = reloaded_engine(GPT2LMHeadModel(gpt2_config("gpt2-tiny", **TINY_MODEL), parallel=ps), ps, run_dir)
    with torch.no_grad():
        logits = {"gpt2": gpt(input_ids=input_ids(), gather_output=True).logits}

    from zoo.models import BertForPreTraining, bert_config

    config = _pretrain_config(bert_data_path, bert_run_dir)
    config.model, config.model_overrides = "bert-tiny", dict(BERT_MODEL)
    pretrain(config)
    bert = reloaded_engine(BertForPreTraining(bert_config("bert-tiny", **BERT_MODEL), parallel=ps), ps, bert_run_dir)
    with torch.no_grad():
        output = bert(**bert_inputs(), gather_output=True)
    logits["bert"] = (output.prediction_logits, output.seq_relationship_logits)
    return logits


def reloaded_engine(model, ps, run_dir):
    """A fresh zoo model filled by DeepSpeed's own load_checkpoint from the run's latest checkpoint."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, mpu=ps, config={
        "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10 ** 9})
    path, client = engine.load_checkpoint(f"{run_dir}/checkpoints", load_optimizer_states=False,
                                          load_lr_scheduler_states=False)
    assert path is not None and client["iteration"] == 2
    engine.eval()
    return engine


@pytest.fixture(scope="module")
def trained_run(random_corpus_prefix, bert_corpus_prefix, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    logits = spawn(_train_then_reload_worker, 2, random_corpus_prefix, str(root / "tp2"), bert_corpus_prefix,
                   str(root / "bert_tp2"))
    return {"run_dir": root / "tp2", "logits": logits[0]["gpt2"], "bert_run_dir": root / "bert_tp2",
            "bert_logits": logits[0]["bert"]}


def test_export_of_tp2_run_equals_deepspeed_loaded_model(trained_run, tmp_path):
    import transformers

    from zoo.checkpoint.deepspeed_export import export_checkpoint
    from zoo.models import GPT2LMHeadModel

    out = tmp_path / "hf"
    result = export_checkpoint(trained_run["run_dir"], out)
    assert result.tp_size == 2 and result.dtype == torch.float32
    assert result.tag_dir.name == "iter_0000002" and "model_config" in result.config_source

    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert (hf.config.n_layer, hf.config.n_embd, hf.config.n_head, hf.config.n_positions) == (2, 64, 4, 256)
    with torch.no_grad():
        assert rel_err(hf(input_ids()).logits, trained_run["logits"]) <= REL_TOL
        zoo = GPT2LMHeadModel.from_pretrained(out).eval()
        assert rel_err(zoo(input_ids(), gather_output=True).logits, trained_run["logits"]) <= REL_TOL
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("Hello world")["input_ids"] == [15496, 995]


def test_export_of_tp2_bert_run_equals_deepspeed_loaded_model(trained_run, tmp_path):
    import json

    import transformers

    from zoo.checkpoint.deepspeed_export import export_checkpoint

    out = tmp_path / "hf"
    result = export_checkpoint(trained_run["bert_run_dir"], out)
    assert result.tp_size == 2 and result.model_type == "megatron-bert"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MegatronBertForPreTraining"] and (out / "vocab.txt").is_file()
    hf = transformers.MegatronBertForPreTraining.from_pretrained(out).eval()
    with torch.no_grad():
        output = hf(**bert_inputs())
    prediction, sop = trained_run["bert_logits"]
    assert rel_err(output.prediction_logits, prediction) <= REL_TOL
    assert rel_err(output.seq_relationship_logits, sop) <= REL_TOL


def test_post_norm_bert_at_tp4_exports_bert_for_pretraining(tmp_path):
    """Post-norm BERT in DeepSpeed's file layout at tp=4 (no processes: TP-invariant init makes the rank
    models shards of one master) -> transformers.BertForPreTraining with the tp=1 model's logits."""
    import transformers

    from zoo.checkpoint.deepspeed_export import export_checkpoint
    from zoo.models import BertForPreTraining, bert_config

    config = bert_config("bert-tiny", **BERT_MODEL, pre_norm=False, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    tag_dir = tmp_path / "run" / "checkpoints" / "iter_0000001"
    tag_dir.mkdir(parents=True)
    for rank in range(4):
        torch.manual_seed(7)
        model = BertForPreTraining(config, parallel=layout_state(4, rank))
        torch.save({"module": model.state_dict(), "optimizer": None, "mp_world_size": 4, "iteration": 1,
                    "zoo_model": "bert-tiny", "tensor_parallel_size": 4,
                    "model_config": model.hf_config_dict()}, tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
    (tmp_path / "run" / "checkpoints" / "latest").write_text(tag_dir.name)
    result = export_checkpoint(tmp_path / "run", tmp_path / "hf")
    assert result.model_type == "bert" and result.tp_size == 4
    torch.manual_seed(7)
    reference = BertForPreTraining(config).eval()
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ours, theirs = reference(**bert_inputs(), gather_output=True), hf(**bert_inputs())
    assert rel_err(theirs.prediction_logits, ours.prediction_logits) <= REL_TOL
    assert rel_err(theirs.seq_relationship_logits, ours.seq_relationship_logits) <= REL_TOL


def test_export_main_writes_requested_dtype(trained_run, tmp_path, capsys):
    """The CLI's main in-process (a subprocess would pay the imports again; the exit-2 test runs one)."""
    from safetensors.torch import load_file

    from zoo.checkpoint.deepspeed_export import export_checkpoint
    from zoo.cli.export import main

    export_checkpoint(trained_run["run_dir"] / "checkpoints", tmp_path / "fp32", tag="iter_0000002")
    main(["--load", str(trained_run["run_dir"]), "--out", str(tmp_path / "bf16"), "--dtype", "bf16"])
    assert "(tp=2)" in capsys.readouterr().out
    fp32, bf16 = load_file(tmp_path / "fp32" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    assert set(fp32) == set(bf16)
    for key, tensor in fp32.items():
        assert bf16[key].dtype == torch.bfloat16 and torch.equal(bf16[key], tensor.to(torch.bfloat16)), key


# ----------------------------------------------------------------------------- a tp=4 checkpoint in DeepSpeed's layout
def tp1_reference(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from zoo.checkpoint.hf.hf_io import hf_state_dict
    from zoo.models import GPT2LMHeadModel, gpt2_config

    torch.manual_seed(99)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", **FAKE_MODEL))
    return {k: v.to(dtype) for k, v in hf_state_dict(model, None).items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tp4_checkpoint_exports_the_tp1_weights(tmp_path, dtype):
    import json

    from safetensors.torch import load_file

    from zoo.checkpoint.deepspeed_export import export_checkpoint

    write_tp_checkpoint(tmp_path / "run", 4, dtype)
    result = export_checkpoint(tmp_path / "run", tmp_path / "hf", max_shard_size=1_000_000)
    assert result.tp_size == 4 and result.dtype == dtype and "model_config" in result.config_source
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"], config["n_positions"], config["vocab_size"]) == (2, 64, 32, 50257)
    assert config["torch_dtype"] == str(dtype).replace("torch.", "")
    files = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(files) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    exported = {k: v for f in files for k, v in load_file(f).items()}
    expected = tp1_reference(dtype)
    assert set(exported) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(exported[key], tensor), key


# ----------------------------------------------------------------------------- bad inputs
@pytest.fixture
def fake_run(tmp_path):
    return write_tp_checkpoint(tmp_path / "run", 2, torch.float32, tag="iter_0000003")


def expect_error(kind, pattern, load, out, **kwargs) -> str:
    from zoo.checkpoint.deepspeed_export import export_checkpoint

    with pytest.raises(kind, match=pattern) as err:
        export_checkpoint(load, out, **kwargs)
    assert not Path(out).exists(), "an export that failed left files behind"
    return one_sentence(err)


def test_missing_path(tmp_path):
    expect_error(FileNotFoundError, r"checkpoint path .*nowhere does not exist; pass the run directory",
                 tmp_path / "nowhere", tmp_path / "hf")


def test_directory_without_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    expect_error(FileNotFoundError, r"no DeepSpeed checkpoint under .*empty; pass a run directory",
                 tmp_path / "empty", tmp_path / "hf")


def test_missing_latest(fake_run, tmp_path):
    (fake_run / "checkpoints" / "latest").unlink()
    expect_error(FileNotFoundError, r"has no 'latest' file .* pass --tag with one of \['iter_0000003'\]",
                 fake_run, tmp_path / "hf")


def test_unknown_tag(fake_run, tmp_path):
    expect_error(FileNotFoundError, r"checkpoint tag 'iter_0000009' is not a directory .* one of \['iter_0000003'\]",
                 fake_run, tmp_path / "hf", tag="iter_0000009")


def test_missing_rank_file(fake_run, tmp_path):
    (fake_run / "checkpoints" / "iter_0000003" / "mp_rank_01_model_states.pt").unlink()
    expect_error(FileNotFoundError, r"mp_rank_01_model_states.pt is missing from a tp=2 checkpoint; copy every",
                 fake_run, tmp_path / "hf")


def test_stray_rank_file(fake_run, tmp_path):
    tag_dir = fake_run / "checkpoints" / "iter_0000003"
    (tag_dir / "mp_rank_02_model_states.pt").write_bytes((tag_dir / "mp_rank_01_model_states.pt").read_bytes())
    expect_error(ValueError, r"holds model states of ranks \[0, 1, 2\] but its client state says tensor_parallel_size=2",
                 fake_run, tmp_path / "hf")


def test_not_a_zoo_checkpoint(fake_run, tmp_path):
    path = fake_run / "checkpoints" / "iter_0000003" / "mp_rank_00_model_states.pt"
    torch.save({"module": {"bert.embeddings.word_embeddings.weight": torch.zeros(4, 4)}, "mp_world_size": 2}, path)
    expect_error(ValueError, r"mp_rank_00_model_states.pt is not a zoo checkpoint \(its client state has no "
                             r"'zoo_model'\)", fake_run, tmp_path / "hf")


def test_not_a_torch_file(fake_run, tmp_path):
    (fake_run / "checkpoints" / "iter_0000003" / "mp_rank_01_model_states.pt").write_bytes(b"not a checkpoint")
    expect_error(ValueError, r"mp_rank_01_model_states.pt cannot be read as a torch checkpoint",
                 fake_run, tmp_path / "hf")


def test_weights_disagree_with_recorded_config(tmp_path):
    from zoo.models import gpt2_config

    wrong = gpt2_config("gpt2-tiny", **dict(FAKE_MODEL, n_embd=128)).to_hf_dict()
    run = write_tp_checkpoint(tmp_path / "run", 2, torch.float32, client={"model_config": wrong})
    expect_error(ValueError, r"holds transformer.wte.weight of shape \(25216, 64\) but the recorded model config at "
                             r"tp=2 gives \(25216, 128\)", run, tmp_path / "hf")


def test_cli_exits_2_with_the_sentence(tmp_path):
    proc = subprocess.run([sys.executable, "launch/export.py", "--load", str(tmp_path / "nowhere"),
                           "--out", str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: checkpoint path {tmp_path / 'nowhere'} does not exist")
    assert not (tmp_path / "hf").exists()


def test_evaluate_reads_a_deepspeed_checkpoint_directly(trained_run, tmp_path):
    """launch/evaluate.py --load <run dir>: the DeepSpeed checkpoint is exported once and scored like
    the same weights exported by hand."""
    import json

    from zoo.checkpoint.deepspeed_export import export_checkpoint
    from zoo.cli.evaluate import main

    texts = ["The quick brown fox jumps over the lazy dog", "Tensor parallel layers split the heads"]
    data = tmp_path / "lambada_test.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    export_checkpoint(trained_run["run_dir"], tmp_path / "hf")
    scores = {}
    for name, load in (("deepspeed", trained_run["run_dir"]), ("exported", tmp_path / "hf")):
        main(["--task", "lambada", "--data", str(data), "--load", str(load), "--out", str(tmp_path / f"{name}.json"),
              "--no-strict"])
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())
    for key in ("correct", "total", "accuracy"):
        assert scores["deepspeed"][key] == scores["exported"][key], key
