"""A pretraining run's checkpoints: which iterations save, what a checkpoint holds, and resuming from one.

The client state of a checkpoint is built in one place (:meth:`Checkpointer.payload`) and read back by
the same object (:meth:`Checkpointer.restore`): the loop's position (:meth:`LoopState.state_dict`), every
random generator the run draws from (Python, NumPy, torch, the accelerator and DeepSpeed's TP RNG
tracker), and the run's identity (preset, model config, tp, seed, split, sequence length, LR schedule),
which resuming checks and warns about. Writing goes through :func:`zoo.checkpoint.save.save_checkpoint`
(a tag counts only once every rank finished it); reading through
:func:`zoo.checkpoint.resume.checkpoint_to_load` (located and checked on every rank) and DeepSpeed's loader under
the weights-only unpickler at the checkpoint's own layout; at any other layout, the run's ranks move it into the
engine (:mod:`zoo.checkpoint.layout_change`), and the resume line says what the move did.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zoo.checkpoint.files import CHECKPOINT_SUBDIR, model_states_path, read_model_states
from zoo.checkpoint.layout_change import (
    check_precision,
    engine_optimizer_files,
    engine_precision,
    load_at_new_layout,
    move_line,
    needs_layout_change,
    param_names_by_group,
)
from zoo.checkpoint.resume import (
    check_latest_files,
    check_rank_states,
    checkpoint_to_load,
    has_checkpoint,
    resume_tag_and_layout,
)
from zoo.checkpoint.safe_load import weights_only_loads
from zoo.checkpoint.save import save_checkpoint
from zoo.checkpoint.training_state import precision_of, zero_stage_of
from zoo.checkpoint.zero_reshard import partition_files
from zoo.config.deepspeed_dict import lr_schedule, schedule_change_warning
from zoo.config.run_config import RunConfig
from zoo.distributed import first_rank_result, raise_on_any_rank
from zoo.errors import MissingInput
from zoo.parallel.random import model_parallel_seed, seed_after_layout_change
from zoo.training.loop import LoopState

__all__ = ["Checkpointer", "resumed_line", "rng_state", "set_rng_state"]


def layout_name(tp: int, pp: int, dp: int | None, cp: int = 1) -> str:
    context = f"×cp{cp}" if cp > 1 else ""
    return f"tp{tp}{context}×pp{pp}×dp{'?' if dp is None else dp}"


def resumed_line(tag: str, state: LoopState, source: tuple[int, ...], layout: tuple[int, ...],
                 moved: dict[str, Any] | None = None) -> str:
    """``resumed from iter_0000020 (iteration 20, 160 samples consumed) at tp2×pp1×dp1``, with the layout the
    checkpoint was written at first (``tp1×pp2×dp1 → tp2×pp1×dp1``) when it differs, and, after a move
    (``moved``: the record of :func:`zoo.checkpoint.layout_change.load_at_new_layout`), its precision, seconds, peak
    bytes held per rank (the largest, and which rank) and reads (:func:`zoo.checkpoint.layout_change.move_line`).
    A checkpoint that does not record its dp shows ``dp?``. The layouts are (tp, pp, dp) or (tp, pp, dp, cp); a
    context-parallel size above 1 on either side shows as ``×cp2``."""
    now = layout_name(*layout)
    changed = (source[:2] != layout[:2] or source[2] not in (None, layout[2]) or source[3:] != layout[3:]
               or moved is not None)
    where = f"{layout_name(*source)} → {now}" if changed else now
    line = f"resumed from {tag} (iteration {state.iteration}, {state.consumed_samples} samples consumed) at {where}"
    return line if moved is None else f"{line}: {move_line(moved)}"


def rng_state() -> dict[str, Any]:
    """Every generator a training step draws from, as a checkpoint keeps it."""
    import deepspeed  # local: DeepSpeed costs seconds to import

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "accelerator": deepspeed.accelerator.get_accelerator().get_rng_state(),
            "tracker": deepspeed.checkpointing.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Put every generator back where :func:`rng_state` found it."""
    import deepspeed  # local: DeepSpeed costs seconds to import

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    deepspeed.accelerator.get_accelerator().set_rng_state(state["accelerator"])
    deepspeed.checkpointing.get_cuda_rng_tracker().set_states(state["tracker"])


