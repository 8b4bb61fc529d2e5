"""Finding and checking the checkpoint a ``--load`` run resumes from, before DeepSpeed reads it.

Every check runs on every rank and is agreed across ranks (:func:`zoo.distributed.raise_on_any_rank`),
so a checkpoint that one rank cannot read (a truncated ``mp_rank_01_model_states.pt``) or that holds
another model shape ends the run with the same sentence on every rank, never with one rank's traceback
and a transport error on the others.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from zoo.checkpoint.files import (checkpoints_root, model_states_path, rank_files_tp, read_model_states,
                                  tag_directory)
from zoo.distributed import raise_on_any_rank

__all__ = ["checkpoint_to_load", "check_rank_states", "model_config_differences"]

# How a pretraining run picks another checkpoint when `latest` names a missing one (it has no --tag).
LATEST_FIX = ("write the tag of a complete checkpoint ({tags}) into {latest}, or start the run without --load")
# Model-config keys a resumed run may change: they are not part of the weights' shapes or meaning.
FREE_ON_RESUME = ("initializer_range",)


def checkpoint_to_load(load: str | os.PathLike, ps, model_config: dict[str, Any] | None = None) -> tuple[Path, str]:
    """The (DeepSpeed load directory, tag) to resume from at this run's tp degree, checked on every rank.

    When the checkpoint named by ``latest`` was written at another tp, rank 0 writes (or reuses) a copy
    resharded for this tp under ``<checkpoints>/resharded/<tag>-tp<N>/`` and every rank reads that.
    Each rank proves it can read its own model-states file, and that the file's recorded model config
    equals ``model_config`` (this run's ``hf_config_dict()``), before any rank loads anything.
    """
    from zoo.checkpoint.reshard import ensure_resharded, resharded_directory

    def locate() -> tuple[Path, Path, int]:
        root = checkpoints_root(load)
        tag_dir = tag_directory(root, fix=LATEST_FIX)
        return root, tag_dir, rank_files_tp(tag_dir)

    root, tag_dir, source_tp = raise_on_any_rank(locate)
    if source_tp == ps.tp_size:
        raise_on_any_rank(lambda: check_rank_states(tag_dir, ps.tp_rank, model_config, load))
        return root, tag_dir.name
    # The shape first (from rank 0's file, every rank), so that no copy of another model is resharded.
    raise_on_any_rank(lambda: check_rank_states(tag_dir, 0, model_config, load))
    target = resharded_directory(root, tag_dir.name, ps.tp_size)
    raise_on_any_rank(lambda: ensure_resharded(tag_dir, ps.tp_size, target) if dist.get_rank() == 0 else None)
    raise_on_any_rank(lambda: check_rank_states(target, ps.tp_rank, model_config, load))
    return target.parent, target.name


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
        raise ValueError(f"--load {load} holds a checkpoint of another model ({'; '.join(differences)}); pass the "
                         f"--model preset and model_overrides it was trained with (preset "
                         f"{states.get('zoo_model')!r}), or start a new run without --load.")


def model_config_differences(recorded: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``"n_layer 2 in the checkpoint, 4 in this run"`` for every field of the model's (transformers) config
    that differs, except the ones a resumed run may change (dropout, init range)."""
    keys = sorted(set(recorded) | set(wanted))
    return [f"{key} {recorded.get(key)!r} in the checkpoint, {wanted.get(key)!r} in this run" for key in keys
            if "drop" not in key and key not in FREE_ON_RESUME and recorded.get(key) != wanted.get(key)]
