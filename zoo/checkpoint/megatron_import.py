"""Import a Megatron-LM GPT checkpoint into zoo's Hugging Face GPT-2 layout, in one process.

Megatron-LM writes one file per model-parallel rank::

    <load>/latest_checkpointed_iteration.txt          "1000", or "release"
    <load>/iter_0001000/mp_rank_XX/model_optim_rng.pt            pp = 1 (XX: tp rank)
    <load>/iter_0001000/mp_rank_XX_YYY/model_optim_rng.pt        pp > 1 (YYY: pp rank)
    <load>/release/...                                             released weights

Each file holds ``args`` (the run's argparse Namespace: the model's shape and parallel layout),
``checkpoint_version`` and ``model``, a nested dict whose dotted paths are the parameter names. The import

1. finds the iteration directory (``--iteration``, else the tracker file) and every (tp, pp) rank's file,
2. reads each with torch's weights-only unpickler and a named allow-list (:func:`megatron_safe_globals`):
   anything else a file names is refused in one sentence before any of it is built,
3. names every tensor by its transformers GPT-2 key (:func:`gpt2_target`), whichever generation of
   Megatron's names it carries (legacy ``language_model.{transformer,encoder}...``, and Megatron Core's
   ``decoder...`` in its per-rank "torch" format), with layer numbers made global (each pipeline stage numbers its layers
   from 0: stage s adds the layers of stages 0 .. s-1),
4. merges the tp shards (column-parallel weights on dim 0, row-parallel ones on dim 1, the vocab on dim 0
   then cut to the real vocabulary; the fused QKV is put back from Megatron's per-rank interleaving, which
   depends on ``checkpoint_version``), transposes the linear weights to GPT-2's Conv1D layout,
5. streams the tensors, one merged tensor at a time (the rank files stay memory-mapped), through the writer
   of ``save_pretrained`` and ``launch/export.py`` (:func:`zoo.checkpoint.hf.hf_io.stream_pretrained`): config.json,
   safetensors, generation_config.json and the GPT-2 tokenizer files, atomically, into a new or empty
   directory only.

The result loads with ``transformers.GPT2LMHeadModel.from_pretrained`` and with zoo's
``GPT2LMHeadModel.from_pretrained(path, parallel=parallel)`` at any tp, so zoo finetunes or continues from it.
"""

from __future__ import annotations

import argparse
import functools
import io
import math
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zoo.atomic import check_output_directory
from zoo.checkpoint.hf.hf_io import DEFAULT_MAX_SHARD_SIZE, OutputTensor, stream_pretrained
from zoo.checkpoint.safe_load import is_refused_global, refused_global
from zoo.errors import MissingInput, UserError
from zoo.models.families import family_of_model_type
from zoo.models.gpt2.config import GPT2Config
from zoo.models.gpt2.model import GPT2LMHeadModel
from zoo.models.pretrained import tokenizer_files, with_dtype

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:   # numpy 1.x
    from numpy.core.multiarray import _reconstruct

__all__ = ["ImportResult", "import_megatron", "megatron_safe_globals"]

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RANK_FILE_NAMES = ("model_optim_rng.pt", "model_rng.pt")   # the second: runs with a distributed optimizer
GPT2_BPE_VOCAB_SIZE = 50257
GPT2_TOKENIZERS = (None, "GPT2BPETokenizer")
OUTPUT_KIND = "Megatron-LM import"

# The Megatron-LM enums its args Namespace holds (``args.model_type``, ``args.attention_backend``, ...), by the
# module paths of the releases that pickled them. They are read as inert records (:class:`MegatronEnumValue`).
MEGATRON_ENUMS = (
    "megatron.core.enums.ModelType",
    "megatron.model.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.model.enums.AttnMaskType",
)

# Megatron's QKV rows of one tp rank, by checkpoint_version: how the (3 = q|k|v, heads, head_dim) rows are
# ordered. Version 0 stores [3, heads, d]; version 1.0 [heads, d, 3]; 2.0 and later [heads, 3, d].
QKV_ORDER_V0 = "3,heads,d"
QKV_ORDER_V1 = "heads,d,3"
QKV_ORDER_V2 = "heads,3,d"


# --------------------------------------------------------------------------- reading files safely
@dataclass(frozen=True)
class MegatronEnumValue:
    """A member of a Megatron-LM enum read from a checkpoint: its enum's path and its value. Building it runs
    no Megatron code (none is imported), and the import reads nothing from it."""

    enum: str
    value: object


