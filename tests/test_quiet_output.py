"""What a run prints is zoo's lines and real warnings, the libraries' own lines only at ``--log-level debug``
(``ZOO_LOG_LEVEL=debug``), and what it says is true.

* A pretraining rank, started as a launcher starts it (RANK, WORLD_SIZE, MASTER_ADDR/PORT set; one rank), prints
  no line of DeepSpeed's logger and none of its prints ("Setting accelerator to CPU", "... built successfully").
* Within a command, DeepSpeed's logger passes real warnings only, and its notes and INFO lines at debug; the
  lines DeepSpeed prints (the CPU kernel's load, a pipeline's seed settings) are dropped, other output untouched.
* Preprocessing draws zoo's bar, not datasets' "Generating train split".
* The first use of a corpus says it was preprocessed and where it is kept; the next use says nothing.
* The settings line of a grouped-query model names its key/value heads, as the planner's does.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.corpora import WIKI_SAMPLE
from tests.helpers.pretraining import ds_config
from tests.spawn import free_port

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED_LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] \[(DEBUG|INFO|WARNING)\] \[")


def test_a_pretraining_rank_prints_no_deepspeed_line_at_the_default_level(tmp_path, corpus_prefix):
    config = ds_config(2, 2, zoo={"model": "gpt2-tiny", "model_overrides": {"n_layer": 1, "n_embd": 32, "n_head": 4},
                                  "seq_length": 16, "train_iters": 2, "eval_interval": 0, "log_interval": 1,
                                  "data_path": corpus_prefix, "split": "80,20,0", "data_workers": 0,
                                  "save": str(tmp_path / "run")})
    config["scheduler"]["params"].update(total_num_steps=2, warmup_num_steps=1)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    env = {key: value for key, value in os.environ.items() if key != "ZOO_LOG_LEVEL"}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "launch/pretrain.py", "--deepspeed_config", str(path)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    library_lines = [line for line in output.splitlines()
                     if DEEPSPEED_LOG_LINE.match(line) or "built successfully" in line or "Setting accelerator" in line]
    assert not library_lines, library_lines
    assert "effective settings" in output and "done: 2 iterations" in output, output[-3000:]


@pytest.fixture
def deepspeed_records():
    """The records DeepSpeed's logger hands its handlers (after its filters), collected."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _log_deepspeed_lines() -> None:
    logger = logging.getLogger("DeepSpeed")
    logger.info("DeepSpeed info line")
    logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
    logger.warning("Attempting to get learning rate from scheduler before it has started")
    logger.warning("a real warning")


@pytest.mark.parametrize("level, expected", [
    ("info", ["a real warning"]),
    ("debug", ["DeepSpeed info line", "Setting accelerator to CPU. If you have GPU or other accelerator, we were "
               "unable to detect it.", "Attempting to get learning rate from scheduler before it has started",
               "a real warning"]),
])
def test_deepspeed_s_logger_passes_real_warnings_and_its_own_lines_only_at_debug(deepspeed_records, level, expected):
    from zoo.operations.library_output import library_output

    logger = logging.getLogger("DeepSpeed")
    level_before, filters_before = logger.level, list(logger.filters)
    with library_output(level):
        assert os.environ["ZOO_LOG_LEVEL"] == level   # the processes a command starts print alike
        _log_deepspeed_lines()
    assert [record.getMessage() for record in deepspeed_records] == expected
    assert (logger.level, logger.filters) == (level_before, filters_before)


def test_deepspeed_s_prints_are_dropped_and_other_output_goes_through(capsys, monkeypatch):
    from zoo.operations.library_output import prints_dropped

    def library_and_zoo_lines():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("SEED_LAYERS=False BASE_SEED=1234 SEED_FN=None")
        print("zoo's line")
        sys.stdout.write("a partial ")
        sys.stdout.write("line\nDeep learning\n")

    with prints_dropped():
        library_and_zoo_lines()
    assert capsys.readouterr().out == "zoo's line\na partial line\nDeep learning\n"
    monkeypatch.setenv("ZOO_LOG_LEVEL", "debug")
    with prints_dropped():
        library_and_zoo_lines()
    assert capsys.readouterr().out.count("\n") == 5


def test_a_bad_log_level_variable_is_one_sentence(monkeypatch, capsys):
    from zoo.cli.plan import main

    monkeypatch.setenv("ZOO_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit) as exit_info:
        main(["--deepspeed_config", str(REPO / "ds_configs" / "cpu_demo.json"), "--num-gpus", "2", "--gpu", "cpu"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("error: ZOO_LOG_LEVEL='loud' is not a log level; set it to one of ['info', "
                                       "'debug'] (or unset it).\n")


def test_preprocessing_draws_no_datasets_bar_and_says_its_first_build(tmp_path, capfd):
    import gzip

    from zoo.cli.preprocess import main
    from zoo.data.preprocess import default_corpus_prefix

    with gzip.open(WIKI_SAMPLE, "rt") as articles:
        (tmp_path / "few.jsonl").write_text("".join(next(articles) for _ in range(3)))
    assert main(["--input", str(tmp_path / "few.jsonl"), "--output-prefix", str(tmp_path / "few"), "--workers", "1"]) == 0
    assert "Generating train split" not in capfd.readouterr().err

    prefix = default_corpus_prefix(cache_dir=tmp_path / "cache", corpus=tmp_path / "few.jsonl", workers=1)
    first = capfd.readouterr().out
    assert first == f"preprocessed few.jsonl once: 3 documents, {count_tokens(prefix):,} tokens in " \
                    f"{first.split(' tokens in ')[1].split(' s,')[0]} s, kept in {prefix}.bin/.idx for later runs\n"
    assert default_corpus_prefix(cache_dir=tmp_path / "cache", corpus=tmp_path / "few.jsonl") == prefix
    assert capfd.readouterr().out == ""


def count_tokens(prefix: str) -> int:
    from zoo.data.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return int(sum(len(dataset[i]) for i in range(len(dataset))))


def test_the_settings_line_of_a_llama_names_its_key_value_heads(tmp_path):
    from zoo.config.run_config import RunConfig
    from zoo.config.validation import validate_static
    from zoo.training.effective_settings import describe_model, model_settings

    demo = json.loads((REPO / "ds_configs" / "llama_cpu_demo.json").read_text())
    config = validate_static(RunConfig(**{**demo["zoo"], "save": str(tmp_path / "run")}, ds_config=demo,
                                       ds_config_path="llama_cpu_demo.json"))
    line = describe_model(model_settings(config))
    assert "2 layers, hidden 128, 4 heads (2 key/value heads)," in line, line
