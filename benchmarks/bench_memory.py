"""Per-rank peak memory of zoo's model I/O and of one training step, as ratios to the model's bytes.

For a GPT-2 of >= 200 MB fp32 (default: 8 layers x 512 hidden, vocab 50257, 256 positions: 204 MB),
at tp = 1, 2, 4 (CPU ranks joined by gloo, one fresh process per rank), each rank measures the
growth of its resident set during

- ``from_pretrained``: loading a transformers-layout directory (this rank's slices only);
- ``train step``: one training step through a DeepSpeed engine (fp32, no ZeRO, a client
  ``torch.optim.AdamW``, micro-batch 1 x the full 256 positions): weights + gradients + Adam's two
  moments + activations. This row counts from *before* ``from_pretrained`` (the weights are part
  of it); the planner's prediction (``zoo.planning.planner.plan(...).total``) is printed next to it;
- ``ds save``: ``engine.save_checkpoint`` of that engine (zoo's pretrain client state);
- ``save_pretrained``: the collective that writes the merged transformers directory (rank 0 writes);

and one process measures ``export`` (``launch/export.py``'s ``export_checkpoint``) of the DeepSpeed
checkpoint written at that tp.

The growth of an operation is VmHWM (the RSS high-water mark, reset just before through
``/proc/self/clear_refs``) minus the RSS just before it. RSS also counts the pages of memory-mapped
files a process has touched (reclaimable page cache, not allocations), so figures are upper bounds
on what the process allocates. Prints one table; nothing is asserted (tests/test_memory.py asserts
generous structural bounds on a smaller model).

    .venv/bin/python benchmarks/bench_memory.py                       # ~200 MB fp32, tp 1 2 4
    .venv/bin/python benchmarks/bench_memory.py --layers 2 --hidden 256 --tp 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
OPERATIONS = ("from_pretrained", "train_step", "ds_save", "save_pretrained")


# --------------------------------------------------------------------------- RSS (Linux /proc)
def current_rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Set this process's RSS high-water mark (VmHWM) to its current RSS (Linux, clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def peak_rss_bytes() -> int:
    """VmHWM: the RSS high-water mark of this process image."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line; this benchmark needs Linux.")


def peak_growth(operation, since: int | None = None) -> tuple[object, int]:
    """Run ``operation()``; return its result and the peak RSS growth over ``since`` (default: RSS now)."""
    before = current_rss_bytes() if since is None else since
    reset_peak_rss()
    result = operation()
    return result, max(peak_rss_bytes() - before, 0)


# --------------------------------------------------------------------------- the planner hook
def planner_prediction(config, tp: int, micro_batch: int, seq_length: int) -> int | None:
    """Bytes per rank that ``zoo.planning.planner.plan`` predicts for this run (fp32, no ZeRO, tp ranks,
    dp = 1, on the CPU): weights + gradients + Adam + activations; None if zoo has no planner."""
    try:
        from zoo.planning.planner import plan
    except ImportError:
        return None
    overrides = {"n_layer": config.n_layer, "n_embd": config.n_embd, "n_head": config.n_head,
                 "n_positions": config.n_positions, "vocab_size": config.vocab_size}
    ds = {"train_batch_size": micro_batch, "train_micro_batch_size_per_gpu": micro_batch,
          "gradient_accumulation_steps": 1,
          "zoo": {"model": "gpt2", "tensor_parallel_size": tp, "seq_length": seq_length, "model_overrides": overrides}}
    return int(plan(ds, tp, gpu="cpu").total)