def megatron_safe_globals() -> list:
    """The globals, beyond torch's defaults, that a Megatron-LM checkpoint may name, each harmless to build:

    * ``argparse.Namespace`` (``args``): its pickle makes an empty Namespace and updates its ``__dict__``;
    * numpy's array reconstruction, for the numpy RNG state in ``rng_state`` (an empty array of a numpy
      dtype whose state sets shape and bytes), under numpy 2's module name and numpy 1's;
    * Megatron's enums (:data:`MEGATRON_ENUMS`), each a factory of :class:`MegatronEnumValue` that stores the
      value it is given;
    * ``io.BytesIO``, Transformer Engine's ``_extra_state`` in Megatron Core checkpoints: an in-memory byte
      buffer whose state is its bytes and position; with the two ways pickle's protocol 2 writes its bytes,
      ``bytes()`` and ``_codecs.encode(text, "latin1")``, the latter by :func:`latin1_bytes`, which encodes
      latin-1 only.

    Built per call and passed to ``torch.serialization.safe_globals`` for one load, so the allow-list of
    other ``torch.load`` calls in the process is never widened."""
    enums = [(functools.partial(MegatronEnumValue, name), name) for name in MEGATRON_ENUMS]
    return [argparse.Namespace, io.BytesIO, bytes, (latin1_bytes, "_codecs.encode"), np.ndarray, np.dtype, type(np.dtype(np.uint32)),
            (_reconstruct, "numpy._core.multiarray._reconstruct"),
            (_reconstruct, "numpy.core.multiarray._reconstruct"), *enums]


