"""Host time per micro-step: batches read by DataLoader workers (this tree) against batches read in the
training process (a baseline checkout of commit 18ce9da).

For GPT-2 and BERT pretraining data, on CPU: the time from the start of a micro-step to the model's
first forward op (a forward pre-hook on the model), i.e. everything the host does before the device
could start: read the samples (BERT: sentence pairs and whole-word masking), stack them, copy them.

* this tree ("after" in the table): batches come from ``zoo.data.gpt_dataset.build_pretraining_dataloader`` and are
  copied with ``zoo.training.device_batches.to_device``, as ``zoo.training.loop`` reads them. With ``--workers 0``
  the reading and masking happen on the critical path; with workers (``data_workers``, default 2) they
  run in other processes while the model computes, so the host time is taking a ready batch.
* the baseline ("before" in the table; commit 18ce9da, checked out with ``git worktree add /tmp/before
  18ce9da``): the training process reads each micro-batch itself, ``PretrainingData.micro_batch_at`` then
  ``model_forward_kwargs``, so masking is always on the critical path.

Each micro-step runs the model's forward and backward (so the workers have compute to overlap with),
in one torch thread; DeepSpeed's engine and the per-iteration agreement collective are left out (the
same in both trees). The device copy is a no-op on CPU (it is a pinned, non-blocking copy on a GPU).
Each tree runs in its own interpreter with its own ``zoo`` on ``PYTHONPATH`` and preprocesses the
first articles of the bundled Wikipedia sample with its own code.

    .venv/bin/python benchmarks/bench_host_time.py --before /tmp/before
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SEQ_LENGTH = {"gpt2": 256, "bert": 512}
PRESET = {"gpt2": "gpt2-tiny", "bert": "bert-tiny"}
ARTICLES = 60


# ------------------------------------------------------------------------- inside one tree's interpreter
def small_corpus(family: str, directory: Path) -> str:
    """The first ARTICLES articles of the bundled sample, preprocessed by this tree's code."""
    import zoo  # local: the measured tree's zoo, on the child's PYTHONPATH
    from zoo.data import preprocess, preprocess_bert  # local: the measured tree's zoo, on the child's PYTHONPATH

    bundled = Path(zoo.__file__).parent / "assets" / "corpora" / "wiki-sample.jsonl.gz"
    with gzip.open(bundled, "rt") as src:
        lines = [next(src) for _ in range(ARTICLES)]
    source = directory / "small.jsonl"
    source.write_text("".join(lines))
    prefix = str(directory / f"small_{family}")
    (preprocess_bert if family == "bert" else preprocess)([str(source)], prefix, workers=1, progress=False)
    return prefix


def after_reader(dataset, micro: int, workers: int):
    """This tree's training read: the pretraining DataLoader, then the device copy."""
    from zoo.data.gpt_dataset import batch_or_raise, build_pretraining_dataloader  # local: absent from 18ce9da
    from zoo.training.device_batches import to_device  # local: absent from 18ce9da

    batches = iter(build_pretraining_dataloader(dataset, micro, 0, None, num_workers=workers, pin_memory=False))
    return lambda step: to_device(batch_or_raise(next(batches)), "cpu")


def old_training_families():
    """18ce9da's ``zoo.training.families``, which this tree names ``zoo.training.pretraining_objectives`` (and
    whose build_model lives in ``zoo.models.families``): imported by name, since only the measured tree has it."""
    import importlib  # local: only the child interpreters of the 18ce9da tree need it

    return importlib.import_module("zoo.training.families")


def before_reader(dataset, micro: int):
    """18ce9da's training read: ``micro_batch_at`` in the training process, then ``model_forward_kwargs``."""
    from zoo.parallel import ParallelState  # local: the measured tree's zoo, on the child's PYTHONPATH
    from zoo.training.pretraining_data import PretrainingData  # local: 18ce9da's API

    model_forward_kwargs = old_training_families().model_forward_kwargs

    data = object.__new__(PretrainingData)   # only the two fields micro_batch_at reads
    data.parallel, data.micro_batch = ParallelState.single(), micro
    return lambda step: model_forward_kwargs(data.micro_batch_at(dataset, step * micro), "cpu")


