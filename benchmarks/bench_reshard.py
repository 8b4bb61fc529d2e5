"""Changing a checkpoint's layout: zoo's parallel move (``launch/reshard.py``, each rank of the new layout reading
only the byte ranges of its own shards) against the one-process resharders it replaces
(``zoo.checkpoint.reshard.reshard_checkpoint``, and through it ``zoo.checkpoint.zero_reshard``), on a GPT-2-shaped
model with about 1 GB of fp32 training state (master + exp_avg + exp_avg_sq).

Sources, built once with the real launcher (``deepspeed --num_gpus 2 launch/pretrain.py``, one training step on
CPU, gloo) and cached under ``--cache``:

* ``fp32-tp2``: fp32, no ZeRO, tp = 2 (the optimizer state in ``mp_rank_XX_model_states.pt``);
* ``bf16z1-tp2``: bf16 + ZeRO-1 (DeepSpeed's BF16_Optimizer), tp = 2 (the state in ``bf16_zero_pp_rank_*``).

Each conversion is run by both tools, one after the other:

* ``parallel``: ``deepspeed --num_gpus N benchmarks/bench_reshard.py --worker ...``, which runs
  ``zoo.cli.reshard.main`` (what ``launch/reshard.py`` runs) on every rank and writes what that rank measured:
  the move's own seconds and peak bytes as zoo reports them (``resharded_from``), and the process's VmHWM;
* ``one-process``: ``reshard_checkpoint(tag, new_tp, out, new_dp)`` in one Python process, imported from
  ``--old-root`` (a checkout where it still exists, e.g. ``git worktree add ../old-5c743e9 5c743e9``).

"wall" is the whole command (the parallel one includes the launcher, imports, building the engine at the new
layout and saving it; the one-process one imports, reads and writes files); "move" is the move itself (zoo's
``seconds``; for the one-process resharder, its function call). VmHWM is each process's peak resident set
(``/proc/self/status``), the one-minute load average is printed beside each row: other work on the machine
slows every figure. Nothing is asserted.

    .venv/bin/python benchmarks/bench_reshard.py --cache /tmp/bench-reshard --old-root ../old-5c743e9
    .venv/bin/python benchmarks/bench_reshard.py --cache /tmp/bench-reshard --layers 1 --hidden 128 --heads 4  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCAB = 50257
# (name, source, new tp, new pp, new dp): the ranks of the parallel move are tp x pp x dp
CONVERSIONS = (
    ("fp32 tp2 -> tp1 x dp2", "fp32-tp2", 1, 1, 2),
    ("fp32 tp2 -> tp4", "fp32-tp2", 4, 1, 1),
    ("bf16+ZeRO-1 tp2 -> tp1 x dp2", "bf16z1-tp2", 1, 1, 2),
    ("bf16+ZeRO-1 tp2 -> tp1 x dp4", "bf16z1-tp2", 1, 1, 4),
)


# --------------------------------------------------------------------------- measured inside a process
def peak_resident_bytes() -> int:
    """This process's VmHWM (peak resident set), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_parallel_worker(report_dir: str, argv: list[str]) -> None:
    """One rank of ``launch/reshard.py`` (zoo.cli.reshard.main), then this rank's figures into ``report_dir``."""
    import zoo
    import zoo.training.offline_reshard as offline

    records = []
    convert = offline.convert_checkpoint

    def convert_and_keep(conversion):
        record = convert(conversion)
        records.append(record)
        return record

    offline.convert_checkpoint = convert_and_keep   # zoo.cli.reshard imports it at call time
    from zoo.cli.reshard import main

    try:
        main(argv)
    finally:
        rank = int(os.environ.get("RANK", "0"))
        moved = records[0] if records else {}
        report = {"rank": rank, "vmhwm": peak_resident_bytes(), "seconds": moved.get("seconds"),
                  "peak_bytes": moved.get("peak_bytes"), "bytes_read": moved.get("bytes_read"), "zoo": zoo.__file__}
        Path(report_dir, f"rank{rank}.json").write_text(json.dumps(report))


