"""Run-directory logging: metrics.jsonl (one JSON object per event, flushed at once so a crash loses
nothing), optional Weights & Biases and TensorBoard (the same scalars), loss.png at the end, and the console
log line of a training event.

A line cut short (a full disk, a killed writer) can only be the last one: readers leave it out, a resume
drops it with a warning; any other line that is not a JSON object is named with its number."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zoo.atomic import atomic_file, check_directory_can_be_made, unwritable_directory
from zoo.errors import UserError

METRICS_FILE = "metrics.jsonl"


def format_duration(seconds: float) -> str:
    """``HH:MM:SS``, with whole days in front past 24 hours (``3 days 01:00:00``)."""
    days, rest = divmod(int(round(seconds)), 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return clock if days == 0 else f"{days} day{'s' if days > 1 else ''} {clock}"


def format_log_line(event: dict[str, Any], train_iters: int) -> str:
    """The console line of a training event, with what Megatron's carries: throughput and MFU (where the
    device has a known peak), this rank's memory (allocated/reserved on an accelerator, RSS on a CPU), the
    iterations of the window skipped by fp16 loss scaling and those whose loss was NaN/inf, and the ETA.
    Fields an event lacks are left out. Where the event has the phases of an iteration (:func:`format_breakdown`),
    the line shows where the iteration's time went."""
    grad_norm = "n/a" if event["grad_norm"] is None else f"{event['grad_norm']:.3f}"
    mfu = f" (MFU {event['mfu_pct']:.1f}%)" if event.get("mfu_pct") is not None else ""
    parts = [f"iteration {event['iteration']:>7d}/{train_iters}", f"loss {event['loss']:.4f}",
             f"lr {event['lr']:.3e}", f"loss scale {event['loss_scale']:.0f}", f"grad norm {grad_norm}",
             f"{event['tokens_per_s']:.0f} tokens/s", f"{event['tflops']:.3f} TFLOPs/device{mfu}"]
    if breakdown := format_breakdown(event):
        parts.append(breakdown)
    if "mem_allocated_gb" in event:
        parts.append(f"mem {event['mem_allocated_gb']:.2f}/{event['mem_reserved_gb']:.2f} GB allocated/reserved")
    elif "rss_gb" in event:
        parts.append(f"mem {event['rss_gb']:.2f} GB RSS")
    if "skipped_iterations" in event:
        parts.append(f"skipped {event['skipped_iterations']}")
    if "nan_iterations" in event:
        parts.append(f"nan/inf {event['nan_iterations']}")
    parts.append(f"ETA {format_duration(event['eta_s'])}")
    return " | ".join(parts)


# The phases of an iteration a log event may carry as ``<phase>_ms`` (zoo.training.phase_clock), in line order.
BREAKDOWN_PHASES = ("forward", "backward", "optimizer", "train_batch", "data")


def format_breakdown(event: dict[str, Any]) -> str:
    """``iteration 412.3 ms: forward 96.1, backward 181.7, optimizer 80.2, data 0.4`` from an event's
    ``step_time_s`` and ``<phase>_ms`` (milliseconds per iteration); the difference between the iteration and
    its phases is what the loop spent elsewhere. Empty where the event has no phase."""
    phases = [f"{phase} {event[f'{phase}_ms']:.1f}" for phase in BREAKDOWN_PHASES if f"{phase}_ms" in event]
    if not phases:
        return ""
    total = f"iteration {1e3 * event['step_time_s']:.1f} ms" if "step_time_s" in event else "ms per iteration"
    return f"{total}: {', '.join(phases)}"


