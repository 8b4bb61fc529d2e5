"""Reading and writing Hugging Face transformers checkpoints at any tp degree.

A model states, per parameter, the transformers key it maps to (:class:`HFParam`); the partition
rule comes from the parameter's own tags (``partition_dim``, ``partition_stride``). Loading reads
only this rank's slices with ``safetensors.safe_open(...).get_slice``; saving all-gathers the
shards, merges them back to the master layout and writes transformers' own layout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from zoo.atomic import check_output_directory, staged_directory
from zoo.parallel.layers import is_tensor_parallel
from zoo.parallel.state import ParallelState, tp_rank_of, tp_size_of
from zoo.parallel.utils import merge_shards, shard_index

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_PATTERN = "model{suffix}.safetensors"   # huggingface_hub fills in "-00001-of-00003" when sharded
DEFAULT_MAX_SHARD_SIZE = "5GB"                # the hub's default (transformers 5 uses 50GB)
SHARD_FILE_RE = re.compile(r"model-\d+-of-\d+\.safetensors")
TOKENIZER_FILE_NAMES = ("vocab.json", "merges.txt", "vocab.txt", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "added_tokens.json")
EXPORT_KIND = "Hugging Face export"


@dataclass(frozen=True)
class HFParam:
    """Where a zoo parameter lives in a transformers checkpoint.

    ``transpose``: transformers stores it transposed (GPT-2's Conv1D keeps weights as (in, out),
    zoo as nn.Linear's (out, in)). ``vocab_rows``: the tensor's first dim is the vocabulary, unpadded
    in the file (this many rows) and padded in zoo.
    """

    key: str | None
    transpose: bool = False
    vocab_rows: int | None = None
    fused: tuple[str, ...] = ()

    @property
    def keys(self) -> tuple[str, ...]:
        """The transformers keys behind this parameter: one, or the blocks of a fused parameter
        (e.g. BERT's query, key, value behind zoo's fused QKV, stacked along the partition dim)."""
        return self.fused or (self.key,)


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
                raise ValueError(f"checkpoint index {index} is not a valid safetensors index ({err}); "
                                 "re-save the checkpoint.") from None
            self.key_to_file = {k: self.directory / f for k, f in weight_map.items()}
        elif single.is_file():
            self.key_to_file = {k: single for k in self._keys_of(single)}
        else:
            raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.directory}; zoo reads "
                                    "safetensors only, re-save the model with safe_serialization=True.")
        self._handles: dict[Path, object] = {}

    @staticmethod
    def _keys_of(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="pt") as handle:
                return list(handle.keys())
        except (SafetensorError, OSError) as err:
            raise ValueError(f"safetensors file {path} is truncated or corrupt ({err}); re-save or "
                             "re-download it.") from None

    def keys(self) -> Iterable[str]:
        return self.key_to_file.keys()

    def _handle(self, key: str):
        path = self.key_to_file[key]
        if path not in self._handles:
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint shard {path} named in the index is missing; "
                                        "copy the complete checkpoint directory.")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise ValueError(f"safetensors file {path} is truncated or corrupt ({err}); re-save or "
                                 "re-download it.") from None
        return self._handles[path]

    def shape(self, key: str) -> list[int]:
        return list(self._handle(key).get_slice(key).get_shape())

    def read(self, key: str, dim: int | None = None, ranges: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """The tensor ``key``, or only ``ranges`` of it along ``dim`` (concatenated)."""
        tensor_slice = self._handle(key).get_slice(key)
        try:
            if dim is None:
                return tensor_slice[:]
            pieces = []
            for start, end in ranges:
                index = tuple([slice(None)] * dim + [slice(start, end)])
                pieces.append(tensor_slice[index])
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ValueError(f"tensor {key!r} in {self.key_to_file[key]} cannot be read ({err}); the file "
                             "is truncated or corrupt, re-save it.") from None
        return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def read_local_shard(files: CheckpointFiles, spec: HFParam, param: torch.Tensor,
                     parallel: ParallelState | None) -> torch.Tensor:
    """This rank's piece of ``spec.key``, in zoo's layout and padding, shaped like ``param``."""
    if spec.fused:  # each block is split across ranks on its own; the shard stacks the rank's pieces
        dim = param.partition_dim if is_tensor_parallel(param) else 0
        pieces = []
        for key in spec.fused:
            block_shape = list(param.shape)
            block_shape[dim] //= len(spec.fused)
            block = torch.empty(block_shape, device="meta")
            if is_tensor_parallel(param):
                block = _tag_like(block, param)
            pieces.append(read_local_shard(files, HFParam(key, spec.transpose), block, parallel))
        return torch.cat(pieces, dim=dim)
    file_shape = files.shape(spec.key)
    expected = list(_master_shape(param, parallel, spec))
    if spec.transpose:
        expected = expected[::-1]
    if file_shape != expected:
        raise ValueError(f"checkpoint tensor {spec.key!r} has shape {file_shape} but the model expects "
                         f"{expected}; the config.json does not match the weights.")
    if not is_tensor_parallel(param):
        tensor = files.read(spec.key)
        return tensor.t() if spec.transpose else tensor

    tp, rank = tp_size_of(parallel), tp_rank_of(parallel)
    dim = param.partition_dim
    file_dim = (param.dim() - 1 - dim) if spec.transpose else dim
    if spec.vocab_rows is not None:                      # vocab rows: real rows of this rank, then zeros
        per_rank = param.shape[dim]
        start = rank * per_rank
        end = min(start + per_rank, spec.vocab_rows)
        local = files.read(spec.key, file_dim, [(start, end)]) if end > start else None
        pad_shape = list(param.shape)
        pad_shape[dim] = per_rank - max(end - start, 0)
        if local is not None and pad_shape[dim] == 0:
            return local                                 # no padding on this rank: no concatenated copy
        padding = torch.zeros(pad_shape, dtype=local.dtype if local is not None else param.dtype)
        return padding if local is None else torch.cat([local, padding], dim=dim)
    stride = 1 if spec.fused else getattr(param, "partition_stride", 1)
    ranges = shard_index(file_shape[file_dim], rank, tp, stride)
    tensor = files.read(spec.key, file_dim, ranges)
    return tensor.t() if spec.transpose else tensor


def _tag_like(block: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A stand-in for one block of a fused parameter: same partition dim, no stride."""
    block.tensor_model_parallel = True
    block.partition_dim = param.partition_dim
    block.partition_stride = 1
    return block


def _master_shape(param: torch.Tensor, parallel: ParallelState | None, spec: HFParam) -> tuple[int, ...]:
    shape = list(param.shape)
    if is_tensor_parallel(param):
        shape[param.partition_dim] *= tp_size_of(parallel)
    if spec.vocab_rows is not None:
        shape[0] = spec.vocab_rows
    return tuple(shape)


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
        spec = param_map[name]
        absent = [key for key in spec.keys if key not in available]
        if absent and name.startswith(may_be_missing) and may_be_missing:
            missing.append(name)
            continue
        if absent:
            raise ValueError(f"checkpoint {directory} has no tensor {absent[0]!r} (needed for {name}); "
                             "it was not written for this model type or config.")
        local = read_local_shard(files, spec, param, parallel)
        param.copy_(local.to(param.dtype))
    wanted = {key for spec in param_map.values() for key in spec.keys}
    ignorable, ignorable_prefixes = tuple(ignorable), tuple(ignorable_prefixes)
    unexpected = sorted(k for k in available - wanted
                        if not k.endswith(ignorable) and not (ignorable_prefixes and k.startswith(ignorable_prefixes)))
    if unexpected:
        raise ValueError(f"checkpoint {directory} has tensors this model does not use, e.g. {unexpected[0]!r} "
                         f"({len(unexpected)} in all); load it with the matching model class.")
    return missing


# --------------------------------------------------------------------------- writing
def gather_master(local: torch.Tensor, param: torch.Tensor, parallel: ParallelState | None,
                  spec: HFParam) -> torch.Tensor:
    """Collective over the TP group: the full tensor in transformers' layout (merged, unpadded)."""
    full = local.detach()
    if is_tensor_parallel(param) and tp_size_of(parallel) > 1:
        pieces = [torch.empty_like(full) for _ in range(parallel.tp_size)]
        dist.all_gather(pieces, full.contiguous(), group=parallel.tp_group)
        full = merge_shards(pieces, param.partition_dim, getattr(param, "partition_stride", 1))
    else:
        full = full.clone()  # never hand out an alias of a live parameter
    return to_hf_layout(full, spec)


def to_hf_layout(master: torch.Tensor, spec: HFParam) -> torch.Tensor:
    """A merged zoo master tensor in transformers' layout: vocab padding cut, Conv1D transposed."""
    if spec.vocab_rows is not None and master.shape[0] > spec.vocab_rows:
        master = master[:spec.vocab_rows].clone()   # own storage: a view would keep (and count) the padding
    if spec.transpose:
        master = master.t()
    return master.contiguous()


def hf_state_dict(model: torch.nn.Module, param_map: dict[str, HFParam], parallel: ParallelState | None,
                  tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Collective: the model's parameters (or ``tensors`` keyed like them, e.g. gradients) merged across
    TP into transformers' keys and layout, on every rank."""
    out = {}
    for name, param in model.named_parameters():
        local = param if tensors is None else tensors[name]
        spec = param_map[name]
        full = gather_master(local, param, parallel, spec)
        if spec.fused:
            dim = param.partition_dim if is_tensor_parallel(param) else 0
            out.update({key: block.contiguous()
                        for key, block in zip(spec.fused, full.chunk(len(spec.fused), dim=dim))})
        else:
            out[spec.key] = full
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
    known = {"config.json", "generation_config.json", SINGLE_FILE, INDEX_FILE, *TOKENIZER_FILE_NAMES} | shards
    has_weights = SINGLE_FILE in names or (INDEX_FILE in names and bool(shards))
    return "config.json" in names and has_weights and names <= known


def check_pretrained_target(directory: str | os.PathLike) -> None:
    """Refuse, before any work, an output directory :func:`write_pretrained` could not create or would have
    to delete (a file, a directory under a file, a directory that is not a Hugging Face export)."""
    check_output_directory(directory, is_hf_export, EXPORT_KIND)


def write_pretrained(directory: str | os.PathLike, config_dict: dict, state: dict[str, torch.Tensor],
                     tokenizer_files: Iterable[Path], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
    """Write config.json, the weights and the tokenizer files atomically (temp dir, then rename), with the
    permissions the umask gives. An existing ``directory`` is replaced only if it is itself a Hugging Face
    export (:func:`is_hf_export`); anything else is refused with a ``ValueError`` before anything is written.

    Weights up to ``max_shard_size`` (bytes, or a string such as "5GB") go to model.safetensors;
    larger ones to transformers' shards ``model-0000k-of-0000n.safetensors`` plus
    model.safetensors.index.json ({"metadata": {"total_size": bytes}, "weight_map": {key: file}}).
    """
    with staged_directory(directory, is_hf_export, EXPORT_KIND) as staging:
        (staging / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        write_safetensors(staging, state, max_shard_size)
        for path in tokenizer_files:
            shutil.copyfile(path, staging / Path(path).name)   # copyfile, not copy2: the umask sets the mode


def write_safetensors(directory: Path, state: dict[str, torch.Tensor],
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Save ``state`` into ``directory`` as one file or as indexed shards; returns the file names.

    The split is huggingface_hub's (keys in order, a new shard when the next tensor would pass the
    limit; a tensor bigger than the limit gets a shard of its own), so the names and the index are
    exactly what transformers writes and reads.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    try:
        split = split_torch_state_dict_into_shards(state, filename_pattern=SHARD_PATTERN,
                                                   max_shard_size=max_shard_size)
    except ValueError as err:
        raise ValueError(f"max_shard_size {max_shard_size!r} is not a size ({err}); pass bytes as an int or a "
                         "string such as '5GB'.") from None
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: state[k].contiguous() for k in keys}, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return list(split.filename_to_tensors)


def read_config_json(directory: str | os.PathLike) -> dict:
    """config.json of a checkpoint directory, with one-sentence errors."""
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist; pass the directory that "
                                "save_pretrained wrote.")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint directory {directory} has no config.json; pass a directory "
                                "written by save_pretrained (zoo or transformers).")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); fix or re-save the checkpoint.") from None
