"""Locating and reading the files of a zoo DeepSpeed training checkpoint.

DeepSpeed (non-ZeRO) writes, per tag, one ``mp_rank_XX_model_states.pt`` per TP rank (data-parallel
replicas write nothing extra). Each holds the rank's ``module`` state dict, its ``optimizer`` state,
the ``lr_scheduler`` state, DeepSpeed's counters and zoo's client state (``zoo_model``,
``model_config``, ``tensor_parallel_size``, ``iteration``, ``consumed_samples``, ``rng``, ...).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_SUBDIR = "checkpoints"
LATEST_FILE = "latest"
MODEL_STATES = "mp_rank_{:02d}_model_states.pt"
MODEL_STATES_RE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
OPTIMIZER_PARTITION_GLOB = "*_optim_states.pt"   # ZeRO / BF16_Optimizer partitions


def checkpoints_root(load: str | Path) -> Path:
    """The DeepSpeed save directory: ``load/checkpoints`` of a run directory, or ``load`` itself."""
    load = Path(load)
    if not load.exists():
        raise FileNotFoundError(f"checkpoint path {load} does not exist; pass the run directory written with "
                                "--save or its checkpoints/ directory.")
    if (load / CHECKPOINT_SUBDIR).is_dir():
        return load / CHECKPOINT_SUBDIR
    if (load / LATEST_FILE).is_file() or tags_in(load):
        return load
    raise FileNotFoundError(f"no DeepSpeed checkpoint under {load}; pass a run directory written with --save "
                            "(it holds checkpoints/latest) or its checkpoints/ directory.")


def tags_in(root: Path) -> list[str]:
    """Sub-directories of ``root`` that hold at least one model-states file."""
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and any(d.glob("mp_rank_*_model_states.pt")))


TAG_FLAG_FIX = "pass --tag with one of {tags}"


def tag_directory(load: str | Path, tag: str | None = None, fix: str = TAG_FLAG_FIX) -> Path:
    """The directory of checkpoint ``tag``, by default the one named in ``latest``.

    ``fix`` is the caller's way to pick another checkpoint, said when the tag is missing: a template
    with ``{tags}`` (the complete tags present) and ``{latest}`` (the path of the ``latest`` file);
    by default the ``--tag`` flag of export and evaluation.
    """
    root = checkpoints_root(load)
    latest = root / LATEST_FILE
    if tag is None:
        if not latest.is_file():
            raise FileNotFoundError(f"{root} has no '{LATEST_FILE}' file naming the checkpoint to read; "
                                    f"{fix.format(tags=tags_in(root), latest=latest)}.")
        tag = latest.read_text().strip()
    directory = root / tag
    if not tag or not directory.is_dir():
        raise FileNotFoundError(f"checkpoint tag {tag!r} is not a directory under {root}; "
                                f"{fix.format(tags=tags_in(root), latest=latest)}.")
    return directory


def model_states_path(tag_dir: Path, tp_rank: int) -> Path:
    return tag_dir / MODEL_STATES.format(tp_rank)


def rank_files_tp(tag_dir: Path) -> int:
    """The tp degree the files of a tag were written at: the number of model-states files, which must
    be ranks 0..tp-1 (a gap means a file is missing)."""
    ranks = sorted(int(m.group(1)) for p in tag_dir.iterdir() if (m := MODEL_STATES_RE.fullmatch(p.name)))
    if not ranks:
        raise FileNotFoundError(f"{tag_dir} holds no mp_rank_XX_model_states.pt; copy the complete checkpoint "
                                "tag directory.")
    for rank in range(max(ranks) + 1):
        if rank not in ranks:
            raise FileNotFoundError(f"{model_states_path(tag_dir, rank)} is missing from a checkpoint with ranks up "
                                    f"to {max(ranks)}; copy every mp_rank_XX_model_states.pt of the tag.")
    return len(ranks)


def check_rank_files(tag_dir: Path, tp_size: int) -> None:
    """Every TP rank's model-states file is present, and no file of another tp degree."""
    for rank in range(tp_size):
        if not model_states_path(tag_dir, rank).is_file():
            raise FileNotFoundError(f"{model_states_path(tag_dir, rank)} is missing from a tp={tp_size} "
                                    "checkpoint; copy every mp_rank_XX_model_states.pt of the tag.")
    ranks = sorted(int(m.group(1)) for p in tag_dir.iterdir() if (m := MODEL_STATES_RE.fullmatch(p.name)))
    if ranks != list(range(tp_size)):
        raise ValueError(f"{tag_dir} holds model states of ranks {ranks} but its client state says "
                         f"tensor_parallel_size={tp_size}; remove the stray files or re-save the checkpoint.")


def read_model_states(path: Path) -> dict[str, Any]:
    """One rank's model-states file, memory-mapped so that unused entries stay on disk until touched."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; copy every mp_rank_XX_model_states.pt of the tag.")
    try:
        # weights_only=False: DeepSpeed's model-states files pickle the client state (python/numpy RNG
        # states, configs), which the weights-only unpickler refuses. Only load checkpoints you trust.
        states = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError, AttributeError,
            ModuleNotFoundError) as err:
        raise ValueError(f"{path} cannot be read as a torch checkpoint ({first_line(err)}); it is truncated or "
                         "not a DeepSpeed model-states file, re-save it.") from None
    if not isinstance(states, dict) or not isinstance(states.get("module"), dict):
        raise ValueError(f"{path} has no 'module' state dict; it is not a DeepSpeed model-states file, pass the "
                         "checkpoint that zoo's pretrain wrote.")
    if "zoo_model" not in states:
        raise ValueError(f"{path} is not a zoo checkpoint (its client state has no 'zoo_model'); use only "
                         "checkpoints written by zoo's pretrain.")
    return states


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def tp_size_of_states(states: dict[str, Any], path: Path) -> int:
    tp = states.get("tensor_parallel_size", states.get("mp_world_size"))
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{path} records no valid tensor_parallel_size ({tp!r}); it is not a checkpoint written "
                         "by zoo's pretrain.")
    return tp
