"""The run configuration: a DeepSpeed config JSON plus its ``"zoo"`` block, CLI flags overriding both.

A ds_config is complete for DeepSpeed (batch sizes, optimizer, scheduler, fp16/bf16, clipping).
zoo reads its own settings from the top-level ``"zoo"`` key, which DeepSpeed ignores:

    "zoo": {"tensor_parallel_size": 2, "model": "gpt2-tiny", "seq_length": 128, "train_iters": 300,
            "data_path": null, "split": "969,30,1", "seed": 1234, "save": "runs/demo",
            "pretrained": null, "log_interval": 10, "eval_interval": 100, "eval_iters": 4, "save_interval": 0,
            "checkpoint_activations": false, "wandb_project": null, "model_overrides": {}}

``data_path`` null means the bundled Wikipedia sample, preprocessed once into a cache directory.
``pretrained`` names a transformers-layout directory (GPT-2, MegatronBert or Bert, e.g. from
``save_pretrained`` or ``launch/export.py``) whose weights replace the random init, at any tp; the
preset then only names the family, the shapes come from the directory. ``load`` resumes a zoo
DeepSpeed checkpoint, also one written at another tp (it is resharded once, see zoo.checkpoint.reshard).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from zoo.models.presets import model_config


@dataclass
class RunConfig:
    tensor_parallel_size: int = 1
    model: str = "gpt2-tiny"
    seq_length: int = 1024
    train_iters: int = 1000
    data_path: str | None = None
    split: str = "969,30,1"
    seed: int = 1234
    save: str | None = "runs/pretrain"
    load: str | None = None
    pretrained: str | None = None   # transformers-layout directory to start from (instead of random init)
    log_interval: int = 10
    eval_interval: int = 1000
    eval_iters: int = 10
    save_interval: int = 0
    checkpoint_activations: bool = False
    wandb_project: str | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)   # e.g. {"resid_pdrop": 0.0}
    ds_config: dict[str, Any] = field(default_factory=dict, repr=False)
    ds_config_path: str | None = None

    @property
    def dtype_name(self) -> str:
        if self.ds_config.get("fp16", {}).get("enabled"):
            return "fp16"
        if self.ds_config.get("bf16", {}).get("enabled"):
            return "bf16"
        return "fp32"


CLI_FLAGS = {  # flag -> (RunConfig field, type)
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--model": ("model", str),
    "--seq-length": ("seq_length", int),
    "--train-iters": ("train_iters", int),
    "--data-path": ("data_path", str),
    "--split": ("split", str),
    "--seed": ("seed", int),
    "--save": ("save", str),
    "--load": ("load", str),
    "--pretrained": ("pretrained", str),
    "--log-interval": ("log_interval", int),
    "--eval-interval": ("eval_interval", int),
    "--eval-iters": ("eval_iters", int),
    "--save-interval": ("save_interval", int),
    "--wandb-project": ("wandb_project", str),
}


def build_parser(description: str) -> argparse.ArgumentParser:
    import deepspeed

    parser = argparse.ArgumentParser(description=description)
    for flag, (name, kind) in CLI_FLAGS.items():
        parser.add_argument(flag, dest=name, type=kind, default=None,
                            help=f"overrides zoo.{name} of the ds_config")
    parser.add_argument("--checkpoint-activations", dest="checkpoint_activations", action="store_true",
                        default=None, help="recompute each layer in backward (DeepSpeed activation checkpointing)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return deepspeed.add_config_arguments(parser)


def read_ds_config(path: str | None) -> dict[str, Any]:
    """The JSON of ``--deepspeed_config``, with one-sentence errors (shared by pretraining and finetuning)."""
    if path is None:
        raise ValueError("no DeepSpeed config given; pass --deepspeed_config ds_configs/<name>.json.")
    if not Path(path).is_file():
        raise FileNotFoundError(f"DeepSpeed config {path} does not exist; pass one of the files in ds_configs/.")
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON ({err}); fix the file.") from None


def load_run_config(args: argparse.Namespace) -> RunConfig:
    """ds_config file (``--deepspeed_config``) + its zoo block, then CLI flags on top; validated."""
    path = getattr(args, "deepspeed_config", None)
    ds_config = read_ds_config(path)
    block = dict(ds_config.get("zoo", {}))
    known = {f.name for f in fields(RunConfig)} - {"ds_config", "ds_config_path"}
    unknown = sorted(set(block) - known)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in the zoo block of {path}; valid keys are {sorted(known)}.")
    config = RunConfig(**block, ds_config=copy.deepcopy(ds_config), ds_config_path=str(path))
    for name in known:
        value = getattr(args, name, None)
        if value is not None:
            setattr(config, name, value)
    return validate_static(config)


def validate_static(config: RunConfig) -> RunConfig:
    """Checks that need no process group."""
    family_config = model_config(config.model)  # raises on an unknown preset
    allowed = {f.name for f in fields(family_config)} - {"extra"}
    bad = sorted(set(config.model_overrides) - allowed)
    if bad:
        raise ValueError(f"model_overrides key {bad[0]!r} is not a {type(family_config).__name__} field; "
                         f"use one of {sorted(allowed)}.")
    for name in ("train_iters", "seq_length", "tensor_parallel_size", "log_interval", "eval_iters"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} = {getattr(config, name)} must be at least 1; fix the zoo block or the flag.")
    if config.pretrained is not None and not Path(config.pretrained).is_dir():
        raise FileNotFoundError(f"--pretrained directory {config.pretrained} does not exist; pass a directory written "
                                "by save_pretrained or launch/export.py.")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        if key not in config.ds_config:
            raise ValueError(f"DeepSpeed config {config.ds_config_path} lacks {key!r}; zoo fixes the global "
                             "batch in the config, add both train_batch_size and train_micro_batch_size_per_gpu.")
    return config


def validate_for_world(config: RunConfig, world_size: int) -> int:
    """Batch sizes against the data-parallel size; returns the gradient-accumulation steps."""
    tp = config.tensor_parallel_size
    if world_size % tp != 0:
        fits = [t for t in range(1, world_size + 1) if world_size % t == 0]
        raise ValueError(f"tensor_parallel_size {tp} does not divide the {world_size} launched processes; "
                         f"pass --tensor-parallel-size one of {fits} or launch a multiple of {tp} processes.")
    dp = world_size // tp
    global_batch = config.ds_config["train_batch_size"]
    micro = config.ds_config["train_micro_batch_size_per_gpu"]
    if global_batch % (micro * dp) != 0:
        raise ValueError(f"train_batch_size {global_batch} is not a multiple of micro batch {micro} x "
                         f"data-parallel size {dp}; set train_batch_size to a multiple of {micro * dp}.")
    gas = global_batch // (micro * dp)
    declared = config.ds_config.get("gradient_accumulation_steps")
    if declared not in (None, "auto", gas):
        raise ValueError(f"gradient_accumulation_steps {declared} disagrees with train_batch_size {global_batch} "
                         f"/ (micro {micro} x dp {dp}) = {gas}; remove it and DeepSpeed derives it.")
    return gas


def deepspeed_dict(config: RunConfig, gas: int) -> dict[str, Any]:
    """The dict handed to deepspeed.initialize: the file's config, schedule length tied to train_iters."""
    ds = copy.deepcopy(config.ds_config)
    ds.pop("zoo", None)
    ds["gradient_accumulation_steps"] = gas
    scheduler = ds.get("scheduler")
    if scheduler and scheduler.get("type") in ("WarmupCosineLR", "WarmupDecayLR"):
        params = scheduler.setdefault("params", {})
        params["total_num_steps"] = config.train_iters
        params["warmup_num_steps"] = max(1, min(params.get("warmup_num_steps", 1), config.train_iters))
    return ds