def latin1_bytes(text: str, encoding: str) -> bytes:
    """``_codecs.encode(text, "latin1")``, how pickle's protocol 2 stores bytes; any other codec is refused."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"WeightsUnpickler error: _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def load_rank_file(path: Path) -> dict:
    """A Megatron rank file, read by the weights-only unpickler with :func:`megatron_safe_globals` and
    memory-mapped (tensors are paged in only when merged; files in torch's pre-1.6 format are read whole)."""
    try:
        return _weights_only_load(path, mmap=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise unreadable(path, err) from None
    try:
        return _weights_only_load(path, mmap=False)
    except RuntimeError as err:
        raise unreadable(path, err) from None


def _weights_only_load(path: Path, mmap: bool) -> dict:
    try:
        with torch.serialization.safe_globals(megatron_safe_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if not is_refused_global(err):
            raise unreadable(path, err) from None
        raise UserError(f"{path} holds the pickled global {refused_global(err, path)}, which zoo refuses to load "
                         "because unpickling it could run code; import only Megatron-LM checkpoints from a source "
                         "you trust, saved without objects beyond args, tensors and RNG states.") from None
    except (EOFError, OSError, ValueError) as err:
        raise unreadable(path, err) from None
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"{path} holds no 'model' state dict, so it is not a Megatron-LM model checkpoint; pass "
                         "the --save directory of a Megatron-LM GPT run.")
    return state


def unreadable(path: Path, err: BaseException) -> UserError:
    lines = str(err).strip().splitlines()
    return UserError(f"{path} cannot be read as a torch checkpoint ({lines[0] if lines else type(err).__name__}); it "
                      "is truncated or not a Megatron-LM checkpoint file, copy the complete file.")


# --------------------------------------------------------------------------- finding the files
def iteration_directory(load: Path, iteration: int | None) -> Path:
    """The directory of the checkpoint to import: ``iter_<iteration:07d>`` when ``iteration`` is given, else
    the one the tracker file names (an iteration or ``release``), else ``release/``; ``load`` itself when it
    already holds the rank directories."""
    if not load.is_dir():
        raise MissingInput(f"Megatron-LM checkpoint directory {load} does not exist; pass the --save directory "
                                "of the Megatron-LM run.")
    if any(load.glob("mp_rank_*")):
        return load
    if iteration is not None:
        return existing_iteration(load, f"iter_{iteration:07d}", f"--iteration {iteration}")
    tracker = load / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text(encoding="utf-8", errors="replace").strip()
        if text == "release":
            return existing_iteration(load, "release", f"{tracker} ('release')")
        if not text.isdigit():
            raise UserError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'; fix it or pass "
                             "--iteration N.")
        return existing_iteration(load, f"iter_{int(text):07d}", f"{tracker} ({text})")
    if (load / "release").is_dir():
        return load / "release"
    found = sorted(path.name for path in load.glob("iter_*"))
    hint = f"pass --iteration N (found {', '.join(found[-3:])})" if found else "pass the --save directory of a Megatron-LM run"
    raise MissingInput(f"{load} has no {TRACKER_FILE}, release/ or mp_rank_* directories; {hint}.")


def existing_iteration(load: Path, name: str, named_by: str) -> Path:
    directory = load / name
    if not directory.is_dir():
        found = sorted(path.name for path in load.glob("iter_*"))
        raise MissingInput(f"{directory} (named by {named_by}) does not exist; pass --iteration with one of "
                                f"{found[-5:] or 'the saved iterations'}.")
    if (directory / "metadata.json").is_file() or any(directory.glob("*.distcp")):
        raise UserError(f"{directory} is a torch_dist (distributed) checkpoint; convert it to Megatron's per-rank "
                         "files first (Megatron-LM's --ckpt-convert-format torch), then import that.")
    return directory


def rank_file(iteration_dir: Path, tp_rank: int, pp_rank: int, tp_size: int, pp_size: int) -> Path:
    """``mp_rank_XX[_YYY]/model_optim_rng.pt`` of one rank (``model_rng.pt`` in runs with a distributed
    optimizer), or one sentence naming the missing file."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    for file_name in RANK_FILE_NAMES:
        if (iteration_dir / name / file_name).is_file():
            return iteration_dir / name / file_name
    raise MissingInput(f"{iteration_dir / name / RANK_FILE_NAMES[0]} is missing; a Megatron-LM checkpoint of "
                            f"tp={tp_size} x pp={pp_size} holds one file per (tp, pp) rank, copy them all.")


def first_rank_file(iteration_dir: Path) -> Path:
    """Rank (0, 0)'s file, whose args give the layout: ``mp_rank_00`` (pp = 1) or ``mp_rank_00_000``."""
    for name in ("mp_rank_00", "mp_rank_00_000"):
        for file_name in RANK_FILE_NAMES:
            if (iteration_dir / name / file_name).is_file():
                return iteration_dir / name / file_name
    raise MissingInput(f"{iteration_dir / 'mp_rank_00' / RANK_FILE_NAMES[0]} (or mp_rank_00_000/ with pipeline "
                            "stages) is missing; copy every mp_rank_* directory of the checkpoint.")


# --------------------------------------------------------------------------- names
# How the shards of one tensor are merged over tp ranks.
VOCAB, COLUMN, QKV, ROW, REPLICATED = "vocab", "column", "qkv", "row", "replicated"


@dataclass(frozen=True)
class Target:
    """Where one Megatron tensor goes: its transformers GPT-2 key, how its tp shards merge and whether the
    merged tensor is transposed (a linear weight [out, in] to GPT-2's Conv1D [in, out])."""

    key: str
    merge: str
    transposed: bool = False


# Megatron's per-layer names (each generation's, see normalized_name) -> GPT-2's.
LAYER_TARGETS = {
    "input_norm.weight": Target("ln_1.weight", REPLICATED),
    "input_norm.bias": Target("ln_1.bias", REPLICATED),
    "self_attention.query_key_value.weight": Target("attn.c_attn.weight", QKV, transposed=True),
    "self_attention.query_key_value.bias": Target("attn.c_attn.bias", QKV),
    "self_attention.dense.weight": Target("attn.c_proj.weight", ROW, transposed=True),
    "self_attention.dense.bias": Target("attn.c_proj.bias", REPLICATED),
    "post_attention_norm.weight": Target("ln_2.weight", REPLICATED),
    "post_attention_norm.bias": Target("ln_2.bias", REPLICATED),
    "mlp.dense_h_to_4h.weight": Target("mlp.c_fc.weight", COLUMN, transposed=True),
    "mlp.dense_h_to_4h.bias": Target("mlp.c_fc.bias", COLUMN),
    "mlp.dense_4h_to_h.weight": Target("mlp.c_proj.weight", ROW, transposed=True),
    "mlp.dense_4h_to_h.bias": Target("mlp.c_proj.bias", REPLICATED),
}
# Megatron Core's names (GPTModel saved in the per-rank "torch" format; Transformer Engine fuses each
# LayerNorm into the linear layer after it) -> the legacy ones above.
MCORE_LAYER_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_norm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_norm.bias",
    "self_attention.linear_qkv.weight": "self_attention.query_key_value.weight",
    "self_attention.linear_qkv.bias": "self_attention.query_key_value.bias",
    "self_attention.linear_proj.weight": "self_attention.dense.weight",
    "self_attention.linear_proj.bias": "self_attention.dense.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_norm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_norm.bias",
    "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight",
    "mlp.linear_fc1.bias": "mlp.dense_h_to_4h.bias",
    "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
    "mlp.linear_fc2.bias": "mlp.dense_4h_to_h.bias",
}
MODEL_TARGETS = {
    "embedding.word_embeddings.weight": Target("transformer.wte.weight", VOCAB),
    "embedding.position_embeddings.weight": Target("transformer.wpe.weight", REPLICATED),
    "encoder.final_norm.weight": Target("transformer.ln_f.weight", REPLICATED),
    "encoder.final_norm.bias": Target("transformer.ln_f.bias", REPLICATED),
}
# The last stage's copy of the word embeddings (pipeline runs; legacy and Megatron Core names): tied to them
# (the args were checked to say so), so GPT-2 stores it once.
TIED_COPIES = ("word_embeddings_for_head.weight", "output_layer.weight")
LAYER_NAME = re.compile(r"encoder\.layers\.(\d+)\.(.+)")
# Older Megatron names -> the newest legacy ones, applied to each dotted component of a name.
RENAMED_COMPONENTS = {"transformer": "encoder", "decoder": "encoder", "attention": "self_attention",
                      "input_layernorm": "input_norm", "post_attention_layernorm": "post_attention_norm",
                      "pre_mlp_layernorm": "post_attention_norm", "final_layernorm": "final_norm"}


