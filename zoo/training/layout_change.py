"""Resuming a GPT-2 checkpoint at another (tp, pp) layout where either side has pipeline stages: P -> 1,
1 -> P, P -> P' and any tp change with them (a one-stage checkpoint at another tp goes through the file
resharder, :mod:`zoo.checkpoint.reshard`).

Every parameter is named by its ``GPT2LMHeadModel`` name on both sides (a stage module through
:func:`zoo.models.gpt2_pipeline.hf_names`), and its split by its layer's partition spec, so the move is:
for each parameter this rank holds, merge the checkpoint's TP shards of that name (from the stage that
held it), re-pad the vocabulary for this tp and keep this rank's slice; the same for the Adam moments
(``exp_avg``, ``exp_avg_sq``, shaped like the parameter), and the step count. The LR schedule, DeepSpeed's
step counters and zoo's client state come from the checkpoint's first rank. Each rank reads only the
files that hold the names it holds (:class:`SourceCheckpoint`), memory-mapped.

It supports what the optimizer files of an fp32 run without ZeRO hold (the torch optimizer's state per
parameter in ``mp_rank_XX_model_states.pt``); other checkpoints are refused in one sentence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint.files import model_states_path, read_model_states
from zoo.checkpoint.safe_load import check_tag_files
from zoo.distributed import raise_on_any_rank
from zoo.parallel.partition import partition_specs

__all__ = ["needs_layout_change", "load_at_new_layout", "param_names_by_group", "one_stage_names"]

MOMENTS = ("exp_avg", "exp_avg_sq")


def needs_layout_change(source: tuple[int, int], ps) -> bool:
    """Whether a checkpoint of (tp, pp) ``source`` is resumed through this module by a run at ``ps``."""
    return source != (ps.tp_size, ps.pp_size) and (source[1] > 1 or ps.pp_size > 1)


def one_stage_names(module) -> dict[str, str]:
    """Each parameter of the run's module -> its ``GPT2LMHeadModel`` name (a stage's mapping, or the identity)."""
    from zoo.models.gpt2_pipeline import hf_names

    if hasattr(module, "zoo_config"):
        return hf_names(module)
    return {name: name for name, _ in module.named_parameters()}


def param_names_by_group(module) -> list[list[str]]:
    """The optimizer's parameters as ``GPT2LMHeadModel`` names, in its group order
    (:func:`zoo.models.families.param_groups`: matrices, then biases and norms)."""
    from zoo.models.families import param_groups

    names = one_stage_names(module)
    by_id = {id(p): names[n] for n, p in module.named_parameters()}
    return [[by_id[id(p)] for p in group["params"]] for group in param_groups(module, 0.0)]


def entry_of(name: str, n_layer: int) -> int:
    """The index, in the pipeline's layer sequence (:mod:`zoo.models.gpt2_pipeline`: wte, wpe, the layers,
    ln_f, the tied head), of the entry that holds ``GPT2LMHeadModel`` parameter ``name``."""
    parts = name.split(".")
    if parts[:2] == ["transformer", "h"]:
        return int(parts[2]) + 2
    fixed = {"wte": 0, "wpe": 1, "ln_f": n_layer + 2}
    if parts[0] == "transformer" and parts[1] in fixed:
        return fixed[parts[1]]
    raise ValueError(f"{name} is not a parameter of zoo's GPT-2 pipeline stages; only GPT-2 checkpoints move to "
                     "another pipeline layout.")


def stage_of_entry(entry: int, parts: list[int]) -> int:
    """The source stage that held layer-sequence ``entry``, from DeepSpeed's stage bounds ``parts``."""
    return next(stage for stage in range(len(parts) - 1) if parts[stage] <= entry < parts[stage + 1])


def recorded_parts(first: dict[str, Any], pp: int) -> list[int] | None:
    """The source's stage bounds as its checkpoint recorded them (``pipeline_parts``), or None when it did not
    (an older zoo): then every stage's file is read."""
    parts = first.get("pipeline_parts")
    if isinstance(parts, list) and len(parts) == pp + 1 and all(isinstance(p, int) for p in parts):
        return parts
    return None


