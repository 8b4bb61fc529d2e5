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

from zoo.config.deepspeed_overrides import accumulate_bf16_in_fp32
from zoo.config.ds_config_file import check_ds_config, read_ds_config
from zoo.errors import UserError
from zoo.options import (
    CommandParser,
    add_deepspeed_config_argument,
    add_options,
    block_keys,
    check_block_keys,
    check_types,
    merged_settings,
    option,
)

# The paper's Table 6 grid uses these defaults' neighbourhood; a single run gets sensible ones.
DEFAULT_MAX_SEQ_LENGTH = {"mnli": 128, "qqp": 128, "race": 512, "squad": 384, "same-article": 64}
# The settings only one task reads: the other tasks' scripts have no such flag (their --help does not list it,
# and passing it is an error rather than a silent no-op).
TASK_ONLY_SETTINGS = {"doc_stride": "squad", "max_query_length": "squad", "squad_version": "squad"}
# What a user types to read each task's data from the Hugging Face hub, as the README writes it.
HUB_EXAMPLES = {"mnli": "hub:nyu-mll/glue/mnli", "qqp": "hub:nyu-mll/glue/qqp", "squad": "hub:rajpurkar/squad_v2",
                "race": "hub:ehovy/race/all"}
DATA_DIR_HELP = "the task's data: a directory (original or HF hub layout) or hub:NAME[/CONFIG]"


@dataclass
class FinetuneConfig:
    """One finetuning run's settings: each field is a ``--flag`` (dashes); those marked so are also zoo-block keys."""

    task: str
    pretrained: str = option(group="model", in_block=False, help="HF-style BERT directory (zoo or transformers)")
    data_dir: str = option(group="data", in_block=False,
                           help=f"{DATA_DIR_HELP}, e.g. {', '.join(HUB_EXAMPLES.values())}")
    ds_config: dict[str, Any] = field(default_factory=dict)
    ds_config_path: str = "<dict>"
    lr: float = option(2e-5, group="training", help="peak learning rate")
    batch_size: int = option(32, group="training", in_block=False,
                             help="global train batch (default: the ds_config's train_batch_size, else 32)")
    epochs: float = option(3, group="training", in_block=False, help="training epochs; 0 evaluates only")
    seed: int = option(1234, group="training", in_block=False, help="seeds the head's init, dropout and data order")
    max_seq_length: int | None = option(None, group="data", in_block=False,
                                        help=f"tokens per example (default per task: {DEFAULT_MAX_SEQ_LENGTH})")
    save: str | None = option(None, group="checkpointing", help="run directory (default runs/finetune-<task>)")
    tensor_parallel_size: int | None = option(None, group="parallelism",
                                              help="tensor-parallel degree: ranks per model replica")
    warmup: float = option(0.1, group="training", in_block=False, help="warmup fraction of all steps")
    weight_decay: float = option(0.01, group="training", in_block=False, help="AdamW weight decay")
    eval_batch_size: int = option(32, group="training", in_block=False, help="per data-parallel rank")
    log_interval: int = option(10, group="logging", in_block=False, help="iterations between log lines")
    doc_stride: int = option(128, group="data", in_block=False, help="SQuAD: step between context windows")
    overwrite: bool = option(False, group="checkpointing", in_block=False,
                             help="let the run write into a --save directory that holds an earlier finetuning "
                                  "run's metrics.jsonl and results.json (they are replaced)")
    max_query_length: int = option(64, group="data", in_block=False, help="SQuAD: question tokens kept")
    squad_version: str | None = option(None, group="data", in_block=False, choices=("1.1", "2.0"),
                                       help="SQuAD: which files to read when --data-dir holds both")
    dropout: float | None = option(None, group="model", in_block=False, help="override hidden/attention dropout")
    sequence_parallel: bool = option(False, group="parallelism",
                                     help="sequence parallelism (Korthikanti et al. 2022); --max-seq-length must "
                                          "divide by tp")
    distributed_timeout_minutes: float | None = option(
        None, group="parallelism",
        help="bound every collective: a rank that never arrives ends the job, named, after this long "
             "(default: DeepSpeed's 10 minutes)")
    wandb_project: str | None = option(None, group="logging", in_block=False,
                                       help="log to W&B (WANDB_MODE=offline works)")
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values.pop("ds_config")
        return values


FINETUNE_ZOO_KEYS = block_keys(FinetuneConfig)   # what a finetune ds_config's zoo block may set


def build_parser(task: str) -> argparse.ArgumentParser:
    """``finetune/<task>.py``'s parser: every FinetuneConfig flag that ``task`` reads, in its --help group (absent
    flags parse as None, so the zoo block and then the defaults fill them), plus DeepSpeed's ``--deepspeed_config``.
    Another task's flags (:data:`TASK_ONLY_SETTINGS`) are not accepted; the help of ``--data-dir`` and
    ``--max-seq-length`` gives this task's hub example and default."""
    parser = CommandParser(
        prog=f"finetune/{task.replace('-', '_')}.py",
        description=f"Finetune a (pre- or post-norm) BERT on {task.upper()} through DeepSpeed at any tp degree.")
    add_options(parser, FinetuneConfig, exclude=[name for name, owner in TASK_ONLY_SETTINGS.items() if owner != task])
    add_deepspeed_config_argument(parser)
    task_help = {"data_dir": DATA_DIR_HELP + (f", e.g. {HUB_EXAMPLES[task]}" if task in HUB_EXAMPLES else ""),
                 "max_seq_length": f"tokens per example (default: {DEFAULT_MAX_SEQ_LENGTH.get(task)})"}
    for action in parser._actions:
        if action.dest in task_help:
            action.help = task_help[action.dest]
    return parser


def parse_args(task: str, argv=None) -> FinetuneConfig:
    return config_from_args(task, build_parser(task).parse_args(argv))


def config_from_args(task: str, args: argparse.Namespace) -> FinetuneConfig:
    """The ds_config (checked), its zoo block and the flags, merged: flags win, then the block, then the
    defaults; the global batch defaults to the ds_config's train_batch_size, ``save`` to runs/finetune-<task>."""
    ds_config = read_ds_config(args.deepspeed_config)
    check_ds_config(ds_config, args.deepspeed_config, needs_optimizer=False)   # deepspeed_dict fills the optimizer
    block = check_block_keys(ds_config.get("zoo", {}), FinetuneConfig, args.deepspeed_config,
                             unknown_fix=f"the finetune scripts read {sorted(FINETUNE_ZOO_KEYS)}")
    values = merged_settings(FinetuneConfig, block, args)
    if "train_batch_size" in ds_config:
        values.setdefault("batch_size", ds_config["train_batch_size"])
    values["save"] = values.get("save") or f"runs/finetune-{task}"
    config = FinetuneConfig(task=task, ds_config=ds_config, ds_config_path=args.deepspeed_config, **values)
    check_types(config, args.deepspeed_config)
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
            raise UserError(message)
    return config


def deepspeed_dict(config: FinetuneConfig, dp_size: int, total_steps: int) -> dict[str, Any]:
    """The ds_config with the run's batch, learning rate and schedule filled in (zoo block removed), bf16 gradients
    accumulated in fp32 (:func:`zoo.config.deepspeed_overrides.accumulate_bf16_in_fp32`)."""
    ds = copy.deepcopy(config.ds_config)
    ds.pop("zoo", None)
    micro = ds.get("train_micro_batch_size_per_gpu")
    if config.batch_size % dp_size:
        raise UserError(f"--batch-size {config.batch_size} is not divisible by the data-parallel size {dp_size}; "
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
    return accumulate_bf16_in_fp32(ds)
