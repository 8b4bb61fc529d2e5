"""The dev curve of a finetuning run: its main metric at each evaluation, beside the majority-class baseline.

``dev.png`` (written atomically) plots the task's main metric against the training step, one point per
evaluation, and, when the eval set scores one, the ``majority_baseline`` as a dashed line: a curve that
stays on that line has learned nothing the label counts do not give.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zoo.training.metrics import save_figure

DEV_CURVE_FILE = "dev.png"


def baseline_metric(main_metric: str) -> str:
    """The name of the majority-class baseline scored beside ``main_metric`` ("dev/accuracy" ->
    "dev/majority_baseline")."""
    return main_metric.split("/")[0] + "/majority_baseline"


def plot_dev_curve(run_dir: str | os.PathLike, history: Sequence[dict[str, Any]], main_metric: str) -> Path:
    """``<run_dir>/dev.png`` from the evaluation events ``history`` (each with ``iteration`` and the metric)."""
    import matplotlib  # local: matplotlib only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: matplotlib only when a plot is drawn

    points = [(e["iteration"], e[main_metric]) for e in history if isinstance(e.get(main_metric), float)]
    baselines = [e[baseline_metric(main_metric)] for e in history if baseline_metric(main_metric) in e]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if points:
        ax.plot(*zip(*points), "o-", color="tab:orange", label=main_metric)
    if baselines:
        ax.axhline(baselines[-1], color="gray", linestyle="--", label=f"majority-class baseline ({baselines[-1]:.3f})")
    ax.set_xlabel("training step")
    ax.set_ylabel(main_metric.split("/")[-1])
    ax.set_title(f"{Path(run_dir).name}: {main_metric}")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, Path(run_dir) / DEV_CURVE_FILE)