def scalars(event: dict[str, Any]) -> dict[str, float]:
    """The numbers of an event other than its iteration (the step they are plotted at): TensorBoard's scalars."""
    return {key: value for key, value in event.items()
            if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class MetricsLogger:
    """Appends the run's events to ``metrics.jsonl`` on one rank (the writer).

    :meth:`log` is collective over ``group`` (default: the world; every rank calls it, the writer writes), so
    a write that fails on the writer (a full disk, a quota) ends every rank with the same sentence, naming the
    file, instead of leaving the others waiting in their next collective. A line cut short by that failure
    is cut off again where possible; one that stays (the process was killed mid-append) is dropped on resume.

    An existing ``metrics.jsonl`` is appended to only when ``resume``; otherwise it belongs to another run and
    is refused (the run directory's claim, :mod:`zoo.training.run_directory`, says so before anything runs).

    ``tensorboard_dir`` (Megatron's ``--tensorboard-dir``): every event's :func:`scalars` also go there, through
    torch's SummaryWriter, at the event's iteration. A run resumed at iteration ``resumed_at`` hides the events
    the earlier run wrote after it (TensorBoard's ``purge_step``), as metrics.jsonl drops them. A missing
    tensorboard package is a user error at the start; a write that fails later stops TensorBoard logging with
    one warning and the run goes on.
    """

    def __init__(self, run_dir: str | os.PathLike, is_writer: bool, wandb_project: str | None = None,
                 wandb_config: dict[str, Any] | None = None, resume: bool = False, group=None,
                 tensorboard_dir: str | os.PathLike | None = None, resumed_at: int = 0):
        self.run_dir = Path(run_dir)
        self.is_writer = is_writer
        self.path = self.run_dir / METRICS_FILE
        self.group = group
        self._wandb = None
        self._tensorboard = None
        if not is_writer:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            raise UserError(f"{self.path} already exists (an earlier run's metrics); pass another --save, or "
                             "resume that run with --load.")
        if tensorboard_dir is not None:
            self._tensorboard = _start_tensorboard(tensorboard_dir, resumed_at + 1 if resumed_at else None)
        if wandb_project:
            self._wandb = _start_wandb(wandb_project, wandb_config, self.run_dir)

    def log(self, event: dict[str, Any]) -> None:
        from zoo.distributed import raise_on_any_rank  # local: torch import cost; plan and sweep read this module

        raise_on_any_rank(lambda: self._append(event) if self.is_writer else None, self.group)
        if self.is_writer and self._tensorboard is not None:
            self._write_tensorboard(event)
        if self.is_writer and self._wandb is not None:
            numbers = {k: v for k, v in event.items() if isinstance(v, (int, float))}
            self._call_wandb(lambda run: run.log(numbers, step=event.get("iteration")))

    def _write_tensorboard(self, event: dict[str, Any]) -> None:
        """The event's scalars at its iteration, flushed (a log event is rare next to an iteration, and a
        crash then loses none); a failure ends TensorBoard logging with one warning, never the run."""
        try:
            for key, value in scalars(event).items():
                self._tensorboard.add_scalar(key, value, global_step=event.get("iteration"))
            self._tensorboard.flush()
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            self._tensorboard = None
            print(f"warning: TensorBoard logging stopped ({type(err).__name__}: {err}); the run goes on, its "
                  f"events are still in {self.path}.", file=sys.stderr, flush=True)

    def _call_wandb(self, call: Callable[[Any], None]) -> None:
        """``call(the W&B run)``, after the ranks agreed on the metrics write, on the writer alone: so that
        W&B never stops training nor leaves the other ranks waiting, a failure ends this run's tracking
        with one warning (later events still go to ``metrics.jsonl``)."""
        try:
            call(self._wandb)
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            self._wandb = None
            print(f"warning: W&B tracking stopped ({type(err).__name__}: {err}); the run goes on, its events "
                  f"are still in {self.path}.", file=sys.stderr, flush=True)

    def _append(self, event: dict[str, Any]) -> None:
        line = json.dumps(event) + "\n"
        size = self.path.stat().st_size if self.path.exists() else 0
        try:
            with self.path.open("a") as handle:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as err:
            with contextlib.suppress(OSError):   # a full disk still lets a file shrink
                if self.path.stat().st_size > size:
                    os.truncate(self.path, size)
            reason = err.strerror or type(err).__name__
            raise UserError(f"appending to {self.path} failed ({reason}); free space in {self.run_dir} or pass "
                             "another --save, then run again (a pretraining run resumes from its last checkpoint "
                             f"with --load {self.run_dir}).") from None

    def summary(self, values: dict[str, Any]) -> None:
        """Final values of the run (W&B's run summary, e.g. the best score); no-op without W&B."""
        if self._wandb is not None:
            self._call_wandb(lambda run: run.summary.update(values))

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._call_wandb(lambda run: run.finish())


def _start_tensorboard(directory: str | os.PathLike, purge_step: int | None):
    """torch's SummaryWriter on ``directory``; UserError in one sentence when tensorboard is not installed or
    ``directory`` cannot be made or written."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # local: tensorboard is optional
    except ImportError:
        raise UserError(f"--tensorboard-dir {directory} needs the tensorboard package; pip install tensorboard, "
                         "or run without --tensorboard-dir.") from None
    check_directory_can_be_made(directory, "--tensorboard-dir")
    try:
        return SummaryWriter(log_dir=str(directory), purge_step=purge_step)
    except OSError as err:
        raise unwritable_directory("--tensorboard-dir", directory, err) from None


def _start_wandb(project: str, config: dict[str, Any] | None, run_dir: Path):
    """A W&B run (WANDB_MODE=offline honoured), or None after one warning line: tracking never stops
    training, so a missing wandb (an install without its dependencies) says how to install it, and any
    other failure (a broken install, no network, no API key) says what failed and how to log locally."""
    try:
        import wandb  # local: wandb is optional; only --wandb-project needs it
    except Exception as err:  # noqa: BLE001 - tracking must never stop training
        _warn_wandb_off(project, err, importing=True)
        return None
    try:
        return wandb.init(project=project, name=run_dir.name, config=config, dir=str(run_dir))
    except Exception as err:  # noqa: BLE001 - tracking must never stop training
        _warn_wandb_off(project, err, importing=False)
        return None


def _warn_wandb_off(project: str, err: Exception, importing: bool) -> None:
    if importing and isinstance(err, ImportError):
        message = (f"wandb is not installed, so this run is not tracked in W&B project {project!r}; pip install "
                   "wandb to track it.")
    elif importing:
        message = (f"import wandb fails ({type(err).__name__}: {err}), so this run is not tracked in W&B project "
                   f"{project!r}; pip install --force-reinstall wandb to track it.")
    else:
        message = f"W&B disabled ({type(err).__name__}: {err}); set WANDB_MODE=offline to log locally."
    print(f"warning: {message}", file=sys.stderr, flush=True)


@dataclass
class MetricsFile:
    """``metrics.jsonl`` as read: each whole event with its text, and the number of a torn last line."""

    path: Path
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    torn_line: int | None = None


MAX_EVENT_BYTES = 1 << 20   # far above any event zoo logs (a few hundred bytes); the most a reader holds per line


def metrics_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(line number, text without its newline) of every line of ``path``, read one line at a time and at
    most :data:`MAX_EVENT_BYTES` at once, so memory stays bounded however long a line or the file is. A longer
    line is no event zoo logged: ``UserError`` naming the file, the line and its length."""
    path = Path(path)
    with path.open("rb") as handle:
        for number in itertools.count(1):
            raw = handle.readline(MAX_EVENT_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_EVENT_BYTES and not raw.endswith(b"\n"):
                length = len(raw) + _skip_rest_of_line(handle)
                raise UserError(f"{path} line {number} is {length} bytes long, longer than any event zoo logs (at "
                                 f"most {MAX_EVENT_BYTES} bytes), so it is not one; delete or repair that line, then "
                                 "run again.")
            yield number, raw.decode("utf-8", errors="replace").removesuffix("\n")


def _skip_rest_of_line(handle) -> int:
    """Read past the rest of the current line in bounded pieces; the bytes skipped (without the newline)."""
    skipped = 0
    while piece := handle.readline(MAX_EVENT_BYTES):
        if piece.endswith(b"\n"):
            return skipped + len(piece) - 1
        skipped += len(piece)
    return skipped


class MetricsScan:
    """The whole events of a ``metrics.jsonl``, as (text, event), streamed (:func:`metrics_lines`); blank lines
    are skipped. A line that is not a JSON object is an append cut short (a full disk, a killed writer) when
    it is the last non-blank line: it is left out and, once the iteration ends, its number is in
    ``torn_line``. Before any other line it raises ``UserError`` naming the file and the line."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.torn_line: int | None = None

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        pending: tuple[int, str] | None = None   # (number, text shown) of a line that is no event
        for number, text in metrics_lines(self.path):
            if not text.strip():
                continue
            if pending is not None:
                raise self._corrupt(*pending)
            event = _event(text)
            if event is None:
                pending = (number, text if len(text) <= 60 else text[:57] + "...")
                continue
            yield text, event
        self.torn_line = pending[0] if pending is not None else None

    def _corrupt(self, number: int, shown: str) -> UserError:
        return UserError(f"{self.path} line {number} is not a JSON object ({shown!r}); delete or repair that line "
                          "(every line holds one logged event), then run again.")


def read_metrics_file(path: str | os.PathLike) -> MetricsFile:
    """Every event of ``path`` with its text, and the number of a torn last line (:class:`MetricsScan`)."""
    scan = MetricsScan(path)
    content = MetricsFile(Path(path), events=list(scan))
    content.torn_line = scan.torn_line
    return content


def check_metrics_file(path: str | os.PathLike) -> None:
    """Read ``path`` as :func:`read_metrics_file` does, keeping nothing: raises the same sentences."""
    for _ in MetricsScan(path):
        pass


def _event(text: str) -> dict[str, Any] | None:
    try:
        event = json.loads(text)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def truncate_metrics_after(path: str | os.PathLike, iteration: int) -> None:
    """On resume, keep the events up to ``iteration`` (the checkpoint's; later ones are logged again) and drop
    a torn last line with a warning naming the file. Rewritten atomically, and only when something goes;
    the file is streamed twice (what goes, then the rewrite), never held whole."""
    path = Path(path)
    if not path.exists():
        return
    scan = MetricsScan(path)
    later = sum(1 for _, event in scan if event.get("iteration", 0) > iteration)
    if scan.torn_line is not None:
        print(f"warning: {path} ends in a partial line (line {scan.torn_line}, an append cut short); "
              "dropping it.", file=sys.stderr, flush=True)
    if scan.torn_line is None and not later:
        return
    try:
        with atomic_file(path) as tmp, tmp.open("w", encoding="utf-8") as out:
            out.writelines(text + "\n" for text, event in MetricsScan(path) if event.get("iteration", 0) <= iteration)
    except OSError as err:
        raise UserError(f"rewriting {path} to the checkpoint's iteration {iteration} failed ({err.strerror}); "
                         f"free space in {path.parent}, then resume again.") from None


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of ``<run_dir>/metrics.jsonl``; a torn last line is left out (see :func:`read_metrics_file`)."""
    return [event for _, event in read_metrics_file(Path(run_dir) / METRICS_FILE).events]


def plot_loss(run_dir: str | os.PathLike) -> Path:
    """loss.png: training loss and validation loss against iteration (written atomically). A BERT
    run gets a second panel: sentence-order accuracy, train and validation, against chance."""
    import matplotlib  # local: matplotlib only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: matplotlib only when a plot is drawn

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
    return save_figure(fig, Path(run_dir) / "loss.png")


def save_figure(fig, target: Path) -> Path:
    """Write a matplotlib figure as a PNG atomically (a reader never sees half a plot), then close it."""
    import matplotlib.pyplot as plt  # local: matplotlib only when a plot is drawn

    try:
        with atomic_file(target) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return target


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
