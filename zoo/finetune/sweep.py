"""Run a W&B sweep file's grid locally and report the median over seeds (the paper's protocol).

``finetune/sweeps/<task>-<size>.yaml`` (one per task and BERT size: the paper's Table 6 row over 5
seeds) is in W&B's sweep format (``program``, ``method``, ``metric``, ``parameters``), so ``wandb
sweep`` + ``wandb agent`` run it unchanged on a cluster. This module
runs the same grid here, one subprocess per point (``python <program> --key=value ...``, or under a
``--launcher`` such as ``deepspeed --num_gpus 2``), each an offline W&B run grouped by the sweep's
name, then writes ``runs.csv`` (one row per run), ``summary.csv``/``summary.md`` (one row per setting:
median, min and max of the metric over seeds) and ``sweep.png``.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.atomic import atomic_file, write_text_atomic
from zoo.errors import report_error

SEED_KEY = "seed"


@dataclass(frozen=True)
class SweepSpec:
    name: str
    program: str
    metric: str
    goal: str
    fixed: dict[str, Any]
    grid: dict[str, list[Any]]

    def settings(self) -> list[dict[str, Any]]:
        """Every grid point (fixed values included), in the order W&B's grid search walks them."""
        keys = list(self.grid)
        return [{**self.fixed, **dict(zip(keys, values))} for values in itertools.product(*self.grid.values())]


def load_sweep(path: str | os.PathLike) -> SweepSpec:
    """Read and check a W&B sweep YAML; errors name the file and the missing or wrong entry."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"sweep file {path} does not exist; pass one of finetune/sweeps/*.yaml.")
    try:
        spec = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"sweep file {path} is not valid YAML ({err}); fix it.") from None
    if not isinstance(spec, dict):
        raise ValueError(f"sweep file {path} is not a mapping; write it in W&B's sweep format.")
    for key in ("program", "metric", "parameters"):
        if key not in spec:
            raise ValueError(f"sweep file {path} has no '{key}' entry; add it (W&B's sweep format).")
    if spec.get("method", "grid") != "grid":
        raise ValueError(f"sweep file {path} uses method {spec.get('method')!r}; the local runner walks grids only, "
                         "so set method: grid (wandb agent can still run other methods).")
    fixed, grid = read_parameters(spec["parameters"], path)
    metric = spec["metric"]
    if not isinstance(metric, dict) or "name" not in metric:
        raise ValueError(f"sweep file {path} needs metric: {{name: ..., goal: maximize}}.")
    return SweepSpec(name=spec.get("name") or file.stem, program=spec["program"], metric=metric["name"],
                     goal=metric.get("goal", "maximize"), fixed=fixed, grid=grid)


def read_parameters(parameters: Any, path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The fixed values (``value:``) and the grid (``values:``, each a non-empty list) of a sweep."""
    if not isinstance(parameters, dict) or not parameters:
        raise ValueError(f"sweep file {path} needs 'parameters' to map each flag to {{value: ...}} or "
                         "{values: [...]}; write it in W&B's sweep format.")
    fixed, grid = {}, {}
    for name, entry in parameters.items():
        if isinstance(entry, dict) and "values" in entry:
            values = entry["values"]
            if not isinstance(values, list):
                raise ValueError(f"sweep parameter {name!r} in {path} has values: {values!r}, not a list; write "
                                 f"values: [{values!r}] (or value: for a fixed one).")
            if not values:
                raise ValueError(f"sweep parameter {name!r} in {path} has an empty values list, which makes a grid "
                                 "of 0 runs; give it at least one value (or use value: for a fixed one).")
            grid[name] = list(values)
        elif isinstance(entry, dict) and "value" in entry:
            fixed[name] = entry["value"]
        else:
            raise ValueError(f"sweep parameter {name!r} in {path} needs 'value' or 'values'; the grid runner "
                             "cannot expand distributions.")
    return fixed, grid