class Checkpointer:
    """Saves and resumes the DeepSpeed ``engine`` of a pretraining run (collective: every rank).

    Saves go to ``<--save>/checkpoints/iter_NNNNNNN`` every ``--save-interval`` iterations, at the last
    iteration, and at an early stop (the loop decides that one). ``model_config`` is the model's
    ``hf_config_dict()``: recorded with each save and required of the checkpoint a run resumes from.
    """

    def __init__(self, engine, config: RunConfig, ds_config: dict[str, Any], parallel, model_config: dict[str, Any],
                 is_writer: bool):
        self.engine, self.config, self.ds_config, self.parallel = engine, config, ds_config, parallel
        self.model_config, self.is_writer = model_config, is_writer
        self.directory = Path(config.save) / CHECKPOINT_SUBDIR

    # saving ---------------------------------------------------------------------------------------
    def is_save_step(self, iteration: int) -> bool:
        interval = self.config.save_interval
        return bool(interval) and iteration % interval == 0 or iteration == self.config.train_iters

    def tag_directory(self, iteration: int) -> Path:
        return self.directory / f"iter_{iteration:07d}"

    def save(self, state: LoopState) -> None:
        save_checkpoint(self.engine, self.directory, self.tag_directory(state.iteration).name, self.payload(state))

    def payload(self, state: LoopState) -> dict[str, Any]:
        """The checkpoint's client state (:meth:`restore` reads it back)."""
        config = self.config
        return {**state.state_dict(), "rng": rng_state(), "zoo_model": config.model,
                "model_config": self.model_config, "tensor_parallel_size": self.parallel.tp_size,
                "pipeline_model_parallel_size": self.parallel.pp_size, "data_parallel_size": self.parallel.dp_size,
                "context_parallel_size": self.parallel.cp_size,
                # DeepSpeed's stage bounds over the layer sequence: a run at another layout reads only the stages
                # that held its parameters (zoo.checkpoint.layout_change.SourceCheckpoint)
                "pipeline_parts": [int(bound) for bound in getattr(self.engine.module, "parts", None) or []] or None,
                "param_names": param_names_by_group(self.engine.module),   # the optimizer state's order, by name
                "seed": config.seed, "split": config.split, "seq_length": config.seq_length,
                "lr_schedule": lr_schedule(self.ds_config)}

    # resuming -------------------------------------------------------------------------------------
    def resume(self) -> LoopState:
        """The loop state to start from: ``--load``'s checkpoint, or a fresh start, said in one line when
        ``--load`` names a run without a complete checkpoint yet (so a job script can always pass
        ``--save X --load X``). A resume says in one line on the writer what it resumed (:func:`resumed_line`)."""
        load = self.config.load
        if not load:
            return LoopState()
        first_rank_result(lambda: check_latest_files(load))   # a finished checkpoint missing a file: refused
        if not has_checkpoint(load):
            if self.is_writer:
                print(f"--load {load}: no checkpoint yet, starting from iteration 0", flush=True)
            return LoopState()
        located = first_rank_result(lambda: resume_tag_and_layout(load))
        client = self.load(load, located)
        tag_dir, (source_tp, source_pp) = located
        state = self.restore(client)
        if self.is_writer:
            moved = client.get("resharded_from")
            source_dp = (moved or {}).get("data_parallel_size") or client.get("data_parallel_size") or client.get(
                "dp_world_size") or getattr(self.engine, "loaded_checkpoint_dp_world_size", None)
            source_cp = client.get("context_parallel_size", 1)
            print(resumed_line(tag_dir.name, state, (source_tp, source_pp, source_dp, source_cp),
                               (self.parallel.tp_size, self.parallel.pp_size, self.parallel.dp_size,
                                self.parallel.cp_size), moved), flush=True)
        return state

    def restore(self, client: dict[str, Any]) -> LoopState:
        """The loop state of a :meth:`payload`, with every generator restored (after a layout change, the
        default and TP streams seeded afresh for this rank's stage and TP rank, as at the start of a run:
        :func:`zoo.parallel.random.seed_after_layout_change`), and a changed LR schedule warned about on the
        writer."""
        state = LoopState()
        state.load_state_dict(client)
        set_rng_state(client["rng"])
        if "resharded_from" in client:   # no stream of the checkpoint belongs to this rank's new place
            model_parallel_seed(seed_after_layout_change(client.get("seed", self.config.seed), state.iteration),
                                self.parallel)
        change = schedule_change_warning(client.get("lr_schedule"), lr_schedule(self.ds_config), state.iteration)
        if self.is_writer and "lr_schedule" in client and change:
            print(f"warning: {change}", file=sys.stderr)
        return state

    def load(self, load: str, located: tuple[Path, tuple[int, int]] | None = None) -> dict[str, Any]:
        """Load the engine from ``--load``: the checkpoint is located and checked (readable, same model, same
        precision; by the first rank where every rank would read the same files), then loaded; its client state
        is returned. A failure on any rank is raised on all. A checkpoint written at another layout (tp, pp, a
        ZeRO/BF16 partitioning over another dp, another ZeRO stage) is moved into the engine by every rank
        (:mod:`zoo.checkpoint.layout_change`); at its own layout DeepSpeed loads it. ``located``: the (tag
        directory, (tp, pp)) already found."""
        # one rank looks through the tags and reads the first rank's states; every rank gets what it found
        tag_dir, source = located or first_rank_result(lambda: resume_tag_and_layout(load))
        engine = self.engine

        def check_first_rank() -> bool:
            check_rank_states(tag_dir, 0, self.model_config, load)
            states = read_model_states(model_states_path(tag_dir, 0))
            check_precision(precision_of(states.get("ds_config")), engine_precision(engine), f"--load {load}")
            return needs_layout_change(source, self.parallel, partition_files(tag_dir), engine_optimizer_files(engine),
                                       zero_stage_of(states.get("ds_config")))

        if first_rank_result(check_first_rank):
            return load_at_new_layout(engine, tag_dir, source, self.parallel, load)
        load_dir, tag = checkpoint_to_load(load, self.parallel, self.model_config)

        def load_here() -> dict[str, Any]:
            with weights_only_loads(engine):   # DeepSpeed's own reads use the weights-only unpickler too
                _, client = engine.load_checkpoint(str(load_dir), tag=tag)
            if client is None:
                raise MissingInput(f"the checkpoint under {load} could not be loaded; check its 'latest' tag "
                                        "file and its mp_rank_XX_model_states.pt files.")
            return client

        return raise_on_any_rank(load_here)
