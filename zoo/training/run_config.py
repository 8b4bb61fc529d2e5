"""The run configuration: a DeepSpeed config JSON plus its ``"zoo"`` block, CLI flags overriding both.

A ds_config is complete for DeepSpeed (batch sizes, optimizer, scheduler, fp16/bf16, clipping).
zoo reads its own settings from the top-level ``"zoo"`` key, which DeepSpeed ignores:

    "zoo": {"tensor_parallel_size": 2, "model": "gpt2-tiny", "seq_length": 128, "train_iters": 300,
            "data_path": null, "split": "969,30,1", "seed": 1234, "save": "runs/demo",
            "pretrained": null, "log_interval": 10, "eval_interval": 100, "eval_iters": 4, "save_interval": 0,
            "checkpoint_activations": false, "wandb_project": null, "model_overrides": {},
            "data_workers": 2, "exit_interval": 0, "exit_duration_in_mins": null, "exit_signal_handler": true,
            "distributed_timeout_minutes": null, "sample_prompts": []}

``data_path`` null means the bundled Wikipedia sample, preprocessed once into a cache directory.
``pretrained`` names a transformers-layout directory (GPT-2, MegatronBert or Bert, e.g. from
``save_pretrained`` or ``launch/export.py``) whose weights replace the random init, at any tp; the
preset then only names the family, the shapes come from the directory. ``load`` resumes a zoo
DeepSpeed checkpoint, also one written at another tp (it is resharded once, see zoo.checkpoint.reshard);
a ``load`` with no checkpoint yet starts the run from iteration 0, so a job script can always pass
``--save X --load X``.

Preemption (Megatron's flag names): ``exit_interval`` N stops with a checkpoint after every iteration
that is a multiple of N (so the same flag serves every allocation of a job); ``exit_duration_in_mins``
M stops with a checkpoint before M minutes of wall time (ranks agree); ``exit_signal_handler`` (on by
default) turns SIGTERM or SIGUSR1 on any rank into a checkpoint at the next iteration and exit 0.
``sample_prompts`` (GPT only; the demo's) are completed by sampling at the end of the run, and the
writer prints each beside the validation perplexity (zoo.inference.run_samples); empty, nothing is
generated. ``distributed_timeout_minutes`` bounds every collective (DeepSpeed's default is 10 minutes), so a rank
that never arrives ends the job with the backend's timeout error rather than a hang.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from zoo.parallel.state import check_grid
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
    checkpoint_activations: bool = False   # full recomputation (Megatron's older flag for --recompute-granularity full)
    recompute_granularity: str | None = None   # "full" (every layer) or "selective" (the attention core)
    sequence_parallel: bool = False  # Korthikanti et al. 2022: LayerNorm/dropout/residual split along the sequence
    wandb_project: str | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)   # e.g. {"resid_pdrop": 0.0}
    data_workers: int = 2            # DataLoader worker processes per rank (0: read batches in the training process)
    exit_interval: int = 0           # stop with a checkpoint after every iteration that is a multiple of it
    exit_duration_in_mins: float | None = None   # stop with a checkpoint before this much wall time
    exit_signal_handler: bool = True   # SIGTERM/SIGUSR1: stop at the next iteration with a checkpoint
    distributed_timeout_minutes: float | None = None   # every collective's timeout (DeepSpeed's default: 10)
    overwrite: bool = False          # a fresh run (no --load) may replace the checkpoints of a --save directory
    sample_prompts: list[str] = field(default_factory=list)   # GPT only: text sampled from each at the end (the demo)
    ds_config: dict[str, Any] = field(default_factory=dict, repr=False)
    ds_config_path: str | None = None

    @property
    def recompute(self) -> str | None:
        """The activation recomputation: "full", "selective" or None."""
        return "full" if self.checkpoint_activations else self.recompute_granularity

    def model_run_fields(self) -> dict[str, Any]:
        """The model-config keywords of the run's recomputation and sequence parallelism."""
        return {"activation_checkpointing": self.recompute == "full", "sequence_parallel": self.sequence_parallel,
                "recompute_granularity": "selective" if self.recompute == "selective" else None}

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
    "--recompute-granularity": ("recompute_granularity", str),
    "--data-workers": ("data_workers", int),
    "--exit-interval": ("exit_interval", int),
    "--exit-duration-in-mins": ("exit_duration_in_mins", float),
    "--distributed-timeout-minutes": ("distributed_timeout_minutes", float),
}


