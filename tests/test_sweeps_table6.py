"""The sweep files carry the Megatron-LM paper's Table 6, one file per task and model size, and the
local runner refuses a grid that would make no runs.

TABLE6 is the paper's appendix A table (Shoeybi et al. 2019, arXiv 1909.08053): per task and
BERT size, the global batch, the learning rate and the epochs. QQP 3.9B (batch 256) and the
SQuAD 2.0 block (336M 48, 1.3B 64) follow two text renderings of the arXiv PDF that agree with each
other, where another copy of the table is damaged (see the comments in those files).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from zoo.cli.sweep import main
from zoo.finetune.sweep import load_sweep

SWEEPS = Path(__file__).resolve().parent.parent / "finetune" / "sweeps"
SIZES = ("336m", "1.3b", "3.9b")
TABLE6 = {  # task: (epochs, {size: (batch, lr)})
    "mnli": (10, {"336m": (128, 1e-5), "1.3b": (128, 1e-5), "3.9b": (128, 1e-5)}),
    "qqp": (12, {"336m": (128, 5e-5), "1.3b": (128, 3e-5), "3.9b": (256, 4e-5)}),
    "squad1": (2, {"336m": (64, 3e-5), "1.3b": (48, 3e-5), "3.9b": (48, 1e-5)}),
    "squad2": (2, {"336m": (48, 3e-5), "1.3b": (64, 3e-5), "3.9b": (48, 1e-5)}),
    "race": (3, {"336m": (32, 2e-5), "1.3b": (16, 1e-5), "3.9b": (32, 2e-5)}),
}
PROGRAM = {"mnli": "finetune/mnli.py", "qqp": "finetune/qqp.py", "squad1": "finetune/squad.py",
           "squad2": "finetune/squad.py", "race": "finetune/race.py"}
ROWS = [(task, size) for task in TABLE6 for size in SIZES]


def test_one_sweep_file_per_task_and_size():
    """Table 6's files, and the finetuning demo's sweep (tests/test_sweep_overrides.py)."""
    assert sorted(p.name for p in SWEEPS.glob("*.yaml")) == sorted([f"{t}-{s}.yaml" for t, s in ROWS] + ["demo.yaml"])


@pytest.mark.parametrize("task,size", ROWS)
def test_sweep_file_is_its_table6_row_over_5_seeds(task, size):
    path = SWEEPS / f"{task}-{size}.yaml"
    raw = yaml.safe_load(path.read_text())
    # W&B's sweep format, as `wandb sweep` reads it: every parameter a value or a non-empty list.
    assert raw["method"] == "grid" and raw["metric"]["goal"] == "maximize" and "${args}" in raw["command"]
    for name, entry in raw["parameters"].items():
        assert set(entry) in ({"value"}, {"values"}), name
    spec = load_sweep(path)
    epochs, rows = TABLE6[task]
    batch, lr = rows[size]
    assert spec.name == f"{task}-{size}" and spec.program == PROGRAM[task]
    assert spec.grid == {"batch-size": [batch], "lr": [lr], "epochs": [epochs], "seed": [1, 2, 3, 4, 5]}
    assert spec.fixed["pretrained"].endswith(f"megatron-bert-{size}")
    settings = spec.settings()
    assert len(settings) == 5 and {s["seed"] for s in settings} == {1, 2, 3, 4, 5}
    assert f"batch {batch}, learning rate {lr:.0e}".replace("e-0", "e-") in path.read_text()  # the comment agrees


@pytest.mark.parametrize("task,size", [("squad2", "1.3b"), ("qqp", "3.9b"), ("race", "336m")])
def test_dry_run_prints_the_papers_row(task, size, capsys):
    epochs, rows = TABLE6[task]
    batch, lr = rows[size]
    main([str(SWEEPS / f"{task}-{size}.yaml"), "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"# sweep {task}-{size}: batch-size {batch}, lr {lr}, epochs {epochs} x 5 seeds "
                        f"(1, 2, 3, 4, 5); 5 runs, {load_sweep(SWEEPS / f'{task}-{size}.yaml').metric}")
    assert len(lines) == 6
    for seed, line in enumerate(lines[1:], start=1):
        assert f" {PROGRAM[task]} " in line and f"--batch-size={batch} --lr={lr} --epochs={epochs} --seed={seed}" in line


def _sweep_file(tmp_path: Path, lr_entry: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"""program: finetune/qqp.py
method: grid
metric: {{name: best/dev/accuracy, goal: maximize}}
parameters:
  batch-size: {{values: [8]}}
  lr: {lr_entry}
  seed: {{values: [1, 2]}}
""")
    return path


@pytest.mark.parametrize("lr_entry,message", [
    ("{values: []}", "sweep parameter 'lr' in .* has an empty values list, which makes a grid of 0 runs; give it "
                     "at least one value"),
    ("{values: 1.0e-5}", "sweep parameter 'lr' in .* has values: 1e-05, not a list; write values: \\[1e-05\\]"),
])
def test_a_grid_without_runs_is_one_sentence_and_exit_2(tmp_path, capsys, lr_entry, message):
    """Before: `values: []` ran "0 runs" and exited 0; a scalar `values` was iterated or crashed."""
    import re

    path = _sweep_file(tmp_path, lr_entry)
    with pytest.raises(SystemExit) as exit_:
        main([str(path), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_the_summary_table_shows_each_setting_as_the_file_gives_it():
    """Table 6's learning rates (1e-5 .. 5e-5) are settings, not scores: rounded to 4 decimals they would all
    read 0.0000 or 0.0001."""
    from zoo.finetune.sweep import format_table, summarize

    spec = load_sweep(SWEEPS / "qqp-336m.yaml")
    rows = [{"batch-size": 128, "lr": lr, "epochs": 12, "seed": seed, "score": score}
            for lr, seed, score in [(5e-5, 1, 0.9), (5e-5, 2, 0.8), (1e-5, 1, 0.7)]]
    lines = format_table(summarize(rows, spec), spec).splitlines()
    assert lines[0] == "| batch-size | lr | epochs | seeds | finished | median best/dev/accuracy | min | max |"
    assert lines[2:] == ["| 128 | 5e-05 | 12 | 2 | 2 | 0.8500 | 0.8000 | 0.9000 |",
                         "| 128 | 1e-05 | 12 | 1 | 1 | 0.7000 | 0.7000 | 0.7000 |"]
