"""Export a zoo DeepSpeed training checkpoint, written at any tp degree, to transformers' GPT-2 layout.

One process does it, whatever number of processes trained the model. DeepSpeed wrote one
``mp_rank_XX_model_states.pt`` per TP rank (data-parallel replicas write nothing extra), each holding
that rank's ``module`` state dict plus zoo's client state (``zoo_model``, ``model_config``,
``tensor_parallel_size``, ...). The exporter

1. finds the tag directory (``latest`` or ``--tag``) and checks every TP rank's file is there,
2. recovers the model config and builds the zoo model on the meta device with a layout-only
   :class:`ParallelState` of that tp degree, which tells each parameter's ``partition_dim``,
   ``partition_stride`` and transformers key without allocating or communicating,
3. merges the shards with :func:`zoo.parallel.utils.merge_shards`, cuts the vocab padding and
   transposes the Conv1D weights (:func:`zoo.models.hf_io.to_hf_layout`),
4. writes config.json, safetensors (sharded above ``max_shard_size``) and the bundled GPT-2 tokenizer
   files with the same atomic writer as ``save_pretrained``.
"""

from __future__ import annotations

import argparse
import pickle
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zoo.models.config import GPT2Config
from zoo.models.gpt2 import GPT2_TOKENIZER_DIR, GPT2LMHeadModel
from zoo.models.pretrained import tokenizer_files, with_dtype
from zoo.models.hf_io import DEFAULT_MAX_SHARD_SIZE, to_hf_layout, write_pretrained
from zoo.models.presets import gpt2_config
from zoo.parallel.layers import is_tensor_parallel
from zoo.parallel.state import ParallelState
from zoo.parallel.utils import merge_shards

CHECKPOINT_SUBDIR = "checkpoints"
LATEST_FILE = "latest"
MODEL_STATES = "mp_rank_{:02d}_model_states.pt"
MODEL_STATES_RE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote and from where."""

    out: Path
    tag_dir: Path
    tp_size: int
    dtype: torch.dtype
    config_source: str   # "client_state['model_config']" or how the config was inferred


# --------------------------------------------------------------------------- locating the files
def checkpoints_root(load: str | Path) -> Path:
    """The DeepSpeed save directory: ``load/checkpoints`` of a run directory, or ``load`` itself."""
    load = Path(load)
    if not load.exists():
        raise FileNotFoundError(f"checkpoint path {load} does not exist; pass the run directory written with "
                                "--save or its checkpoints/ directory.")
    if (load / CHECKPOINT_SUBDIR).is_dir():
        return load / CHECKPOINT_SUBDIR
    if (load / LATEST_FILE).is_file() or tags_in(load):
        return load
    raise FileNotFoundError(f"no DeepSpeed checkpoint under {load}; pass a run directory written with --save "
                            "(it holds checkpoints/latest) or its checkpoints/ directory.")


def tags_in(root: Path) -> list[str]:
    """Sub-directories of ``root`` that hold at least one model-states file."""
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and any(d.glob("mp_rank_*_model_states.pt")))


def tag_directory(load: str | Path, tag: str | None = None) -> Path:
    """The directory of checkpoint ``tag``, by default the one named in ``latest``."""
    root = checkpoints_root(load)
    if tag is None:
        latest = root / LATEST_FILE
        if not latest.is_file():
            raise FileNotFoundError(f"{root} has no '{LATEST_FILE}' file naming the checkpoint to export; pass "
                                    f"--tag with one of {tags_in(root)}.")
        tag = latest.read_text().strip()
    directory = root / tag
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint tag {tag!r} is not a directory under {root}; pass --tag with one of "
                                f"{tags_in(root)}.")
    return directory


def model_states_path(tag_dir: Path, tp_rank: int) -> Path:
    return tag_dir / MODEL_STATES.format(tp_rank)


def check_rank_files(tag_dir: Path, tp_size: int) -> None:
    """Every TP rank's model-states file is present, and no file of another tp degree."""
    for rank in range(tp_size):
        if not model_states_path(tag_dir, rank).is_file():
            raise FileNotFoundError(f"{model_states_path(tag_dir, rank)} is missing from a tp={tp_size} "
                                    "checkpoint; copy every mp_rank_XX_model_states.pt of the tag.")
    ranks = sorted(int(m.group(1)) for p in tag_dir.iterdir() if (m := MODEL_STATES_RE.fullmatch(p.name)))
    if ranks != list(range(tp_size)):
        raise ValueError(f"{tag_dir} holds model states of ranks {ranks} but its client state says "
                         f"tensor_parallel_size={tp_size}; remove the stray files or re-save the checkpoint.")