def normalized_name(name: str) -> str:
    """A Megatron parameter name in the newest legacy spelling: without the ``module.`` / ``language_model.``
    prefixes, with ``transformer`` / ``decoder`` -> ``encoder``, ``attention`` -> ``self_attention``,
    ``*_layernorm`` -> ``*_norm`` and Megatron Core's layer names (:data:`MCORE_LAYER_NAMES`) -> the legacy
    ones: the names of Megatron-LM releases from 2019 on."""
    parts = name.split(".")
    while parts and parts[0] in ("module", "language_model"):
        parts = parts[1:]
    normal = ".".join(RENAMED_COMPONENTS.get(part, part) for part in parts)
    match = LAYER_NAME.fullmatch(normal)
    if match and match.group(2) in MCORE_LAYER_NAMES:
        return f"encoder.layers.{match.group(1)}.{MCORE_LAYER_NAMES[match.group(2)]}"
    return normal


def gpt2_target(name: str, layer_offset: int, path: Path) -> Target | None:
    """The GPT-2 target of Megatron tensor ``name`` of a pipeline stage whose first layer is global layer
    ``layer_offset``; None for a tied copy of the word embeddings; one sentence for a tensor GPT-2 lacks."""
    normal = normalized_name(name)
    if normal in TIED_COPIES:
        return None
    if normal in MODEL_TARGETS:
        return MODEL_TARGETS[normal]
    match = LAYER_NAME.fullmatch(normal)
    if match and match.group(2) in LAYER_TARGETS:
        target = LAYER_TARGETS[match.group(2)]
        return Target(f"transformer.h.{layer_offset + int(match.group(1))}.{target.key}", target.merge,
                      target.transposed)
    raise UserError(f"{path} holds {name!r}, which a GPT-2 model does not have; zoo imports Megatron-LM GPT "
                     "checkpoints of GPT-2's architecture (learned positions, LayerNorm, GeLU, biases) only.")