def describe_grid(spec: SweepSpec) -> str:
    """One line: the sweep's settings and how many runs they make (what ``--dry-run`` heads with)."""
    settings = ", ".join(f"{name} {'/'.join(str(v) for v in values)}" for name, values in spec.grid.items()
                         if name != SEED_KEY)
    seeds = spec.grid.get(SEED_KEY)
    over = f" x {len(seeds)} seeds ({', '.join(str(s) for s in seeds)})" if seeds else ""
    return f"sweep {spec.name}: {settings or 'one setting'}{over}; {len(spec.settings())} runs, {spec.metric}"


def run_name(setting: dict[str, Any], spec: SweepSpec) -> str:
    varying = [k for k in spec.grid]
    return "-".join(f"{k.replace('-', '_')}{setting[k]}" for k in varying) or "run"


def command_for(setting: dict[str, Any], spec: SweepSpec, save: Path, launcher: str) -> list[str]:
    args = [f"--{key}={value}" for key, value in setting.items()] + [f"--save={save}"]
    return shlex.split(launcher) + [spec.program] + args


def metric_of(results: dict[str, Any], metric: str) -> float | None:
    """The sweep metric from a run's results.json: ``best/<name>`` is the best epoch's value of <name>."""
    best = results.get("best", {})
    name = metric.removeprefix("best/")
    value = best.get("metrics", {}).get(name)
    return None if value is None else float(value)


def summarize(rows: list[dict[str, Any]], spec: SweepSpec) -> list[dict[str, Any]]:
    """One row per setting (seed excluded): median, min, max over the seeds that finished."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        key = tuple((k, row[k]) for k in spec.grid if k != SEED_KEY)
        groups.setdefault(key, []).append(row)
    summary = []
    for key, members in groups.items():
        scores = [m["score"] for m in members if m["score"] is not None]
        summary.append({**dict(key), "seeds": len(members), "finished": len(scores),
                        "median": statistics.median(scores) if scores else None,
                        "min": min(scores) if scores else None, "max": max(scores) if scores else None})
    reverse = spec.goal != "minimize"
    summary.sort(key=lambda r: (r["median"] is None, -(r["median"] or 0) if reverse else (r["median"] or 0)))
    return summary


def format_table(summary: list[dict[str, Any]], spec: SweepSpec) -> str:
    keys = [k for k in spec.grid if k != SEED_KEY]
    header = keys + ["seeds", "finished", f"median {spec.metric}", "min", "max"]

    def cell(value):
        return "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary:
        values = [row[k] for k in keys] + [row["seeds"], row["finished"], row["median"], row["min"], row["max"]]
        lines.append("| " + " | ".join(cell(v) for v in values) + " |")
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], summary: list[dict[str, Any]], spec: SweepSpec, path: Path) -> None:
    """Each setting's seed scores as dots and its median as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in spec.grid if k != SEED_KEY]
    labels = ["\n".join(f"{k}={row[k]}" for k in keys) or "run" for row in summary]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(summary)), 4.2))
    ax.bar(range(len(summary)), [row["median"] or 0.0 for row in summary], color="tab:blue", alpha=0.35,
           label="median over seeds")
    for i, row in enumerate(summary):
        scores = [r["score"] for r in rows if r["score"] is not None and all(r[k] == row[k] for k in keys)]
        ax.plot([i] * len(scores), scores, "o", color="tab:blue")
    ax.set_xticks(range(len(summary)), labels, fontsize=8)
    ax.set_ylabel(spec.metric)
    ax.set_title(f"sweep {spec.name}: {spec.metric} per setting")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with atomic_file(path) as tmp, tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)


