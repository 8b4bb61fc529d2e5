"""The ``--deepspeed_config`` file: read as JSON with one-sentence errors (a missing file names the closest
config there is), and the settings of its DeepSpeed part that zoo and DeepSpeed both rely on, checked before
anything is built (shared by pretraining and finetuning)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zoo.errors import MissingInput, UserError
from zoo.options import json_kind, shown


def read_ds_config(path: str | None) -> dict[str, Any]:
    """The JSON of ``--deepspeed_config``, with one-sentence errors (shared by pretraining and finetuning)."""
    if path is None:
        raise UserError("no DeepSpeed config given; pass --deepspeed_config ds_configs/<name>.json.")
    if not Path(path).is_file():
        raise MissingInput(f"DeepSpeed config {path} does not exist; {closest_ds_config_hint(path)}.")
    try:
        ds_config = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"DeepSpeed config {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}); fix the file.") from None
    except json.JSONDecodeError as err:
        raise UserError(f"DeepSpeed config {path} is not valid JSON ({err}); fix the file.") from None
    if not isinstance(ds_config, dict):
        raise UserError(f"DeepSpeed config {path} holds {json_kind(ds_config)}, not a JSON object; write it as "
                         "{\"train_batch_size\": 8, \"train_micro_batch_size_per_gpu\": 4, \"optimizer\": {...}, ...}, "
                         "like the files in ds_configs/.")
    return ds_config


BUNDLED_DS_CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


def closest_ds_config_hint(path: str | os.PathLike, bundled: Path = BUNDLED_DS_CONFIGS) -> str:
    """What to pass instead of the missing ``path``: the closest name among the JSON files of its own directory
    (where that exists) and of zoo's ds_configs/ (difflib), else the list of ds_configs/."""
    import difflib  # local: only a missing config pays for it

    wanted = Path(path)
    candidates: dict[str, Path] = {}
    for directory in (bundled, wanted.parent):
        if directory.is_dir():
            candidates.update({file.name: file for file in sorted(directory.glob("*.json"))})
    match = difflib.get_close_matches(wanted.name, list(candidates), n=1, cutoff=0.6)
    if match:
        return f"pass {shown_path(candidates[match[0]])}, the closest name there is"
    return f"pass one of the files in {shown_path(bundled)}/"


def shown_path(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it (as a user types it)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


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
            raise UserError(f"{block!r} in DeepSpeed config {path} is {shown(ds_config[block])} "
                             f"({json_kind(ds_config[block])}), not a JSON object; write it as \"{block}\": "
                             "{...} like the files in ds_configs/.")
    for key in DS_CONFIG_BATCH_KEYS:
        value = ds_config.get(key)
        if key not in ds_config or (key == "gradient_accumulation_steps" and value == "auto"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            kind = "" if isinstance(value, int) and not isinstance(value, bool) else f" ({json_kind(value)})"
            raise UserError(f"{key} in DeepSpeed config {path} is {shown(value)}{kind}, not a positive integer; "
                             f"write it as e.g. \"{key}\": 8.")
    enabled = [name for name in ("fp16", "bf16") if ds_config.get(name, {}).get("enabled") is True]
    if len(enabled) == 2:
        raise UserError(f"DeepSpeed config {path} enables both fp16 and bf16; set \"enabled\": false in one of "
                         "them (bf16 needs no loss scaling, fp16 runs where bf16 is not supported).")
    if needs_optimizer:
        optimizer = ds_config.get("optimizer")
        if optimizer is None:
            raise UserError(f"DeepSpeed config {path} has no optimizer block, and DeepSpeed builds the optimizer "
                             "from it; add e.g. \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1.5e-4, "
                             "\"weight_decay\": 0.01}}.")
        if not isinstance(optimizer.get("type"), str):
            raise UserError(f"the optimizer block of DeepSpeed config {path} names no type (it has "
                             f"{shown(optimizer.get('type'))}); add e.g. \"type\": \"AdamW\".")


__all__ = ["BUNDLED_DS_CONFIGS", "DS_CONFIG_BATCH_KEYS", "DS_CONFIG_BLOCKS", "check_ds_config", "closest_ds_config_hint",
           "read_ds_config", "shown_path"]
