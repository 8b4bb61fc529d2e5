"""Locating and reading the files of a zoo DeepSpeed training checkpoint.

DeepSpeed (non-ZeRO) writes, per tag, one ``mp_rank_XX_model_states.pt`` per TP rank (data-parallel
replicas write nothing extra). Each holds the rank's ``module`` state dict, its ``optimizer`` state,
the ``lr_scheduler`` state, DeepSpeed's counters and zoo's client state (``zoo_model``,
``model_config``, ``tensor_parallel_size``, ``iteration``, ``consumed_samples``, ``rng``, ...).

A tag is a checkpoint only once its save finished on every rank: zoo's save
(:func:`zoo.checkpoint.save.save_checkpoint`) then writes :data:`COMPLETE_MARKER` into it, and only after
that ``latest``. Readers take complete tags only (:func:`incomplete_reason`): export and evaluation refuse
an incomplete one in one sentence, a resumed run takes the newest complete one
(:func:`resume_tag_directory`). Tags of a directory written by a zoo without markers stay readable through
``latest``. Every ``.pt`` is read with the weights-only unpickler (:mod:`zoo.checkpoint.safe_load`).
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

from zoo.checkpoint.safe_load import UnsafeCheckpointError, safe_torch_load
from zoo.errors import MissingInput, UserError

CHECKPOINT_SUBDIR = "checkpoints"
LATEST_FILE = "latest"
MODEL_STATES = "mp_rank_{:02d}_model_states.pt"
MODEL_STATES_RE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
OPTIMIZER_PARTITION_GLOB = "*_optim_states.pt"   # ZeRO / BF16_Optimizer partitions


def checkpoints_root(load: str | Path) -> Path:
    """The DeepSpeed save directory: ``load/checkpoints`` of a run directory, or ``load`` itself."""
    load = Path(load)
    if not load.exists():
        raise MissingInput(f"checkpoint path {load} does not exist; pass the run directory written with "
                                "--save or its checkpoints/ directory.")
    if (load / CHECKPOINT_SUBDIR).is_dir():
        return load / CHECKPOINT_SUBDIR
    if (load / LATEST_FILE).is_file() or tags_with_model_states(load):
        return load
    raise MissingInput(f"no DeepSpeed checkpoint under {load}; pass a run directory written with --save "
                            "(it holds checkpoints/latest) or its checkpoints/ directory.")


COMPLETE_MARKER = "zoo_complete.json"


def tag_order(name: str) -> tuple:
    """Sort key of a tag name: its digit runs compare as numbers (``iter_10`` after ``iter_9``)."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def tags_with_model_states(root: Path) -> list[str]:
    """Sub-directories of ``root`` that hold at least one model-states file, complete or not."""
    if not Path(root).is_dir():
        return []
    return sorted((d.name for d in Path(root).iterdir() if d.is_dir() and any(d.glob("mp_rank_*_model_states.pt"))),
                  key=tag_order)


