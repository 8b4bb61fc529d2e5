"""Reading and writing Hugging Face transformers checkpoints at any tp degree.

A model names, per parameter, the transformers key(s) it maps to (``hf_names()``), and the keys transformers
stores transposed (``hf_transposed_keys``, key endings: GPT-2's Conv1D weights); how the tensor is split and
padded comes from the partition spec its layer declares (:mod:`zoo.parallel.partition`). :func:`hf_params`
joins them into one :class:`HFParam` per parameter.

Loading reads only this rank's slices with ``safetensors.safe_open(...).get_slice``, one tensor at a
time, each file mapped only while its tensor is read (a mapping's touched pages count in the RSS until
it is closed), so a rank's peak is about its own shard plus one tensor.

Saving streams: the plan of files (huggingface_hub's split rules) is made from shapes alone, then
each tensor is gathered to the writer only (TP rank 0 of DP rank 0), cast, appended to its
safetensors file and freed (:mod:`zoo.checkpoint.hf.safetensors_io`). The writer holds one merged tensor at a time,
the other ranks their own shards plus the piece in flight. :func:`hf_state_dict` (every merged tensor
on every rank) serves comparisons in tests.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import SafetensorError, safe_open

from zoo.atomic import check_output_directory
from zoo.checkpoint.hf.safetensors_io import safetensors_order, stream_directory
from zoo.errors import MissingInput, UserError
from zoo.options import json_kind
from zoo.parallel.gather import gather_to_first
from zoo.parallel.partition import PartitionSpec, partition_specs
from zoo.parallel.state import ParallelState, as_state
from zoo.parallel.utils import shard_index

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_PATTERN = "model{suffix}.safetensors"   # huggingface_hub fills in "-00001-of-00003" when sharded
DEFAULT_MAX_SHARD_SIZE = "5GB"                # the hub's default (transformers 5 uses 50GB)

SHARD_FILE_RE = re.compile(r"model-\d+-of-\d+\.safetensors")
TOKENIZER_FILE_NAMES = ("vocab.json", "merges.txt", "vocab.txt", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "added_tokens.json")
EXPORT_KIND = "Hugging Face export"
GENERATION_CONFIG_FILE = "generation_config.json"


def max_shard_size_of(value: str | int | None) -> str | int:
    """A ``--max-shard-size`` value as transformers takes it: a byte count, a size such as "2GB", or by
    default transformers' own limit."""
    value = value or DEFAULT_MAX_SHARD_SIZE
    return int(value) if str(value).isdigit() else value


@dataclass(frozen=True)
class HFParam:
    """Where a zoo parameter lives in a transformers checkpoint: its key, or the keys of the blocks of a fused
    parameter (BERT's query, key, value behind zoo's fused QKV, stacked along the split dimension), and the
    parameter's partition spec (split, stride, vocabulary rows, transposition)."""

    keys: tuple[str, ...]
    spec: PartitionSpec

    @property
    def key(self) -> str:
        return self.keys[0]

    @property
    def fused(self) -> bool:
        return len(self.keys) > 1


def hf_params(model: torch.nn.Module) -> dict[str, HFParam]:
    """Every parameter of ``model`` with its transformers key(s) (the model's ``hf_names()``) and its
    layer's partition spec (:func:`zoo.parallel.partition.partition_specs`), marked transposed where the
    model's ``hf_transposed_keys`` (if any) says transformers stores that key so."""
    names = model.hf_names()
    transposed = tuple(getattr(model, "hf_transposed_keys", ()))
    params = {}
    for name, spec in partition_specs(model).items():
        keys = (names[name],) if isinstance(names[name], str) else tuple(names[name])
        params[name] = HFParam(keys, stored_spec(spec, keys[0], transposed))
    return params


def stored_spec(spec: PartitionSpec, key: str, transposed_keys: tuple[str, ...]) -> PartitionSpec:
    """``spec`` as the file stores the tensor under ``key``: transposed when the key ends with one of
    ``transposed_keys`` (a model's ``hf_transposed_keys``)."""
    return replace(spec, transposed=True) if key.endswith(transposed_keys) else spec


