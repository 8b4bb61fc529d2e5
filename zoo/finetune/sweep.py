"""Run a W&B sweep file's grid locally and report the median over seeds (the paper's protocol).

``finetune/sweeps/<task>-<size>.yaml`` (one per task and BERT size: the paper's Table 6 row over 5
seeds) is in W&B's sweep format (``program``, ``method``, ``metric``, ``parameters``), so ``wandb
sweep`` + ``wandb agent`` run it unchanged on a cluster. This module
runs the same grid here, one subprocess per point (``python <program> --key=value ...``, or under a
``--launcher`` such as ``deepspeed --num_gpus 2``), each a W&B run (offline unless ``WANDB_MODE`` says
otherwise) grouped by the sweep's name, then writes ``runs.csv`` (one row per run), ``summary.csv``/
``summary.md`` (one row per setting: median, min and max of the metric over seeds) and ``sweep.png``.

What every user changes is a flag, not an edit of the file: ``--pretrained``, ``--data-dir`` and
``--deepspeed-config`` replace the file's values (:mod:`zoo.finetune.sweep_overrides`), ``--project`` and
``--entity`` name the W&B project and entity, ``--count`` runs the first N points; ``--dry-run`` prints each
resolved run as the command line it runs. Every run writes into its own directory under ``--out``; an
``--out`` holding an earlier sweep's results is refused before anything runs, unless ``--overwrite`` (which
each run is given too). Without wandb installed a tracked sweep stops before it starts, saying how to
install it (``--no-wandb`` runs the grid untracked).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tqdm import tqdm

from zoo.atomic import atomic_file, write_text_atomic
from zoo.errors import MissingInput, UserError, report_error
from zoo.finetune.config import parse_args
from zoo.finetune.sweep_overrides import SweepOverrides, check_file_values, flag_key
from zoo.training.run_directory import FINETUNING_OUTPUTS

SEED_KEY = "seed"
SWEEP_OUTPUTS = ("runs.csv", "summary.csv", "summary.md", "sweep.png")
DEFAULT_PROJECT = "zoo-finetune"
WANDB_NAME_FORBIDDEN = "/\\#?%:"   # what W&B refuses in a project name


@dataclass(frozen=True)
class SweepSpec:
    name: str
    program: str
    metric: str
    goal: str
    fixed: dict[str, Any]
    grid: dict[str, list[Any]]
    program_args: tuple[str, ...] = ()   # literal flags of the file's command: after ${program}
    project: str | None = None            # the file's W&B project: and entity: entries
    entity: str | None = None

    def settings(self) -> list[dict[str, Any]]:
        """Every grid point (fixed values included), in the order W&B's grid search walks them."""
        keys = list(self.grid)
        return [{**self.fixed, **dict(zip(keys, values))} for values in itertools.product(*self.grid.values())]


