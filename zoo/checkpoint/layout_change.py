"""Resuming a checkpoint at another layout: any change of tp, pp and, for ZeRO/BF16 runs, dp, or of the ZeRO stage
(0, 1, 2), one stage or pipeline stages on either side, any family of the registry; the one path every such
resume takes, on the ranks of the new run, and the one the offline conversion (:mod:`zoo.training.offline_reshard`)
runs too.

The checkpoint is read in its layout-free form (:class:`zoo.checkpoint.training_state.CheckpointTrainingState`:
per global parameter name the fp32 master, Adam's ``exp_avg`` and ``exp_avg_sq``, the step), whatever
precision and optimizer wrote it: fp32, fp16 (FP16_Optimizer, FP16_UnfusedOptimizer), bf16 (BF16_Optimizer,
with ZeRO-1 or without) and ZeRO-1/2. For each parameter this rank holds, this rank's slice is copied out of the
checkpoint's TP shards of that name (its partition spec says how; the vocabulary re-padded for this tp), and the slice goes where the run's optimizer keeps it (:func:`optimizer_target`): the weight and the
torch optimizer's state (fp32), the fp32 copies and flat Adam buffers of the fp16 optimizers, or through
DeepSpeed's hp-fragment mapping (``safe_set_full_fp32_param``/``safe_set_full_optimizer_state``) into this dp
rank's partition of a ZeRO or BF16 optimizer. The low-precision weight is the master rounded, as DeepSpeed's
step leaves it. The LR schedule, DeepSpeed's step counters, the loss scaler (fp16 to fp16) and zoo's client
state come from the checkpoint's first rank.

Memory, per rank, in the planner's terms (:mod:`zoo.planning.planner`: ``params_per_rank`` parameters on a rank,
12 bytes each of fp32 master and two Adam moments): the move holds at most its own share, 12 x params_per_rank
bytes, plus the largest merged tensor (4 bytes x the numel of the largest parameter, merged over the source's TP
ranks at its padding). In fact it holds one parameter's three slices of this rank and, for a ZeRO/BF16 source, the
copy of one source shard that straddles two partitions while it is read; the merged tensor is never built
(:meth:`zoo.checkpoint.training_state.CheckpointTrainingState.local`). Reads: the files are memory-mapped, each
rank opens only the files of the names it holds and copies out of them only the ranges of its own slices (a
straddling shard whole); its bytes read are about its share (tests/test_layout_change_one_path.py counts both).

Under ZeRO-1/2 or BF16_Optimizer the share is this rank's flat fp32 partition, 12 bytes per element: about
1/(tp x dp) of the model's state. Each parameter's element range in the partition is known first
(:meth:`PartitionedTarget.wanted`), and only the rows of dimension 0 that range touches are copied out of the
source (:meth:`zoo.checkpoint.training_state.CheckpointTrainingState.fragment`), one key at a time: a rank reads
its share plus at most a partial row at each end of its partition per group, and holds one key's window of it
(plus, where a source shard straddles two source partitions, the copy of just those rows). The low-precision
weights are then the partitions rounded and gathered over dp, as DeepSpeed's step leaves them.

Every bad case is refused in one sentence before anything is moved (:func:`check_layout_change`, shared with
the offline conversion).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from zoo.checkpoint.files import model_states_path, read_model_states
from zoo.checkpoint.layout import checked_layout_model, config_from_dict
from zoo.checkpoint.safe_load import check_tag_files
from zoo.checkpoint.training_state import (
    LOSS_SCALER_KEYS,
    MOMENTS,
    CheckpointTrainingState,
    one_stage_names,
    param_names_by_group,
    precision_of,
    zero_stage_of,
)
from zoo.checkpoint.zero_reshard import check_reshardable_zero_config, partition_files
from zoo.distributed import agree_max, raise_on_any_rank
from zoo.errors import MissingInput, UserError
from zoo.parallel.partition import partition_specs

__all__ = ["needs_layout_change", "load_at_new_layout", "param_names_by_group", "one_stage_names",
           "engine_precision", "engine_optimizer_files", "check_precision", "check_layout_change",
           "check_source_files", "move_line"]


def engine_optimizer_files(engine) -> str | None:
    """Which optimizer files a DeepSpeed engine reads and writes: None (in the model states),
    "zero_pp_rank" or "bf16_zero_pp_rank" partitions (ZeRO-1/2, BF16_Optimizer), or "stage3"."""
    stage = engine.zero_optimization_stage()
    if stage >= 3:
        return "stage3"
    if stage in (1, 2) or type(engine.optimizer).__name__ == "BF16_Optimizer":
        return "bf16_zero_pp_rank" if engine.bfloat16_enabled() else "zero_pp_rank"
    return None


def needs_layout_change(source: tuple[int, int], parallel, partitions=None, engine_files: str | None = None,
                        source_stage: int = 0) -> bool:
    """Whether a checkpoint of (tp, pp) ``source``, with ZeRO/BF16 partition files ``partitions``
    (:func:`zoo.checkpoint.zero_reshard.partition_files`, None without) written at ZeRO stage ``source_stage``, is
    resumed through this module by a run at ``parallel`` whose engine reads ``engine_files``
    (:func:`engine_optimizer_files`): at another tp or pp, with the optimizer state in other files (another ZeRO
    stage, or none), or partitioned over another dp (DeepSpeed refuses a new dp for partitioned state). ZeRO-3
    on one side only is such a change too (and :func:`check_layout_change` refuses it in one sentence); data
    parallelism alone without partitions, and ZeRO-3 on both sides at one layout, are DeepSpeed's own load."""
    if tuple(source) != (parallel.tp_size, getattr(parallel, "pp_size", 1)):
        return True
    if (engine_files == "stage3") != (source_stage >= 3):
        return True
    if engine_files == "stage3":
        return False
    have = None if partitions is None else f"{partitions.prefix}zero_pp_rank"
    if have != engine_files:
        return True
    # ZeRO partitions over data x context parallelism (DeepSpeed's sequence-data-parallel group)
    return partitions is not None and partitions.dp_size != parallel.dp_size * getattr(parallel, "cp_size", 1)


