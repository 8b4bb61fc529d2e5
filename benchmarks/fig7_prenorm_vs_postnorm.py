"""The paper's Figure 7 in miniature: pre-norm vs post-norm BERT trained at the same depth, width,
learning rate, seed and data (printed and plotted, never asserted).

Megatron-LM (Shoeybi et al. 2019, Figure 7) moves BERT's LayerNorm inside the residual branch
(pre-norm, 7b) because the original order (post-norm, 7a: sublayer -> add -> LN) trains badly once
the model gets big. Here both layouts are zoo's own ``BertForPreTraining`` (``pre_norm`` True/False
through the run config's ``model_overrides``), trained by zoo's ``pretrain()`` on the bundled
Wikipedia sample (MLM + sentence-order prediction), DeepSpeed AdamW with linear warmup then linear
decay (``WarmupDecayLR``), fp32. The two runs go in two single-rank processes side by side (tp = 1,
one torch thread each), so on two cores they see the same machine.

Output: a table of the logged training loss (MLM + SOP) of both runs, their final train-window and
validation losses, and ``<out>/fig7_prenorm_vs_postnorm.png`` with both loss curves. Run directories
(metrics.jsonl, train.log, loss.png, the final checkpoint) are ``<out>/prenorm`` and ``<out>/postnorm``.

    .venv/bin/python benchmarks/fig7_prenorm_vs_postnorm.py       # 24 layers, h 128, lr 1e-3, 120 its
    .venv/bin/python benchmarks/fig7_prenorm_vs_postnorm.py --lr 3e-3 --iters 100 --out out/fig7-lr3e-3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from bench_pretrain import print_table  # benchmarks/ is on sys.path when run as a script

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

REPO = Path(__file__).resolve().parent.parent
VARIANTS = (("pre-norm", "prenorm", True), ("post-norm", "postnorm", False))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_config(args: argparse.Namespace, run_dir: Path, pre_norm: bool):
    from zoo.config.run_config import RunConfig
    from zoo.config.validation import validate_static

    ds_config = {
        "train_batch_size": args.batch,
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1.0,
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": args.iters,
                                                          "warmup_num_steps": args.warmup,
                                                          "warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                          "warmup_type": "linear"}},
    }
    overrides = dict(num_hidden_layers=args.layers, hidden_size=args.hidden,
                     num_attention_heads=args.heads or max(1, args.hidden // 32), pre_norm=pre_norm,
                     hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout)
    config = RunConfig(tensor_parallel_size=1, model="bert-tiny", seq_length=args.seq_length,
                       train_iters=args.iters, data_path=None, split="949,50,1", seed=args.seed,
                       save=str(run_dir), log_interval=args.log_interval, eval_interval=args.iters,
                       eval_iters=args.eval_iters, save_interval=0, model_overrides=overrides,
                       ds_config=ds_config, ds_config_path="<fig7>")
    return validate_static(config)


def _train(args: argparse.Namespace, run_dir: str, pre_norm: bool, port: int) -> None:
    """One single-rank run in a fresh process; its stdout/stderr go to ``run_dir/train.log``."""
    log = open(Path(run_dir) / "train.log", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", LOCAL_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from zoo.training.pretrain import pretrain

    pretrain(run_config(args, Path(run_dir), pre_norm))


def last_iteration(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return max((json.loads(line)["iteration"] for line in lines), default=0)


def train_both(args: argparse.Namespace, out: Path) -> float:
    """Both runs side by side; a progress bar follows their metrics.jsonl. Returns the wall time."""
    import multiprocessing as mp

    from tqdm import tqdm

    from zoo.data import default_bert_corpus_prefix

    default_bert_corpus_prefix(progress=True)  # preprocess the bundled corpus once, before the two runs
    ctx = mp.get_context("spawn")
    procs = {}
    for _, name, pre_norm in VARIANTS:
        run_dir = out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        procs[name] = ctx.Process(target=_train, args=(args, str(run_dir), pre_norm, free_port()))
    start = time.perf_counter()
    for proc in procs.values():
        proc.start()
    with tqdm(total=2 * args.iters, desc="pre-norm + post-norm", unit="it", file=sys.stderr) as bar:
        while any(proc.is_alive() for proc in procs.values()):
            time.sleep(2)
            bar.update(sum(last_iteration(out / name) for name in procs) - bar.n)
    failed = [name for name, proc in procs.items() if proc.exitcode != 0]
    if failed:
        tail = "\n".join((out / failed[0] / "train.log").read_text().splitlines()[-30:])
        raise SystemExit(f"run {failed[0]} failed (exit {procs[failed[0]].exitcode}); its log ends with:\n{tail}")
    return time.perf_counter() - start


def read_events(run_dir: Path) -> tuple[list[dict], list[dict]]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [e for e in events if "split" not in e], [e for e in events if e.get("split") == "valid"]


def fmt(value) -> str:
    return "nan" if value is None or not math.isfinite(value) else f"{value:.4f}"


def plot(curves: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, train in curves.items():
        its = [e["iteration"] for e in train]
        axes[0].plot(its, [e["loss"] for e in train], label=label)
        axes[1].plot(its, [e["mlm_loss"] for e in train], label=label)
    axes[0].set_title("training loss (MLM + SOP)")
    axes[1].set_title("MLM loss")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"BERT {args.layers} layers, hidden {args.hidden}, lr {args.lr:g} (warmup {args.warmup}), "
                 f"batch {args.batch} x seq {args.seq_length}, seed {args.seed}: pre-norm vs post-norm")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24, help="transformer layers of both models")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (FFN 4x)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default hidden / 32)")
    parser.add_argument("--iters", type=int, default=120, help="training iterations of each run")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, the same for both")
    parser.add_argument("--warmup", type=int, default=10, help="linear warmup iterations, then linear decay")
    parser.add_argument("--batch", type=int, default=8, help="global batch (one rank, no accumulation)")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    parser.add_argument("--seed", type=int, default=1234, help="same initialisation seed and data order for both")
    parser.add_argument("--log-interval", type=int, default=5)
    parser.add_argument("--eval-iters", type=int, default=8, help="validation batches at the end")
    parser.add_argument("--out", default="out/fig7", help="output directory (run dirs and the PNG)")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wall = train_both(args, out)

    curves, valid = {}, {}
    for label, name, _ in VARIANTS:
        train, val = read_events(out / name)
        curves[label], valid[label] = train, (val[-1]["val_loss"] if val else None)
    pre, post = curves["pre-norm"], curves["post-norm"]
    rows = [[str(a["iteration"]), fmt(a["loss"]), fmt(b["loss"]), fmt(a["mlm_loss"]), fmt(b["mlm_loss"])]
            for a, b in zip(pre, post)]
    print_table(f"BERT pretraining loss on the bundled corpus ({args.layers} layers, hidden {args.hidden}, "
                f"lr {args.lr:g}, warmup {args.warmup}, batch {args.batch} x seq {args.seq_length}, "
                f"log windows of {args.log_interval} iterations)",
                ["iteration", "pre-norm loss", "post-norm loss", "pre-norm MLM", "post-norm MLM"], rows)
    final = [[label, fmt(curves[label][-1]["loss"]), fmt(curves[label][-1]["mlm_loss"]),
              fmt(curves[label][-1]["sop_loss"]), f"{curves[label][-1]['sop_acc']:.3f}", fmt(valid[label]),
              f"{statistics.median([e['step_time_s'] for e in curves[label]]):.2f}"]
             for label in curves]
    print_table("final (last log window; validation after the last iteration)",
                ["layout", "train loss", "MLM loss", "SOP loss", "SOP acc", "val loss", "s/iter (median)"], final)
    path = out / "fig7_prenorm_vs_postnorm.png"
    plot(curves, args, path)
    print(f"\nwall time {wall:.0f} s for both runs side by side; plot {path}; run directories {out}/prenorm, "
          f"{out}/postnorm")


if __name__ == "__main__":
    main()