def run_old_worker(report: str, tag_dir: str, new_tp: int, out: str, new_dp: int | None) -> None:
    """The one-process resharder of the checkout on PYTHONPATH, timed, with this process's VmHWM."""
    import zoo
    from zoo.checkpoint.reshard import reshard_checkpoint

    started = time.perf_counter()
    reshard_checkpoint(tag_dir, new_tp, out, new_dp)
    seconds = time.perf_counter() - started
    Path(report).write_text(json.dumps({"rank": 0, "vmhwm": peak_resident_bytes(), "seconds": seconds,
                                        "peak_bytes": None, "zoo": zoo.__file__}))


# --------------------------------------------------------------------------- building the sources
def launcher_env(pythonpath: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def launcher(ranks: int) -> list[str]:
    """``deepspeed --num_gpus N`` on a free port (other jobs on the machine may hold DeepSpeed's default)."""
    from zoo.operations.launcher import free_port

    return [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port())]


def make_corpus(prefix: Path) -> str:
    """A random-token corpus of GPT-2's vocabulary in zoo's indexed format (the step's data does not matter)."""
    import numpy as np

    from zoo.data.indexed_dataset import IndexedDatasetBuilder

    if not prefix.with_suffix(".idx").exists():
        rng = np.random.default_rng(0)
        with IndexedDatasetBuilder(prefix, vocab_size=VOCAB) as builder:
            for _ in range(64):
                builder.add_document(rng.integers(0, VOCAB, size=200))
    return str(prefix)


def source_config(precision: str, args) -> dict:
    """The ds_config of a source run: one step of the GPT-2-shaped model at tp = 2 (global batch 4: dp 1, 2 and 4
    divide it)."""
    config = {
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
        "zoo": {"tensor_parallel_size": 2, "model": "gpt2", "seq_length": 64, "train_iters": 1,
                "split": "98,2,0", "seed": 1234, "log_interval": 1, "eval_interval": 0, "eval_iters": 1,
                "save_interval": 0, "data_workers": 0, "sample_prompts": [],
                "model_overrides": {"n_layer": args.layers, "n_embd": args.hidden, "n_head": args.heads,
                                    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}},
    }
    if precision == "bf16":
        config.update(bf16={"enabled": True}, zero_optimization={"stage": 1},
                      data_types={"grad_accum_dtype": "fp32"})
    return config


