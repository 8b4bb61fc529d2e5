"""Every command knows every model family: each runs on each family it claims, and refuses in one sentence (exit
code 2) a family it does not apply to. In-process, on tiny models and a tp=2 DeepSpeed checkpoint of each family
written without processes:

    runs       export (GPT-2, Llama, BERT), generate and evaluate (GPT-2, Llama), reshard's checks (all; pipeline
               stages for GPT-2 and Llama), plan (all), smoke's --model (GPT-2, Llama)
    refusals   generate, evaluate and smoke's --model of a BERT; reshard of a BERT into pipeline stages; the
               import of a Megatron-LM Llama or BERT
    plan       bf16 on the V100 (which has no bf16) is refused
    pretrain   Megatron's model-shape flags land in model_overrides under each family's own field names; a flag the
               family lacks, and an unknown flag, are one sentence naming the fix
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TP = 2
# Each family's preset with the smallest shapes its checks allow; dropout off.
TINY = {
    "gpt2": ("gpt2-tiny", dict(n_layer=2, n_embd=32, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                               attn_pdrop=0.0)),
    "llama": ("llama-tiny", dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=32)),
    "bert": ("bert-tiny", dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                               max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
}


def one_line_exit_2(capsys, main, argv: list[str]) -> str:
    """The sentence of ``main(argv)``, a command that ends with exit code 2: one ``error:`` line on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def write_deepspeed_checkpoint(root: Path, family: str) -> Path:
    """``root/checkpoints/<tag>/mp_rank_XX_model_states.pt`` at tp=2 as DeepSpeed writes them, from the rank models
    built without processes (TP-invariant init: the shards of one master model)."""
    from zoo.checkpoint.layout import layout_only_state
    from zoo.models.families import build_model, model_config

    preset, shape = TINY[family]
    tag_dir = root / "checkpoints" / "iter_0000001"
    tag_dir.mkdir(parents=True)
    for rank in range(TP):
        torch.manual_seed(11)
        model = build_model(model_config(preset, **shape), layout_only_state(TP, rank))
        torch.save({"module": model.state_dict(), "optimizer": None, "mp_world_size": TP, "iteration": 1,
                    "zoo_model": preset, "tensor_parallel_size": TP, "model_config": model.hf_config_dict()},
                   tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
    (root / "checkpoints" / "latest").write_text(tag_dir.name)
    return root


DEMO_CONFIGS = {"gpt2": "cpu_demo.json", "llama": "llama_cpu_demo.json", "bert": "bert_cpu_demo.json"}
MODEL_TYPES = {"gpt2": "gpt2", "llama": "llama", "bert": "megatron-bert"}
GENERATES_TEXT = ("gpt2", "llama")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each family's tp=2 checkpoint in a run directory whose config.json is the family's CPU demo config with the
    tiny shapes: {family: run directory}."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in TINY:
        run = write_deepspeed_checkpoint(root / family, family)
        config = json.loads((REPO / "ds_configs" / DEMO_CONFIGS[family]).read_text())
        config["zoo"]["model_overrides"] = dict(TINY[family][1])
        (run / "config.json").write_text(json.dumps(config))
        out[family] = run
    return out


def test_every_command_runs_each_family_it_claims(runs, tmp_path, capsys):
    """export (every family), generate and evaluate (the families that generate text), reshard's checks before the
    launched ranks' work (pipeline stages for GPT-2 and Llama, data parallelism for all; the launched conversions:
    tests/test_offline_reshard.py, tests/test_llama_layout_change.py), plan and smoke's --model checks."""
    from zoo.cli import evaluate, export, generate, plan
    from zoo.cli.smoke import parse_args
    from zoo.training.offline_reshard import plan_conversion

    data = tmp_path / "wiki.test.tokens"
    data.write_text(" = Title = \n\n The tensor @-@ parallel layer splits every matrix across the ranks . \n" * 3)
    for family, run in runs.items():
        hf = tmp_path / f"{family}-hf"
        export.main(["--load", str(run), "--out", str(hf)])
        assert json.loads((hf / "config.json").read_text())["model_type"] == MODEL_TYPES[family]
        layout = (1, 2, 1) if family in GENERATES_TEXT else (1, 1, 2)
        conversion = plan_conversion(str(run), *layout, None, None, None, world_size=2)
        assert conversion.layout == layout and conversion.source[:2] == (TP, 1)
        plan.main(["--deepspeed_config", str(REPO / "ds_configs" / DEMO_CONFIGS[family]), "--num-gpus", "2",
                   "--gpu", "cpu", "--json"])
        capsys.readouterr()
        if family not in GENERATES_TEXT:
            continue
        results = generate.main(["--load", str(hf), "--prompt", "The history of", "--max-new-tokens", "3", "--greedy"])
        assert len(results) == 1 and len(results[0].tokens) == 3, family
        scores = evaluate.main(["--task", "wikitext", "--data", str(data), "--load", str(hf), "--seq-length", "16",
                                "--overlap", "8"])
        assert scores["ppl"] > 1, family

    from zoo.smoke import lm_config, no_dropout, validate

    for family in GENERATES_TEXT:
        args = parse_args(["--model", TINY[family][0], "--seq-length", "64"])
        validate(args)
        smoke = argparse.Namespace(args=args)
        assert lm_config(smoke, **no_dropout(smoke)).model_type == MODEL_TYPES[family]


def test_every_command_refuses_a_family_it_does_not_apply_to_in_one_sentence(runs, tmp_path, capsys, monkeypatch):
    """A BERT generates no text (generate, evaluate, smoke's --model) and has no pipeline stages (reshard); Megatron-LM
    checkpoints of a Llama or a BERT are not imported (GPT-2's import: tests/test_import_megatron.py)."""
    from zoo.cli import evaluate, export, generate, import_megatron, reshard, smoke

    bert_hf = tmp_path / "bert-hf"
    export.main(["--load", str(runs["bert"]), "--out", str(bert_hf)])
    capsys.readouterr()
    data = tmp_path / "wiki.test.tokens"
    data.write_text(" = Title = \n")
    for command, argv in ((generate, ["--prompt", "Hello"]), (evaluate, ["--task", "wikitext", "--data", str(data)])):
        err = one_line_exit_2(capsys, command.main, ["--load", str(bert_hf), *argv])
        assert "holds a BERT model (model_type 'megatron-bert')" in err and "pass a GPT-2 or Llama directory" in err

    assert smoke.main(["--model", "bert-tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model 'bert-tiny' is a BERT preset") and "'llama-tiny'" in err

    monkeypatch.setenv("WORLD_SIZE", "2")
    err = one_line_exit_2(capsys, reshard.main, ["--load", str(runs["bert"]), "--tensor-parallel-size", "1",
                                                   "--pipeline-model-parallel-size", "2"])
    assert "pipeline stages are built for GPT-2 and Llama only" in err

    for named, args in (("Llama", dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)),
                        ("BERT", dict(bert_binary_head=True, tokenizer_type="BertWordPieceLowerCase"))):
        rank_dir = tmp_path / named / "iter_0000010" / "mp_rank_00"
        rank_dir.mkdir(parents=True)
        shape = argparse.Namespace(num_layers=1, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=1,
                                   pipeline_model_parallel_size=1, **args)
        torch.save({"args": shape, "iteration": 10, "checkpoint_version": 3.0, "model": {}},
                   rank_dir / "model_optim_rng.pt")
        (tmp_path / named / "latest_checkpointed_iteration.txt").write_text("10")
        err = one_line_exit_2(capsys, import_megatron.main, ["--load", str(tmp_path / named),
                                                              "--out", str(tmp_path / f"{named}-hf")])
        assert f"describe a Megatron-LM {named}" in err and f"transformers {named} directory" in err
        assert not (tmp_path / f"{named}-hf").exists()


def test_plan_refuses_bf16_on_the_v100(capsys):
    """The planner's default GPU, the V100, has no bf16: a bf16 config is one sentence naming the GPUs that do."""
    from zoo.cli.plan import main

    err = one_line_exit_2(capsys, main, ["--deepspeed_config", str(REPO / "ds_configs" / "llama2_7b_tp8.json"),
                                          "--num-gpus", "8"])
    assert "trains in bf16, which the V100 does not have" in err and "H100" in err
    main(["--deepspeed_config", str(REPO / "ds_configs" / "llama2_7b_tp8.json"), "--num-gpus", "8", "--gpu", "H100"])


@pytest.mark.parametrize("preset, flags, expected", [
    ("gpt2-tiny", ["--num-layers", "3", "--hidden-size", "64", "--ffn-hidden-size", "96",
                   "--max-position-embeddings", "512", "--make-vocab-size-divisible-by", "64"],
     dict(n_layer=3, n_embd=64, n_inner=96, n_positions=512, make_vocab_size_divisible_by=64)),
    ("llama-tiny", ["--num-layers", "3", "--num-attention-heads", "8", "--num-key-value-heads", "4"],
     dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4)),
    ("bert-tiny", ["--num-layers", "3", "--ffn-hidden-size", "96"], dict(num_hidden_layers=3, intermediate_size=96)),
])
def test_megatron_shape_flags_set_each_family_s_own_fields(tmp_path, preset, flags, expected):
    from zoo.config.loading import load_run_config
    from zoo.config.run_config import build_parser

    ds_config = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())
    ds_config["zoo"] = {"model": preset, "save": str(tmp_path / "run"), "seq_length": 32,
                        "model_overrides": {"num_hidden_layers" if preset != "gpt2-tiny" else "n_layer": 5}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_config))
    config = load_run_config(build_parser("test").parse_args(["--deepspeed_config", str(path), "--skip-fit-check",
                                                              *flags]))
    assert config.model_overrides == expected   # the flag wins over the block's override of the same field
    written = {key: value for key, value in config.__dict__.items() if key in ("num_layers", "hidden_size")}
    assert set(written.values()) == {None}


def test_a_shape_flag_the_family_lacks_and_an_unknown_flag_are_one_sentence(capsys):
    from zoo.cli.pretrain import main

    demo = str(REPO / "ds_configs" / "cpu_demo.json")
    err = one_line_exit_2(capsys, main, ["--deepspeed_config", demo, "--num-key-value-heads", "2"])
    assert err == ("error: --num-key-value-heads sets nothing of GPT-2 (the preset 'gpt2-tiny'); drop it, or pass a "
                   "--model preset of Llama.\n")
    err = one_line_exit_2(capsys, main, ["--deepspeed_config", demo, "--hiden-size", "64"])
    assert "unknown flag --hiden-size" in err and "did you mean --hidden-size?" in err
    err = one_line_exit_2(capsys, main, ["--deepspeed_config", demo, "--trian-iters=5"])
    assert "did you mean --train-iters?" in err
