"""The training state of a zoo checkpoint by global parameter name, whatever layout and precision wrote it.

Every checkpoint zoo writes holds, for each parameter of the family's one-stage model (``GPT2LMHeadModel``,
``LlamaForCausalLM``, ...: named as :func:`zoo.parallel.partition.partition_specs` and the recorded
``param_names`` name it) and each of the
source's TP ranks: an fp32 master, Adam's ``exp_avg`` and ``exp_avg_sq`` shaped like the rank's shard, and
Adam's step. Where DeepSpeed keeps them depends on the precision and the optimizer, and this module reads
each of those layouts as that one form:

* fp32 without ZeRO: the torch optimizer's state per parameter in ``mp_rank_XX_model_states.pt``; the master
  is the weight itself (the module, or with pipeline stages the ``layer_XX-model_YY`` file of its entry);
* fp16 without ZeRO: FP16_UnfusedOptimizer (``fp32_groups``, per-parameter masters) or FP16_Optimizer
  (``fp32_groups_flat``, one flat master and one flat Adam state per group), in the same file
  (:func:`zoo.checkpoint.reshard.optimizer_state_by_name`);
* ZeRO-1/2 and DeepSpeed's BF16_Optimizer (bf16, with or without ZeRO-1): the masters and moments in
  ``[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt``, each group flat and cut into dp slices
  (:class:`zoo.checkpoint.zero_reshard.PartitionedState`).

A model-parallel rank XX is stage ``XX // tp`` and TP rank ``XX % tp``. Besides the per-parameter state the
checkpoint carries the loss scaler (fp16), the LR schedule, DeepSpeed's counters and zoo's client state,
all read from the first rank's file. Nothing is read before it is asked for: the files are memory-mapped,
and a reader built for the names one rank holds opens only the files that hold them (with stages: the
stages that held those names, from the recorded ``pipeline_parts``), so a rank holds its own share and
the tensor it is working on; a rank that keeps only a range of a parameter's elements (a ZeRO/BF16 partition)
reads only the rows of that range (:meth:`CheckpointTrainingState.fragment`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint.files import model_states_path, read_model_states
from zoo.checkpoint.reshard import optimizer_state_by_name
from zoo.checkpoint.zero_reshard import PartitionedState, partition_files
from zoo.errors import UserError

__all__ = ["CheckpointTrainingState", "LOSS_SCALER_KEYS", "MOMENTS", "ReadAccount", "one_stage_names",
           "param_names_by_group", "precision_of", "stage_of_entry", "recorded_parts", "pipeline_stages_of"]

MOMENTS = ("exp_avg", "exp_avg_sq")
# The dynamic loss scaler of DeepSpeed's fp16 optimizers as their state dicts hold it.
LOSS_SCALER_KEYS = ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor",
                    "scale_window")


# --------------------------------------------------------------------------- what a reader took
@dataclass
class ReadAccount:
    """What one rank's reader took from a checkpoint.

    ``files``: the paths it opened (memory-mapped, :func:`zoo.checkpoint.safe_load.safe_torch_load`).
    ``bytes_read``: bytes of the source tensors it handed out, each time it handed one out (the byte ranges of
    the files the reader's caller touched). ``held`` / ``peak``: bytes of tensors materialised in this
    process's memory for the move (copies out of the files, merged tensors, this rank's slices) that are alive
    at once, now and at most. Not counted: the file mappings themselves (their pages are the page cache's,
    which the OS may drop and read again), the unpickled non-tensor parts of the files (counters, config,
    a few kB), and the state the run's engine holds anyway (its weights and optimizer state, which the move
    fills in place)."""

    files: set[str] = field(default_factory=set)
    bytes_read: int = 0
    held: int = 0
    peak: int = 0

    def opened(self, path: Path) -> None:
        self.files.add(str(path))

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.nbytes
        return tensor

    def hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        self.held -= nbytes


# --------------------------------------------------------------------------- names
def one_stage_names(module) -> dict[str, str]:
    """Each parameter of a run's module -> its one-stage model's name (a pipeline stage's mapping, which its
    family's ``PipelineStages.one_stage_names`` gives, or the identity)."""
    from zoo.models.families import family_of

    if hasattr(module, "zoo_config"):
        return family_of(module.zoo_config).pipeline.one_stage_names(module)
    return {name: name for name, _ in module.named_parameters()}


def param_names_by_group(module) -> list[list[str]]:
    """The optimizer's parameters as the one-stage model's names, in its group order
    (:func:`zoo.models.families.param_groups`: matrices, then biases and norms)."""
    from zoo.models.families import param_groups

    names = one_stage_names(module)
    by_id = {id(p): names[n] for n, p in module.named_parameters()}
    return [[by_id[id(p)] for p in group["params"]] for group in param_groups(module, 0.0)]


def one_stage_param_names(model_config: dict[str, Any], tp: int) -> list[list[str]]:
    """The optimizer's parameter names of a one-stage checkpoint that did not record them (its model built on
    the meta device)."""
    from zoo.checkpoint.layout import checked_layout_model, config_from_dict

    path = Path("<checkpoint>")
    return param_names_by_group(checked_layout_model(config_from_dict(model_config, path), tp, path))


def local_shapes(model_config: dict[str, Any], tp: int, path: Path) -> dict[str, torch.Size]:
    """Every parameter's shape on one TP rank of tp = ``tp``, by the one-stage model's name (meta device)."""
    from zoo.checkpoint.layout import checked_layout_model, config_from_dict

    layout = checked_layout_model(config_from_dict(model_config, path), tp, path)
    return {name: param.shape for name, param in layout.named_parameters()}


def pipeline_stages_of(model_config: dict[str, Any], path: Path):
    """(The :class:`zoo.models.families.PipelineStages` of the family whose model ``model_config`` records, its
    layer count): the family names the layer-sequence entry that holds each one-stage name (``entry_of``)
    and the one-stage name of each layer file's key (``entry_name``), so reading stages asks no model type."""
    from zoo.checkpoint.layout import config_from_dict
    from zoo.models.families import family_of, shape_of

    config = config_from_dict(model_config, path)
    family = family_of(config)
    if family.pipeline is None:
        raise UserError(f"{path} records pipeline stages of a {family.display_name} model, which zoo does not "
                         "build as pipeline stages; it was not written by zoo: resume it where it was written.")
    return family.pipeline, shape_of(config).layers


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


# --------------------------------------------------------------------------- precision and ZeRO stage
def precision_of(ds_config: Any) -> str:
    """"bf16", "fp16" or "fp32": what a DeepSpeed config (as a checkpoint records it) trains in."""
    config = ds_config if isinstance(ds_config, dict) else {}
    for precision in ("bf16", "fp16"):
        block = config.get(precision)
        if isinstance(block, dict) and block.get("enabled"):
            return precision
    return "fp32"


def zero_stage_of(ds_config: Any) -> int:
    config = ds_config if isinstance(ds_config, dict) else {}
    zero = config.get("zero_optimization")
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


# --------------------------------------------------------------------------- one source rank
class ModelStatesOptimizer:
    """A non-ZeRO rank's optimizer state (fp32 torch, FP16_UnfusedOptimizer, FP16_Optimizer) by name; the fp32
    master is the optimizer's, or for fp32 runs the weight (``weights``, looked up only then)."""

    def __init__(self, states: dict[str, Any], groups: list[list[str]], shapes: dict[str, torch.Size], path: Path,
                 weights):
        optimizer = states.get("optimizer")
        if not isinstance(optimizer, dict):
            raise UserError(f"{path} holds no optimizer state; resume it at the tp and pp it was written with, or "
                             "export it (launch/export.py) and start the new layout with --pretrained.")
        self.state, self.masters = optimizer_state_by_name(optimizer, groups, shapes, path)
        self.weights, self.path = weights, path
        inner = optimizer.get("optimizer_state_dict", optimizer)
        self.group_of = {name: g for g, group in enumerate(groups) for name in group}
        self.group_steps = [group.get("step") for group in inner.get("param_groups", [])]

    def tensor(self, name: str, key: str, rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, int]:
        """(``key`` of ``name``, or its indices ``rows`` = [first, stop) of dimension 0: a view of the
        memory-mapped file, 0 bytes copied)."""
        if key != "master":
            tensor = self.state[name][key]
        else:
            tensor = self.masters[name] if self.masters is not None else self.weights()[name]
        return (tensor if rows is None else tensor.narrow(0, rows[0], rows[1] - rows[0])), 0

    def step(self, name: str) -> Any:
        step = self.state[name].get("step")
        return step if step is not None else self.group_steps[self.group_of[name]]


# --------------------------------------------------------------------------- the whole tag
class CheckpointTrainingState:
    """The layout-free training state of the checkpoint in ``tag_dir``, written at (``tp``, ``pp``), for the
    one-stage model's names in ``wanted``: :meth:`master` merges a name's TP shards of its fp32 master or of
    an Adam moment; :meth:`step`, :attr:`first` (the first rank's states: client state, LR schedule,
    counters), :meth:`loss_scaler` and :attr:`precision` give the rest.

    A reader opens the first rank's model-states file and, for each source TP rank, only the files that hold
    a wanted name: with stages, the model-states (and partition) files of the stages that held them (from the
    recorded stage bounds, ``pipeline_parts``) and, for fp32 runs without ZeRO (whose masters are the
    weights), the layer files of their entries; without stages, each TP rank's files. In a 4-rank tp2 x pp2 ->
    tp1 x pp4 move of 4 layers that is 4 to 9 of the tag's 18 files a rank (tests/test_pipeline_training.py;
    docs/design-notes.md states the 20B config's figures)."""

    def __init__(self, tag_dir: Path, tp: int, pp: int, wanted: set[str]):
        self.tag_dir, self.tp, self.pp = Path(tag_dir), tp, pp
        self.account = ReadAccount()
        first_path = model_states_path(self.tag_dir, 0)
        self.first = self.read_states(first_path)
        ds_config = self.first.get("ds_config")
        self.precision = precision_of(ds_config)
        self.zero_stage = zero_stage_of(ds_config)
        if self.zero_stage >= 3:
            raise UserError(f"{first_path} was written with ZeRO stage 3, whose partitioned parameters zoo does "
                             "not move to another layout; resume it at its own layout, or export it "
                             "(launch/export.py) and start the new layout with --pretrained.")
        model_config = self.first["model_config"]
        shapes = self.shapes = local_shapes(model_config, tp, first_path)
        self.partitions = partition_files(self.tag_dir)
        self.stages, n_layer = pipeline_stages_of(model_config, first_path) if pp > 1 else (None, 0)
        entries = sorted({self.stages.entry_of(name, n_layer) for name in wanted}) if pp > 1 else []
        parts = recorded_parts(self.first, pp)
        stages = [0] if pp == 1 else (
            range(pp) if parts is None else sorted({stage_of_entry(entry, parts) for entry in entries} or {0}))
        self.owner: list[dict[str, Any]] = [{} for _ in range(tp)]
        for stage in stages:
            for tp_rank in range(tp):
                rank = stage * tp + tp_rank
                path = model_states_path(self.tag_dir, rank)
                states = self.first if rank == 0 else self.read_states(path)
                groups = states.get("param_names")
                if groups is None and pp == 1:
                    groups = one_stage_param_names(model_config, tp)
                if not isinstance(groups, list):
                    raise UserError(f"{path} does not record its optimizer's parameter names (param_names); it was "
                                     "written by an older zoo: resume it at its own layout, or export it "
                                     "(launch/export.py) and start the new layout with --pretrained.")
                source = self.rank_source(states, groups, shapes, path, tp_rank, n_layer, entries)
                for name in (name for group in groups for name in group):
                    if name in wanted:
                        self.owner[tp_rank].setdefault(name, source)

    def read_states(self, path: Path) -> dict[str, Any]:
        self.account.opened(path)
        return read_model_states(path)

    def rank_source(self, states, groups, shapes, path, tp_rank, n_layer, entries):
        """The per-name reader of one source rank's optimizer state."""
        if self.partitions is not None:
            mp_rank = int(path.name.split("_")[2])
            paths = [self.partitions.path(self.tag_dir, d, mp_rank) for d in range(self.partitions.dp_size)]
            return PartitionedState(paths, [[(name, shapes[name]) for name in group] for group in groups],
                                    self.account.opened)
        cache: dict[str, torch.Tensor] = {}

        def weights() -> dict[str, torch.Tensor]:
            from zoo.checkpoint.pipeline_files import layer_path, pipeline_module_states

            if not cache:
                if self.pp > 1:
                    for entry in entries:
                        self.account.opened(layer_path(self.tag_dir, entry, tp_rank))
                cache.update(states["module"] if self.pp == 1 else
                             pipeline_module_states(self.tag_dir, tp_rank, n_layer, entries,
                                                    entry_name=self.stages.entry_name))
            return cache

        return ModelStatesOptimizer(states, groups, shapes, path, weights)

    @property
    def dp_size(self) -> int:
        return self.partitions.dp_size if self.partitions is not None else int(self.first.get("dp_world_size", 1))

    @contextmanager
    def merged(self, name: str, spec, key: str = "master") -> Iterator[torch.Tensor]:
        """The merged (padded for the source tp) fp32 ``key`` of ``name`` ("master", "exp_avg" or "exp_avg_sq"),
        held (counted in :attr:`account`) until the block ends; the caller keeps no view of it past the block.

        The source's TP shards are views of the mapped files, except a shard that straddles two ZeRO/BF16
        partitions (copied out of both); the shards copied are held while they are merged, so the most this
        holds at once is the merged tensor and, for a straddling name, its copied shards (together at most one
        more merged tensor). A name the source did not split is its rank-0 tensor: a view, nothing held."""
        shards, copied = [], 0
        for tp_rank in range(self.tp if spec.is_sharded else 1):
            shard, copy = self.owner[tp_rank][name].tensor(name, key)
            shards.append(self.account.read(shard))
            copied += copy
            self.account.hold(copy)
        merged = spec.merge(shards)
        made = merged.nbytes if spec.is_sharded else 0
        self.account.hold(made)
        del shards
        self.account.release(copied)
        try:
            yield merged
        finally:
            del merged
            self.account.release(made)

    def local(self, name: str, spec, key: str, shape: torch.Size, tp_rank: int, tp_size: int,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
        """(TP rank ``tp_rank`` of ``tp_size``'s fp32 slice of ``key`` of ``name``, shaped ``shape`` and in storage of
        its own; the bytes of the merged tensor it is a slice of), copied straight out of the source's TP shards:
        each source shard gives only the ranges of the slice it holds (per block of a strided dimension, the
        fused [q | k | v]), the vocabulary rows are the real ones and the padding of the new tp zeros. The merged
        tensor is never built: this holds the slice and, where a shard straddles two ZeRO/BF16 partitions, that
        shard's copy while it is read (:attr:`account`: the slice stays held until the caller releases it), and
        reads the bytes it copies (a straddling shard whole)."""
        out = torch.zeros(shape, dtype=torch.float32, device=device)
        self.account.hold(out.nbytes)
        ranks = range(self.tp) if spec.is_sharded else range(1)
        merged_bytes = 0
        for source_rank in ranks:
            shard, copied = self.owner[source_rank][name].tensor(name, key)
            self.account.hold(copied)
            merged_bytes += shard.numel() * 4
            read = self.copy_ranges(shard, out, spec, source_rank, tp_rank, tp_size) if spec.is_sharded else \
                out.copy_(shard).nbytes
            self.account.bytes_read += copied or read
            del shard
            self.account.release(copied)
        return out, merged_bytes

    def fragment(self, name: str, spec, key: str, shape: torch.Size, tp_rank: int, tp_size: int, start: int,
                 numel: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
        """(Elements [``start``, ``start + numel``) of the flattened TP slice that :meth:`local` gives, the bytes
        held for them): what one ZeRO/BF16 partition of the new layout keeps of ``name``. Only the indices of
        dimension 0 that those elements touch are copied out of the source's shards (for a split dimension 0,
        only the source rows that map to them; for a split column, those rows of each source shard), so the
        bytes read and held are the fragment's plus at most two partial rows; a source shard that straddles
        two ZeRO/BF16 partitions is copied only over those rows. The returned fragment is a view of a window
        of those rows, held (:attr:`account`) until the caller releases the returned bytes."""
        row = shape.numel() // shape[0] if len(shape) else 1
        first, stop = start // row, -(-(start + numel) // row)
        window = torch.zeros((stop - first, *shape[1:]), dtype=torch.float32, device=device)
        self.account.hold(window.nbytes)
        for source_rank in range(self.tp) if spec.is_sharded else range(1):
            for rows, into in self.source_rows(spec, source_rank, tp_rank, tp_size, shape, first, stop, name):
                part, copied = self.owner[source_rank][name].tensor(name, key, rows)
                self.account.hold(copied)
                target = window.narrow(0, into, rows[1] - rows[0])
                read = self.copy_ranges(part, target, spec, source_rank, tp_rank, tp_size) \
                    if spec.is_sharded and spec.dim != 0 else target.copy_(part).nbytes
                self.account.bytes_read += copied or read
                del part
                self.account.release(copied)
        return window.reshape(-1).narrow(0, start - first * row, numel), window.nbytes

    def source_rows(self, spec, source_rank: int, tp_rank: int, tp_size: int, shape: torch.Size, first: int,
                    stop: int, name: str) -> list[tuple[tuple[int, int], int]]:
        """The pieces of source TP rank ``source_rank``'s shard of ``name`` that fill indices [``first``, ``stop``)
        of dimension 0 of new TP rank ``tp_rank``'s slice (shaped ``shape``): ((first, stop) of the shard's
        dimension 0, where the piece starts in the window). Dimension 0 unsplit (replicated, or a split column):
        the same indices of the shard, whose columns :meth:`copy_ranges` then picks. Dimension 0 split: per block
        of its stride, the merged indices both ranks cover (:meth:`copy_ranges`' coordinates), the
        vocabulary's padding rows left out (zeros in the window)."""
        if not spec.is_sharded or spec.dim != 0:
            return [((first, stop), 0)]
        stride = spec.stride
        piece = self.shapes[name][0] // stride          # rows of one block on one source rank
        new_piece = shape[0] // stride                  # rows of one block on one new rank
        pieces = []
        for block in range(stride):
            have = block * piece * self.tp + source_rank * piece
            want = block * new_piece * tp_size + tp_rank * new_piece
            local_lo, local_hi = max(first, block * new_piece), min(stop, (block + 1) * new_piece)
            lo = max(have, want + local_lo - block * new_piece)
            hi = min(have + piece, want + local_hi - block * new_piece)
            if spec.vocab_rows is not None:
                hi = min(hi, spec.vocab_rows)
            if lo < hi:
                pieces.append(((block * piece + lo - have, block * piece + hi - have),
                               block * new_piece + lo - want - first))
        return pieces

    def merged_bytes(self, name: str, spec) -> int:
        """Bytes of ``name``'s merged fp32 tensor at the source's padding."""
        return self.shapes[name].numel() * 4 * (self.tp if spec.is_sharded else 1)

    def copy_ranges(self, shard: torch.Tensor, out: torch.Tensor, spec, source_rank: int, tp_rank: int,
                    tp_size: int) -> int:
        """Copy into ``out`` (new TP rank ``tp_rank``'s slice) the ranges of source TP rank ``source_rank``'s
        ``shard`` that it needs; returns the bytes copied. Coordinates are the merged dimension's: with stride s it
        is s equal blocks, each split over the ranks (:func:`zoo.parallel.utils.shard_index`); the vocabulary's
        real rows keep their index at every tp and rows past them are padding (zeros in ``out``)."""
        dim, stride = spec.dim, spec.stride
        if spec.vocab_rows is not None and stride != 1:
            raise UserError(f"a vocabulary dimension split with stride {stride} is not a layout zoo writes.")
        piece = shard.shape[dim] // stride                  # rows of one block on one source rank
        new_piece = out.shape[dim] // stride                # rows of one block on one new rank
        real = spec.vocab_rows
        copied = 0
        for block in range(stride):
            have = block * piece * self.tp + source_rank * piece
            want = block * new_piece * tp_size + tp_rank * new_piece
            lo, hi = max(have, want), min(have + piece, want + new_piece)
            if real is not None:
                hi = min(hi, real)
            if lo >= hi:
                continue
            part = shard.narrow(dim, block * piece + lo - have, hi - lo)
            out.narrow(dim, block * new_piece + lo - want, hi - lo).copy_(part)
            copied += part.nbytes
        return copied

    def master(self, name: str, spec, key: str = "master") -> torch.Tensor:
        """The merged (padded for the source tp) fp32 ``key`` of ``name``, as a tensor of its own."""
        with self.merged(name, spec, key) as merged:
            return merged.clone() if not spec.is_sharded else merged

    def step(self, name: str) -> Any:
        return self.owner[0][name].step(name)

    def optimizer_groups(self) -> list[dict[str, Any]]:
        """The first rank's optimizer groups' hyper-parameters (lr, betas, ...), in group order."""
        if self.partitions is not None:
            optimizer = PartitionedState([self.partitions.path(self.tag_dir, 0, 0)], [],
                                         self.account.opened).partition(0)
            return optimizer["base_optimizer_state"]["param_groups"]
        optimizer = self.first["optimizer"]
        return optimizer.get("optimizer_state_dict", optimizer)["param_groups"]

    def loss_scaler(self) -> dict[str, Any] | None:
        """The fp16 dynamic loss scaler's state (scale, iteration, last overflow, factor, window), or None
        when the source did not train in fp16."""
        optimizer = self.first.get("optimizer")
        if self.precision != "fp16" or not isinstance(optimizer, dict):
            return None
        return {key: optimizer[key] for key in LOSS_SCALER_KEYS if key in optimizer}

    def describe(self) -> str:
        """``tp=2 x pp=1 x dp=1, fp16`` (ZeRO stage added when there is one)."""
        zero = f", ZeRO-{self.zero_stage}" if self.zero_stage else ""
        return f"tp={self.tp} x pp={self.pp} x dp={self.dp_size}, {self.precision}{zero}"