# --------------------------------------------------------------------------- reading
class CheckpointFiles:
    """The safetensors file(s) of a transformers directory: single file or sharded with an index."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise UserError(f"checkpoint index {index} is not a valid safetensors index ({err}); "
                                 "re-save the checkpoint.") from None
            self.key_to_file = {k: self.directory / f for k, f in weight_map.items()}
        elif single.is_file():
            self.key_to_file = {k: single for k in self._keys_of(single)}
        else:
            raise MissingInput(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.directory}; zoo reads "
                                    "safetensors only, re-save the model with safe_serialization=True.")

    @staticmethod
    def _keys_of(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="pt") as handle:
                return list(handle.keys())
        except (SafetensorError, OSError) as err:
            raise UserError(f"safetensors file {path} is truncated or corrupt ({err}); re-save or "
                             "re-download it.") from None

    def keys(self) -> Iterable[str]:
        return self.key_to_file.keys()

    @contextmanager
    def _slice(self, key: str):
        """``key``'s lazy slice, its file mapped only for the duration: pages a read touches leave the RSS
        when the mapping closes, so reading tensor after tensor never accumulates the whole file."""
        path = self.key_to_file[key]
        if not path.is_file():
            raise MissingInput(f"checkpoint shard {path} named in the index is missing; "
                                    "copy the complete checkpoint directory.")
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as err:
            raise UserError(f"safetensors file {path} is truncated or corrupt ({err}); re-save or "
                             "re-download it.") from None
        with handle:
            yield handle.get_slice(key)

    def shape(self, key: str) -> list[int]:
        with self._slice(key) as tensor_slice:
            return list(tensor_slice.get_shape())

    def read(self, key: str, dim: int | None = None, ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """The tensor ``key``, or only ``ranges`` of it along ``dim`` (concatenated)."""
        with self._slice(key) as tensor_slice:
            try:
                if dim is None:
                    return tensor_slice[:]
                pieces = []
                for start, end in ranges:
                    index = tuple([slice(None)] * dim + [slice(start, end)])
                    pieces.append(tensor_slice[index])
            except (SafetensorError, OSError, RuntimeError) as err:
                raise UserError(f"tensor {key!r} in {self.key_to_file[key]} cannot be read ({err}); the file "
                                 "is truncated or corrupt, re-save it.") from None
        return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def read_local_shard(files: CheckpointFiles, hf: HFParam, param: torch.Tensor,
                     parallel: ParallelState | None) -> torch.Tensor:
    """This rank's piece of ``hf``'s tensor(s), in zoo's layout and padding, shaped like ``param``."""
    spec = hf.spec
    if hf.fused:  # each block is split across ranks on its own; the shard stacks the rank's pieces
        dim = spec.block_dim
        block_shape = list(param.shape)
        block_shape[dim] //= len(hf.keys)
        block = torch.empty(block_shape, device="meta")
        pieces = [read_local_shard(files, HFParam((key,), spec.block()), block, parallel) for key in hf.keys]
        return torch.cat(pieces, dim=dim)
    parallel = as_state(parallel)
    tp, rank = parallel.tp_size, parallel.tp_rank
    file_shape = files.shape(hf.key)
    expected = list(spec.file_shape(param.shape, tp))
    if file_shape != expected:
        raise UserError(f"checkpoint tensor {hf.key!r} has shape {file_shape} but the model expects "
                         f"{expected}; the config.json does not match the weights.")
    if not spec.is_sharded:
        tensor = files.read(hf.key)
        return tensor.t() if spec.transposed else tensor
    dim = spec.dim
    file_dim = spec.file_dim(param.dim())
    if spec.vocab_rows is not None:                      # vocab rows: real rows of this rank, then zeros
        per_rank = param.shape[dim]
        start = rank * per_rank
        end = min(start + per_rank, spec.vocab_rows)
        local = files.read(hf.key, file_dim, [(start, end)]) if end > start else None
        pad_shape = list(param.shape)
        pad_shape[dim] = per_rank - max(end - start, 0)
        if local is not None and pad_shape[dim] == 0:
            return local                                 # no padding on this rank: no concatenated copy
        padding = torch.zeros(pad_shape, dtype=local.dtype if local is not None else param.dtype)
        return padding if local is None else torch.cat([local, padding], dim=dim)
    ranges = shard_index(file_shape[file_dim], rank, tp, spec.stride)
    tensor = files.read(hf.key, file_dim, ranges)
    return tensor.t() if spec.transposed else tensor


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, directory: str | os.PathLike, param_map: dict[str, HFParam],
                    parallel: ParallelState | None, ignorable: Iterable[str] = (),
                    ignorable_prefixes: Iterable[str] = (), may_be_missing: Iterable[str] = ()) -> list[str]:
    """Fill every parameter of ``model`` from a transformers directory, this rank's slices only.

    Missing keys and keys the model does not know are errors, except file keys ending in one of
    ``ignorable`` or starting with one of ``ignorable_prefixes``, and parameters whose zoo name
    starts with one of ``may_be_missing`` (returned, left for the caller to initialise).
    """
    files = CheckpointFiles(directory)
    available = set(files.keys())
    params = dict(model.named_parameters())
    may_be_missing = tuple(may_be_missing)
    missing = []
    for name, param in params.items():
        hf = param_map[name]
        absent = [key for key in hf.keys if key not in available]
        if absent and name.startswith(may_be_missing) and may_be_missing:
            missing.append(name)
            continue
        if absent:
            raise UserError(f"checkpoint {directory} has no tensor {absent[0]!r} (needed for {name}); "
                             "it was not written for this model type or config.")
        local = read_local_shard(files, hf, param, parallel)
        param.copy_(local.to(param.dtype))
    wanted = {key for hf in param_map.values() for key in hf.keys}
    ignorable, ignorable_prefixes = tuple(ignorable), tuple(ignorable_prefixes)
    unexpected = sorted(k for k in available - wanted
                        if not k.endswith(ignorable) and not (ignorable_prefixes and k.startswith(ignorable_prefixes)))
    if unexpected:
        raise UserError(f"checkpoint {directory} has tensors this model does not use, e.g. {unexpected[0]!r} "
                         f"({len(unexpected)} in all); load it with the matching model class.")
    return missing


