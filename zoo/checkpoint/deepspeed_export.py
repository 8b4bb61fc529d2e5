"""Export a zoo DeepSpeed training checkpoint, written at any tp degree, to transformers' layout:
GPT-2 to ``GPT2LMHeadModel``, pre-norm BERT to ``MegatronBertForPreTraining``, post-norm BERT to
``BertForPreTraining``.

One process does it, whatever number of processes trained the model. The exporter

1. finds the tag directory (``latest`` or ``--tag``) and checks every TP rank's file is there,
2. recovers the model config (:mod:`zoo.checkpoint.layout`) and builds the training model on the meta
   device with a layout-only :class:`ParallelState` of that tp degree, which tells each parameter's
   partition spec (split dimension, stride, vocab rows, transposition, declared by its layer) and
   transformers key (:func:`zoo.checkpoint.hf.hf_io.hf_params`, BERT's fused QKV naming three) without
   allocating or communicating,
3. streams, one output tensor at a time, with the same writer as ``save_pretrained``
   (:func:`zoo.checkpoint.hf.hf_io.stream_pretrained`): each tensor's shards are read from the rank files,
   which stay memory-mapped (``torch.load(..., mmap=True)``: the optimizer states are never read),
   merged (:meth:`zoo.parallel.partition.PartitionSpec.merge`; rows split along the file's first dimension are
   written as they are, never merged), the vocab padding cut, GPT-2's Conv1D weights transposed,
   BERT's fused QKV split into its blocks, cast, appended to its safetensors file and freed; the
   source pages it touched are then released (:func:`zoo.checkpoint.mapped_pages.release_pages`). The peak is
   about one merged tensor, whatever the model size,
4. writes config.json, safetensors (sharded above ``max_shard_size``, huggingface_hub's split rules) and
   the family's bundled tokenizer files atomically: it replaces only a previous export (never the run
   directory or any other folder) and honours the umask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from zoo.checkpoint.files import (
    check_rank_files,
    layout_of_tag,
    model_states_path,
    read_model_states,
    tag_directory,
    tp_size_of_states,
)
from zoo.checkpoint.hf.hf_io import (
    DEFAULT_MAX_SHARD_SIZE,
    HFParam,
    OutputTensor,
    check_pretrained_target,
    hf_params,
    hf_rows,
    local_block,
    output_tensors,
    stream_pretrained,
)
from zoo.checkpoint.layout import (
    check_layout,
    checked_layout_model,
    config_from_dict,
    embedding_key,
    recover_config,
)
from zoo.checkpoint.mapped_pages import mapped_ranges, release_pages
from zoo.errors import MissingInput, UserError
from zoo.models.families import family_of, shape_of
from zoo.models.pretrained import tokenizer_files, with_dtype
from zoo.parallel.partition import partition_specs
from zoo.parallel.state import ParallelState

__all__ = ["ExportResult", "export_checkpoint", "merged_hf_state", "merged_master"]


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote and from where."""

    out: Path
    tag_dir: Path
    tp_size: int
    dtype: torch.dtype
    config_source: str   # "client_state['model_config']" or how the config was inferred
    model_type: str = "gpt2"
    pp_size: int = 1