def _run_in_process(command: list[str], env: dict[str, str], log_path: Path) -> int:
    """Run a finetune script's ``main`` in this process (one world-of-one process group for the whole
    sweep, no per-run interpreter and DeepSpeed start-up); returns its exit code."""
    import contextlib

    from zoo.finetune.runner import main as finetune_main

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        with log_path.open("w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            finetune_main(Path(command[0]).stem, command[1:], leave_process_group=False)
        return 0
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception:  # noqa: BLE001 - one failed point must not end the sweep
        import traceback

        with log_path.open("a") as log:
            log.write(traceback.format_exc())
        return 1
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_sweep(path: str | os.PathLike, out: str | os.PathLike | None = None, count: int | None = None,
              dry_run: bool = False, launcher: str | None = None, project: str = "zoo-finetune",
              extra_env: dict[str, str] | None = None, in_process: bool = False) -> dict[str, Any]:
    """Run (or, with ``dry_run``, print) the grid; returns the per-run rows and the summary.

    ``in_process`` runs every point in this process, one after the other (no launcher; tp = 1 unless
    this process already belongs to a larger torch.distributed world)."""
    from tqdm import tqdm

    spec = load_sweep(path)
    if count is not None and count < 1:
        raise ValueError(f"--count {count} must be 1 or more (the number of grid points to run); leave it out to "
                         "run them all.")
    out_dir = Path(out or Path("runs") / "sweeps" / spec.name)
    settings = spec.settings()[: count or None]
    launcher = launcher or shlex.quote(sys.executable)
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "WANDB_RUN_GROUP": spec.name,
           "WANDB_PROJECT": os.environ.get("WANDB_PROJECT", project), **(extra_env or {})}
    rows = []
    if dry_run:
        print(f"# {describe_grid(spec)}")
        for setting in settings:
            print(shlex.join(command_for(setting, spec, out_dir / run_name(setting, spec), launcher)))
        return {"rows": [], "summary": [], "spec": spec}
    out_dir.mkdir(parents=True, exist_ok=True)
    for setting in tqdm(settings, desc=f"sweep {spec.name}", unit="run", file=sys.stdout):
        save = out_dir / run_name(setting, spec)
        command = command_for(setting, spec, save, launcher)
        if in_process:
            returncode = _run_in_process(command_for(setting, spec, save, ""), env, out_dir / f"{save.name}.log")
        else:
            with (out_dir / f"{save.name}.log").open("w") as log:
                returncode = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        score = None
        if returncode == 0 and (save / "results.json").is_file():
            score = metric_of(json.loads((save / "results.json").read_text()), spec.metric)
        else:
            print(f"run {save.name} failed (exit {returncode}); see {out_dir / (save.name + '.log')}")
        rows.append({**{k: setting[k] for k in spec.grid}, "run": save.name, "exit_code": returncode,
                     "score": score})
    summary = summarize(rows, spec)
    table = format_table(summary, spec)
    _write_csv(out_dir / "runs.csv", rows)
    _write_csv(out_dir / "summary.csv", summary)
    write_text_atomic(out_dir / "summary.md", f"# sweep {spec.name} ({spec.metric}, median over seeds)\n\n{table}\n")
    plot_sweep(rows, summary, spec, out_dir / "sweep.png")
    print(table)
    print(f"{len(rows)} runs; table in {out_dir / 'summary.md'}, plot in {out_dir / 'sweep.png'}, "
          f"W&B offline runs under each run's wandb/ directory (group {spec.name})")
    return {"rows": rows, "summary": summary, "spec": spec}


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="finetune/sweep.py", description=__doc__.splitlines()[0])
    parser.add_argument("sweep", help="a W&B sweep YAML, e.g. finetune/sweeps/race-336m.yaml")
    parser.add_argument("--count", type=int, default=None, help="run only the first N grid points")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--out", default=None, help="output directory (default runs/sweeps/<name>)")
    parser.add_argument("--launcher", default=None,
                        help="command prefix, e.g. 'deepspeed --num_gpus 8' (default: this python)")
    parser.add_argument("--project", default="zoo-finetune", help="W&B project of the runs")
    parser.add_argument("--in-process", action="store_true",
                        help="run every point in this process (tp = 1; saves the start-up of each run)")
    args = parser.parse_args(argv)
    try:
        run_sweep(args.sweep, args.out, args.count, args.dry_run, args.launcher, args.project,
                  in_process=args.in_process)
    except (ValueError, FileNotFoundError) as err:
        report_error(err)
        sys.exit(2)