def build_source(name: str, cache: Path, corpus: str, args, zoo_root: Path) -> Path:
    """``cache/<name>``: a run directory with one checkpoint, built once."""
    run = cache / name
    if (run / "checkpoints" / "latest").is_file() and (run / "config.json").is_file():
        return run
    if run.exists():
        shutil.rmtree(run)   # an unfinished build of this script's own
    config_path = cache / f"{name}.json"
    config_path.write_text(json.dumps(source_config("bf16" if name.startswith("bf16") else "fp32", args), indent=2))
    command = launcher(2) + [str(zoo_root / "launch" / "pretrain.py"), "--deepspeed_config", str(config_path),
                             "--save", str(run), "--data-path", corpus]
    print(f"building {name}: {' '.join(command)}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True, env=launcher_env(zoo_root), cwd=zoo_root, stdout=sys.stderr)
    return run


def tag_directory(run: Path) -> Path:
    checkpoints = run / "checkpoints"
    return checkpoints / (checkpoints / "latest").read_text().strip()


def state_bytes(tag: Path) -> int:
    return sum(p.stat().st_size for p in tag.iterdir() if p.is_file())


# --------------------------------------------------------------------------- the two tools
def measure(command: list[str], env: dict[str, str], reports: Path) -> dict:
    """Run ``command``, then gather the per-rank reports it wrote into ``reports``."""
    if reports.exists():
        shutil.rmtree(reports)
    reports.mkdir(parents=True)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=env.get("PYTHONPATH", REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - started
    load_after = os.getloadavg()[0]
    if result.returncode != 0:
        print(result.stdout[-4000:], file=sys.stderr)
        raise SystemExit(f"{command[:4]} failed with exit code {result.returncode}")
    ranks = sorted((json.loads(p.read_text()) for p in reports.glob("*.json")), key=lambda r: r["rank"])
    return {"wall": wall, "ranks": ranks, "load": (load_before, load_after)}


def parallel_move(source: Path, tp: int, pp: int, dp: int, out: Path, reports: Path, zoo_root: Path) -> dict:
    ranks = tp * pp * dp
    command = launcher(ranks) + [str(Path(__file__).resolve()), "--worker", str(reports), "--load", str(source),
                                 "--tensor-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                                 "--data-parallel-size", str(dp), "--out", str(out)]
    return measure(command, launcher_env(zoo_root), reports)


def one_process_move(source: Path, tp: int, dp: int, zero: bool, out: Path, reports: Path, old_root: Path) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--old-worker", str(reports / "rank0.json"),
               str(tag_directory(source)), str(tp), str(out), str(dp if zero else 0)]
    return measure(command, launcher_env(old_root), reports)


# --------------------------------------------------------------------------- the table
def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def row(conversion: str, tool: str, ranks: int, figures: dict) -> str:
    per_rank = figures["ranks"]
    move = max((r["seconds"] for r in per_rank if r["seconds"] is not None), default=None)
    vmhwm = "/".join(gib(r["vmhwm"]) for r in per_rank)
    held = [r["peak_bytes"] for r in per_rank if r["peak_bytes"] is not None]
    held_text = "/".join(f"{b / 2**20:.0f}" for b in held) if held else "-"
    read = [r.get("bytes_read") for r in per_rank if r.get("bytes_read") is not None]
    read_text = "/".join(f"{b / 2**20:.0f}" for b in read) if read else "-"
    load = "{:.1f}-{:.1f}".format(*figures["load"])
    move_text = "-" if move is None else f"{move:.1f}"
    return (f"| {conversion} | {tool} | {ranks} | {figures['wall']:.1f} | {move_text} | {vmhwm} | {held_text} "
            f"| {read_text} | {load} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", required=True, help="directory for the corpus, the source runs and the outputs")
    parser.add_argument("--old-root", default=None, help="checkout holding the one-process resharders (skip: none)")
    parser.add_argument("--zoo-root", default=str(REPO), help="checkout whose launch/reshard.py code is measured")
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--only", default=None, help="run only the conversions whose name contains this text")
    args = parser.parse_args()

    cache = Path(args.cache).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(cache / "random_text_document")
    zoo_root = Path(args.zoo_root).resolve()
    sources = {name: build_source(name, cache, corpus, args, zoo_root) for name in ("fp32-tp2", "bf16z1-tp2")}
    params = args.layers * 12 * args.hidden ** 2 + (VOCAB + 1024) * args.hidden   # approximately
    print(f"model: {args.layers} layers x {args.hidden} hidden x {args.heads} heads, ~{params / 1e6:.0f}M parameters,"
          f" ~{12 * params / 2**30:.2f} GiB of fp32 state; {os.cpu_count()} CPUs")
    for name, run in sources.items():
        print(f"source {name}: {tag_directory(run)} ({state_bytes(tag_directory(run)) / 2**30:.2f} GiB on disk)")
    print("\n| conversion | tool | ranks | wall s | move s | VmHWM GiB per rank | move held MiB per rank "
          "| move read MiB per rank | load 1-min |")
    print("|---|---|---|---|---|---|---|---|---|")
    outputs = cache / "outputs"
    for conversion, source, tp, pp, dp in CONVERSIONS:
        if args.only and args.only not in conversion:
            continue
        out = outputs / f"{source}-to-tp{tp}pp{pp}dp{dp}"
        for path in (out, out.with_name(out.name + "-old")):
            if path.exists():
                shutil.rmtree(path)   # this script's own output of an earlier run
        figures = parallel_move(sources[source], tp, pp, dp, out, cache / "reports", zoo_root)
        print(row(conversion, "parallel (launch/reshard.py)", tp * pp * dp, figures), flush=True)
        shutil.rmtree(out, ignore_errors=True)
        if args.old_root:
            old_out = out.with_name(out.name + "-old")
            figures = one_process_move(sources[source], tp, dp, source.startswith("bf16"), old_out, cache / "reports",
                                       Path(args.old_root).resolve())
            print(row(conversion, "one process (reshard_checkpoint)", 1, figures), flush=True)
            shutil.rmtree(old_out, ignore_errors=True)


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]   # the launcher adds it first
    if arguments[:1] == ["--worker"]:
        run_parallel_worker(arguments[1], arguments[2:])
    elif arguments[:1] == ["--old-worker"]:
        report, tag, new_tp, out, new_dp = arguments[1:6]
        run_old_worker(report, tag, int(new_tp), out, int(new_dp) or None)
    else:
        main()