# --------------------------------------------------------------------------- one rank
def ds_config(seq_length: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "steps_per_print": 10 ** 9, "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}


def rank_worker(workdir: Path, tp: int, rank: int, port: int, seq_length: int) -> dict:
    """Every operation on this rank, in order: from_pretrained, one train step, ds save, save_pretrained."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from zoo.checkpoint.save import save_checkpoint
    from zoo.models import GPT2LMHeadModel
    from zoo.models.families import param_groups
    from zoo.parallel import ParallelState

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(tp),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(tp))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    ps = ParallelState.initialize(tp)
    growth = {}
    start = current_rss_bytes()
    model, growth["from_pretrained"] = peak_growth(
        lambda: GPT2LMHeadModel.from_pretrained(workdir / "hf", parallel=ps, resid_pdrop=0.0, embd_pdrop=0.0,
                                                attn_pdrop=0.0))

    def train_step():
        model.train()   # from_pretrained returns eval mode; the step measured is a training step
        optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(seq_length), mpu=ps)
        ids = torch.randint(0, model.config.vocab_size, (1, seq_length), generator=torch.Generator().manual_seed(0))
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return engine

    engine, growth["train_step"] = peak_growth(train_step, since=start)
    client = {"iteration": 1, "consumed_samples": 1, "zoo_model": "gpt2", "model_config": model.hf_config_dict(),
              "tensor_parallel_size": tp}
    _, growth["ds_save"] = peak_growth(
        lambda: save_checkpoint(engine, workdir / f"run_tp{tp}" / "checkpoints", "iter_0000001", client))
    _, growth["save_pretrained"] = peak_growth(lambda: model.save_pretrained(workdir / f"saved_tp{tp}"))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    dist.destroy_process_group()
    return {"tp": tp, "rank": rank, "held": held, **growth}


def export_worker(workdir: Path, tp: int) -> dict:
    """``export_checkpoint`` of the tp checkpoint, in this one process."""
    import torch

    from zoo.checkpoint.deepspeed_export import export_checkpoint

    torch.set_num_threads(1)
    _, growth = peak_growth(lambda: export_checkpoint(workdir / f"run_tp{tp}", workdir / f"export_tp{tp}"))
    return {"tp": tp, "export": growth}


# --------------------------------------------------------------------------- the driver
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo")


def run_ranks(workdir: Path, tp: int, seq_length: int) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-worker", str(workdir), str(tp), str(rank),
                               str(port), str(seq_length)], cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(tp)]
    outputs = [proc.communicate() for proc in procs]
    for proc, (_, err) in zip(procs, outputs):
        if proc.returncode != 0:
            raise RuntimeError(f"a tp={tp} rank failed:\n{err[-4000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def run_export(workdir: Path, tp: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--export-worker", str(workdir), str(tp)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"export of the tp={tp} checkpoint failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_checkpoint(directory: Path, config) -> int:
    """A random zoo GPT-2 saved in transformers' layout; returns the bytes of its weights."""
    import torch
    from safetensors import safe_open

    from zoo.models import GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(directory)
    total = 0
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                sliced = handle.get_slice(key)
                numel = 1
                for size in sliced.get_shape():
                    numel *= size
                total += numel * 4
    return total


def print_table(config, model_bytes: int, rows: list[dict], exports: dict[int, int], seq_length: int) -> None:
    mb = 1e6
    print(f"GPT-2 {config.n_layer} layers x {config.n_embd} hidden, vocab {config.vocab_size}, "
          f"{config.n_positions} positions: model {model_bytes / mb:.1f} MB fp32 (train step: micro-batch 1 x "
          f"{seq_length} tokens, DeepSpeed fp32 no ZeRO, torch AdamW)")
    print("peak RSS growth / model bytes")
    header = (f"{'tp':>3} {'rank':>4} {'held':>6} {'from_pretrained':>15} {'train step':>10} {'planner':>8} "
              f"{'ds save':>8} {'save_pretrained':>15} {'export':>7}")
    print(header)
    for row in rows:
        predicted = row.get("planner")
        planner = f"{predicted / model_bytes:.2f}" if predicted is not None else "-"
        export = f"{exports[row['tp']] / model_bytes:.2f}" if row["rank"] == 0 else ""
        print(f"{row['tp']:>3} {row['rank']:>4} {row['held'] / model_bytes:>6.2f} "
              f"{row['from_pretrained'] / model_bytes:>15.2f} {row['train_step'] / model_bytes:>10.2f} "
              f"{planner:>8} {row['ds_save'] / model_bytes:>8.2f} {row['save_pretrained'] / model_bytes:>15.2f} "
              f"{export:>7}")
    if not any(row.get("planner") is not None for row in rows):
        print("planner: zoo.planning.planner not found; the column stays empty")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rank-worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--export-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        workdir, tp, rank, port, seq = args.rank_worker
        print(json.dumps(rank_worker(Path(workdir), int(tp), int(rank), int(port), int(seq))))
        return
    if args.export_worker:
        print(json.dumps(export_worker(Path(args.export_worker[0]), int(args.export_worker[1]))))
        return

    from zoo.models import GPT2Config

    config = GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, n_positions=args.positions)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_bytes = write_checkpoint(workdir / "hf", config)
        rows, exports = [], {}
        for tp in args.tp:
            for row in run_ranks(workdir, tp, args.positions):
                row["planner"] = planner_prediction(config, tp, 1, args.positions)
                rows.append(row)
            exports[tp] = run_export(workdir, tp)["export"]
    print_table(config, model_bytes, rows, exports, args.positions)


if __name__ == "__main__":
    main()
