"""DeepSpeed universal checkpoints are refused by zoo's tools, in one sentence naming the fix.

DeepSpeed's ``ds_to_universal`` turns a ZeRO checkpoint tag into a folder holding one merged tensor per parameter
and state (``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``), ``zero/optimizer_state.pt`` and copies of the
source's ``mp_rank_XX_model_states.pt``, and names it in ``latest_universal`` beside the tags; a ds_config with
``"checkpoint": {"load_universal": true}`` makes ``engine.load_checkpoint`` read such a folder (from
``latest_universal``) instead of a checkpoint, slicing each tensor for the new layout by patterns the model
publishes. zoo needs neither: every zoo checkpoint resumes at any (tp, pp, dp) from the files the run saved
(the ranks of the new layout read their own byte ranges, zoo.checkpoint.layout_change, or once offline with
launch/reshard.py), and a zoo checkpoint written at tp > 1 does not convert to a right universal checkpoint
(its fused QKV, row-parallel weights and padded vocabulary are merged wrongly unless the model publishes their
layout, and pipeline checkpoints do not convert at all; docs/design-notes.md, "DeepSpeed's universal
checkpoints", has the measured comparison). So a universal checkpoint or ``load_universal`` reaching
``launch/pretrain.py`` or ``launch/reshard.py`` is a user error, raised before anything is built or written:

* :func:`check_no_load_universal`: a ds_config whose ``checkpoint.load_universal`` is set;
* :func:`check_not_universal`: a ``--load`` that is a universal folder, or a save directory (or run directory)
  whose ``latest`` names one or that has only a ``latest_universal``;
* :func:`check_conversion_not_universal`: both, for ``launch/reshard.py`` (its ds_config is ``--deepspeed_config``
  or the run's ``config.json``);
* :func:`check_export_not_universal`: ``launch/export.py``'s ``--load`` and ``--tag``.

A run directory that holds zoo's own ``latest`` tag is resumed as usual, whatever else lies beside it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from zoo.checkpoint.files import CHECKPOINT_SUBDIR, LATEST_FILE
from zoo.errors import UserError

__all__ = ["check_conversion_not_universal", "check_export_not_universal", "check_no_load_universal",
           "check_not_universal", "universal_folder"]

LATEST_UNIVERSAL = "latest_universal"             # written by ds_to_universal beside the tags
UNIVERSAL_OPTIMIZER_STATE = ("zero", "optimizer_state.pt")
FIX = ("zoo changes a run's layout itself: resume the zoo checkpoint it was converted from with --load at the new "
       "--tensor-parallel-size/--pipeline-model-parallel-size, or convert that checkpoint once with launch/reshard.py")


def is_universal_folder(path: Path) -> bool:
    """``path`` is a folder ``ds_to_universal`` wrote (it holds ``zero/optimizer_state.pt``)."""
    return path.joinpath(*UNIVERSAL_OPTIMIZER_STATE).is_file()


def named_tag(root: Path, pointer: str) -> Path | None:
    """The tag directory the file ``root/pointer`` names, or None when there is no such file."""
    try:
        tag = (root / pointer).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return root / tag if tag else None


def universal_folder(load: str | os.PathLike) -> Path | None:
    """The DeepSpeed universal checkpoint folder ``--load`` would resume from, or None when it leads elsewhere: the
    folder itself, or in the save directory (``load`` or ``load/checkpoints``) the tag ``latest`` names or, with
    no ``latest``, the one ``latest_universal`` names."""
    path = Path(load)
    if not path.is_dir():
        return None
    if is_universal_folder(path):
        return path
    for root in (path / CHECKPOINT_SUBDIR, path):
        if not root.is_dir():
            continue
        pointer = LATEST_FILE if (root / LATEST_FILE).is_file() else LATEST_UNIVERSAL
        tag = named_tag(root, pointer)
        if tag is not None or (root / LATEST_FILE).is_file():
            return tag if tag is not None and is_universal_folder(tag) else None
    return None


def check_not_universal(load: str | os.PathLike | None) -> None:
    """Raise UserError when ``--load`` leads to a DeepSpeed universal checkpoint (see :func:`universal_folder`)."""
    if load is None:
        return
    folder = universal_folder(load)
    if folder is not None:
        raise UserError(f"--load {load} is a DeepSpeed universal checkpoint ({folder}, written by ds_to_universal), "
                         f"which zoo does not read; {FIX}.")


def check_no_load_universal(ds_config: dict[str, Any], path: str | os.PathLike | None) -> None:
    """Raise UserError when ``ds_config`` sets DeepSpeed's ``checkpoint.load_universal``."""
    block = ds_config.get("checkpoint")
    if isinstance(block, dict) and block.get("load_universal"):
        raise UserError(f"DeepSpeed config {path} sets \"checkpoint\": {{\"load_universal\": "
                         f"{str(block['load_universal']).lower()}}}, which zoo does not use; remove it: {FIX}.")


def check_conversion_not_universal(load: str | os.PathLike, ds_config_path: str | os.PathLike | None) -> None:
    """Neither ``--load`` nor the ds_config a conversion builds its engine from (``ds_config_path``, else the run's
    ``config.json``) asks for a universal checkpoint; a missing or unreadable config is left to the conversion's
    own checks."""
    check_not_universal(load)
    run = Path(load).parent if Path(load).name == CHECKPOINT_SUBDIR else Path(load)
    path = Path(ds_config_path) if ds_config_path else run / "config.json"
    try:
        settings = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if isinstance(settings, dict):
        check_no_load_universal(settings, path)


def check_export_not_universal(load: str | os.PathLike, tag: str | None) -> None:
    """Raise UserError when ``launch/export.py`` would read a DeepSpeed universal checkpoint: ``--tag`` naming a
    universal folder in the save directory (``load`` or ``load/checkpoints``), or without ``--tag`` a ``--load``
    that leads to one (:func:`universal_folder`)."""
    if tag is None:
        folder = universal_folder(load)
    else:
        folders = (Path(load) / CHECKPOINT_SUBDIR / tag, Path(load) / tag)
        folder = next((path for path in folders if is_universal_folder(path)), None)
    if folder is not None:
        named = f"--load {load}" + (f" --tag {tag}" if tag is not None else "")
        raise UserError(f"{named} is a DeepSpeed universal checkpoint ({folder}, written by ds_to_universal), which "
                         "zoo does not read; export the zoo checkpoint it was converted from (zoo exports a tag "
                         "saved at any tp and pp).")