def load_sweep(path: str | os.PathLike) -> SweepSpec:
    """Read and check a W&B sweep YAML; errors name the file and the missing or wrong entry."""
    file = Path(path)
    if not file.is_file():
        raise MissingInput(f"sweep file {path} does not exist; pass one of finetune/sweeps/*.yaml.")
    try:
        spec = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"sweep file {path} is not valid YAML ({yaml_problem(err)}); fix it.") from None
    if not isinstance(spec, dict):
        raise UserError(f"sweep file {path} is not a mapping; write it in W&B's sweep format.")
    for key in ("program", "metric", "parameters"):
        if key not in spec:
            raise UserError(f"sweep file {path} has no '{key}' entry; add it (W&B's sweep format).")
    if spec.get("method", "grid") != "grid":
        raise UserError(f"sweep file {path} uses method {spec.get('method')!r}; the local runner walks grids only, "
                         "so set method: grid (wandb agent can still run other methods).")
    fixed, grid = read_parameters(spec["parameters"], path)
    metric = spec["metric"]
    if not isinstance(metric, dict) or "name" not in metric:
        raise UserError(f"sweep file {path} needs metric: {{name: ..., goal: maximize}}.")
    for key in ("project", "entity"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise UserError(f"sweep file {path} has {key}: {spec[key]!r}, not a name; write it as a string "
                             f"(or pass --{key}).")
    return SweepSpec(name=spec.get("name") or file.stem, program=spec["program"], metric=metric["name"],
                     goal=metric.get("goal", "maximize"), fixed=fixed, grid=grid,
                     program_args=read_program_args(spec.get("command"), path), project=spec.get("project"),
                     entity=spec.get("entity"))


def read_program_args(command: Any, path: str | os.PathLike) -> tuple[str, ...]:
    """The literal words of a sweep's ``command:`` after ``${program}`` (W&B's macros such as ``${args}``
    left out): flags the file gives every run besides its parameters."""
    if command is None:
        return ()
    if not isinstance(command, list) or not all(isinstance(word, (str, int, float)) for word in command):
        raise UserError(f"sweep file {path} has command: {command!r}, not a list of words; write it as W&B's "
                         "sweep format does, e.g. ['${env}', deepspeed, '${program}', '${args}'].")
    words = [str(word) for word in command]
    if "${program}" not in words:
        return ()
    after = words[words.index("${program}") + 1:]
    return tuple(word for word in after if not (word.startswith("${") and word.endswith("}")))


def yaml_problem(err: Exception) -> str:
    """A YAML parse error as one line: what is wrong and where."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def read_parameters(parameters: Any, path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The fixed values (``value:``) and the grid (``values:``, each a non-empty list) of a sweep."""
    if not isinstance(parameters, dict) or not parameters:
        raise UserError(f"sweep file {path} needs 'parameters' to map each flag to {{value: ...}} or "
                         "{values: [...]}; write it in W&B's sweep format.")
    fixed, grid = {}, {}
    for name, entry in parameters.items():
        if isinstance(entry, dict) and "values" in entry:
            values = entry["values"]
            if not isinstance(values, list):
                raise UserError(f"sweep parameter {name!r} in {path} has values: {values!r}, not a list; write "
                                 f"values: [{values!r}] (or value: for a fixed one).")
            if not values:
                raise UserError(f"sweep parameter {name!r} in {path} has an empty values list, which makes a grid "
                                 "of 0 runs; give it at least one value (or use value: for a fixed one).")
            grid[name] = list(values)
        elif isinstance(entry, dict) and "value" in entry:
            fixed[name] = entry["value"]
        else:
            raise UserError(f"sweep parameter {name!r} in {path} needs 'value' or 'values'; the grid runner "
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


def command_for(setting: dict[str, Any], spec: SweepSpec, save: Path, launcher: str,
                overwrite: bool = False) -> list[str]:
    args = list(spec.program_args) + [f"--{key}={value}" for key, value in setting.items()] + [f"--save={save}"]
    return shlex.split(launcher) + [spec.program] + args + (["--overwrite"] if overwrite else [])


def apply_overrides(spec: SweepSpec, overrides: SweepOverrides) -> SweepSpec:
    fixed, grid, program_args = overrides.apply(spec.fixed, spec.grid, spec.program_args)
    return dataclasses.replace(spec, fixed=fixed, grid=grid, program_args=program_args)


def _check_wandb_name(value: str, source: str, kind: str, example: str) -> None:
    bad = [char for char in WANDB_NAME_FORBIDDEN if char in value]
    if not value.strip() or len(value) > 128 or bad or (kind == "entity" and any(c.isspace() for c in value)):
        raise UserError(f"{source} {value!r} is not a W&B {kind} name (1 to 128 characters, none of "
                         f"{' '.join(WANDB_NAME_FORBIDDEN)}{' or spaces' if kind == 'entity' else ''}); "
                         f"pass e.g. --{kind} {example}.")


def wandb_environment(spec: SweepSpec, project: str | None, entity: str | None, path: str | os.PathLike
                      ) -> dict[str, str]:
    """The W&B variables every run gets: the mode (offline unless ``$WANDB_MODE`` says otherwise), the project
    (``--project``, the file's ``project:``, ``$WANDB_PROJECT``, else zoo-finetune), the entity (``--entity``,
    the file's ``entity:``, ``$WANDB_ENTITY``, else W&B's default) and the sweep's name as the run group."""
    sources = [("--project", project), (f"the project of {path}", spec.project),
               ("$WANDB_PROJECT", os.environ.get("WANDB_PROJECT")), ("the default project", DEFAULT_PROJECT)]
    project_source, project = next((s, v) for s, v in sources if v is not None)
    _check_wandb_name(project, project_source, "project", DEFAULT_PROJECT)
    env = {"WANDB_MODE": os.environ.get("WANDB_MODE", "offline"), "WANDB_PROJECT": project}
    sources = [("--entity", entity), (f"the entity of {path}", spec.entity),
               ("$WANDB_ENTITY", os.environ.get("WANDB_ENTITY"))]
    entity_source, entity = next(((s, v) for s, v in sources if v is not None), (None, None))
    if entity is not None:
        _check_wandb_name(entity, entity_source, "entity", "my-team")
        env["WANDB_ENTITY"] = entity
    return {**env, "WANDB_RUN_GROUP": spec.name}


def require_wandb() -> None:
    """A tracked sweep needs wandb in every run: without it, stop before the first run, saying how to get it."""
    try:
        import wandb  # noqa: F401 - local: wandb is optional; this only checks that it imports
    except ImportError:
        raise UserError("the sweep logs every run to W&B but wandb is not installed; pip install wandb, or pass "
                         "--no-wandb to run the grid untracked.") from None
    except Exception as err:  # noqa: BLE001 - a broken install fails in many ways; each is the same sentence
        raise UserError(f"the sweep logs every run to W&B but import wandb fails ({type(err).__name__}: {err}); "
                         "pip install --force-reinstall wandb, or pass --no-wandb to run the grid untracked.") from None


def earlier_outputs(out_dir: Path, saves: list[Path]) -> list[str]:
    """What an earlier sweep left in ``out_dir`` that this one would write over: its tables and plot, a
    run's log, or a run directory's finetuning results."""
    found = [name for name in SWEEP_OUTPUTS if (out_dir / name).exists()]
    for save in saves:
        found += [f"{save.name}.log"] if (out_dir / f"{save.name}.log").exists() else []
        found += [f"{save.name}/{name}" for name in FINETUNING_OUTPUTS if (save / name).exists()]
    return found


def check_output_directory(out_dir: Path, saves: list[Path], overwrite: bool) -> None:
    """``out_dir`` is a directory (or can be made) holding nothing this sweep would replace, unless ``overwrite``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir} is a file; pass a directory for the sweep's runs and tables.")
    earlier = earlier_outputs(out_dir, saves) if out_dir.is_dir() else []
    if earlier and not overwrite:
        more = f" and {len(earlier) - 1} more file{'s' if len(earlier) > 2 else ''}" if len(earlier) > 1 else ""
        raise UserError(f"{out_dir} (the sweep's --out) already holds an earlier sweep's {earlier[0]}{more}; pass "
                         "another --out, or --overwrite to replace them.")


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
    """The summary as a Markdown table: each setting's values as the sweep file gives them (an lr of 5e-05
    stays 5e-05), the scores to 4 decimals."""
    keys = [k for k in spec.grid if k != SEED_KEY]
    header = keys + ["seeds", "finished", f"median {spec.metric}", "min", "max"]

    def score(value):
        return "-" if value is None else f"{value:.4f}"

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary:
        values = [str(row[k]) for k in keys] + [str(row["seeds"]), str(row["finished"])]
        values += [score(row[k]) for k in ("median", "min", "max")]
        lines.append("| " + " | ".join(values) + " |")
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], summary: list[dict[str, Any]], spec: SweepSpec, path: Path) -> None:
    """Each setting's seed scores as dots and its median as a bar."""
    import matplotlib  # local: matplotlib only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # local: matplotlib only when a plot is drawn

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


def check_parameter_flags(spec: SweepSpec, path: str | os.PathLike) -> None:
    """Every parameter of the sweep (fixed or a grid key) is a flag its finetune script takes, else one sentence
    naming the key, the file and the closest flag: each run passes it as ``--<key>=<value>``, and a script
    refuses a flag it does not take, so a wrong key would fail every run. A program that is no zoo finetune
    script is left to itself."""
    import difflib

    from zoo.finetune.config import build_parser  # local: with the tasks, only a sweep's check needs it
    from zoo.finetune.task_catalog import TASKS  # local: torch import cost (the tasks import torch)

    task = task_of_program(spec.program)
    if task not in TASKS:
        return
    flags = {flag_key(option) for action in build_parser(task)._actions for option in action.option_strings
             if option.startswith("--")}
    for key in [*spec.fixed, *spec.grid]:
        if flag_key(key) in flags:      # the script takes the dash and the underscore spelling alike
            continue
        closest = difflib.get_close_matches(flag_key(key), sorted(flags), n=1)
        hint = f"the closest is {closest[0]!r}" if closest else f"python {spec.program} --help lists them"
        raise UserError(f"sweep file {path} has parameter {key!r}, which is no flag of {spec.program} (every run "
                         f"would fail on it); rename it to one of the script's flags ({hint}).")


def task_of_program(program: str) -> str:
    """The task a finetune script runs, from its file name: ``finetune/race.py`` runs race, and underscores
    read as dashes where only that spelling is a task (``finetune/same_article.py`` runs same-article)."""
    from zoo.finetune.task_catalog import (
        TASKS,  # local: torch import cost (the tasks import torch); in-process sweeps only
    )

    stem = Path(program).stem
    dashed = stem.replace("_", "-")
    return dashed if stem not in TASKS and dashed in TASKS else stem


def _run_in_process(command: list[str], env: dict[str, str], log_path: Path) -> int:
    """Run a finetune script's parse-and-finetune in this process (one world-of-one process group for the
    whole sweep, no per-run interpreter and DeepSpeed start-up); returns its exit code: 2 with the one
    sentence in the run's log for a user error, as the script would."""
    from zoo.distributed import single_process_env  # local: torch import cost, for in-process sweeps only
    from zoo.finetune.finetune_job import finetune  # local: torch import cost, for in-process sweeps only

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        with log_path.open("w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                single_process_env()
                finetune(parse_args(task_of_program(command[0]), command[1:]))
            except UserError as err:
                report_error(err)
                return 2
        return 0
    except SystemExit as exit_:   # argparse's own exit for a malformed flag
        return int(exit_.code or 0)
    except Exception:  # noqa: BLE001 - one failed point must not end the sweep
        with log_path.open("a") as log:
            log.write(traceback.format_exc())
        return 1
    finally:
        os.environ.clear()
        os.environ.update(saved)


def tracking_environment(spec: SweepSpec, project: str | None, entity: str | None, path, track_wandb: bool) -> dict:
    """The W&B variables every run of the grid gets; ``--no-wandb`` disables W&B, and naming a project or an
    entity with it is one sentence."""
    if track_wandb:
        return wandb_environment(spec, project, entity, path)
    if project is not None or entity is not None:
        flag = "--project" if project is not None else "--entity"
        raise UserError(f"{flag} names a W&B {flag[2:]} but --no-wandb runs the grid untracked; drop one of them.")
    return {"WANDB_MODE": "disabled"}


def run_point(command: list[str], setting: dict, spec: SweepSpec, save: Path, env: dict, in_process: bool) -> dict:
    """One grid point run to its end, its output in ``<save>.log`` beside it: the row of its grid values, run
    name, exit code and score (None for a failed run, which is said in one line)."""
    log_path = save.parent / f"{save.name}.log"
    if in_process:
        returncode = _run_in_process(command, env, log_path)
    else:
        with log_path.open("w") as log:
            returncode = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    score = None
    if returncode == 0 and (save / "results.json").is_file():
        score = metric_of(json.loads((save / "results.json").read_text()), spec.metric)
    else:
        print(f"run {save.name} failed (exit {returncode}); see {log_path}")
    return {**{k: setting[k] for k in spec.grid}, "run": save.name, "exit_code": returncode, "score": score}


def write_results(rows: list[dict], summary: list[dict], spec: SweepSpec, out_dir: Path) -> str:
    """runs.csv, summary.csv, summary.md and sweep.png in ``out_dir``; returns the summary table."""
    table = format_table(summary, spec)
    _write_csv(out_dir / "runs.csv", rows)
    _write_csv(out_dir / "summary.csv", summary)
    write_text_atomic(out_dir / "summary.md", f"# sweep {spec.name} ({spec.metric}, median over seeds)\n\n{table}\n")
    plot_sweep(rows, summary, spec, out_dir / "sweep.png")
    return table


def run_sweep(path: str | os.PathLike, out: str | os.PathLike | None = None, count: int | None = None,
              dry_run: bool = False, launcher: str | None = None, project: str | None = None,
              extra_env: dict[str, str] | None = None, in_process: bool = False, *,
              overrides: SweepOverrides | None = None, entity: str | None = None, overwrite: bool = False,
              track_wandb: bool = True) -> dict[str, Any]:
    """Run (or, with ``dry_run``, print) the grid; returns the per-run rows and the summary.

    Everything a user can get wrong (the file, the overrides, ``count``, the W&B names, wandb missing, an
    ``out`` holding an earlier sweep's results) is checked before the first run, the dry run included; the
    file's own paths are checked before a real run. ``in_process`` runs every point in this process, one
    after the other (no launcher; tp = 1 unless this process already belongs to a larger torch.distributed
    world)."""
    overrides = overrides or SweepOverrides()
    spec = load_sweep(path)
    if count is not None and count < 1:
        raise UserError(f"--count {count} must be 1 or more (the number of grid points to run); leave it out to "
                         "run them all.")
    spec = apply_overrides(spec, overrides)
    check_parameter_flags(spec, path)
    wandb_env = tracking_environment(spec, project, entity, path, track_wandb)
    out_dir = Path(out or Path("runs") / "sweeps" / spec.name)
    settings = spec.settings()[: count or None]
    saves = [out_dir / run_name(setting, spec) for setting in settings]
    check_output_directory(out_dir, saves, overwrite)
    overrides.check()   # after the checks that cost nothing: a ds_config's check imports the model code
    if track_wandb:
        require_wandb()
    launcher = launcher or shlex.quote(sys.executable)
    shown_env = {**wandb_env, **(extra_env or {})}
    env = {**os.environ, **shown_env}
    if not track_wandb:
        env.pop("WANDB_PROJECT", None)
    rows = []
    if dry_run:
        print(f"# {describe_grid(spec)}")
        for setting, save in zip(settings, saves):
            words = [f"{key}={value}" for key, value in shown_env.items()]
            print(shlex.join(words + command_for(setting, spec, save, launcher, overwrite)))
        return {"rows": [], "summary": [], "spec": spec}
    check_file_values(spec.fixed, spec.grid, overrides, str(path))
    out_dir.mkdir(parents=True, exist_ok=True)
    for setting, save in tqdm(list(zip(settings, saves)), desc=f"sweep {spec.name}", unit="run", file=sys.stdout):
        command = command_for(setting, spec, save, "" if in_process else launcher, overwrite)
        rows.append(run_point(command, setting, spec, save, env, in_process))
    summary = summarize(rows, spec)
    table = write_results(rows, summary, spec, out_dir)
    print(table)
    print(f"{len(rows)} runs; table in {out_dir / 'summary.md'}, plot in {out_dir / 'sweep.png'}; "
          f"{tracking_note(env, spec, track_wandb)}")
    return {"rows": rows, "summary": summary, "spec": spec, "out": out_dir}


def failed_runs_sentence(result: dict[str, Any]) -> str | None:
    """The sentence a sweep with failed runs ends on (its exit code is then non-zero, so a script or CI
    job that runs the sweep sees it): how many of the runs did not finish, their names and where their logs
    are; None when every run finished."""
    rows = result["rows"]
    failed = [row["run"] for row in rows if row["exit_code"] != 0 or row["score"] is None]
    if not failed:
        return None
    return (f"{len(failed)} of {len(rows)} sweep runs did not finish ({', '.join(failed)}); their logs are "
            f"{result['out']}/<run>.log, fix what they report and run the sweep again.")


def tracking_note(env: dict[str, str], spec: SweepSpec, track_wandb: bool) -> str:
    if not track_wandb:
        return "untracked (--no-wandb)"
    where = f"project {env['WANDB_PROJECT']}, group {spec.name}"
    if env.get("WANDB_MODE") == "offline":
        return f"W&B offline runs under each run's wandb/ directory ({where}; wandb sync uploads them)"
    return f"W&B runs in {where}"
