"""benchmarks/gpu_checks.sh, the GPU checks' one command, cannot go stale: its CPU rehearsal runs here.

The rehearsal preprocesses the bundled corpus, checks every command of its plan and of the GPU node's plan
(gpt2-1.2b, the 961M Llama, bert-large, the acceptance run, fp16 finetuning) through the commands' own parsers
and pre-launch checks, runs the GPT-2 pretraining commands in fp16 and bf16 (``--only gpt2-tiny``: the whole
rehearsal takes minutes on two cores) and prints the report from their run directories. Nothing about time
is asserted: the figures only have to be there and be consistent (the phases add up to no more than the
iteration, as the log computes them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.repo import REPO


def markdown_rows(text: str, first_header: str) -> tuple[list[str], list[list[str]]]:
    """(headers, rows) of the markdown table of ``text`` whose first column is ``first_header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    cells = lambda line: [cell.strip() for cell in line.strip().strip("|").split("|")]  # noqa: E731
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(cells(line))
    return cells(lines[start]), rows


def test_the_rehearsal_checks_every_command_runs_gpt2_and_reports(tmp_path):
    out = tmp_path / "checks"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(REPO))
    proc = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_checks.sh"), "--rehearse", "--only", "gpt2-tiny",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    report = (out / "report.md").read_text()
    assert report in proc.stdout
    assert "REFUSED" not in report
    assert re.search(r"The GPU node's \d+ pretraining, acceptance and finetuning commands pass their own checks here",
                     report), report

    headers, rows = markdown_rows(report, "run")
    runs = {row[0]: dict(zip(headers, row)) for row in rows}
    models = [f"{model} {precision}" for model in ("gpt2-tiny", "llama-tiny", "bert-tiny")
              for precision in ("fp16, eager", "bf16, eager", "bf16, compiled")]
    assert list(runs) == models + ["acceptance (launch/smoke.py, 1 rank)", "finetune fp16 (same-article, MiniLM)"]
    for name in models[:3]:
        run = runs[name]
        assert run["status"] == "ok" and run["throughput"].endswith(" tokens/s"), run
        phases = [float(run[f"{phase} ms"]) for phase in ("forward", "backward", "optimizer", "data")]
        assert min(phases) >= 0 and sum(phases) <= float(run["iteration ms"]) + 0.1 * len(phases), run  # rounded to 0.1
        assert run["MFU %"] == "n/a" and run["peak memory GB"].endswith(" RSS"), run
    for name in list(runs)[3:]:
        assert runs[name]["status"] == "checked, not run (--only)", runs[name]

    headers, rows = markdown_rows(report, "iteration")
    assert headers == ["iteration", "gpt2-tiny fp16", "gpt2-tiny bf16"]
    assert [row[0] for row in rows] == ["1", "2", "3"] and all(float(cell) > 0 for row in rows for cell in row[1:])
    assert (out / "loss_curves.png").stat().st_size > 0
    commands = report.split("Commands (each step's output in")[1]
    for script in ("launch/preprocess.py", "launch/pretrain.py", "launch/smoke.py", "finetune/same_article.py"):
        assert script in commands, script
    assert Path(out / "logs" / "pretrain-gpt2-tiny-bf16.log").exists()