class SourceCheckpoint:
    """The tensors a rank needs of a (tp, pp) checkpoint, by ``GPT2LMHeadModel`` name: weights and Adam
    moments per TP rank of the names in ``wanted`` (this rank's parameters at the new layout), read from the
    first stage that holds the name.

    A rank reads the first rank's file (its client state) and, for each of the source's TP ranks, only the
    files that hold a wanted name: with stages, the layer files of the entries those names live in and the
    model-states files of the stages that held them (from the recorded stage bounds, ``pipeline_parts``);
    without stages, each TP rank's model-states file. In a 4-rank tp2 x pp2 -> tp1 x pp4 move of 4 layers that
    is 4 to 9 of the tag's 18 files a rank, where every rank read all of them (tests/test_pipeline_training.py;
    docs/design-notes.md states the 20B config's figures)."""

    def __init__(self, tag_dir: Path, tp: int, pp: int, wanted: set[str]):
        from zoo.checkpoint.pipeline_files import pipeline_module_states

        self.tag_dir, self.tp, self.pp = tag_dir, tp, pp
        self.first = read_model_states(model_states_path(tag_dir, 0))
        n_layer = self.first["model_config"]["n_layer"]
        self.weights: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        self.moments: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(tp)]
        self.step: Any = None
        entries = sorted({entry_of(name, n_layer) for name in wanted}) if pp > 1 else []
        if pp > 1:
            self.weights = [pipeline_module_states(tag_dir, tp_rank, n_layer, entries) for tp_rank in range(tp)]
        parts = recorded_parts(self.first, pp)
        stages = range(pp) if parts is None else sorted({stage_of_entry(entry, parts) for entry in entries} or {0})
        for stage in stages:
            for tp_rank in range(tp):
                path = model_states_path(tag_dir, stage * tp + tp_rank)
                states = self.first if stage * tp + tp_rank == 0 else read_model_states(path)
                if pp == 1:
                    self.weights[tp_rank] = states["module"]
                self.add_moments(states, tp_rank, path)

    def add_moments(self, states: dict[str, Any], tp_rank: int, path: Path) -> None:
        optimizer = states.get("optimizer")
        names = states.get("param_names")
        if names is None and self.pp == 1:
            names = one_stage_param_names(states["model_config"], self.tp)
        if not (isinstance(optimizer, dict) and "state" in optimizer and isinstance(names, list)):
            raise ValueError(f"{path} holds no per-parameter optimizer state that zoo can move to another layout "
                             "(it moves fp32 checkpoints without ZeRO); resume it at the tp and pp it was written "
                             "with, or export it (launch/export.py) and start the new layout with --pretrained.")
        indices = [index for group in optimizer["param_groups"] for index in group["params"]]
        flat_names = [name for group in names for name in group]
        for index, name in zip(indices, flat_names):
            state = optimizer["state"].get(index)
            if state is None or name in self.moments[tp_rank]:
                continue
            self.moments[tp_rank][name] = {key: state[key] for key in MOMENTS}
            self.step = state["step"]

    def master(self, name: str, spec, key: str | None = None) -> torch.Tensor:
        """The merged (padded for the source tp) tensor of ``name``: the weight, or Adam moment ``key``."""
        shards = [self.weights[r][name] if key is None else self.moments[r][name][key] for r in range(self.tp)]
        return spec.merge(shards)


def one_stage_param_names(model_config: dict[str, Any], tp: int) -> list[list[str]]:
    """The optimizer's parameter names of a one-stage GPT-2 checkpoint that did not record them (its model
    built on the meta device)."""
    from zoo.checkpoint.layout import checked_layout_model, config_from_dict

    path = Path("<checkpoint>")
    layout = checked_layout_model(config_from_dict(model_config, path), tp, path)
    return param_names_by_group(layout)


def local_slice(master: torch.Tensor, spec, param: torch.Tensor, ps) -> torch.Tensor:
    """This rank's slice of a merged tensor shaped like ``param``, the vocabulary re-padded for this tp."""
    if spec.vocab_rows is not None:
        master = spec.repad(master, param.shape[0] * ps.tp_size)
    return spec.shard(master, ps.tp_rank, ps.tp_size).to(param.device, param.dtype)


@torch.no_grad()
def load_at_new_layout(engine, tag_dir: Path, source: tuple[int, int], ps, load: str) -> dict[str, Any]:
    """Fill the engine's module and optimizer state from a checkpoint written at (tp, pp) ``source``; returns its
    client state (marked ``resharded_from``). Collective: every rank reads the files of its own names; a
    failure anywhere is raised on every rank."""
    raise_on_any_rank(lambda: check_tag_files(tag_dir, ps.rank, ps.world_size))
    if engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled():
        raise ValueError(f"--load {load} was written at tp={source[0]} x pp={source[1]}, and zoo moves checkpoints "
                         "to another pipeline layout for fp32 runs without ZeRO only; resume it at its own layout, "
                         "or export it (launch/export.py) and start the new layout with --pretrained.")
    names = one_stage_names(engine.module)
    source_files = raise_on_any_rank(lambda: SourceCheckpoint(tag_dir, *source, wanted=set(names.values())))

    def fill() -> None:
        module, optimizer = engine.module, engine.optimizer
        specs = partition_specs(module)
        for local_name, param in module.named_parameters():
            name, spec = names[local_name], specs[local_name]
            param.copy_(local_slice(source_files.master(name, spec), spec, param, ps))
            state = optimizer.state[param]
            for key in MOMENTS:
                state[key] = local_slice(source_files.master(name, spec, key), spec, param, ps).clone()
            state["step"] = source_files.step.clone() if torch.is_tensor(source_files.step) else source_files.step

    raise_on_any_rank(fill)
    first = source_files.first
    # The schedule-driven values of each group (the lr; betas under a cycle schedule) are the checkpoint's:
    # the scheduler sets them only at its next step, after this iteration's update.
    for group, saved in zip(engine.optimizer.param_groups, first["optimizer"]["param_groups"]):
        group.update({key: saved[key] for key in ("lr", "betas") if key in saved})
    if engine.lr_scheduler is not None and first.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(first["lr_scheduler"])
    engine.global_steps, engine.global_samples = first["global_steps"], first["global_samples"]
    engine.skipped_steps = first.get("skipped_steps", 0)
    client = {key: value for key, value in first.items() if key not in ("module", "optimizer")}
    client["resharded_from"] = {"tensor_parallel_size": source[0], "pipeline_model_parallel_size": source[1]}
    return client