# --------------------------------------------------------------------------- writing
def gather_master(local: torch.Tensor, parallel: ParallelState | None, spec: PartitionSpec) -> torch.Tensor:
    """Collective over the TP group: the full tensor in transformers' layout (merged, unpadded)."""
    parallel = as_state(parallel)
    full = local.detach()
    if spec.is_sharded and parallel.tp_size > 1:
        pieces = [torch.empty_like(full) for _ in range(parallel.tp_size)]
        dist.all_gather(pieces, full.contiguous(), group=parallel.tp_group)
        full = spec.merge(pieces)
    else:
        full = full.clone()  # never hand out an alias of a live parameter
    return spec.to_file_layout(full)


def hf_state_dict(model: torch.nn.Module, parallel: ParallelState | None,
                  tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Collective: the model's parameters (or ``tensors`` keyed like them, e.g. gradients) merged across
    TP into transformers' keys and layout, on every rank. It holds the whole model on every rank: for
    comparisons in tests; saving streams instead (:func:`stream_pretrained`)."""
    out = {}
    for name, hf in hf_params(model).items():
        full = gather_master(model.get_parameter(name) if tensors is None else tensors[name], parallel, hf.spec)
        if hf.fused:
            out.update({key: block.contiguous() for key, block in zip(hf.keys, full.chunk(len(hf.keys),
                                                                                        dim=hf.spec.block_dim))})
        else:
            out[hf.key] = full
    return out


def is_hf_export(directory: Path) -> bool:
    """``directory`` holds a transformers model and nothing else: config.json, the weights (model.safetensors,
    or shards with their index) and tokenizer files. Only such a directory may be replaced by a new export,
    so an ``--out`` that names a run directory (checkpoints, metrics) or any other folder is never deleted."""
    entries = list(Path(directory).iterdir())
    if not all(entry.is_file() for entry in entries):   # a sub-directory is never part of an export
        return False
    names = {entry.name for entry in entries}
    shards = {name for name in names if SHARD_FILE_RE.fullmatch(name)}
    known = {"config.json", GENERATION_CONFIG_FILE, SINGLE_FILE, INDEX_FILE, *TOKENIZER_FILE_NAMES} | shards
    has_weights = SINGLE_FILE in names or (INDEX_FILE in names and bool(shards))
    return "config.json" in names and has_weights and names <= known


def check_pretrained_target(directory: str | os.PathLike) -> None:
    """Refuse, before any work, an output directory :func:`stream_pretrained` could not create or would have
    to delete (a file, a directory under a file, a directory that is not a Hugging Face export)."""
    check_output_directory(directory, is_hf_export, EXPORT_KIND)


# --------------------------------------------------------------------------- streaming writes
@dataclass(frozen=True)
class OutputTensor:
    """One tensor of a transformers checkpoint being written: its key, shape (transformers' layout)
    and dtype, where it comes from (a zoo parameter ``name``, and the ``block`` of a fused one), and
    how huggingface_hub's split counts it.

    ``split_bytes`` and ``group`` reproduce what the split saw when zoo wrote a merged state dict in
    memory: the blocks of a fused parameter that were not cast were views of one storage, so the
    first block counted the whole storage and the others joined its shard (``group``, the storage).
    """

    key: str
    name: str
    block: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    split_bytes: int
    group: object = None

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def output_tensors(named_params: Iterable[tuple[str, torch.Tensor]], param_map: dict[str, HFParam],
                   parallel: ParallelState | None, dtype: torch.dtype | None = None,
                   source_dtypes: dict[str, torch.dtype] | None = None) -> list[OutputTensor]:
    """The transformers tensors of a model, from its (possibly meta) parameters alone: no data, no
    communication. ``dtype``: the written dtype (default: each source's); ``source_dtypes``: the dtype of
    each parameter's data when it is not the parameter's own (an exported checkpoint)."""
    tp = as_state(parallel).tp_size
    out = []
    for name, param in named_params:
        hf = param_map[name]
        source = (source_dtypes or {}).get(name, param.dtype)
        written = dtype or source
        if not hf.fused:
            entry = OutputTensor(hf.key, name, None, hf.spec.file_shape(param.shape, tp), written, 0)
            out.append(_with_split_bytes(entry, entry.nbytes))
            continue
        master = list(hf.spec.master_shape(param.shape, tp))
        master[hf.spec.block_dim] //= len(hf.keys)
        shape = tuple(master[::-1] if hf.spec.transposed else master)
        shared = written == source          # uncast blocks were views of the merged parameter
        for block, key in enumerate(hf.keys):
            entry = OutputTensor(key, name, block, shape, written, 0, name if shared else None)
            total = entry.nbytes * (len(hf.keys) if shared and block == 0 else 1)
            out.append(_with_split_bytes(entry, total))
    return out


def _with_split_bytes(entry: OutputTensor, split_bytes: int) -> OutputTensor:
    return OutputTensor(entry.key, entry.name, entry.block, entry.shape, entry.dtype, split_bytes, entry.group)


def check_max_shard_size(max_shard_size: int | str) -> None:
    """Refuse a ``max_shard_size`` huggingface_hub cannot read, with one sentence."""
    plan_files([], max_shard_size)


def plan_files(outputs: list[OutputTensor], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
    """huggingface_hub's split of the tensors into files (keys in order, a new shard when the next tensor
    would pass the limit, a tensor bigger than the limit alone), from sizes only: the names and the index
    are exactly what transformers writes and reads."""
    try:
        return split_state_dict_into_shards_factory(
            {entry.key: entry for entry in outputs}, get_storage_size=lambda entry: entry.split_bytes,
            get_storage_id=lambda entry: entry.group, filename_pattern=SHARD_PATTERN, max_shard_size=max_shard_size)
    except ValueError as err:
        raise UserError(f"max_shard_size {max_shard_size!r} is not a size ({err}); pass bytes as an int or a "
                         "string such as '5GB'.") from None


def stream_pretrained(directory: str | os.PathLike, config_dict: dict, outputs: list[OutputTensor],
                      produce: Callable[[OutputTensor], list[torch.Tensor] | None], tokenizer_files: Iterable[Path],
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, is_writer: bool = True) -> Exception | None:
    """Write a transformers directory tensor by tensor (:func:`zoo.checkpoint.hf.safetensors_io.stream_directory`):
    ``produce(entry)`` returns the entry's data on the writer and is called in the same order on every rank
    (it may be a collective that returns None off the writer). An existing ``directory`` is replaced only if
    it is itself a Hugging Face export (:func:`is_hf_export`).

    Files follow :func:`plan_files` (model.safetensors, or transformers' shards
    ``model-0000k-of-0000n.safetensors`` plus model.safetensors.index.json), with config.json, the
    tokenizer files and, for a model transformers can generate with, generation_config.json
    (:func:`generation_config_json`). Returns the writer's error (None on success) once every entry was produced.
    """
    split = plan_files(outputs, max_shard_size)
    by_key = {entry.key: entry for entry in outputs}
    files = [(name, safetensors_order([by_key[key] for key in keys])) for name, keys in
             split.filename_to_tensors.items()]
    text_files = {"config.json": json.dumps(config_dict, indent=2, sort_keys=True) + "\n"}
    if is_writer and (generation := generation_config_json(config_dict)) is not None:
        text_files[GENERATION_CONFIG_FILE] = generation
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        text_files[INDEX_FILE] = json.dumps(index, indent=2, sort_keys=True) + "\n"
    return stream_directory(directory, files, produce, text_files, tokenizer_files, is_hf_export, EXPORT_KIND,
                            is_writer)


def generation_config_json(config_dict: dict) -> str | None:
    """generation_config.json exactly as transformers' ``save_pretrained`` writes it for the model that
    ``config_dict`` (config.json's contents) describes, or None where transformers writes none.

    transformers writes the file only for an architecture that can generate (GPT2LMHeadModel: yes; BERT's
    pretraining and task models: no), with the values ``GenerationConfig.from_model_config`` takes from the
    model config (for GPT-2: bos_token_id = eos_token_id = 50256, no pad token), through
    ``GenerationConfig.save_pretrained``. Both are called here, so the file follows the installed
    transformers and ``GenerationConfig.from_pretrained`` reads it back."""
    import transformers  # local: only the writer of an export needs transformers' generation classes

    architectures = config_dict.get("architectures") or []
    model_classes = [getattr(transformers, name, None) for name in architectures]
    if not model_classes or not all(cls is not None and cls.can_generate() for cls in model_classes):
        return None
    model_config = transformers.AutoConfig.for_model(**config_dict)
    generation = transformers.GenerationConfig.from_model_config(model_config)
    with tempfile.TemporaryDirectory(prefix="zoo-generation-config-") as scratch:
        generation.save_pretrained(scratch)
        return (Path(scratch) / GENERATION_CONFIG_FILE).read_text(encoding="utf-8")


def hf_rows(pieces: list[torch.Tensor], param: torch.Tensor, hf: HFParam, entry: OutputTensor) -> list[torch.Tensor]:
    """One output tensor in transformers' layout and ``entry.dtype``, from every TP rank's piece of it (zoo's
    layout, rank order; one piece for a replicated parameter), as consecutive row blocks.

    When the pieces are consecutive rows of the output (split along the file's first dimension, no stride:
    the vocabulary rows, GPT-2's row-parallel Conv1D weights) they are written as they are, vocab padding
    cut as a view, one cast at a time: the merged tensor is never built, and at tp = 1 the padded embedding
    is not copied. Otherwise they are merged first."""
    spec = hf.spec if entry.block is None else hf.spec.block()
    if not spec.is_sharded:
        return [spec.to_file_layout(pieces[0])]
    if spec.file_dim(param.dim()) == 0 and spec.stride == 1:   # also at tp = 1: the padding is cut as a view
        rows, left = [], entry.shape[0]
        for piece in pieces:
            piece = piece.t() if spec.transposed else piece
            rows.append(piece[:max(min(left, piece.shape[0]), 0)])
            left -= piece.shape[0]
        return rows
    if len(pieces) == 1:
        return [spec.to_file_layout(pieces[0])]
    merged = spec.merge(pieces)
    pieces.clear()
    return [spec.to_file_layout(merged)]


def model_producer(model: torch.nn.Module, param_map: dict[str, HFParam], parallel: ParallelState | None,
                   is_writer: bool) -> Callable[[OutputTensor], list[torch.Tensor] | None]:
    """``produce`` for :func:`stream_pretrained` from a live model: a collective over the TP group for a
    sharded parameter (gathered to the writer only, :func:`zoo.parallel.gather.gather_to_first`), a local
    read on the writer for a replicated one; None on every rank but the writer."""
    parallel = as_state(parallel)
    params = dict(model.named_parameters())

    def produce(entry: OutputTensor) -> list[torch.Tensor] | None:
        param, hf = params[entry.name], param_map[entry.name]
        local = local_block(param.detach(), hf, entry)
        if hf.spec.is_sharded and parallel.tp_size > 1:
            pieces = gather_to_first(local, parallel.tp_group)
        else:
            pieces = [local.cpu()] if is_writer else None
        return None if pieces is None else hf_rows(pieces, param, hf, entry)

    return produce


def local_block(local: torch.Tensor, hf: HFParam, entry: OutputTensor) -> torch.Tensor:
    """This rank's part of ``entry``: the whole local tensor, or one block of a fused parameter's shard
    (each rank's shard stacks its piece of every block along the split dimension)."""
    if entry.block is None:
        return local
    return local.chunk(len(hf.keys), dim=hf.spec.block_dim)[entry.block]


def read_config_json(directory: str | os.PathLike) -> dict:
    """config.json of a checkpoint directory as a JSON object, with one-sentence errors. Its fields are the
    family's to check (:func:`zoo.models.families.read_checked_config_json`, or a model class's
    ``check_hf_config`` after it has named the ``model_type`` it expects)."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise MissingInput(f"checkpoint directory {directory} does not exist; pass the directory that "
                                "save_pretrained wrote.")
    if not path.is_file():
        raise MissingInput(f"checkpoint directory {directory} has no config.json; pass a directory "
                                "written by save_pretrained (zoo or transformers).")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                         "fix or re-save the checkpoint.") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err}); fix or re-save the checkpoint.") from None
    check_json_object(values, path)
    return values


def check_json_object(values: Any, path: Any) -> None:
    """config.json holds a JSON object, else one sentence naming the file."""
    if not isinstance(values, dict):
        raise UserError(f"{path} holds {json_kind(values)}, not a JSON object; pass a model directory whose "
                         "config.json is the model's configuration as save_pretrained writes it.")