# --------------------------------------------------------------------------- merging
def merged_master(layout: torch.nn.Module, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """One parameter's master tensor (zoo's layout, vocab still padded) from every TP rank's shard, by its
    partition spec: sharded parameters are concatenated along the split dimension in rank order, respecting
    the stride (the per-rank [q | k | v] blocks of the fused QKV); replicated ones are taken from rank 0."""
    return partition_specs(layout)[name].merge(shards)


def hf_tensors(master: torch.Tensor, hf: HFParam) -> dict[str, torch.Tensor]:
    """A merged master in transformers' keys and layout; a fused parameter gives one tensor per block."""
    tensor = hf.spec.to_file_layout(master)
    if not hf.fused:
        return {hf.key: tensor}
    return {key: block.contiguous() for key, block in zip(hf.keys, tensor.chunk(len(hf.keys), dim=hf.spec.block_dim))}


def merged_hf_state(layout: torch.nn.Module, modules: list[dict[str, torch.Tensor]],
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every TP rank's module state dict merged into transformers' keys and layout."""
    out = {}
    for name, hf in hf_params(layout).items():
        master = hf.spec.merge([module[name] for module in modules])
        for key, tensor in hf_tensors(master, hf).items():
            out[key] = tensor.to(dtype) if dtype is not None else tensor.clone()
    return out


def checkpoint_producer(layout: torch.nn.Module, modules: list[dict[str, torch.Tensor]],
                        release: Callable[[list[torch.Tensor]], object] = lambda sources: None):
    """``produce`` for :func:`stream_pretrained` from every TP rank's memory-mapped module state dict.

    Each call first hands the previous entry's source tensors (written by then) to ``release``."""
    params = dict(layout.named_parameters())
    param_map = hf_params(layout)
    previous: list[torch.Tensor] = []

    def produce(entry: OutputTensor) -> list[torch.Tensor]:
        release(previous)
        param, hf = params[entry.name], param_map[entry.name]
        sources = [module[entry.name] for module in modules] if hf.spec.is_sharded else [modules[0][entry.name]]
        previous[:] = sources
        return hf_rows([local_block(source, hf, entry) for source in sources], param, hf, entry)

    return produce


def layout_parallel(layout: torch.nn.Module) -> ParallelState | None:
    return getattr(layout, "parallel", None)


# --------------------------------------------------------------------------- the whole export
def export_checkpoint(load: str | Path, out: str | Path, tag: str | None = None, dtype: torch.dtype | None = None,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> ExportResult:
    """Write the transformers directory ``out`` from the zoo DeepSpeed checkpoint under ``load``.

    ``dtype`` defaults to the dtype of the checkpoint's module weights (fp32, fp16 or bf16). ``out`` must be
    new, empty or a previous export: anything else (the run directory itself, a file) is refused first.
    """
    check_pretrained_target(out)
    tag_dir = tag_directory(load, tag)
    first_path = model_states_path(tag_dir, 0)
    if not first_path.is_file():
        raise MissingInput(f"{first_path} is missing; a checkpoint tag holds mp_rank_00_model_states.pt and "
                                "one more file per TP rank, copy them all.")
    first = read_model_states(first_path)
    tp_size = tp_size_of_states(first, first_path)
    if first.get("pipeline_model_parallel_size", 1) > 1:
        return export_pipeline_checkpoint(tag_dir, first, out, dtype, max_shard_size)
    check_rank_files(tag_dir, tp_size)
    config, source = recover_config(first, tp_size, first_path)
    layout = checked_layout_model(config, tp_size, first_path)

    modules = []
    for rank in range(tp_size):
        path = model_states_path(tag_dir, rank)
        states = first if rank == 0 else read_model_states(path)
        if (recorded := tp_size_of_states(states, path)) != tp_size:
            raise UserError(f"{path} records tensor_parallel_size={recorded} but rank 0 records {tp_size}; the "
                             "tag mixes files of two checkpoints, re-save it.")
        check_layout(layout, states["module"], path)
        modules.append(states["module"])   # keep only the weights; the rest of the file is dropped
        del states

    out_dtype = dtype or modules[0][embedding_key(config)].dtype
    ranges = mapped_ranges(model_states_path(tag_dir, rank) for rank in range(tp_size))
    stream_export(out, layout, modules, out_dtype, ranges, max_shard_size)
    return ExportResult(out=Path(out), tag_dir=tag_dir, tp_size=tp_size, dtype=out_dtype, config_source=source,
                        model_type=config.model_type)


def stream_export(out, layout, modules: list[dict[str, torch.Tensor]], out_dtype: torch.dtype, ranges,
                  max_shard_size: int | str) -> None:
    """Stream every TP rank's (memory-mapped) module state dict through the ``save_pretrained`` writer."""
    param_map = hf_params(layout)
    outputs = output_tensors(layout.named_parameters(), param_map, layout_parallel(layout), out_dtype,
                             {name: modules[0][name].dtype for name, _ in layout.named_parameters()})
    error = stream_pretrained(out, with_dtype(layout.hf_config_dict(), out_dtype), outputs,
                              checkpoint_producer(layout, modules, lambda sources: release_pages(sources, ranges)),
                              tokenizer_files(layout.default_tokenizer_dir), max_shard_size)
    if error is not None:
        raise error


def export_pipeline_checkpoint(tag_dir: Path, first: dict, out, dtype: torch.dtype | None,
                               max_shard_size: int | str) -> ExportResult:
    """The export of a checkpoint written with pipeline stages: each TP rank's layer files put together as the
    one-stage model's state dict (:func:`zoo.checkpoint.pipeline_files.pipeline_module_states`), then the same
    stream as a one-stage checkpoint."""
    from zoo.checkpoint.pipeline_files import layer_path, pipeline_module_states

    tp_size, pp_size = layout_of_tag(tag_dir)
    first_path = model_states_path(tag_dir, 0)
    recorded = config_from_dict(first.get("model_config") or {}, first_path)
    n_layer, entry_name = shape_of(recorded).layers, family_of(recorded).pipeline.entry_name
    modules = [pipeline_module_states(tag_dir, rank, n_layer, entry_name=entry_name) for rank in range(tp_size)]
    config, source = recover_config({**first, "module": modules[0]}, tp_size, first_path)
    layout = checked_layout_model(config, tp_size, first_path)
    for rank, module in enumerate(modules):
        check_layout(layout, module, layer_path(tag_dir, 0, rank))
    out_dtype = dtype or modules[0][embedding_key(config)].dtype
    ranges = mapped_ranges(layer_path(tag_dir, index, rank) for index in range(n_layer + 3)
                           for rank in range(tp_size))
    stream_export(out, layout, modules, out_dtype, ranges, max_shard_size)
    return ExportResult(out=Path(out), tag_dir=tag_dir, tp_size=tp_size, dtype=out_dtype, config_source=source,
                        model_type=config.model_type, pp_size=pp_size)