def build_parser(description: str) -> argparse.ArgumentParser:
    import deepspeed

    parser = argparse.ArgumentParser(description=description)
    for flag, (name, kind) in CLI_FLAGS.items():
        parser.add_argument(flag, dest=name, type=kind, default=None,
                            help=f"overrides zoo.{name} of the ds_config")
    parser.add_argument("--checkpoint-activations", dest="checkpoint_activations", action="store_true",
                        default=None, help="recompute each layer in backward (DeepSpeed activation checkpointing)")
    parser.add_argument("--sequence-parallel", dest="sequence_parallel", action="store_true", default=None,
                        help="sequence parallelism (Korthikanti et al. 2022): LayerNorm, dropout and residuals on "
                             "seq_length / tp tokens per rank; seq_length must divide by tp")
    parser.add_argument("--exit-signal-handler", dest="exit_signal_handler", action=argparse.BooleanOptionalAction,
                        default=None, help="on SIGTERM or SIGUSR1 every rank stops at the next iteration with a "
                                           "checkpoint and exits 0 (default on; --no-exit-signal-handler: off)")
    parser.add_argument("--overwrite", dest="overwrite", action="store_true", default=None,
                        help="let a run without --load write into a --save directory that already holds "
                             "checkpoints (its checkpoints and metrics are replaced)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return deepspeed.add_config_arguments(parser)


def read_ds_config(path: str | None) -> dict[str, Any]:
    """The JSON of ``--deepspeed_config``, with one-sentence errors (shared by pretraining and finetuning)."""
    if path is None:
        raise ValueError("no DeepSpeed config given; pass --deepspeed_config ds_configs/<name>.json.")
    if not Path(path).is_file():
        raise FileNotFoundError(f"DeepSpeed config {path} does not exist; pass one of the files in ds_configs/.")
    try:
        ds_config = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"DeepSpeed config {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}); fix the file.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON ({err}); fix the file.") from None
    if not isinstance(ds_config, dict):
        raise ValueError(f"DeepSpeed config {path} holds {_json_kind(ds_config)}, not a JSON object; write it as "
                         "{\"train_batch_size\": 8, \"train_micro_batch_size_per_gpu\": 4, \"optimizer\": {...}, ...}, "
                         "like the files in ds_configs/.")
    return ds_config


