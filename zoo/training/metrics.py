"""Run-directory logging: metrics.jsonl (one JSON object per event, flushed at once so a crash loses
nothing), optional Weights & Biases, and loss.png at the end."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from zoo.atomic import atomic_file


def megatron_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int,
                                 recompute: bool = False) -> float:
    """Model FLOPs of one training iteration of a GPT (Narayanan et al. 2021, section 5.1).

    A layer's forward does 24 B s h^2 (the four GEMMs) + 4 B s^2 h (QK^T and PV) FLOPs, the LM head
    2 B s h V. Backward costs twice the forward; activation recomputation adds one more forward of
    the layers (not of the LM head). So with k = 3 passes (4 with recomputation):

        F = 24 k B s l h^2 (1 + s / (6 h)) + 6 B s h V

    which is the paper's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) for k = 4, and
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)) without recomputation.
    """
    k = 4 if recompute else 3
    return 24.0 * k * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden)) + 6.0 * batch * seq * hidden * vocab


class MetricsLogger:
    """Writes events on one rank (the writer); other ranks' calls are no-ops."""

    def __init__(self, run_dir: str | os.PathLike, is_writer: bool, wandb_project: str | None = None,
                 wandb_config: dict[str, Any] | None = None, resume: bool = False):
        self.run_dir = Path(run_dir)
        self.is_writer = is_writer
        self.path = self.run_dir / "metrics.jsonl"
        self._wandb = None
        if not is_writer:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            self.path.unlink()
        if wandb_project:
            self._wandb = _start_wandb(wandb_project, wandb_config, self.run_dir)

    def log(self, event: dict[str, Any]) -> None:
        if not self.is_writer:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps(event) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in event.items() if isinstance(v, (int, float))},
                            step=event.get("iteration"))

    def summary(self, values: dict[str, Any]) -> None:
        """Final values of the run (W&B's run summary, e.g. the best score); no-op without W&B."""
        if self._wandb is not None:
            for key, value in values.items():
                self._wandb.summary[key] = value

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(project: str, config: dict[str, Any] | None, run_dir: Path):
    """A W&B run (WANDB_MODE=offline honoured); any failure (no network, no API key) is reported and
    training goes on without it."""
    try:
        import wandb

        return wandb.init(project=project, name=run_dir.name, config=config, dir=str(run_dir))
    except Exception as err:  # noqa: BLE001 - tracking must never stop training
        print(f"warning: W&B disabled ({type(err).__name__}: {err}); set WANDB_MODE=offline to log locally.")
        return None


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(run_dir: str | os.PathLike) -> Path:
    """loss.png: training loss and validation loss against iteration (written atomically). A BERT
    run gets a second panel: sentence-order accuracy, train and validation, against chance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = read_metrics(run_dir)
    train = [(e["iteration"], e["loss"]) for e in events if "loss" in e and "split" not in e]
    valid = [(e["iteration"], e["val_loss"]) for e in events if e.get("split") == "valid"]
    train_sop = [(e["iteration"], e["sop_acc"]) for e in events if "sop_acc" in e and "split" not in e]
    valid_sop = [(e["iteration"], e["val_sop_acc"]) for e in events if "val_sop_acc" in e]
    if train_sop or valid_sop:
        fig, (ax, sop_ax) = plt.subplots(1, 2, figsize=(12, 4.2))
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        sop_ax = None
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation loss", color="tab:orange")
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"{Path(run_dir).name}: loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if sop_ax is not None:
        if train_sop:
            sop_ax.plot(*zip(*train_sop), label="train (log window)", color="tab:blue")
        if valid_sop:
            sop_ax.plot(*zip(*valid_sop), "o-", label="validation", color="tab:orange")
        sop_ax.axhline(0.5, color="gray", linestyle="--", label="chance")
        sop_ax.set_xlabel("iteration")
        sop_ax.set_ylabel("accuracy")
        sop_ax.set_title("sentence-order prediction")
        sop_ax.grid(alpha=0.3)
        sop_ax.legend()
    target = Path(run_dir) / "loss.png"
    try:
        with atomic_file(target) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return target


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