def flat_tensors(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of Megatron's nested ``model`` dict by dotted path (``language_model.embedding.
    word_embeddings.weight``); entries that are not parameters (Transformer Engine's ``_extra_state``, None)
    are left out."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor) and not str(key).endswith("_extra_state"):
            out[f"{prefix}{key}"] = value
    return out


def layer_numbers(names: list[str]) -> list[int]:
    """The local layer numbers of one pipeline stage's tensor names, sorted."""
    found = {int(match.group(1)) for name in names if (match := LAYER_NAME.fullmatch(normalized_name(name)))}
    return sorted(found)


# --------------------------------------------------------------------------- merging
def qkv_order(version: float, path: Path) -> str:
    """Megatron's per-rank QKV row order for ``checkpoint_version`` (Megatron reads 0 and 1.0 by reordering
    them to the 2.0 order on load; no other version below 2.0 exists)."""
    if version == 0:
        return QKV_ORDER_V0
    if version == 1.0:
        return QKV_ORDER_V1
    if version >= 2.0:
        return QKV_ORDER_V2
    raise UserError(f"{path} has checkpoint_version {version}, which Megatron-LM never wrote (0, 1.0, 2.0 and "
                     "later are known); check that the file is a Megatron-LM checkpoint.")


def qkv_blocks(shard: torch.Tensor, order: str, heads: int) -> torch.Tensor:
    """One tp rank's fused QKV rows as (3, heads, head_dim, *rest): q, k and v of its ``heads`` heads."""
    rest = tuple(shard.shape[1:])
    head_dim = shard.shape[0] // (3 * heads)
    if order == QKV_ORDER_V0:
        return shard.reshape(3, heads, head_dim, *rest)                     # (3, heads, d, *rest)
    if order == QKV_ORDER_V1:
        return shard.reshape(heads, head_dim, 3, *rest).movedim(2, 0)      # (heads, d, 3) -> (3, heads, d)
    return shard.reshape(heads, 3, head_dim, *rest).transpose(0, 1)        # (heads, 3, d) -> (3, heads, d)


def merged_tensor(target: Target, shards: list[torch.Tensor], vocab_size: int, qkv_row_order: str,
                  heads_per_rank: int) -> torch.Tensor:
    """One tensor in GPT-2's layout from its tp shards (rank order): the vocab rows on dim 0 cut to
    ``vocab_size``, column-parallel on dim 0, row-parallel on dim 1, the fused QKV regrouped per rank to
    q | k | v over all heads, replicated ones from rank 0; linear weights transposed to Conv1D."""
    if target.merge == REPLICATED:
        merged = shards[0]
    elif target.merge == ROW:
        merged = torch.cat(shards, dim=1)
    elif target.merge == QKV:
        blocks = [qkv_blocks(shard, qkv_row_order, heads_per_rank) for shard in shards]
        merged = torch.cat(blocks, dim=1)                                   # (3, heads, d, *rest)
        merged = merged.reshape(-1, *merged.shape[3:])                      # (3 * heads * d, *rest)
    else:
        merged = torch.cat(shards, dim=0)
        if target.merge == VOCAB:
            merged = merged[:vocab_size]
    return merged.t() if target.transposed else merged


# --------------------------------------------------------------------------- the model's shape
def arg(args: argparse.Namespace, *names: str, default=None):
    """The first of ``names`` that ``args`` sets (Megatron renamed some: layernorm_epsilon -> norm_epsilon)."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return default


def required_arg(args: argparse.Namespace, name: str, path: Path) -> int:
    value = getattr(args, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{path}'s args has {name}={value!r}, not a positive integer; the checkpoint's args are "
                         "incomplete, import a checkpoint saved by Megatron-LM's training.")
    return value


# (args field, value GPT-2 needs or a predicate, what it means): architectures GPT-2 cannot represent.
UNSUPPORTED_ARGS = (
    ("position_embedding_type", lambda v: v in (None, "learned_absolute"), "learned absolute positions"),
    ("normalization", lambda v: v in (None, "LayerNorm"), "LayerNorm"),
    ("swiglu", lambda v: not v, "a GeLU MLP, not SwiGLU"),
    ("squared_relu", lambda v: not v, "a GeLU MLP, not squared ReLU"),
    ("add_bias_linear", lambda v: v is None or bool(v), "biases on every linear layer"),
    ("group_query_attention", lambda v: not v, "one key and value head per query head"),
    ("num_experts", lambda v: not v, "a dense MLP, not experts"),
    ("apply_residual_connection_post_layernorm", lambda v: not v, "residuals taken before the LayerNorm"),
    ("untie_embeddings_and_output_weights", lambda v: not v, "the output layer tied to the word embeddings"),
    ("virtual_pipeline_model_parallel_size", lambda v: v in (None, 1), "one model chunk per pipeline stage"),
    ("apply_layernorm_1p", lambda v: not v, "LayerNorm weights stored as they are, not as 1 + weight"),
)


# What marks a Megatron-LM run as another zoo family than GPT-2, whose import does not apply: (how many of the
# markers, the markers as (args field, predicate)); the family's name comes from the registry.
OTHER_FAMILY_ARGS = {
    "llama": (2, (("position_embedding_type", lambda v: v == "rope"), ("normalization", lambda v: v == "RMSNorm"),
                  ("swiglu", bool))),
    "bert": (1, (("bert_binary_head", lambda v: v is not None), ("tokenizer_type", lambda v: str(v).startswith("Bert")))),
}


def check_gpt2_family(args: argparse.Namespace, path: Path) -> None:
    """One sentence for a Megatron-LM run of a family zoo builds but does not import from Megatron-LM (a Llama: RoPE,
    RMSNorm, SwiGLU; a BERT), naming where zoo reads that family from instead."""
    for model_type, (needed, markers) in OTHER_FAMILY_ARGS.items():
        shown = [f"{name}={getattr(args, name)!r}" for name, marks in markers
                 if getattr(args, name, None) is not None and marks(getattr(args, name))]
        if len(shown) >= needed:
            family = family_of_model_type(model_type)
            raise UserError(f"{path}'s args ({', '.join(shown)}) describe a Megatron-LM {family.display_name}, and "
                             "zoo imports only Megatron-LM GPT checkpoints of GPT-2's architecture; start from a "
                             f"transformers {family.display_name} directory instead (--pretrained reads one).")


def check_gpt2_architecture(args: argparse.Namespace, path: Path) -> None:
    """One sentence for a Megatron run whose architecture differs from GPT-2's (zoo's model family)."""
    check_gpt2_family(args, path)
    for name, allowed, meaning in UNSUPPORTED_ARGS:
        value = getattr(args, name, None)
        if not allowed(value):
            raise UserError(f"{path}'s args has {name}={value!r}, but GPT-2 has {meaning}; zoo imports only "
                             "Megatron-LM GPT checkpoints of GPT-2's architecture.")


def gpt2_config_from_args(args: argparse.Namespace, vocab_size: int, path: Path) -> GPT2Config:
    """zoo's GPT-2 config of the Megatron run: shape from its args, GeLU as Megatron ran it (exact unless
    ``--openai-gelu``), LayerNorm epsilon and dropouts from the args."""
    check_gpt2_architecture(args, path)
    hidden = required_arg(args, "hidden_size", path)
    heads = required_arg(args, "num_attention_heads", path)
    kv_channels = arg(args, "kv_channels", default=hidden // heads)
    if kv_channels * heads != hidden:
        raise UserError(f"{path}'s args has kv_channels={kv_channels} with {heads} heads of a {hidden}-wide "
                         "model, but GPT-2's heads split the width exactly; import a model with kv_channels = "
                         "hidden_size / num_attention_heads.")
    positions = arg(args, "max_position_embeddings", "seq_length")
    if positions is None:
        raise UserError(f"{path}'s args sets neither max_position_embeddings nor seq_length; the checkpoint's "
                         "args are incomplete, import a checkpoint saved by Megatron-LM's training.")
    ffn = arg(args, "ffn_hidden_size", default=4 * hidden)
    dropout = arg(args, "hidden_dropout", default=0.1)
    return GPT2Config(
        vocab_size=vocab_size, n_positions=positions, n_embd=hidden, n_layer=required_arg(args, "num_layers", path),
        n_head=heads, n_inner=None if ffn == 4 * hidden else ffn,
        activation_function="gelu_new" if getattr(args, "openai_gelu", False) else "gelu",
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=arg(args, "attention_dropout", default=0.1),
        layer_norm_epsilon=arg(args, "norm_epsilon", "layernorm_epsilon", default=1e-5),
    ).validate()


def real_vocab_size(args: argparse.Namespace, padded_rows: int, requested: int | None, path: Path) -> int:
    """How many word-embedding rows are real tokens: ``requested``, else the args' ``vocab_size`` (runs without
    a tokenizer file), else GPT-2 BPE's 50257; Megatron padded the rest (to ``args.padded_vocab_size``)."""
    tokenizer = getattr(args, "tokenizer_type", None)
    size = requested or arg(args, "vocab_size")
    if size is None and tokenizer not in GPT2_TOKENIZERS:
        raise UserError(f"{path} was trained with tokenizer_type {tokenizer!r}, whose vocabulary size its args do "
                         "not record; pass --vocab-size N (the tokenizer's size).")
    size = size or GPT2_BPE_VOCAB_SIZE
    if not 1 <= size <= padded_rows:
        raise UserError(f"vocabulary size {size} does not fit the checkpoint's {padded_rows} word-embedding rows; "
                         f"pass --vocab-size between 1 and {padded_rows}.")
    return size