# Blocks of a ds_config that DeepSpeed reads as JSON objects.
DS_CONFIG_BLOCKS = ("optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "zoo")
DS_CONFIG_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_ds_config(ds_config: dict[str, Any], path: str | None, *, needs_optimizer: bool) -> None:
    """The settings of a ds_config that zoo and DeepSpeed both rely on, checked before anything is built or
    written (DeepSpeed's own checks come after the engine starts, as assertions): its blocks are JSON
    objects, the batch sizes present are positive integers (``gradient_accumulation_steps`` may be
    "auto"), at most one of fp16 and bf16 is enabled, and, where DeepSpeed builds the optimizer from the
    file (``needs_optimizer``: pretraining), an ``optimizer`` block with a ``type`` is there."""
    for block in DS_CONFIG_BLOCKS:
        if block in ds_config and not isinstance(ds_config[block], dict):
            raise ValueError(f"{block!r} in DeepSpeed config {path} is {_shown(ds_config[block])} "
                             f"({_json_kind(ds_config[block])}), not a JSON object; write it as \"{block}\": "
                             "{...} like the files in ds_configs/.")
    for key in DS_CONFIG_BATCH_KEYS:
        value = ds_config.get(key)
        if key not in ds_config or (key == "gradient_accumulation_steps" and value == "auto"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            kind = "" if isinstance(value, int) and not isinstance(value, bool) else f" ({_json_kind(value)})"
            raise ValueError(f"{key} in DeepSpeed config {path} is {_shown(value)}{kind}, not a positive integer; "
                             f"write it as e.g. \"{key}\": 8.")
    enabled = [name for name in ("fp16", "bf16") if ds_config.get(name, {}).get("enabled") is True]
    if len(enabled) == 2:
        raise ValueError(f"DeepSpeed config {path} enables both fp16 and bf16; set \"enabled\": false in one of "
                         "them (bf16 needs no loss scaling, fp16 runs where bf16 is not supported).")
    if needs_optimizer:
        optimizer = ds_config.get("optimizer")
        if optimizer is None:
            raise ValueError(f"DeepSpeed config {path} has no optimizer block, and DeepSpeed builds the optimizer "
                             "from it; add e.g. \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1.5e-4, "
                             "\"weight_decay\": 0.01}}.")
        if not isinstance(optimizer.get("type"), str):
            raise ValueError(f"the optimizer block of DeepSpeed config {path} names no type (it has "
                             f"{_shown(optimizer.get('type'))}); add e.g. \"type\": \"AdamW\".")


def load_run_config(args: argparse.Namespace) -> RunConfig:
    """ds_config file (``--deepspeed_config``) + its zoo block, then CLI flags on top; validated."""
    path = getattr(args, "deepspeed_config", None)
    ds_config = read_ds_config(path)
    block = ds_config.get("zoo", {})
    if not isinstance(block, dict):
        raise ValueError(f"the zoo block of {path} is {block!r}, not a JSON object; write it as "
                         "\"zoo\": {\"tensor_parallel_size\": 1, \"model\": \"gpt2-tiny\", ...}.")
    check_ds_config(ds_config, path, needs_optimizer=True)
    block = dict(block)
    known = {f.name for f in fields(RunConfig)} - {"ds_config", "ds_config_path"}
    unknown = sorted(set(block) - known)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in the zoo block of {path}; valid keys are {sorted(known)}.")
    config = RunConfig(**block, ds_config=copy.deepcopy(ds_config), ds_config_path=str(path))
    for name in known:
        value = getattr(args, name, None)
        if value is not None:
            setattr(config, name, value)
    return check_input_paths(validate_static(config))


def check_input_paths(config: RunConfig) -> RunConfig:
    """Every file the run reads exists, checked before a process group, a model or an engine is built: the
    ``data_path`` prefix's ``.bin`` and ``.idx``, the ``pretrained`` directory and its config.json (read and
    checked, see :func:`zoo.models.hf_io.read_config_json`), and ``load`` when it exists (a ``load`` not
    there yet is a run to start, so a job script can always pass ``--save X --load X``)."""
    from zoo.data.indexed_dataset import data_file_path, index_file_path
    from zoo.models.hf_io import read_config_json

    if config.data_path is not None:
        missing = [path for path in (data_file_path(config.data_path), index_file_path(config.data_path))
                   if not Path(path).is_file()]
        if missing:
            raise FileNotFoundError(f"--data-path {config.data_path} names no indexed dataset ({' and '.join(missing)} "
                                    f"{'is' if len(missing) == 1 else 'are'} missing); pass the --output-prefix that "
                                    "launch/preprocess.py wrote, without .bin or .idx.")
    if config.pretrained is not None:
        read_config_json(config.pretrained)
    if config.load is not None and Path(config.load).exists() and not Path(config.load).is_dir():
        raise FileNotFoundError(f"--load {config.load} is a file, not a directory; pass the run directory (or its "
                                "checkpoints/ directory) to resume from.")
    return config


def validate_static(config: RunConfig) -> RunConfig:
    """Checks that need no process group."""
    check_field_types(config)
    check_ds_config(config.ds_config, config.ds_config_path, needs_optimizer=False)
    family_config = model_config(config.model)  # raises on an unknown preset
    allowed = {f.name for f in fields(family_config)} - {"extra"}
    bad = sorted(set(config.model_overrides) - allowed)
    if bad:
        raise ValueError(f"model_overrides key {bad[0]!r} is not a {type(family_config).__name__} field; "
                         f"use one of {sorted(allowed)}.")
    for name in ("train_iters", "seq_length", "tensor_parallel_size", "log_interval", "eval_iters"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} = {getattr(config, name)} must be at least 1; fix the zoo block or the flag.")
    for name in ("eval_interval", "save_interval", "exit_interval", "data_workers"):
        if getattr(config, name) < 0:
            raise ValueError(f"{name} = {getattr(config, name)} must be 0 (never) or positive; fix the zoo block "
                             "or the flag.")
    for name in ("exit_duration_in_mins", "distributed_timeout_minutes"):
        if getattr(config, name) is not None and not 0 < getattr(config, name) < math.inf:
            raise ValueError(f"{name} = {getattr(config, name)} must be a positive number of minutes; fix the zoo "
                             "block or the flag.")
    check_sample_prompts(config, model_config(config.model, **config.model_overrides))
    if config.recompute_granularity not in (None, "full", "selective"):
        raise ValueError(f"recompute_granularity {config.recompute_granularity!r} is not 'full' or 'selective'; pass "
                         "--recompute-granularity full (every layer) or selective (the attention core).")
    if config.checkpoint_activations and config.recompute_granularity == "selective":
        raise ValueError("checkpoint_activations (full recomputation) contradicts recompute_granularity 'selective'; "
                         "drop one of them.")
    if config.sequence_parallel and config.seq_length % config.tensor_parallel_size:
        raise ValueError(f"sequence parallelism splits seq_length {config.seq_length} over tp="
                         f"{config.tensor_parallel_size} ranks, which does not divide it; pass a --seq-length that "
                         f"is a multiple of {config.tensor_parallel_size}.")
    if not config.save:
        raise ValueError(f"save is {config.save!r} in the zoo block of {config.ds_config_path}; pass --save with the run "
                         "directory that receives the metrics, the plot and the checkpoints.")
    if config.pretrained is not None and not Path(config.pretrained).is_dir():
        raise FileNotFoundError(f"--pretrained directory {config.pretrained} does not exist; pass a directory written "
                                "by save_pretrained or launch/export.py.")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        if key not in config.ds_config:
            raise ValueError(f"DeepSpeed config {config.ds_config_path} lacks {key!r}; zoo fixes the global "
                             "batch in the config, add both train_batch_size and train_micro_batch_size_per_gpu.")
    return config


def check_sample_prompts(config: RunConfig, family_config) -> None:
    """``sample_prompts`` are strings, for a GPT model, each leaving room for new tokens in its
    ``n_positions`` (GPT-2 BPE tokens): checked before training, not after it, where they are used."""
    prompts = config.sample_prompts
    if not prompts:
        return
    bad = next((p for p in prompts if not isinstance(p, str)), None)
    if bad is not None:
        raise ValueError(f"sample_prompts holds {_shown(bad)} ({_json_kind(bad)}), not a string; write it as e.g. "
                         "\"sample_prompts\": [\"The history of\"].")
    if family_config.model_type != "gpt2":
        raise ValueError(f"sample_prompts are for GPT models, but model {config.model!r} is a "
                         f"{family_config.model_type} model, which does not generate text; remove sample_prompts "
                         "from the zoo block.")
    if config.pretrained is not None:   # the directory's n_positions: generation checks the lengths itself
        return
    from zoo.data.tokenizers import load_gpt2_tokenizer

    n_positions = family_config.n_positions
    tokenizer = load_gpt2_tokenizer()
    for index, prompt in enumerate(prompts):
        length = len(tokenizer.encode(prompt))
        if length >= n_positions:
            raise ValueError(f"sample prompt {index} has {length} tokens, which leaves no room for new tokens in the "
                             f"model's n_positions={n_positions}; shorten it.")


TYPE_NAMES = {int: "an integer", str: "a string", bool: "true or false", dict: "a JSON object", float: "a number",
              list: "a list"}
TYPE_EXAMPLES = {int: "6", str: '"text"', bool: "true", dict: "{}", float: "30", list: "[]"}


def check_field_types(config: RunConfig) -> None:
    """Every zoo setting has its field's type (CLI flags are typed by argparse, so a wrong type comes
    from the zoo block of the ds_config): one sentence naming the key, its value and the expected type."""
    hints = typing.get_type_hints(RunConfig)
    for f in fields(RunConfig):
        if f.name in ("ds_config", "ds_config_path"):
            continue
        value = getattr(config, f.name)
        allowed = _allowed_types(hints[f.name])
        if _has_type(value, allowed):
            continue
        kind = allowed[0]
        nullable = " or null" if type(None) in allowed else ""
        raise ValueError(f"zoo setting {f.name!r} in {config.ds_config_path} is {_shown(value)} "
                         f"({_json_kind(value)}) but must be {TYPE_NAMES[kind]}{nullable}; write it as e.g. "
                         f"\"{f.name}\": {TYPE_EXAMPLES[kind]}.")


def _allowed_types(hint) -> tuple[type, ...]:
    """``int`` -> (int,); ``str | None`` -> (str, NoneType); ``dict[str, Any]`` -> (dict,)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in _allowed_types(arg))
    return (typing.get_origin(hint) or hint,)


def _has_type(value, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):   # bool is an int subclass: true is not an iteration count
        return bool in allowed
    if isinstance(value, int) and float in allowed:   # JSON's 30 is a number of minutes too
        return True
    return isinstance(value, allowed)


def _shown(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _json_kind(value) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a JSON object"}.get(type(value), type(value).__name__)


def validate_for_world(config: RunConfig, world_size: int) -> int:
    """Batch sizes against the data-parallel size; returns the gradient-accumulation steps."""
    tp = config.tensor_parallel_size
    check_grid(tp, world_size)
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


SCHEDULES_OVER_TRAIN_ITERS = ("WarmupCosineLR", "WarmupDecayLR")


def deepspeed_dict(config: RunConfig, gas: int) -> dict[str, Any]:
    """The dict handed to deepspeed.initialize: the file's config, schedule length tied to train_iters
    (a warm-up longer than the run is cut to it; :func:`clipped_warmup_warning` says so)."""
    ds = copy.deepcopy(config.ds_config)
    ds.pop("zoo", None)
    ds["gradient_accumulation_steps"] = gas
    scheduler = ds.get("scheduler")
    if scheduler and scheduler.get("type") in SCHEDULES_OVER_TRAIN_ITERS:
        params = scheduler.setdefault("params", {})
        params["total_num_steps"] = config.train_iters
        params["warmup_num_steps"] = max(1, min(params.get("warmup_num_steps", 1), config.train_iters))
    return ds


def clipped_warmup_warning(config: RunConfig) -> str | None:
    """The warning to print (one sentence) when the ds_config's warm-up is longer than the run and is cut to it."""
    scheduler = config.ds_config.get("scheduler") or {}
    warmup = (scheduler.get("params") or {}).get("warmup_num_steps", 1)
    if scheduler.get("type") not in SCHEDULES_OVER_TRAIN_ITERS or warmup <= config.train_iters:
        return None
    return (f"the {scheduler['type']} warm-up of {warmup} steps in {config.ds_config_path} is longer than "
            f"train_iters {config.train_iters}, so it is cut to {config.train_iters} steps and the learning rate "
            f"never decays; pass --train-iters above {warmup} or lower warmup_num_steps.")


def lr_schedule(ds: dict[str, Any]) -> dict[str, Any] | None:
    """The LR schedule of a :func:`deepspeed_dict` result, as recorded in checkpoints: type and params."""
    scheduler = ds.get("scheduler")
    if not scheduler:
        return None
    return {"type": scheduler.get("type"), **dict(scheduler.get("params") or {})}


def schedule_change_warning(old: dict[str, Any] | None, new: dict[str, Any] | None, iteration: int) -> str | None:
    """The warning to print (one sentence) when a resumed run's LR schedule differs from the checkpoint's.

    Megatron's rule stays: this run's flags govern and the step count continues, so from ``iteration``
    on the learning rate follows the new schedule; the warning names both.
    """
    if old == new:
        return None
    return (f"the checkpoint at iteration {iteration} was trained with the LR schedule "
            f"{describe_schedule(old, new)} and this run continues with {describe_schedule(new, old)}, so the "
            f"learning rate follows the new schedule from iteration {iteration}; resume with the old --train-iters "
            "and scheduler settings to keep the old one.")


def describe_schedule(schedule: dict[str, Any] | None, other: dict[str, Any] | None) -> str:
    """``WarmupCosineLR(total_num_steps=3, warmup_num_steps=3)``: the type and the params that differ
    from ``other`` (all of them when the types differ)."""
    if schedule is None:
        return "none (a constant learning rate)"
    other = other or {}
    same_type = other.get("type") == schedule.get("type")
    shown = {k: v for k, v in schedule.items() if k != "type" and not (same_type and other.get(k) == v)}
    if same_type:
        shown.update({k: None for k in other if k not in schedule})
    return f"{schedule.get('type')}(" + ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) + ")"