def read_latest(root: Path) -> str | None:
    """The tag ``root/latest`` names, or None without a readable ``latest``."""
    try:
        return (Path(root) / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def completion_record(tag_dir: Path) -> dict[str, Any]:
    """What :data:`COMPLETE_MARKER` says of a finished save: the tag and every file in it with its size."""
    return {"tag": tag_dir.name,
            "files": {p.name: p.stat().st_size for p in sorted(tag_dir.iterdir())
                      if p.is_file() and p.name != COMPLETE_MARKER}}


def marker_says_complete(tag_dir: Path) -> bool:
    """``tag_dir`` holds a readable :data:`COMPLETE_MARKER` and every file it lists. (A listed file of
    another size is a damaged checkpoint, not an unfinished save: its reader names it in one sentence.)"""
    try:
        record = json.loads((tag_dir / COMPLETE_MARKER).read_text())
        files = record["files"]
        return bool(files) and all((tag_dir / name).is_file() for name in files)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return False


def marked_tags(root: Path) -> list[str]:
    """The tags under ``root`` that hold a :data:`COMPLETE_MARKER` (complete or not)."""
    return [name for name in tags_with_model_states(root) if (Path(root) / name / COMPLETE_MARKER).exists()]


def incomplete_reason(root: Path, tag: str, marked: list[str] | None = None) -> str | None:
    """Why tag ``tag`` under ``root`` is not a complete checkpoint, or None when it is one.

    A tag is complete when its save finished: zoo's save writes :data:`COMPLETE_MARKER` (listing every
    file and its size) after every rank's files are written, and only then ``latest``. A tag without the
    marker was written by a zoo that wrote none, or its save did not finish; it counts as complete only
    as such an older checkpoint: ``latest`` exists, the tag sorts no later than the tag ``latest`` names,
    and before every marked tag under ``root`` (later unmarked tags are saves that did not finish).
    ``marked`` is :func:`marked_tags` of ``root`` when the caller has it."""
    root = Path(root)
    tag_dir = root / tag
    if not tag_dir.is_dir():
        return "it is not a directory"
    if (tag_dir / COMPLETE_MARKER).exists():
        return None if marker_says_complete(tag_dir) else f"files listed in its {COMPLETE_MARKER} are missing"
    latest = read_latest(root)
    marked = marked_tags(root) if marked is None else marked
    if latest and tag_order(tag) <= tag_order(latest) and all(tag_order(tag) < tag_order(m) for m in marked):
        return None
    return f"it has no {COMPLETE_MARKER}: its save did not finish"


def tags_in(root: Path) -> list[str]:
    """The complete checkpoint tags under ``root`` (:func:`incomplete_reason`), oldest first."""
    marked = marked_tags(root)
    return [tag for tag in tags_with_model_states(root) if incomplete_reason(root, tag, marked) is None]


def selectable_tags(root: Path) -> list[str]:
    """The tags ``--tag`` may name: the complete ones, and, under a ``root`` where no tag has a
    :data:`COMPLETE_MARKER` (all written by a zoo that wrote none), every tag with model states."""
    return tags_in(root) if marked_tags(root) else tags_with_model_states(root)


TAG_FLAG_FIX = "pass --tag with one of {tags}"


def tag_directory(load: str | Path, tag: str | None = None, fix: str = TAG_FLAG_FIX) -> Path:
    """The directory of checkpoint ``tag``, by default the one named in ``latest``; an incomplete tag (a save
    that did not finish, :func:`incomplete_reason`) is refused.

    ``fix`` is the caller's way to pick another checkpoint, said when the tag is missing or incomplete: a
    template with ``{tags}`` (the tags that may be chosen) and ``{latest}`` (the path of the ``latest``
    file); by default the ``--tag`` flag of export and evaluation.
    """
    root = checkpoints_root(load)
    latest = root / LATEST_FILE
    if tag is None:
        if not latest.is_file():
            raise MissingInput(f"{root} has no '{LATEST_FILE}' file naming the checkpoint to read; "
                                    f"{fix.format(tags=selectable_tags(root), latest=latest)}.")
        tag = latest.read_text().strip()
    directory = root / tag
    if not tag or not directory.is_dir():
        raise MissingInput(f"checkpoint tag {tag!r} is not a directory under {root}; "
                                f"{fix.format(tags=selectable_tags(root), latest=latest)}.")
    if tag not in selectable_tags(root) and any(directory.glob("mp_rank_*_model_states.pt")):
        raise UserError(f"checkpoint tag {tag!r} under {root} is incomplete ({incomplete_reason(root, tag)}); "
                         f"{fix.format(tags=tags_in(root), latest=latest)}.")
    return directory


def resume_tag_directory(load: str | Path) -> tuple[Path | None, str | None]:
    """(The tag directory a resumed run reads, a line saying why it is not the one ``latest`` names).

    The tag ``latest`` names when it is complete; otherwise (``latest`` missing, or naming a save that did
    not finish) the newest complete tag, said in the line; (None, the line) when there is no complete tag,
    so the run starts from iteration 0."""
    root = checkpoints_root(load)
    latest = read_latest(root)
    complete = tags_in(root)
    if latest and latest in complete:
        return root / latest, None
    where = (f"{root / LATEST_FILE} is missing" if latest is None else
             f"{root / LATEST_FILE} names {latest!r}, which is incomplete ({incomplete_reason(root, latest)})")
    if complete:
        return root / complete[-1], f"{where}; resuming from {complete[-1]}, the newest complete checkpoint"
    return None, f"{where} and {root} holds no complete checkpoint; starting from iteration 0"


def has_complete_checkpoint(load: str | Path) -> bool:
    """Whether ``load`` (a run directory or its checkpoints/) holds a complete checkpoint to resume."""
    try:
        return bool(tags_in(checkpoints_root(load)))
    except FileNotFoundError:
        return False


def model_states_path(tag_dir: Path, tp_rank: int) -> Path:
    return tag_dir / MODEL_STATES.format(tp_rank)


def rank_files_tp(tag_dir: Path) -> int:
    """The tp degree the files of a tag were written at: the number of model-states files, which must
    be ranks 0..tp-1 (a gap means a file is missing)."""
    ranks = sorted(int(m.group(1)) for p in tag_dir.iterdir() if (m := MODEL_STATES_RE.fullmatch(p.name)))
    if not ranks:
        raise MissingInput(f"{tag_dir} holds no mp_rank_XX_model_states.pt; copy the complete checkpoint "
                                "tag directory.")
    for rank in range(max(ranks) + 1):
        if rank not in ranks:
            raise MissingInput(f"{model_states_path(tag_dir, rank)} is missing from a checkpoint with ranks up "
                                    f"to {max(ranks)}; copy every mp_rank_XX_model_states.pt of the tag.")
    return len(ranks)


def check_rank_files(tag_dir: Path, tp_size: int) -> None:
    """Every TP rank's model-states file is present, and no file of another tp degree."""
    for rank in range(tp_size):
        if not model_states_path(tag_dir, rank).is_file():
            raise MissingInput(f"{model_states_path(tag_dir, rank)} is missing from a tp={tp_size} "
                                    "checkpoint; copy every mp_rank_XX_model_states.pt of the tag.")
    ranks = sorted(int(m.group(1)) for p in tag_dir.iterdir() if (m := MODEL_STATES_RE.fullmatch(p.name)))
    if ranks != list(range(tp_size)):
        raise UserError(f"{tag_dir} holds model states of ranks {ranks} but its client state says "
                         f"tensor_parallel_size={tp_size}; remove the stray files or re-save the checkpoint.")


def read_model_states(path: Path) -> dict[str, Any]:
    """One rank's model-states file, memory-mapped so that unused entries stay on disk until touched."""
    if not path.is_file():
        raise MissingInput(f"{path} does not exist; copy every mp_rank_XX_model_states.pt of the tag.")
    try:
        states = safe_torch_load(path)   # weights-only: a file that names other globals is refused, not run
    except UnsafeCheckpointError as err:
        raise UserError(str(err)) from None   # a user error: ranks agree on it by its kind
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError, AttributeError,
            ModuleNotFoundError) as err:
        raise UserError(f"{path} cannot be read as a torch checkpoint ({first_line(err)}); it is truncated or "
                         "not a DeepSpeed model-states file, re-save it.") from None
    pipelined = isinstance(states, dict) and states.get("pipeline_model_parallel_size", 1) > 1
    if not isinstance(states, dict) or not (isinstance(states.get("module"), dict) or pipelined):
        raise UserError(f"{path} has no 'module' state dict; it is not a DeepSpeed model-states file, pass the "
                         "checkpoint that zoo's pretrain wrote.")
    if "zoo_model" not in states:
        raise UserError(f"{path} is not a zoo checkpoint (its client state has no 'zoo_model'); use only "
                         "checkpoints written by zoo's pretrain.")
    return states


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def layout_of_tag(tag_dir: Path) -> tuple[int, int]:
    """The (tp, pp) a tag was written at: recorded in rank 0's model states (pp 1 when absent, a checkpoint of
    one stage), and matched by the number of mp_rank_XX_model_states.pt files (one per stage and TP rank;
    pipeline stages keep their weights in DeepSpeed's layer_XX-model_YY-model_states.pt files)."""
    count = rank_files_tp(tag_dir)
    path = model_states_path(tag_dir, 0)
    states = read_model_states(path)
    tp = tp_size_of_states(states, path)
    pp = states.get("pipeline_model_parallel_size", 1)
    if not isinstance(pp, int) or pp < 1 or tp * pp != count:
        raise UserError(f"{tag_dir} holds {count} mp_rank_XX_model_states.pt files but its client state says "
                         f"tensor_parallel_size={tp} x pipeline_model_parallel_size={pp!r}; copy the complete tag "
                         "directory or re-save the checkpoint.")
    return tp, pp


def tp_size_of_states(states: dict[str, Any], path: Path) -> int:
    tp = states.get("tensor_parallel_size", states.get("mp_world_size"))
    if not isinstance(tp, int) or tp < 1:
        raise UserError(f"{path} records no valid tensor_parallel_size ({tp!r}); it is not a checkpoint written "
                         "by zoo's pretrain.")
    return tp