# --------------------------------------------------------------------------- the plan of tensors
@dataclass
class Source:
    """One GPT-2 tensor to write: its target and its tp shards (memory-mapped), and the file they came from."""

    target: Target
    shards: list[torch.Tensor]
    megatron_name: str
    path: Path


@dataclass(frozen=True)
class MegatronCheckpoint:
    """What the rank files hold: every GPT-2 tensor's sources, the args, version and layout."""

    iteration_dir: Path
    args: argparse.Namespace
    checkpoint_version: float
    tp_size: int
    pp_size: int
    sources: dict[str, Source]
    first_path: Path
    qkv_row_order: str


def read_checkpoint(iteration_dir: Path) -> MegatronCheckpoint:
    """Every rank file of ``iteration_dir``, its tensors named by their GPT-2 keys (global layer numbers)."""
    first_path = first_rank_file(iteration_dir)
    first = load_rank_file(first_path)
    args = first.get("args")
    if not isinstance(args, argparse.Namespace):
        raise UserError(f"{first_path} holds no args Namespace, which gives the model's shape and layout; import a "
                         "checkpoint saved by Megatron-LM's training (it saves args in every file).")
    check_gpt2_architecture(args, first_path)   # first: it also says the output layer is a tied copy
    tp_size = arg(args, "tensor_model_parallel_size", default=1)
    pp_size = arg(args, "pipeline_model_parallel_size", default=1)
    version = float(first.get("checkpoint_version", 0))
    order = qkv_order(version, first_path)
    sources: dict[str, Source] = {}
    layer_offset = 0
    for pp_rank in range(pp_size):
        paths = [rank_file(iteration_dir, tp_rank, pp_rank, tp_size, pp_size) for tp_rank in range(tp_size)]
        stage = [flat_tensors(model_state(first if path == first_path else load_rank_file(path), path))
                 for path in paths]
        check_same_names(stage, paths)
        numbers = layer_numbers(list(stage[0]))
        if numbers != list(range(len(numbers))):
            raise UserError(f"{paths[0]} numbers its layers {numbers[:4]}..., not 0, 1, ... as Megatron-LM numbers "
                             "each pipeline stage's layers; the file was not written by Megatron-LM.")
        for name in stage[0]:
            target = gpt2_target(name, layer_offset, paths[0])
            if target is not None:
                add_source(sources, Source(target, [tensors[name] for tensors in stage], name, paths[0]))
        layer_offset += len(numbers)
    if layer_offset != required_arg(args, "num_layers", first_path):
        raise UserError(f"the {pp_size} pipeline stage(s) of {iteration_dir} hold {layer_offset} layers but the args "
                         f"say num_layers={args.num_layers}; the checkpoint mixes files of two runs, copy one run's.")
    return MegatronCheckpoint(iteration_dir, args, version, tp_size, pp_size, sources, first_path, order)


