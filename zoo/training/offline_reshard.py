"""Converting a run's checkpoint to another (tp, pp, dp) layout once, offline, so that many later jobs resume it
without moving it again (``launch/reshard.py``).

The conversion is the on-resume move itself: the ranks of the new layout build the run's engine at that layout
(the source run's ``config.json`` with the new tp and pp), fill it from the source checkpoint with
:func:`zoo.checkpoint.layout_change.load_at_new_layout` (each rank reading only the byte ranges of the names it
holds), restore the loop state and random streams as a resume would, and save it with
:func:`zoo.checkpoint.save.save_checkpoint` into a staging directory beside the output. Once every rank has
finished, rank 0 renames the staging directory to the output in one step, so the output is either absent or a
complete run directory (``config.json``, ``checkpoints/<tag>/`` and ``latest``) that ``--load`` resumes at
exactly that layout, with no second move. The source is only read.

Everything a user can get wrong is checked before the process group is joined and before anything is written
(:func:`plan_conversion`): a source missing a rank's files, a model shape the new tp cannot split, ZeRO-3 on
either side, a precision other than the checkpoint's (the same check and sentences as a resume at another
layout, :func:`zoo.checkpoint.layout_change.check_layout_change`), a world size that is not tp x pp x dp, an
output that exists and is not empty.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.atomic import check_output_directory, give_default_modes, write_text_atomic
from zoo.checkpoint.files import CHECKPOINT_SUBDIR, checkpoints_root
from zoo.checkpoint.layout_change import check_layout_change
from zoo.checkpoint.resume import check_latest_files, has_checkpoint, resume_tag_and_layout
from zoo.checkpoint.safe_load import check_tag_files
from zoo.checkpoint.training_state import precision_of, zero_stage_of
from zoo.config.run_config import RunConfig
from zoo.errors import MissingInput, UserError

__all__ = ["Conversion", "default_output", "plan_conversion", "convert_checkpoint"]

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass
class Conversion:
    """What a conversion reads and writes, every field checked by :func:`plan_conversion`."""

    load: str
    tag_dir: Path
    source: tuple[int, int, int | None]   # (tp, pp, dp) the checkpoint was written at (dp None: not recorded)
    layout: tuple[int, int, int]          # (tp, pp, dp) it is converted to
    precision: str
    config: RunConfig                     # the source run's settings at the new layout, --save/--load the output
    output: Path


def run_directory_of(load: str | os.PathLike) -> Path:
    """The run directory of ``--load`` (a run directory or its checkpoints/ subdirectory)."""
    root = checkpoints_root(load)
    return root.parent if root.name == CHECKPOINT_SUBDIR else root


def default_output(load: str | os.PathLike, tp: int, pp: int, dp: int) -> Path:
    """``<run>-tp{T}pp{P}dp{D}`` beside the source run directory."""
    run = run_directory_of(load).resolve()
    return run.parent / f"{run.name}-tp{tp}pp{pp}dp{dp}"


def check_output_beside_source(output: Path, run: Path) -> None:
    """The output is a new or empty directory that neither is nor lies inside the source run, nor holds it."""
    out, source = output.resolve(), run.resolve()
    if out == source or source in out.parents or out in source.parents:
        raise UserError(f"--out {output} overlaps the source run {run}, which is only read; choose an output "
                         "directory beside it (the default is <run>-tp<T>pp<P>dp<D>).")
    check_new_or_empty(output)
    check_output_directory(output, None, "converted run directory")


def check_new_or_empty(output: Path) -> None:
    """``output`` does not exist or is an empty directory: a conversion never writes over anything."""
    if output.is_dir() and not output.is_symlink() and any(output.iterdir()):
        raise UserError(f"{output} exists and is not empty, and a conversion never writes over a directory; "
                         "move it away, or pass another --out.")


def source_run_config(load: str, run: Path, ds_config: str | None, tp: int, pp: int, zero_stage: int | None,
                      output: Path) -> RunConfig:
    """The source run's settings (its ``config.json``, or ``ds_config``) at tp x pp, saving to and loading from
    ``output``, read through the pretraining parser as a resumed run would read them."""
    from zoo.config.loading import load_run_config
    from zoo.config.run_config import build_parser

    path = Path(ds_config) if ds_config else run / "config.json"
    if not path.is_file():
        raise MissingInput(f"{path} does not exist, and the conversion builds the run's engine from the "
                                f"settings the run kept there; pass --deepspeed_config with the run's ds_config.")
    argv = ["--deepspeed_config", str(path), "--tensor-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--save", str(output), "--load", str(output)]
    config = load_run_config(build_parser("reshard").parse_args(argv))
    if zero_stage is not None:
        zero = config.ds_config.setdefault("zero_optimization", {})
        zero["stage"] = zero_stage
    return config


def plan_conversion(load: str, tp: int, pp: int, dp: int | None, zero_stage: int | None, precision: str | None,
                    out: str | None, world_size: int, ds_config: str | None = None) -> Conversion:
    """Every check of a conversion that needs no process group, in the order a user would fix them; raises one
    sentence (UserError/MissingInput) and writes nothing."""
    check_latest_files(load)
    if not has_checkpoint(load):
        raise MissingInput(f"--load {load} holds no complete checkpoint; pass the run directory of a run that "
                                "saved one.")
    for name, value in (("--tensor-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--data-parallel-size", dp)):
        if value is not None and value < 1:
            raise UserError(f"{name} {value} must be at least 1; pass a positive degree.")
    dp = max(world_size // (tp * pp), 1) if dp is None else dp
    if world_size != tp * pp * dp:
        ranks = tp * pp * dp
        raise UserError(f"this job has {world_size} rank{'s' * (world_size != 1)} but the new layout tp={tp} x "
                         f"pp={pp} x dp={dp} needs {ranks}; launch it with {ranks} (deepspeed --num_gpus {ranks} "
                         "launch/reshard.py ...).")
    tag_dir, (source_tp, source_pp) = resume_tag_and_layout(load)
    first = check_layout_change(tag_dir, (source_tp, source_pp), tp, precision, zero_stage, f"--load {load}",
                                keep="drop --precision to convert it in {source}", zero_fix="pass --zero-stage 0, 1 or 2")
    check_tag_files(tag_dir)
    recorded = first.get("ds_config")
    source_precision = precision_of(recorded)
    run = run_directory_of(load)
    output = Path(out) if out else default_output(load, tp, pp, dp)
    check_output_beside_source(output, run)
    source_dp = first.get("data_parallel_size") or first.get("dp_world_size")
    if (source_tp, source_pp) == (tp, pp) and source_dp in (None, dp) and zero_stage in (None, zero_stage_of(recorded)):
        raise UserError(f"--load {load} is already at tp={tp} x pp={pp} x dp={dp}; resume it directly with --load, "
                         "or pass the layout to convert it to.")
    config = source_run_config(load, run, ds_config, tp, pp, zero_stage, output)
    return Conversion(load, tag_dir, (source_tp, source_pp, source_dp), (tp, pp, dp), source_precision, config,
                      output)


def convert_checkpoint(conversion: Conversion) -> dict[str, Any]:
    """Run the conversion on every rank of the new layout (collective; call :func:`plan_conversion` first).
    Returns the move's record (source and new layout, tag, iteration, seconds and peak bytes of this rank).
    A failure on any rank is raised on every rank, and the staging directory is removed."""
    import torch.distributed as dist

    from zoo.checkpoint.layout_change import load_at_new_layout
    from zoo.checkpoint.resume import check_rank_states
    from zoo.checkpoint.save import save_checkpoint
    from zoo.config.validation import validate_for_world
    from zoo.distributed import first_rank_result, raise_on_any_rank
    from zoo.training.checkpointer import Checkpointer
    from zoo.training.effective_settings import run_config_file
    from zoo.training.library_noise import library_noise_silenced
    from zoo.training.pretrain import build_engine
    from zoo.training.startup import join

    config, (tp, pp, _) = conversion.config, conversion.layout
    with library_noise_silenced():
        parallel = join(tp, config.seed, config.distributed_timeout_minutes, pp)
        gas = validate_for_world(config, dist.get_world_size())
        is_writer = dist.get_rank() == 0
        engine, model, model_config, _, ds_config, _ = build_engine(config, parallel, gas, is_writer=False)
        recorded_config = model_config.to_hf_dict() if parallel.pp_size > 1 else model.hf_config_dict()
        checkpointer = Checkpointer(engine, config, ds_config, parallel, recorded_config, is_writer)
        first_rank_result(lambda: check_rank_states(conversion.tag_dir, 0, recorded_config, conversion.load))
        client = load_at_new_layout(engine, conversion.tag_dir, conversion.source[:2], parallel, conversion.load)
        state = checkpointer.restore(client)
        payload = {**checkpointer.payload(state), "converted_from": client["resharded_from"]}
        staging = first_rank_result(lambda: make_staging(conversion.output) if is_writer else None)
        try:
            save_checkpoint(engine, Path(staging) / CHECKPOINT_SUBDIR, conversion.tag_dir.name, payload)
            settings = run_config_file(config, parallel.world_size, gas)
            raise_on_any_rank(lambda: publish(Path(staging), conversion.output, settings) if is_writer else None)
        finally:
            if is_writer and Path(staging).exists():
                shutil.rmtree(staging, ignore_errors=True)
    return {**client["resharded_from"], "tag": conversion.tag_dir.name, "iteration": state.iteration,
            "consumed_samples": state.consumed_samples, "writer": is_writer}


def make_staging(output: Path) -> str:
    """An empty directory beside ``output`` that becomes it once complete."""
    output.parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent)


def publish(staging: Path, output: Path, settings: dict[str, Any]) -> None:
    """The run's settings at the new layout into ``staging/config.json``, then ``staging`` renamed to ``output`` in
    one step (an existing ``output`` must still be an empty directory: rename replaces only that)."""
    write_text_atomic(staging / "config.json", json.dumps(settings, indent=2) + "\n")
    give_default_modes(staging)
    check_new_or_empty(output)
    os.replace(staging, output)
