"""Finetuning run settings: the flags of ``finetune/<task>.py`` and what they do to the ds_config.

Flags use dashes and also accept ``--key=value`` (the form ``wandb agent`` passes). The ds_config's
``zoo`` block may set ``tensor_parallel_size``; flags override it. The optimizer's learning rate, the
global batch and the WarmupDecayLR schedule (warmup fraction, then linear decay to 0 over all steps)
are filled in from the flags, so one ds_config serves every point of a sweep.
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

# The paper's Table 6 grid uses these defaults' neighbourhood; a single run gets sensible ones.
DEFAULT_MAX_SEQ_LENGTH = {"mnli": 128, "qqp": 128, "race": 512, "squad": 384, "same-article": 64}
FINETUNE_ZOO_KEYS = {"tensor_parallel_size", "lr", "save", "sequence_parallel", "distributed_timeout_minutes"}   # what a finetune ds_config's zoo block may set


@dataclass
class FinetuneConfig:
    task: str
    pretrained: str
    data_dir: str
    ds_config: dict[str, Any]
    ds_config_path: str = "<dict>"
    lr: float = 2e-5
    batch_size: int = 32
    epochs: float = 3
    seed: int = 1234
    max_seq_length: int | None = None
    save: str | None = None
    tensor_parallel_size: int | None = None
    warmup: float = 0.1
    weight_decay: float = 0.01
    eval_batch_size: int = 32
    log_interval: int = 10
    doc_stride: int = 128
    overwrite: bool = False   # the run may replace an earlier finetuning run's results in --save
    max_query_length: int = 64
    squad_version: str | None = None
    dropout: float | None = None
    sequence_parallel: bool = False
    distributed_timeout_minutes: float | None = None   # every collective's timeout (DeepSpeed's default: 10)
    wandb_project: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values.pop("ds_config")
        return values


def build_parser(task: str) -> argparse.ArgumentParser:
    import deepspeed

    parser = argparse.ArgumentParser(
        prog=f"finetune/{task}.py",
        description=f"Finetune a (pre- or post-norm) BERT on {task.upper()} through DeepSpeed at any tp degree.")
    parser.add_argument("--pretrained", required=True, help="HF-style BERT directory (zoo or transformers)")
    parser.add_argument("--data-dir", required=True,
                        help="the task's data: a directory (original or HF hub layout) or hub:NAME[/CONFIG], "
                             "e.g. hub:glue/mnli, hub:squad_v2, hub:race/all")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-5)")
    parser.add_argument("--batch-size", type=int, default=None, help="global train batch (default: ds_config's)")
    parser.add_argument("--epochs", type=float, default=3, help="training epochs; 0 evaluates only")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max-seq-length", type=int, default=None,
                        help=f"default per task: {DEFAULT_MAX_SEQ_LENGTH}")
    parser.add_argument("--save", default=None, help="run directory (default runs/finetune-<task>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="let the run write into a --save directory that holds an earlier finetuning run's "
                             "metrics.jsonl and results.json (they are replaced)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None)
    parser.add_argument("--warmup", type=float, default=0.1, help="warmup fraction of all steps")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--eval-batch-size", type=int, default=32, help="per data-parallel rank")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--doc-stride", type=int, default=128, help="SQuAD: step between context windows")
    parser.add_argument("--max-query-length", type=int, default=64, help="SQuAD: question tokens kept")
    parser.add_argument("--squad-version", choices=("1.1", "2.0"), default=None,
                        help="SQuAD: which files to read when --data-dir holds both")
    parser.add_argument("--dropout", type=float, default=None, help="override hidden/attention dropout")
    parser.add_argument("--sequence-parallel", action="store_true", default=None,
                        help="sequence parallelism (Korthikanti et al. 2022); --max-seq-length must divide by tp")
    parser.add_argument("--distributed-timeout-minutes", type=float, default=None,
                        help="bound every collective: a rank that never arrives ends the job, named, after this long "
                             "(default: DeepSpeed's 10 minutes)")
    parser.add_argument("--wandb-project", default=None, help="log to W&B (WANDB_MODE=offline works)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0, help=argparse.SUPPRESS)
    deepspeed.add_config_arguments(parser)
    return parser


def parse_args(task: str, argv=None) -> FinetuneConfig:
    args = build_parser(task).parse_args(argv)
    from zoo.training.run_config import check_ds_config, read_ds_config

    ds_config = read_ds_config(args.deepspeed_config)
    check_ds_config(ds_config, args.deepspeed_config, needs_optimizer=False)   # deepspeed_dict fills the optimizer
    zoo_block = ds_config.get("zoo", {})
    unknown = sorted(set(zoo_block) - FINETUNE_ZOO_KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in the zoo block of {args.deepspeed_config}; the finetune "
                         f"scripts read {sorted(FINETUNE_ZOO_KEYS)}.")
    config = FinetuneConfig(
        task=task, pretrained=args.pretrained, data_dir=args.data_dir, ds_config=ds_config,
        ds_config_path=args.deepspeed_config,
        lr=args.lr if args.lr is not None else zoo_block.get("lr", 2e-5),
        batch_size=args.batch_size if args.batch_size is not None else ds_config.get("train_batch_size", 32),
        epochs=args.epochs, seed=args.seed, max_seq_length=args.max_seq_length, overwrite=args.overwrite,
        save=args.save or zoo_block.get("save") or f"runs/finetune-{task}",
        tensor_parallel_size=(args.tensor_parallel_size if args.tensor_parallel_size is not None
                              else zoo_block.get("tensor_parallel_size")),
        warmup=args.warmup, weight_decay=args.weight_decay, eval_batch_size=args.eval_batch_size,
        log_interval=args.log_interval, doc_stride=args.doc_stride, max_query_length=args.max_query_length,
        squad_version=args.squad_version, dropout=args.dropout, wandb_project=args.wandb_project,
        sequence_parallel=bool(args.sequence_parallel if args.sequence_parallel is not None
                               else zoo_block.get("sequence_parallel", False)),
        distributed_timeout_minutes=(args.distributed_timeout_minutes if args.distributed_timeout_minutes is not None
                                     else zoo_block.get("distributed_timeout_minutes")))
    return validate(config)


def _is_positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def validate(config: FinetuneConfig) -> FinetuneConfig:
    """Settings that are wrong whatever the world size, as one-sentence errors."""
    if config.max_seq_length is None:
        config.max_seq_length = DEFAULT_MAX_SEQ_LENGTH[config.task]
    checks = [
        (config.lr > 0, f"--lr {config.lr} must be positive; pass e.g. --lr 2e-5."),
        (config.batch_size > 0, f"--batch-size {config.batch_size} must be positive; pass e.g. --batch-size 32."),
        (config.tensor_parallel_size is None or config.tensor_parallel_size > 0,
         f"--tensor-parallel-size {config.tensor_parallel_size} must be positive; pass e.g. 1."),
        (config.epochs >= 0, f"--epochs {config.epochs} must be 0 (evaluate only) or more."),
        (0 <= config.warmup < 1, f"--warmup {config.warmup} is a fraction of the steps; pass a value in [0, 1)."),
        (config.eval_batch_size > 0, f"--eval-batch-size {config.eval_batch_size} must be positive; pass e.g. 32."),
        (config.log_interval > 0, f"--log-interval {config.log_interval} must be positive; pass e.g. 10."),
        (config.distributed_timeout_minutes is None or _is_positive_number(config.distributed_timeout_minutes),
         f"--distributed-timeout-minutes {config.distributed_timeout_minutes} must be a positive number of minutes; "
         "pass e.g. 10."),
        (not config.sequence_parallel or not config.tensor_parallel_size
         or config.max_seq_length % config.tensor_parallel_size == 0,
         f"--sequence-parallel splits --max-seq-length {config.max_seq_length} over tp={config.tensor_parallel_size} "
         f"ranks, which does not divide it; pass a multiple of {config.tensor_parallel_size}."),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    return config


def deepspeed_dict(config: FinetuneConfig, dp_size: int, total_steps: int) -> dict[str, Any]:
    """The ds_config with the run's batch, learning rate and schedule filled in (zoo block removed)."""
    ds = copy.deepcopy(config.ds_config)
    ds.pop("zoo", None)
    micro = ds.get("train_micro_batch_size_per_gpu")
    if config.batch_size % dp_size:
        raise ValueError(f"--batch-size {config.batch_size} is not divisible by the data-parallel size {dp_size}; "
                         f"pass a multiple of {dp_size}.")
    per_rank = config.batch_size // dp_size
    micro = math.gcd(per_rank, micro) if micro else per_rank   # never above the ds_config's micro-batch
    ds.update(train_batch_size=config.batch_size, train_micro_batch_size_per_gpu=micro)
    ds.pop("gradient_accumulation_steps", None)
    optimizer = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    optimizer.setdefault("params", {}).update(lr=config.lr, weight_decay=config.weight_decay)
    ds["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "total_num_steps": max(total_steps, 1), "warmup_num_steps": max(1, int(round(config.warmup * total_steps))),
        "warmup_min_lr": 0.0, "warmup_max_lr": config.lr, "warmup_type": "linear"}}
    return ds