def model_state(state: dict, path: Path) -> dict:
    model = state["model"]
    if not isinstance(model, dict):
        raise UserError(f"{path}'s 'model' is a {type(model).__name__}, not a state dict; the file is not a "
                         "Megatron-LM checkpoint.")
    return model


def check_same_names(stage: list[dict[str, torch.Tensor]], paths: list[Path]) -> None:
    """Every tp rank of a stage holds the same tensors."""
    for tensors, path in zip(stage[1:], paths[1:]):
        if set(tensors) != set(stage[0]):
            name = sorted(set(tensors) ^ set(stage[0]))[0]
            raise UserError(f"{path} and {paths[0]} differ in tensor {name!r}; the ranks' files come from two "
                             "checkpoints, copy one iteration's files.")


def add_source(sources: dict[str, Source], source: Source) -> None:
    key = source.target.key
    if key in sources:
        raise UserError(f"{source.path} holds {source.megatron_name!r}, which is GPT-2's {key} again (also in "
                         f"{sources[key].path}); the pipeline stages overlap, copy one run's files.")
    sources[key] = source


def gpt2_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a transformers GPT2LMHeadModel checkpoint of ``config``, by key, with its shape."""
    h, ffn = config.n_embd, config.ffn_hidden_size
    shapes = {"transformer.wte.weight": (config.vocab_size, h), "transformer.wpe.weight": (config.n_positions, h),
              "transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)}
    for layer in range(config.n_layer):
        prefix = f"transformer.h.{layer}."
        shapes.update({prefix + "ln_1.weight": (h,), prefix + "ln_1.bias": (h,),
                       prefix + "attn.c_attn.weight": (h, 3 * h), prefix + "attn.c_attn.bias": (3 * h,),
                       prefix + "attn.c_proj.weight": (h, h), prefix + "attn.c_proj.bias": (h,),
                       prefix + "ln_2.weight": (h,), prefix + "ln_2.bias": (h,),
                       prefix + "mlp.c_fc.weight": (h, ffn), prefix + "mlp.c_fc.bias": (ffn,),
                       prefix + "mlp.c_proj.weight": (ffn, h), prefix + "mlp.c_proj.bias": (h,)})
    return shapes


def merged_shape(source: Source, vocab_size: int) -> tuple[int, ...]:
    """The shape :func:`merged_tensor` gives, from the shards' shapes alone."""
    shape = list(source.shards[0].shape)
    if source.target.merge in (COLUMN, QKV, VOCAB):
        shape[0] = sum(shard.shape[0] for shard in source.shards)
    elif source.target.merge == ROW and len(shape) > 1:
        shape[1] = sum(shard.shape[1] for shard in source.shards)
    if source.target.merge == VOCAB:
        shape[0] = vocab_size
    return tuple(shape[::-1]) if source.target.transposed else tuple(shape)


