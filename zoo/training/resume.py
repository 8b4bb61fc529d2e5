"""Finding and checking the checkpoint a ``--load`` run resumes from, before DeepSpeed reads it.

Which tag to resume and its layout are found once, by the first rank (every rank would stat the same files
of a shared filesystem), and handed to every rank (:func:`zoo.distributed.first_rank_result`); every check
of a rank's own files runs on that rank and is agreed across ranks (:func:`zoo.distributed.raise_on_any_rank`),
so a checkpoint that one rank cannot read (a truncated ``mp_rank_01_model_states.pt``) or that holds
another model shape ends the run with the same sentence on every rank, never with one rank's traceback
and a transport error on the others.

A checkpoint written at another layout is resharded once, by rank 0, into a copy the run then loads
with its ordinary ds_config: another tp (:mod:`zoo.checkpoint.reshard`), and for ZeRO-1/2 and BF16
checkpoints, whose optimizer state is partitioned over dp, another tp or dp
(:mod:`zoo.checkpoint.zero_reshard`; DeepSpeed itself refuses a new dp for those).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from zoo.checkpoint.files import (
    LATEST_FILE,
    checkpoints_root,
    has_complete_checkpoint,
    layout_of_tag,
    model_states_path,
    read_model_states,
    resume_tag_directory,
)
from zoo.checkpoint.reshard import ensure_resharded, resharded_directory
from zoo.checkpoint.safe_load import check_tag_files
from zoo.checkpoint.zero_reshard import partition_files
from zoo.distributed import directory_bytes, first_rank_result, raise_on_any_rank, run_on_first_rank

__all__ = ["checkpoint_to_load", "check_rank_states", "has_checkpoint", "model_config_differences",
           "resume_tag_and_layout"]

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


def checkpoint_to_load(load: str | os.PathLike, ps, model_config: dict[str, Any] | None = None,
                       engine=None) -> tuple[Path, str]:
    """The (DeepSpeed load directory, tag) to resume from at this run's layout (found by the first rank,
    handed to all), checked on every rank.

    The checkpoint is the tag ``latest`` names when that save finished, else the newest complete tag
    (:func:`zoo.checkpoint.files.resume_tag_directory`, said in one line on rank 0). Every ``.pt`` file it
    holds is first loaded with the weights-only unpickler (:mod:`zoo.checkpoint.safe_load`): a file that
    names any other global ends the run on every rank with one sentence, before DeepSpeed unpickles it.

    When the checkpoint named by ``latest`` was written at another tp (or, for a ZeRO/BF16 checkpoint,
    another tp x dp), rank 0 writes (or reuses) a resharded copy under
    ``<checkpoints>/resharded/<tag>-tp<N>[-dp<M>]/`` and every rank reads that. Each rank proves it can
    read its own model-states file, and that the file's recorded model config equals ``model_config``
    (this run's ``hf_config_dict()``), before any rank loads anything. With ``engine`` (this run's
    DeepSpeed engine), a checkpoint whose optimizer files the engine would not read (ZeRO partitions
    for a non-ZeRO run, bf16 partitions for an fp32 one, ...) is refused in one sentence.
    """
    def locate() -> tuple[Path, Path, int, Any]:
        root = checkpoints_root(load)
        tag_dir, (source_tp, source_pp) = resume_tag_and_layout(load, announce=True)
        partitions = partition_files(tag_dir)
        if engine is not None:
            check_optimizer_files(partitions, engine_optimizer_files(engine), load)
        return root, tag_dir, source_tp, source_pp, partitions

    root, tag_dir, source_tp, source_pp, partitions = first_rank_result(locate)   # one rank reads the tags
    # Every .pt of the tag loads with the weights-only unpickler (each rank a share, agreed) before
    # DeepSpeed's load_checkpoint, which unpickles with weights_only=False, reads any of them.
    raise_on_any_rank(lambda: check_tag_files(tag_dir, *rank_and_world()))
    same_dp = partitions is None or partitions.dp_size == ps.dp_size
    pp_size = getattr(ps, "pp_size", 1)
    if (source_tp, source_pp) == (ps.tp_size, pp_size) and same_dp:
        model_parallel_rank = getattr(ps, "pp_rank", 0) * ps.tp_size + ps.tp_rank   # DeepSpeed's mp_rank_XX
        raise_on_any_rank(lambda: check_rank_states(tag_dir, model_parallel_rank, model_config, load))
        return root, tag_dir.name
    if source_pp > 1 or pp_size > 1:
        raise ValueError(f"--load {load} holds a checkpoint written at tp={source_tp} x pp={source_pp}"
                         f"{'' if same_dp else ' (another dp)'} and this run is tp={ps.tp_size} x pp={pp_size}; "
                         f"resume it at tp={source_tp} x pp={source_pp}, or export it (launch/export.py) and start "
                         "the new layout with --pretrained.")
    # The shape first (from rank 0's file, every rank), so that no copy of another model is resharded.
    raise_on_any_rank(lambda: check_rank_states(tag_dir, 0, model_config, load))
    new_dp = None if partitions is None else ps.dp_size
    target = resharded_directory(root, tag_dir.name, ps.tp_size, new_dp)
    # Rank 0 reshards while the others wait on a host group whose timeout is sized from the checkpoint's
    # bytes (zoo.distributed.run_on_first_rank): a checkpoint of a hundred gigabytes takes longer than
    # the process group's timeout.
    run_on_first_rank(lambda: ensure_resharded(tag_dir, ps.tp_size, target, new_dp),
                      work_bytes=directory_bytes(tag_dir))
    raise_on_any_rank(lambda: check_tag_files(target, *rank_and_world()))
    raise_on_any_rank(lambda: check_rank_states(target, ps.tp_rank, model_config, load))
    return target.parent, target.name


def resume_tag_and_layout(load: str | os.PathLike, announce: bool = False) -> tuple[Path, tuple[int, int]]:
    """The tag a ``--load`` resumes from (``latest`` when that save finished, else the newest complete tag, said
    in one line on rank 0 with ``announce``) and the (tp, pp) it was written at."""
    root = checkpoints_root(load)
    tag_dir, note = resume_tag_directory(root)
    if tag_dir is None:
        raise ValueError(f"--load {load}: {note.replace('; starting from iteration 0', '')}; remove "
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


def engine_optimizer_files(engine) -> str | None:
    """Which optimizer files a DeepSpeed engine reads: None (model states), "zero_pp_rank" or
    "bf16_zero_pp_rank" partitions, or "stage3" (which zoo does not reshard)."""
    stage = engine.zero_optimization_stage()
    if stage >= 3:
        return "stage3"
    partitioned = stage in (1, 2) or type(engine.optimizer).__name__ == "BF16_Optimizer"
    if not partitioned:
        return None
    return "bf16_zero_pp_rank" if engine.bfloat16_enabled() else "zero_pp_rank"


def check_optimizer_files(partitions, wanted: str | None, load: str | os.PathLike) -> None:
    """The checkpoint's optimizer files are the kind this run's engine reads."""
    have = None if partitions is None else f"{partitions.prefix}zero_pp_rank"
    if have == wanted:
        return
    if wanted == "stage3":
        raise ValueError(f"--load {load} holds a {describe_files(have)} checkpoint, which a ZeRO stage 3 run cannot "
                         "load; resume it with zero_optimization stage 1 or 2 (or none) in the ds_config.")
    raise ValueError(f"--load {load} holds a {describe_files(have)} checkpoint but this run's ds_config reads "
                     f"{describe_files(wanted)} checkpoints; resume it with the zero_optimization stage and bf16 "
                     "setting it was written with (or start a new run without --load).")


def describe_files(kind: str | None) -> str:
    return {None: "non-ZeRO (optimizer in mp_rank_XX_model_states.pt)",
            "zero_pp_rank": "ZeRO-partitioned fp32/fp16 (zero_pp_rank_*_optim_states.pt)",
            "bf16_zero_pp_rank": "bf16 ZeRO/BF16-optimizer-partitioned (bf16_zero_pp_rank_*_optim_states.pt)"}.get(
        kind, str(kind))


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