def engine_precision(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def check_precision(source: str, target: str, where: str, keep: str | None = None) -> None:
    """The run trains in the precision the checkpoint was written in: masters and moments would carry over,
    but fp16's loss scaler has no counterpart in bf16/fp32 (it would be dropped) and a run turning fp16 on
    would restart its scale from the config's initial power, so a change is the user's explicit choice
    (export and --pretrained), never a side effect of a resume. ``keep``: how the caller keeps the checkpoint's
    precision (default: in the ds_config)."""
    if source == target:
        return
    scaler = ("its fp16 loss scaler would be dropped" if source == "fp16" else
              "the fp16 loss scaler would restart at the config's initial scale" if target == "fp16" else
              "the optimizer's master weights would change type")
    keep = keep or f"keep {source} in the ds_config"
    raise UserError(f"{where} was written in {source} and this layout trains in {target}: {scaler}; {keep}, "
                     f"or export the checkpoint (launch/export.py) and start the "
                     f"{target} run with --pretrained.")


def layout_words(tp: int, pp: int) -> str:
    return f"tp={tp}" if pp == 1 else f"tp={tp} x pp={pp}"


def check_source_files(tag_dir: Path, tp: int, pp: int) -> None:
    """Every rank's files of the source tag are there (one model-states file per (stage, TP rank), the layer files
    of every stage's TP ranks, every ZeRO/BF16 optimizer partition), the first missing one named."""
    for rank in range(tp * pp):
        if not model_states_path(tag_dir, rank).is_file():
            raise MissingInput(f"{model_states_path(tag_dir, rank)} is missing from a {layout_words(tp, pp)} "
                                    "checkpoint; copy every file of the tag directory.")
    if pp > 1:
        layers = {p.name.split("-")[0] for p in tag_dir.glob("layer_*-model_*-model_states.pt")}
        for layer in sorted(layers):
            for tp_rank in range(tp):
                path = tag_dir / f"{layer}-model_{tp_rank:02d}-model_states.pt"
                if not path.is_file():
                    raise MissingInput(f"{path} is missing from a {layout_words(tp, pp)} checkpoint; copy "
                                            "every file of the tag directory.")
    partitions = partition_files(tag_dir)   # raises on a missing partition of the ranks it found
    for mp_rank in range(tp * pp) if partitions is not None else ():
        for dp_rank in range(partitions.dp_size):
            if not partitions.path(tag_dir, dp_rank, mp_rank).is_file():
                raise MissingInput(f"{partitions.path(tag_dir, dp_rank, mp_rank)} is missing from a "
                                        f"{layout_words(tp, pp)} checkpoint partitioned over dp={partitions.dp_size}; "
                                        "copy every file of the tag directory.")


def check_layout_change(tag_dir: Path, source: tuple[int, int], tp: int, precision: str | None, zero_stage: int | None,
                        where: str, keep: str | None = None, zero_fix: str = "set zero_optimization.stage to 0, 1 "
                        "or 2 in the ds_config") -> dict[str, Any]:
    """Every reason the checkpoint in ``tag_dir`` (written at (tp, pp) ``source``) cannot move to a run at tp
    ``tp`` training in ``precision`` with ZeRO stage ``zero_stage`` (None: the checkpoint's own), each one
    sentence (UserError/MissingInput) in the order a user fixes them: a rank's file missing, ZeRO-3 on
    either side, ZeRO options whose partitions cannot be read, a precision change (:func:`check_precision`,
    ``where`` and ``keep`` word it; ``{source}`` in ``keep`` is the checkpoint's precision), a model the new tp cannot split (heads, MLP, vocabulary padding).
    Reads only the first rank's model states (returned) and the tag's file names; nothing is written."""
    tag_dir = Path(tag_dir)
    check_source_files(tag_dir, *source)
    first_path = model_states_path(tag_dir, 0)
    first = read_model_states(first_path)
    recorded = first.get("ds_config")
    if zero_stage_of(recorded) >= 3:
        raise UserError(f"{tag_dir} was written with ZeRO stage 3, whose partitioned parameters zoo does not move "
                         "to another layout; resume it at its own layout, or export it (launch/export.py) and "
                         "start the new layout with --pretrained.")
    if zero_stage is not None and zero_stage >= 3:
        raise UserError(f"this layout uses ZeRO stage {zero_stage} (ZeRO-3), whose partitioned parameters zoo does "
                         f"not fill from a checkpoint of another layout; {zero_fix}.")
    if partition_files(tag_dir) is not None:
        check_reshardable_zero_config(first, first_path)
    source_precision = precision_of(recorded)
    check_precision(source_precision, precision or source_precision, where, keep and keep.format(source=source_precision))
    checked_layout_model(config_from_dict(first["model_config"], first_path), tp, first_path)
    return first


# --------------------------------------------------------------------------- where the run keeps its state
def _like(value: Any, step: Any) -> Any:
    """``step`` in the type the optimizer keeps its step in (torch's AdamW: a float tensor; FusedAdam: int)."""
    number = float(step.item()) if torch.is_tensor(step) else float(step)
    if torch.is_tensor(value):
        return torch.tensor(number, dtype=value.dtype, device=value.device)
    return int(number)


def fresh_step(inner, step: Any) -> Any:
    """``step`` as a new state entry of ``inner``: a float32 tensor for torch's optimizers, else a number."""
    scalar = torch.tensor(0.0) if isinstance(inner, torch.optim.Optimizer) and "torch.optim" in type(inner).__module__ \
        else 0
    return _like(scalar, step)


def set_steps(inner, step: Any) -> None:
    """Every step counter of torch optimizer ``inner`` (in its state entries and groups) set to ``step``."""
    for group in inner.param_groups:
        if "step" in group:
            group["step"] = _like(group["step"], step)
        for param in group["params"]:
            state = inner.state.get(param)
            if state is not None and "step" in state:
                state["step"] = _like(state["step"], step)


class TorchTarget:
    """fp32 without ZeRO: the weight is the master; Adam's state is the torch optimizer's, per parameter."""

    def __init__(self, optimizer):
        self.optimizer, self.inner = optimizer, optimizer

    def put(self, param, master: torch.Tensor, moments: dict[str, torch.Tensor], step: Any) -> None:
        param.copy_(master)
        state = self.optimizer.state[param]
        state.update(moments)   # the move's slices, in storage of their own: the optimizer keeps them
        state["step"] = step.clone() if torch.is_tensor(step) else step


class UnfusedFp16Target:
    """FP16_UnfusedOptimizer: an fp32 copy per fp16 parameter, the torch optimizer's state keyed by the copy."""

    def __init__(self, optimizer):
        self.optimizer, self.inner = optimizer, optimizer.optimizer
        self.fp32_of = {id(low): high for lows, highs in zip(optimizer.fp16_groups, optimizer.fp32_groups)
                        for low, high in zip(lows, highs)}

    def put(self, param, master, moments, step) -> None:
        high = self.fp32_of[id(param)]
        high.data.copy_(master)
        param.copy_(master)
        state = self.inner.state[high]
        for key, value in moments.items():
            state[key] = value.clone()
        state["step"] = _like(state.get("step", step), step)


class FusedFp16Target:
    """FP16_Optimizer: one flat fp32 master and one flat Adam state per group, in the group's parameter order."""

    def __init__(self, optimizer):
        self.optimizer, self.inner = optimizer, optimizer.optimizer
        self.where = {}
        for g, group in enumerate(optimizer.fp16_groups):
            offset = 0
            for param in group:
                self.where[id(param)] = (g, offset)
                offset += param.numel()

    def put(self, param, master, moments, step) -> None:
        g, offset = self.where[id(param)]
        flat = self.optimizer.fp32_groups_flat[g]
        flat.data.narrow(0, offset, param.numel()).copy_(master.reshape(-1))
        param.copy_(master)
        state = self.inner.state[flat]
        for key, value in moments.items():
            state[key].narrow(0, offset, param.numel()).copy_(value.reshape(-1))


class PartitionedTarget:
    """ZeRO-1/2 and BF16_Optimizer: this dp rank's fragment of each parameter's fp32 master and moments.

    DeepSpeed maps each parameter to its fragment of the rank's flat fp32 partition (``_hp_mapping``: where the
    fragment starts in the flattened parameter and in the partition; None outside this rank's partition),
    which is DeepSpeed's own answer to the layout :mod:`zoo.checkpoint.zero_reshard` describes (groups in
    ``param_groups`` order, parameters flattened in order, each group padded to a multiple of
    ``ALIGNMENT_FACTOR`` x dp and cut into dp equal slices). The partition is the one parameter of the wrapped
    optimizer's group, and Adam's state of it is flat alike. So a rank needs, of each parameter, only the
    element range :meth:`wanted` names: :meth:`put` copies the master and each moment of that range to the
    fragment's addresses (DeepSpeed links its own moment views only at the first step), and :meth:`finish`
    rounds every rank's fp32 partition into its low-precision partition and all-gathers those over dp, as
    DeepSpeed's step does, so every rank's weights are the masters rounded."""

    def __init__(self, optimizer):
        self.optimizer, self.inner = optimizer, optimizer.optimizer

    @staticmethod
    def wanted(param) -> tuple[int, int] | None:
        """(start, numel) of the elements of ``param``'s flattened tensor in this rank's partition, or None."""
        mapping = param._hp_mapping
        if mapping is None:
            return None
        return mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel

    def put(self, param, key: str, fragment: torch.Tensor, step: Any) -> None:
        """``key`` ("master" or an Adam moment) of the elements :meth:`wanted` names, flat, into the partition."""
        mapping = param._hp_mapping
        hp = mapping.get_hp_fragment_address()
        (partition,) = self.inner.param_groups[mapping.param_group_index]["params"]
        if key == "master":
            partition.data.narrow(0, hp.start, hp.numel).copy_(fragment)
            return
        state = self.inner.state[partition]
        if not state:   # Adam builds its state at the first step: build it as Adam would
            state.update({moment: torch.zeros_like(partition) for moment in MOMENTS})
            state["step"] = fresh_step(self.inner, step)
        state[key].narrow(0, hp.start, hp.numel).copy_(fragment)

    def finish(self) -> None:
        """Collective over dp: every rank's low-precision weights from the fp32 partitions just filled."""
        self.optimizer.update_lp_params()


def optimizer_target(engine):
    """Where ``engine``'s optimizer keeps the fp32 master and Adam's state of a parameter."""
    optimizer = engine.optimizer
    if any(hasattr(param, "_hp_mapping") for param in engine.module.parameters()):
        return PartitionedTarget(optimizer)
    if hasattr(optimizer, "fp32_groups_flat") and hasattr(optimizer, "fp16_groups"):
        return FusedFp16Target(optimizer)
    if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
        return UnfusedFp16Target(optimizer)
    return TorchTarget(optimizer)


def set_loss_scaler(optimizer, saved: dict[str, Any] | None) -> None:
    """The fp16 optimizer's dynamic loss scaler as the checkpoint left it (scale, iteration, last overflow)."""
    config = getattr(optimizer, "loss_scale_config", None)
    if not saved or config is None:
        return
    for key in LOSS_SCALER_KEYS:
        if key in saved:
            setattr(config, key, saved[key])


# --------------------------------------------------------------------------- the move
def held_bytes(module) -> int:
    """This rank's share in the planner's terms: 12 bytes (fp32 master and two Adam moments) per parameter it
    holds."""
    return 12 * sum(param.numel() for param in module.parameters())


def partition_share(target: PartitionedTarget) -> int:
    """This rank's share under ZeRO/BF16: 12 bytes per element of its flat fp32 partitions (padding included)."""
    return 12 * sum(param.numel() for group in target.inner.param_groups for param in group["params"])


@torch.no_grad()
def load_at_new_layout(engine, tag_dir: Path, source: tuple[int, int], parallel, load: str) -> dict[str, Any]:
    """Fill the engine's module and optimizer state from a checkpoint written at (tp, pp) ``source``; returns its
    client state, marked ``resharded_from`` (:func:`move_record`: source layout and precision, seconds, and each
    rank's peak held bytes, files opened and bytes read, with the largest over ranks). Collective: every rank
    reads the files of its own names; a failure anywhere is raised on every rank, before anything is moved when
    it is a bad case (:func:`check_layout_change`).

    Per parameter, per key (master, exp_avg, exp_avg_sq): this rank's slice is copied straight out of the source's
    shards; the three slices are held until the optimizer target has them. So the bytes the move holds at once
    (:class:`zoo.checkpoint.training_state.ReadAccount`) are one parameter's slices and, for a ZeRO/BF16 source,
    one straddling shard's copy: at most this rank's share plus the largest merged tensor, as the module
    docstring states. Into a ZeRO/BF16 partition only the elements the partition keeps are copied, one key at a
    time, and the low-precision weights are gathered over dp afterwards (collective)."""
    started = time.perf_counter()
    precision, files = engine_precision(engine), engine_optimizer_files(engine)
    stage = engine.zero_optimization_stage()
    raise_on_any_rank(lambda: check_layout_change(tag_dir, source, parallel.tp_size, precision, stage, f"--load {load}"))
    raise_on_any_rank(lambda: check_tag_files(tag_dir, parallel.rank, parallel.world_size))
    names = one_stage_names(engine.module)
    state = raise_on_any_rank(lambda: CheckpointTrainingState(tag_dir, *source, wanted=set(names.values())))
    target = raise_on_any_rank(lambda: optimizer_target(engine))
    account, specs = state.account, partition_specs(engine.module)
    share = partition_share(target) if isinstance(target, PartitionedTarget) else held_bytes(engine.module)
    largest = raise_on_any_rank(lambda: max((state.merged_bytes(names[local_name], specs[local_name])
                                             for local_name, _ in engine.module.named_parameters()), default=0))

    def fill_whole() -> None:
        for local_name, param in engine.module.named_parameters():
            name, spec = names[local_name], specs[local_name]
            pieces = {key: state.local(name, spec, key, param.shape, parallel.tp_rank, parallel.tp_size,
                                       param.device)[0]
                      for key in ("master",) + MOMENTS}   # this rank's slice, straight out of the source's shards
            master = pieces.pop("master")
            target.put(param, master, pieces, state.step(name))
            account.release(master.nbytes + sum(piece.nbytes for piece in pieces.values()))
            del master, pieces

    def fill_partition() -> None:
        for local_name, param in engine.module.named_parameters():
            wanted = target.wanted(param)
            if wanted is None:
                continue
            name, spec = names[local_name], specs[local_name]
            for key in ("master",) + MOMENTS:   # one key's fragment at a time, only this partition's elements
                fragment, held = state.fragment(name, spec, key, param.shape, parallel.tp_rank, parallel.tp_size,
                                                *wanted, param.device)
                target.put(param, key, fragment, state.step(name))
                del fragment
                account.release(held)

    def fill() -> None:
        (fill_partition if isinstance(target, PartitionedTarget) else fill_whole)()
        set_steps(target.inner, state.step(next(iter(names.values()))))

    raise_on_any_rank(fill)
    if isinstance(target, PartitionedTarget):
        raise_on_any_rank(target.finish)
    first = state.first
    # The schedule-driven values of each group (the lr; betas under a cycle schedule) are the checkpoint's:
    # the scheduler sets them only at its next step, after this iteration's update.
    for group, saved in zip(target.inner.param_groups, state.optimizer_groups()):
        group.update({key: saved[key] for key in ("lr", "betas") if key in saved})
    set_loss_scaler(engine.optimizer, state.loss_scaler())
    if engine.lr_scheduler is not None and first.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(first["lr_scheduler"])
    engine.global_steps, engine.global_samples = first["global_steps"], first["global_samples"]
    engine.skipped_steps = first.get("skipped_steps", 0)
    client = {key: value for key, value in first.items() if key not in ("module", "optimizer")}
    mine = {"seconds": time.perf_counter() - started, "peak_bytes": account.peak, "files": len(account.files),
            "bytes_read": account.bytes_read, "share_bytes": share, "largest_bytes": largest,
            "bound_bytes": share + largest}
    client["resharded_from"] = {"tensor_parallel_size": source[0], "pipeline_model_parallel_size": source[1],
                                "data_parallel_size": state.dp_size, "precision": state.precision,
                                "zero_stage": state.zero_stage, "layout": state.describe(),
                                "to_precision": precision, "to_zero_stage": stage if files else 0,
                                **mine, **move_record(mine, parallel)}
    return client


RECORDED = ("seconds", "peak_bytes", "bound_bytes", "files", "bytes_read")


def move_record(mine: dict[str, Any], parallel) -> dict[str, Any]:
    """Every rank's ``seconds``, ``peak_bytes``, ``bound_bytes`` (its share + the largest tensor it merged),
    ``files`` and ``bytes_read`` of the move (``ranks``: one list per rank in global rank order, in that key
    order) and the largest of each (``max_seconds``, ``max_peak_bytes`` with ``peak_rank`` and that rank's
    ``peak_rank_bound``, ``max_files``, ``max_bytes_read``). Collective: one all-reduce of 5 integers per rank."""
    world, rank = parallel.world_size, parallel.rank
    values = [0] * (len(RECORDED) * world)
    for i, key in enumerate(RECORDED):
        values[i * world + rank] = round(mine[key] * 1e6) if key == "seconds" else int(mine[key])
    everyone = agree_max(values)
    per_key = {key: everyone[i * world:(i + 1) * world] for i, key in enumerate(RECORDED)}
    per_key["seconds"] = [micros / 1e6 for micros in per_key["seconds"]]
    peaks = per_key["peak_bytes"]
    return {"ranks": [[per_key[key][r] for key in RECORDED] for r in range(world)],
            "max_seconds": max(per_key["seconds"]), "max_peak_bytes": max(peaks), "peak_rank": peaks.index(max(peaks)),
            "peak_rank_bound": per_key["bound_bytes"][peaks.index(max(peaks))], "max_files": max(per_key["files"]), "max_bytes_read": max(per_key["bytes_read"])}


def move_line(moved: dict[str, Any]) -> str:
    """What a move did, for the resume line: ``fp32 moved in 0.41 s; peak 1,234,567 bytes held (rank 3, whose
    share + largest tensor is 2,345,678), at most 9 files and 3,456,789 bytes read per rank``."""
    def precision(value: str, stage: int) -> str:
        return f"{value}{f' ZeRO-{stage}' if stage else ''}"

    source = precision(moved["precision"], moved.get("zero_stage", 0))
    target = precision(moved.get("to_precision", moved["precision"]), moved.get("to_zero_stage", 0))
    what = source if source == target else f"{source} → {target}"
    return (f"{what} moved in {moved['max_seconds']:.2f} s; peak {moved['max_peak_bytes']:,} bytes held (rank "
            f"{moved['peak_rank']}, whose share + largest tensor is {moved['peak_rank_bound']:,}), "
            f"at most {moved['max_files']} files and {moved['max_bytes_read']:,} bytes read per rank")
