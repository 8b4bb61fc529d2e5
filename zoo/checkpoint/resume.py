"""Finding and checking the checkpoint a ``--load`` run resumes from, before anything reads it.

Which tag to resume and its layout are found once, by the first rank (every rank would stat the same files
of a shared filesystem), and handed to every rank (:func:`zoo.distributed.first_rank_result`); every check
of a rank's own files runs on that rank and is agreed across ranks (:func:`zoo.distributed.raise_on_any_rank`),
so a checkpoint that one rank cannot read (a truncated ``mp_rank_01_model_states.pt``) or that holds
another model shape ends the run with the same sentence on every rank, never with one rank's traceback
and a transport error on the others.

A checkpoint at the run's own layout is DeepSpeed's to load (:func:`checkpoint_to_load`); one written at
another layout is moved into the run's engine by its ranks (:mod:`zoo.checkpoint.layout_change`), which nothing
here writes or copies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from zoo.checkpoint.files import (
    COMPLETE_MARKER,
    LATEST_FILE,
    checkpoints_root,
    has_complete_checkpoint,
    layout_of_tag,
    model_states_path,
    read_latest,
    read_model_states,
    resume_tag_directory,
)
from zoo.checkpoint.safe_load import check_tag_files
from zoo.distributed import first_rank_result, raise_on_any_rank
from zoo.errors import MissingInput, UserError

__all__ = ["checkpoint_to_load", "check_latest_files", "check_rank_states", "has_checkpoint",
           "model_config_differences", "resume_tag_and_layout"]

# How a pretraining run picks another checkpoint when `latest` names a missing one (it has no --tag).
LATEST_FIX = ("write the tag of a complete checkpoint ({tags}) into {latest}, or start the run without --load")
# Model-config keys a resumed run may change: they are not part of the weights' shapes or meaning.
FREE_ON_RESUME = ("initializer_range",)


def has_checkpoint(load: str | os.PathLike) -> bool:
    """Whether ``--load`` names something to resume from: a run directory or checkpoints/ directory with a
    complete checkpoint (:func:`zoo.checkpoint.files.has_complete_checkpoint`). A path that does not exist
    yet, a run directory without checkpoints, or one whose only tag is a save that never finished, is a run
    to start (anything else is left to the loader's checks and their sentences)."""
    path = Path(load)
    if not path.exists():
        return False
    if not path.is_dir():
        return True
    return has_complete_checkpoint(path)


def check_latest_files(load: str | os.PathLike) -> None:
    """Every file the completion record of the tag ``latest`` names is there, the first missing one named: a
    finished checkpoint that lost a rank's file is a damaged copy, which a resume or a conversion refuses rather
    than fall back to an older tag (or to iteration 0)."""
    try:
        root = checkpoints_root(load)
    except FileNotFoundError:
        return
    latest = read_latest(root)
    marker = root / latest / COMPLETE_MARKER if latest else None
    if marker is None or not marker.is_file():
        return
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return   # an unreadable record: the tag's own checks say what is wrong
    missing = [name for name in files if not (root / latest / name).is_file()]
    if missing:
        raise MissingInput(f"{root / latest / missing[0]} is missing from checkpoint {latest} (its "
                                f"{COMPLETE_MARKER} lists it); copy every file of the tag directory, or write an "
                                f"older complete tag into {root / LATEST_FILE}.")


def checkpoint_to_load(load: str | os.PathLike, parallel, model_config: dict[str, Any] | None = None) -> tuple[Path, str]:
    """The (DeepSpeed load directory, tag) a run at the checkpoint's own (tp, pp) resumes from (found by the first
    rank, handed to all), checked on every rank.

    The checkpoint is the tag ``latest`` names when that save finished, else the newest complete tag
    (:func:`zoo.checkpoint.files.resume_tag_directory`, said in one line on rank 0). Every ``.pt`` file it
    holds is first loaded with the weights-only unpickler (:mod:`zoo.checkpoint.safe_load`): a file that
    names any other global ends the run on every rank with one sentence, before DeepSpeed unpickles it.
    Each rank proves it can read its own model-states file, and that the file's recorded model config equals
    ``model_config`` (this run's ``hf_config_dict()``), before any rank loads anything. A checkpoint of
    another (tp, pp) is refused here: the run's ranks move it (:mod:`zoo.checkpoint.layout_change`).
    """
    def locate() -> tuple[Path, Path, int, int]:
        root = checkpoints_root(load)
        tag_dir, (source_tp, source_pp) = resume_tag_and_layout(load, announce=True)
        return root, tag_dir, source_tp, source_pp

    root, tag_dir, source_tp, source_pp = first_rank_result(locate)   # one rank reads the tags
    # Every .pt of the tag loads with the weights-only unpickler (each rank a share, agreed) before
    # DeepSpeed's load_checkpoint, which unpickles with weights_only=False, reads any of them.
    raise_on_any_rank(lambda: check_tag_files(tag_dir, *rank_and_world()))
    pp_size = getattr(parallel, "pp_size", 1)
    if (source_tp, source_pp) != (parallel.tp_size, pp_size):
        raise UserError(f"--load {load} holds a checkpoint written at tp={source_tp} x pp={source_pp} and this run "
                         f"is tp={parallel.tp_size} x pp={pp_size}; resume it through zoo's pretraining (launch/pretrain.py "
                         "--load), which moves it to the new layout.")
    model_parallel_rank = getattr(parallel, "pp_rank", 0) * parallel.tp_size + parallel.tp_rank   # DeepSpeed's mp_rank_XX
    raise_on_any_rank(lambda: check_rank_states(tag_dir, model_parallel_rank, model_config, load))
    return root, tag_dir.name


def resume_tag_and_layout(load: str | os.PathLike, announce: bool = False) -> tuple[Path, tuple[int, int]]:
    """The tag a ``--load`` resumes from (``latest`` when that save finished, else the newest complete tag, said
    in one line on rank 0 with ``announce``) and the (tp, pp) it was written at."""
    root = checkpoints_root(load)
    tag_dir, note = resume_tag_directory(root)
    if tag_dir is None:
        raise UserError(f"--load {load}: {note.replace('; starting from iteration 0', '')}; remove "
                         f"{root / LATEST_FILE} to start the run from iteration 0, or pass --load of a run "
                         "with a finished checkpoint.")
    if announce and note and is_first_rank():
        print(f"--load {load}: {note}", flush=True)
    return tag_dir, layout_of_tag(tag_dir)


def is_first_rank() -> bool:
    return rank_and_world()[0] == 0


def rank_and_world() -> tuple[int, int]:
    """(global rank, world size), (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_rank_states(tag_dir: Path, tp_rank: int, model_config: dict[str, Any] | None,
                      load: str | os.PathLike) -> None:
    """The model-states file of ``tp_rank`` reads as a zoo checkpoint, of the model ``model_config`` describes."""
    path = model_states_path(Path(tag_dir), tp_rank)
    states = read_model_states(path)
    recorded = states.get("model_config")
    if model_config is None or not isinstance(recorded, dict):
        return
    differences = model_config_differences(recorded, model_config)
    if differences:
        raise UserError(f"--load {load} holds a checkpoint of another model ({'; '.join(differences)}); pass the "
                         f"--model preset and model_overrides it was trained with (preset "
                         f"{states.get('zoo_model')!r}), or start a new run without --load.")


def model_config_differences(recorded: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``"n_layer 2 in the checkpoint, 4 in this run"`` for every field of the model's (transformers) config
    that differs, except the ones a resumed run may change (dropout, init range)."""
    keys = sorted(set(recorded) | set(wanted))
    return [f"{key} {recorded.get(key)!r} in the checkpoint, {wanted.get(key)!r} in this run" for key in keys
            if "drop" not in key and key not in FREE_ON_RESUME and recorded.get(key) != wanted.get(key)]
