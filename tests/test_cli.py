"""Every command's flags come from one builder (zoo.options): ``--help`` of every script in launch/ and
finetune/ exits 0 listing its groups, the zoo block and the flags merge by one rule (flags win), a block
value of the wrong type is one sentence, and ``--data-path`` takes Megatron's blend syntax."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from zoo.config.run_config import RunConfig
from zoo.config.run_config import build_parser as pretrain_parser
from zoo.finetune.config import FinetuneConfig, config_from_args
from zoo.finetune.config import build_parser as finetune_parser
from zoo.options import add_options, check_block_keys, check_types, merged_settings, option

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(str(path.relative_to(REPO)) for folder in ("launch", "finetune") for path in (REPO / folder).glob("*.py"))
ALL_GROUPS = ("model:", "data:", "parallelism:", "training:", "checkpointing:", "logging:")
# The groups each script's --help lists (launch/run.py passes everything else to DeepSpeed's runner).
GROUPS_OF = {"launch/run.py": (), "launch/preprocess.py": (), "finetune/squad_eval.py": (),
             "launch/plan.py": ("model:", "parallelism:", "training:", "logging:"),
             "launch/export.py": ("model:", "checkpointing:"),
             "launch/reshard.py": ("parallelism:", "training:", "checkpointing:"),
             "launch/import_megatron.py": ("model:", "checkpointing:"),
             "launch/smoke.py": ("model:", "data:", "parallelism:", "training:"),
             "launch/evaluate.py": ("model:", "data:", "parallelism:", "logging:"),
             "launch/generate.py": ("model:", "parallelism:", "generation:", "logging:"),
             "finetune/sweep.py": ALL_GROUPS}
DEMO_DS_CONFIG = json.loads((REPO / "ds_configs" / "cpu_demo.json").read_text())
FINETUNE_DS_CONFIG = json.loads((REPO / "ds_configs" / "finetune_cpu.json").read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_with_its_groups(script):
    result = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:"), result.stdout[:500]
    missing = [group for group in GROUPS_OF.get(script, ALL_GROUPS) if f"\n{group}\n" not in result.stdout]
    assert not missing, (missing, result.stdout)


def _ds_config(tmp_path, base: dict, **zoo) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**base, "zoo": {**base.get("zoo", {}), **zoo}}))
    return str(path)


def test_pretraining_flags_win_over_the_zoo_block_which_wins_over_the_defaults(tmp_path):
    path = _ds_config(tmp_path, DEMO_DS_CONFIG, seq_length=64, eval_iters=3, save=str(tmp_path / "block"))
    args = pretrain_parser("test").parse_args(["--deepspeed_config", path, "--seq-length", "32",
                                               "--no-exit-signal-handler"])
    config = RunConfig(**merged_settings(RunConfig, check_block_keys(json.load(open(path))["zoo"], RunConfig, path),
                                         args))
    assert (config.seq_length, config.eval_iters, config.save) == (32, 3, str(tmp_path / "block"))
    assert config.exit_signal_handler is False and config.seed == RunConfig().seed


def test_data_path_takes_a_blend_or_one_prefix_from_the_flag_and_the_block(tmp_path):
    parse = pretrain_parser("test").parse_args
    assert parse(["--data-path", "0.3", "a", "0.7", "b"]).data_path == ["0.3", "a", "0.7", "b"]
    assert parse(["--data-path", "a"]).data_path == ["a"]
    assert RunConfig(data_path="corpus").data_path == ["corpus"]
    assert RunConfig(data_path=[0.5, "a", 0.5, "b"]).data_path == [0.5, "a", 0.5, "b"]
    with pytest.raises(ValueError) as err:
        check_types(RunConfig(data_path=7, ds_config_path="ds.json"), "ds.json")
    assert str(err.value) == ("zoo setting 'data_path' in ds.json is 7 (an integer) but must be a string or a list of "
                              "strings or null; write it as e.g. \"data_path\": \"data/corpus\".")


def test_finetune_zoo_block_values_are_typed_and_flags_win(tmp_path):
    argv = ["--pretrained", str(tmp_path), "--data-dir", str(tmp_path)]
    path = _ds_config(tmp_path, FINETUNE_DS_CONFIG, lr=3e-5, tensor_parallel_size=1)
    assert config_from_args("mnli", finetune_parser("mnli").parse_args(["--deepspeed_config", path, *argv])).lr == 3e-5
    config = config_from_args("mnli", finetune_parser("mnli").parse_args(["--deepspeed_config", path, "--lr", "1e-4",
                                                                           *argv]))
    assert (config.lr, config.save, config.batch_size) == (1e-4, "runs/finetune-mnli",
                                                           FINETUNE_DS_CONFIG["train_batch_size"])
    path = _ds_config(tmp_path, FINETUNE_DS_CONFIG, lr="fast")
    with pytest.raises(ValueError) as err:
        config_from_args("mnli", finetune_parser("mnli").parse_args(["--deepspeed_config", path, *argv]))
    assert str(err.value) == (f"zoo setting 'lr' in {path} is \"fast\" (a string) but must be a number; write it as "
                              "e.g. \"lr\": 30.")
    assert FinetuneConfig.__dataclass_fields__["lr"].default == 2e-5


def test_an_option_field_gives_its_flag_group_default_and_required_flag():
    @dataclass(kw_only=True)
    class Options:
        path: str = option(group="data", help="where")
        steps: int = option(5, group="training", help="how many")
        quiet: bool = option(False, group="logging", help="say less")
        block_only: dict = option(group="model", flag=None, default_factory=dict, help="not a flag")

    parser = add_options(argparse.ArgumentParser(), Options, with_defaults=True)
    assert vars(parser.parse_args(["--path", "p"])) == {"path": "p", "steps": 5, "quiet": False}
    help_text = parser.format_help()
    assert "\ndata:\n" in help_text and "how many (default: 5)" in help_text and "block-only" not in help_text
    with pytest.raises(SystemExit):
        parser.parse_args([])