def check_tensors(checkpoint: MegatronCheckpoint, config: GPT2Config) -> None:
    """Every GPT-2 tensor is there once, with the shape the args give (one sentence naming the first that is
    missing, extra or misshaped), before anything is written."""
    expected = gpt2_shapes(config)
    for key, shape in expected.items():
        source = checkpoint.sources.get(key)
        if source is None:
            raise UserError(f"{checkpoint.iteration_dir} has no tensor for GPT-2's {key}; the checkpoint is "
                             "incomplete or not a GPT model, copy every rank file of one iteration.")
        if (found := merged_shape(source, config.vocab_size)) != shape:
            raise UserError(f"{source.path}'s {source.megatron_name!r} merges over tp={checkpoint.tp_size} to shape "
                             f"{list(found)} in GPT-2's layout, but the args give {list(shape)}; the args do not "
                             "describe these weights.")
    padded = getattr(checkpoint.args, "padded_vocab_size", None)
    rows = sum(shard.shape[0] for shard in checkpoint.sources["transformer.wte.weight"].shards)
    if padded is not None and padded != rows:
        raise UserError(f"{checkpoint.first_path}'s args has padded_vocab_size={padded} but the word embeddings have "
                         f"{rows} rows; the args do not describe these weights.")


# --------------------------------------------------------------------------- the whole import
@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_megatron` wrote and from where."""

    out: Path
    iteration_dir: Path
    tp_size: int
    pp_size: int
    checkpoint_version: float
    config: GPT2Config
    dtype: torch.dtype


def check_new_output(out: Path) -> None:
    """``out`` must be new or an empty directory: the import never replaces anything."""
    check_output_directory(out, lambda path: False, OUTPUT_KIND)


def import_megatron(load: str | Path, out: str | Path, iteration: int | None = None, vocab_size: int | None = None,
                    dtype: torch.dtype | None = None,
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> ImportResult:
    """Write the transformers GPT-2 directory ``out`` (new or empty) from the Megatron-LM checkpoint under
    ``load``. ``dtype`` defaults to the checkpoint's (its word embeddings'); ``vocab_size`` to
    :func:`real_vocab_size`'s."""
    out = Path(out)
    check_new_output(out)
    iteration_dir = iteration_directory(Path(load), iteration)
    checkpoint = read_checkpoint(iteration_dir)
    embedding = checkpoint.sources.get("transformer.wte.weight")
    if embedding is None:
        raise UserError(f"{iteration_dir} has no word embeddings (language_model.embedding.word_embeddings.weight) "
                         "in its first pipeline stage; copy every rank file of one iteration.")
    rows = sum(shard.shape[0] for shard in embedding.shards)
    config = gpt2_config_from_args(checkpoint.args,
                                   real_vocab_size(checkpoint.args, rows, vocab_size, checkpoint.first_path),
                                   checkpoint.first_path)
    config.validate(checkpoint.tp_size)
    check_tensors(checkpoint, config)
    out_dtype = dtype or embedding.shards[0].dtype
    write_gpt2(out, checkpoint, config, out_dtype, max_shard_size)
    return ImportResult(out, iteration_dir, checkpoint.tp_size, checkpoint.pp_size, checkpoint.checkpoint_version,
                        config, out_dtype)


def write_gpt2(out: Path, checkpoint: MegatronCheckpoint, config: GPT2Config, dtype: torch.dtype,
               max_shard_size: int | str) -> None:
    """Stream the merged tensors through ``save_pretrained``'s writer, one at a time."""
    item_size = torch.empty((), dtype=dtype).element_size()
    outputs = [OutputTensor(key, key, None, shape, dtype, math.prod(shape) * item_size)
               for key, shape in gpt2_shapes(config).items()]
    tokenizer = getattr(checkpoint.args, "tokenizer_type", None)
    copies = tokenizer_files(GPT2LMHeadModel.default_tokenizer_dir) if tokenizer in GPT2_TOKENIZERS else []
    error = stream_pretrained(out, with_dtype(config.to_hf_dict(), dtype), outputs,
                              producer(checkpoint, config), copies, max_shard_size)
    if error is not None:
        raise error


def producer(checkpoint: MegatronCheckpoint, config: GPT2Config) -> Callable[[OutputTensor], list[torch.Tensor]]:
    """``produce`` for :func:`stream_pretrained`: each entry's tensor merged from its shards."""
    heads_per_rank = config.n_head // checkpoint.tp_size

    def produce(entry: OutputTensor) -> list[torch.Tensor]:
        source = checkpoint.sources[entry.key]
        return [merged_tensor(source.target, source.shards, config.vocab_size, checkpoint.qkv_row_order,
                              heads_per_rank)]

    return produce