# --------------------------------------------------------------------------- reading one rank
def read_model_states(path: Path) -> dict[str, Any]:
    """One rank's model-states file, memory-mapped so that unused entries (optimizer state) stay on disk."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; copy every mp_rank_XX_model_states.pt of the tag.")
    try:
        # weights_only=False: DeepSpeed's model-states files pickle the client state (python/numpy RNG
        # states, configs), which the weights-only unpickler refuses. Only load checkpoints you trust.
        states = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError, AttributeError,
            ModuleNotFoundError) as err:
        raise ValueError(f"{path} cannot be read as a torch checkpoint ({_first_line(err)}); it is truncated or "
                         "not a DeepSpeed model-states file, re-save it.") from None
    if not isinstance(states, dict) or not isinstance(states.get("module"), dict):
        raise ValueError(f"{path} has no 'module' state dict; it is not a DeepSpeed model-states file, pass the "
                         "checkpoint that zoo's pretrain wrote.")
    if "zoo_model" not in states:
        raise ValueError(f"{path} is not a zoo GPT-2 checkpoint (its client state has no 'zoo_model'); export "
                         "only checkpoints written by zoo's pretrain.")
    return states


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def tp_size_of_states(states: dict[str, Any], path: Path) -> int:
    tp = states.get("tensor_parallel_size", states.get("mp_world_size"))
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{path} records no valid tensor_parallel_size ({tp!r}); it is not a checkpoint written "
                         "by zoo's pretrain.")
    return tp


# --------------------------------------------------------------------------- the model's layout
def layout_only_state(tp_size: int, tp_rank: int = 0) -> ParallelState:
    """A grid position with no process groups: enough to build a model's shapes and partition tags,
    never to run it (any collective on it would fail)."""
    return ParallelState(tp_size=tp_size, tp_rank=tp_rank, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                         world_size=tp_size, rank=tp_rank)


def layout_model(config: GPT2Config, tp_size: int) -> GPT2LMHeadModel:
    """The zoo GPT-2 of one TP rank on the meta device: names, local shapes and partition tags only."""
    with torch.device("meta"):
        return GPT2LMHeadModel(config, layout_only_state(tp_size))


def recover_config(states: dict[str, Any], tp_size: int, path: Path) -> tuple[GPT2Config, str]:
    """The model config of a checkpoint and where it came from.

    zoo's pretrain stores the full config (``model_config``, transformers' field names). For older
    checkpoints without it, start from the ``zoo_model`` preset and read every size the shapes reveal:
    n_layer, n_embd, n_positions, n_inner (n_head is not visible in the shapes and stays the preset's).
    """
    module = states["module"]
    if isinstance(states.get("model_config"), dict):
        config, source = GPT2Config.from_dict(states["model_config"]), "client_state['model_config']"
    else:
        try:
            config = gpt2_config(states["zoo_model"])
        except ValueError:
            raise ValueError(f"{path} names model preset {states['zoo_model']!r}, which zoo does not know, and "
                             "stores no model_config; export it with the zoo version that trained it.") from None
        config, source = _sizes_from_shapes(config, module, tp_size, path), \
            f"preset {states['zoo_model']!r} with n_layer/n_embd/n_positions/n_inner read from the weight shapes"
    return _match_vocab_padding(config, module, tp_size, path), source


def _sizes_from_shapes(config: GPT2Config, module: dict[str, torch.Tensor], tp_size: int,
                       path: Path) -> GPT2Config:
    try:
        n_positions, n_embd = module["transformer.wpe.weight"].shape
        n_layer = len({k.split(".")[2] for k in module if k.startswith("transformer.h.")})
        ffn = module["transformer.h.0.mlp.c_fc.weight"].shape[0] * tp_size
    except (KeyError, ValueError):
        raise ValueError(f"{path} lacks zoo GPT-2 parameters such as transformer.wpe.weight; it is not a zoo GPT-2 "
                         "checkpoint.") from None
    return config.replace(n_positions=n_positions, n_embd=n_embd, n_layer=n_layer,
                          n_inner=None if ffn == 4 * n_embd else ffn)


def _match_vocab_padding(config: GPT2Config, module: dict[str, torch.Tensor], tp_size: int,
                         path: Path) -> GPT2Config:
    """config.json does not carry zoo's ``make_vocab_size_divisible_by``; take the padding the weights have."""
    wte = module.get("transformer.wte.weight")
    if wte is None:
        raise ValueError(f"{path} has no transformer.wte.weight; it is not a zoo GPT-2 checkpoint.")
    rows = wte.shape[0]
    if rows * tp_size == config.padded_vocab_size(tp_size) or rows * tp_size < config.vocab_size:
        return config   # the default padding matches, or nothing does (the shape check reports it)
    return config.replace(make_vocab_size_divisible_by=rows)   # one unit of rows * tp covers the vocab


def check_layout(layout: GPT2LMHeadModel, module: dict[str, torch.Tensor], path: Path) -> None:
    """The rank's state dict has exactly the layout's names and local shapes."""
    expected = {name: tuple(t.shape) for name, t in layout.state_dict().items()}
    unknown = sorted(set(module) - set(expected))
    missing = sorted(set(expected) - set(module))
    if unknown or missing:
        example = f"unexpected {unknown[0]!r}" if unknown else f"missing {missing[0]!r}"
        raise ValueError(f"{path} does not have the parameters of a zoo GPT-2 ({example}); it is not a zoo GPT-2 "
                         "checkpoint of the recorded model config.")
    for name, shape in expected.items():
        if tuple(module[name].shape) != shape:
            raise ValueError(f"{path} holds {name} of shape {tuple(module[name].shape)} but the recorded model "
                             f"config at tp={layout.parallel.tp_size} gives {shape}; the "
                             "checkpoint's client state does not match its weights.")


# --------------------------------------------------------------------------- merging
def merged_hf_state(layout: GPT2LMHeadModel, modules: list[dict[str, torch.Tensor]],
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every TP rank's module state dict merged into transformers' keys and layout.

    Sharded parameters are concatenated along their ``partition_dim`` in rank order (respecting
    ``partition_stride``, i.e. the per-rank [q | k | v] blocks of the fused QKV); replicated ones are
    taken from rank 0.
    """
    param_map = layout.hf_param_map()
    out = {}
    for name, param in layout.named_parameters():
        spec = param_map[name]
        shards = [module[name] for module in modules]
        if is_tensor_parallel(param):
            master = merge_shards(shards, param.partition_dim, getattr(param, "partition_stride", 1))
        else:
            master = shards[0]
        tensor = to_hf_layout(master, spec)
        out[spec.key] = tensor.to(dtype) if dtype is not None else tensor.clone()
    return out


# --------------------------------------------------------------------------- the whole export
def export_checkpoint(load: str | Path, out: str | Path, tag: str | None = None, dtype: torch.dtype | None = None,
                      max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> ExportResult:
    """Write the transformers GPT-2 directory ``out`` from the zoo DeepSpeed checkpoint under ``load``.

    ``dtype`` defaults to the dtype of the checkpoint's module weights (fp32, fp16 or bf16).
    """
    tag_dir = tag_directory(load, tag)
    first_path = model_states_path(tag_dir, 0)
    if not first_path.is_file():
        raise FileNotFoundError(f"{first_path} is missing; a checkpoint tag holds mp_rank_00_model_states.pt and "
                                "one more file per TP rank, copy them all.")
    first = read_model_states(first_path)
    tp_size = tp_size_of_states(first, first_path)
    check_rank_files(tag_dir, tp_size)
    config, source = recover_config(first, tp_size, first_path)
    try:
        layout = layout_model(config, tp_size)
    except ValueError as err:
        raise ValueError(f"the model config recorded in {first_path} does not build at tp={tp_size} ({err}); the "
                         "checkpoint is not a consistent zoo GPT-2 checkpoint.") from None

    modules = []
    for rank in range(tp_size):
        path = model_states_path(tag_dir, rank)
        states = first if rank == 0 else read_model_states(path)
        if (recorded := tp_size_of_states(states, path)) != tp_size:
            raise ValueError(f"{path} records tensor_parallel_size={recorded} but rank 0 records {tp_size}; the "
                             "tag mixes files of two checkpoints, re-save it.")
        check_layout(layout, states["module"], path)
        modules.append(states["module"])   # keep only the weights; the rest of the file is dropped
        del states

    out_dtype = dtype or modules[0]["transformer.wte.weight"].dtype
    state = merged_hf_state(layout, modules, out_dtype)
    write_pretrained(out, with_dtype(config.to_hf_dict(), out_dtype), state, tokenizer_files(GPT2_TOKENIZER_DIR),
                     max_shard_size)
    return ExportResult(out=Path(out), tag_dir=tag_dir, tp_size=tp_size, dtype=out_dtype, config_source=source)


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Export a zoo DeepSpeed GPT-2 checkpoint (any tp degree) to a "
                                                 "transformers directory, in one process.")
    parser.add_argument("--load", required=True, help="run directory written with --save, or its checkpoints/")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    parser.add_argument("--out", required=True, help="output directory (replaced atomically)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="dtype of the written weights (default: the checkpoint's)")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="split the weights into indexed shards above this size, e.g. 2GB")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    size = int(args.max_shard_size) if str(args.max_shard_size).isdigit() else args.max_shard_size
    try:
        result = export_checkpoint(args.load, args.out, args.tag, DTYPES.get(args.dtype), size)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {result.tag_dir} (tp={result.tp_size}) to {result.out} in "
          f"{str(result.dtype).replace('torch.', '')}; model config from {result.config_source}")