def measure(family: str, workers: int | None, steps: int, warmup: int, micro: int, directory: Path) -> dict:
    """Host milliseconds from micro-step start to the model's first forward op, per measured step."""
    import torch  # local: only the child interpreters load torch

    from zoo.data import IndexedDataset  # local: the measured tree's zoo, on the child's PYTHONPATH
    from zoo.models import model_config  # local: the measured tree's zoo, on the child's PYTHONPATH
    from zoo.parallel import ParallelState  # local: the measured tree's zoo, on the child's PYTHONPATH
    try:
        from zoo.training.pretraining_objectives import build_dataset  # local: this tree's place for it
    except ImportError:
        build_dataset = old_training_families().build_dataset
    try:
        from zoo.models.families import build_model  # local: this tree's place for it
    except ImportError:
        build_model = old_training_families().build_model

    torch.manual_seed(0)
    config = model_config(PRESET[family])
    dataset = build_dataset(config, IndexedDataset(small_corpus(family, directory)), SEQ_LENGTH[family], 1234,
                            "969,30,1", "train", (steps + warmup) * micro)
    model = build_model(config, ParallelState.single())
    reader = before_reader(dataset, micro) if workers is None else after_reader(dataset, micro, workers)
    entered: list[float] = []
    model.register_forward_pre_hook(lambda module, args: entered.append(time.perf_counter()))
    host_ms = []
    for step in range(steps + warmup):
        start = time.perf_counter()
        output = model(**reader(step))
        host_ms.append((entered[-1] - start) * 1e3)
        output.loss.backward()
        model.zero_grad(set_to_none=True)
    per_sample_ms = sample_read_ms(dataset, micro)
    measured = host_ms[warmup:]
    return {"median_ms": statistics.median(measured), "p90_ms": sorted(measured)[int(0.9 * (len(measured) - 1))],
            "mean_ms": statistics.fmean(measured), "sample_ms": per_sample_ms}


def sample_read_ms(dataset, count: int) -> float:
    """Median host milliseconds of one ``dataset[i]`` (BERT: pair building and masking)."""
    times = []
    for index in range(count * 4):
        start = time.perf_counter()
        dataset[index]
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure_tree(args: argparse.Namespace) -> None:
    import torch  # local: only the child interpreters load torch

    torch.set_num_threads(1)
    is_after = os.path.exists(os.path.join(os.environ["PYTHONPATH"], "zoo", "training", "loop.py"))
    cases = ([(family, workers) for family in ("gpt2", "bert") for workers in (0, args.workers)] if is_after
             else [(family, None) for family in ("gpt2", "bert")])
    with tempfile.TemporaryDirectory() as directory:
        for family, workers in cases:
            result = measure(family, workers, args.steps, args.warmup, args.micro_batch, Path(directory))
            print(json.dumps({"family": family, "workers": workers, **result}), flush=True)


# ------------------------------------------------------------------------------------------- driver
def run_tree(root: Path, args: argparse.Namespace) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, os.path.abspath(__file__), "--measure-tree", "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch), "--workers", str(args.workers)]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"measuring {root} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def table(rows: list[tuple[str, dict]], micro: int) -> str:
    lines = [f"host time per micro-step, start -> model's first forward op (CPU, 1 thread, micro-batch {micro}, "
             f"GPT-2 seq {SEQ_LENGTH['gpt2']}, BERT seq {SEQ_LENGTH['bert']})",
             "| code | model | batches read | masking | median ms | p90 ms | mean ms | host ms per sample |",
             "|---|---|---|---|---:|---:|---:|---:|"]
    for code, row in rows:
        if row["workers"] is None:
            read, masking = "micro_batch_at in the training process", "on the critical path"
        elif row["workers"] == 0:
            read, masking = "DataLoader, workers 0", "on the critical path"
        else:
            read, masking = f"DataLoader, workers {row['workers']}", "off it (in the workers)"
        if row["family"] == "gpt2":
            masking = "none (GPT-2)"
        lines.append(f"| {code} | {PRESET[row['family']]} | {read} | {masking} | {row['median_ms']:.2f} | "
                     f"{row['p90_ms']:.2f} | {row['mean_ms']:.2f} | {row['sample_ms']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="/tmp/before", help="a checkout of commit 18ce9da (git worktree add)")
    parser.add_argument("--steps", type=int, default=20, help="measured micro-steps per case")
    parser.add_argument("--warmup", type=int, default=4, help="micro-steps dropped first (worker start-up)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers of the 'off the critical path' case")
    parser.add_argument("--measure-tree", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_tree:
        measure_tree(args)
        return
    rows = []
    before = Path(args.before)
    if (before / "zoo").is_dir():
        rows += [("before (18ce9da)", row) for row in run_tree(before, args)]
    else:
        print(f"no checkout at {before}: run `git worktree add {before} 18ce9da` to measure the old code too")
    rows += [("after (this tree)", row) for row in run_tree(Path(__file__).resolve().parent.parent, args)]
    print(table(rows, args.micro_batch))


if __name__ == "__main__":
    main()
