"""``from_pretrained`` / ``save_pretrained`` in transformers' own layouts, shared by zoo's models.

A model class provides ``config_from_hf(values)``, ``hf_names()`` (each parameter's transformers key or
keys; how it is split and stored comes from its layer's partition spec, see :func:`zoo.checkpoint.hf.hf_io.hf_params`)
and the class attributes below. Loading builds the model on torch's meta device (``with torch.device("meta")``: no memory, no
init; accelerate's ``init_empty_weights`` does the same but accelerate is not a dependency), then
``to_empty`` allocates this rank's shards only and each is filled from its slices of the file, one
tensor at a time: a rank's peak is its own shard plus one tensor. zoo's models hold no buffers
(position ids and causal masks are made in ``forward``), so nothing else needs recreating. Saving
streams tensor by tensor to one writer (:func:`zoo.checkpoint.hf.hf_io.stream_pretrained`).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch

from zoo.assets import ASSETS_DIR
from zoo.checkpoint.hf.hf_io import (
    DEFAULT_MAX_SHARD_SIZE,
    TOKENIZER_FILE_NAMES,
    CheckpointFiles,
    HFParam,
    check_max_shard_size,
    check_pretrained_target,
    hf_params,
    load_hf_weights,
    model_producer,
    output_tensors,
    read_config_json,
    stream_pretrained,
)
from zoo.parallel.agreement import first_error_everywhere, same_error_everywhere
from zoo.parallel.layers import materialize_meta_module
from zoo.parallel.state import ParallelState, as_state

logger = logging.getLogger(__name__)


def tokenizer_files(directory: str | os.PathLike) -> list[Path]:
    """The tokenizer files present in ``directory``, to be copied next to saved weights."""
    return [Path(directory) / name for name in TOKENIZER_FILE_NAMES if (Path(directory) / name).is_file()]


class BundledTokenizerWarning(UserWarning):
    """A model directory holds no tokenizer files, so the model family's bundled tokenizer stands in for it."""


def tokenizer_dir_of(directory: str | os.PathLike, default: Path) -> Path:
    """Where the tokenizer of the model in ``directory`` is: ``directory`` itself when it holds vocabulary files
    (vocab.json, vocab.txt or tokenizer.json), else ``default`` (the family's bundled one), with a
    :class:`BundledTokenizerWarning` naming both, since the bundled vocabulary is right only for a model
    trained with it and a wrong one gives wrong text without any error."""
    if any((Path(directory) / name).is_file() for name in ("vocab.json", "vocab.txt", "tokenizer.json")):
        return Path(directory)
    warnings.warn(f"{directory} holds no tokenizer files (vocab.json, vocab.txt or tokenizer.json), so the bundled "
                  f"{default.name} tokenizer ({default}) is used for it; if the model was trained with another "
                  "vocabulary, put its tokenizer files there or pass --tokenizer DIR.", BundledTokenizerWarning,
                  stacklevel=3)
    return default


def with_dtype(config_dict: dict, dtype: torch.dtype) -> dict:
    """config.json contents for weights stored in ``dtype``."""
    return {**config_dict, "torch_dtype": str(dtype).replace("torch.", "")}


def _is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class HFPretrainedMixin:
    """Shared checkpoint I/O. Subclasses set:

    ``base_prefix``: the key prefix of the bare model inside a heads checkpoint ("bert.",
    "transformer."); ``ignorable_keys``: suffixes of file keys that hold no parameter (buffers, tied
    copies); ``ignorable_prefixes``: file keys of other heads that this model drops (a pretraining
    head under a finetuning model); ``new_param_prefixes``: zoo parameters a checkpoint may lack (a
    task head not trained yet), initialised by ``init_new_params``; ``default_tokenizer_dir``:
    bundled tokenizer files written next to the weights.
    """

    base_prefix = ""
    ignorable_keys: tuple[str, ...] = ()
    ignorable_prefixes: tuple[str, ...] = ()
    new_param_prefixes: tuple[str, ...] = ()
    default_tokenizer_dir: Path = ASSETS_DIR

    @classmethod
    def config_from_hf(cls, values: dict):
        raise NotImplementedError

    @classmethod
    def check_hf_config(cls, values: dict, path: Path) -> None:
        """Refuse a config.json of the family whose shape fields are missing or out of bounds, in one sentence
        naming the file and the field (a model family hook; the family's registry entry holds the same check)."""

    def hf_config_dict(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, parallel: ParallelState | None = None,
                        dtype: torch.dtype | None = None, **config_overrides):
        """Build from a transformers directory (config.json + safetensors), reading only this rank's
        slices, in eval mode as transformers returns it (dropout off; call ``.train()`` to train).
        ``config_overrides`` set config fields, e.g. ``activation_checkpointing=True``."""
        values = read_config_json(directory)
        config = cls.config_from_hf(values)   # a config.json of another model type is named as such first
        cls.check_hf_config(values, Path(directory) / "config.json")
        cls.check_overrides(directory, values, config_overrides)
        config = config.replace(**config_overrides)
        return cls.load_into(directory, config, parallel, dtype)

    @classmethod
    def check_overrides(cls, directory, values: dict, overrides: dict) -> None:
        """Refuse overrides that contradict what the checkpoint holds (a model family hook)."""

    @classmethod
    def load_into(cls, directory: str | os.PathLike, config, parallel: ParallelState | None = None,
                  dtype: torch.dtype | None = None, new_params_seed: int | None = None):
        """Build ``cls(config, parallel)`` on the meta device and fill it from ``directory``; returned in eval
        mode, as transformers' ``from_pretrained`` returns its models, so that two forwards of the same input agree.

        Parameters named in ``cls.new_param_prefixes`` (a task head the checkpoint may not have)
        are drawn fresh from ``new_params_seed`` when absent, identically on every rank."""
        with torch.device("meta"):
            model = cls(config, parallel)
        materialize_meta_module(model, "cpu")
        file_keys = set(CheckpointFiles(directory).keys())
        cls.check_checkpoint_keys(directory, file_keys, config)
        table, ignorable = _match_key_prefix(hf_params(model), file_keys, cls.base_prefix)
        missing = load_hf_weights(model, directory, table, parallel, ignorable=cls.ignorable_keys + ignorable,
                                  ignorable_prefixes=cls.ignorable_prefixes,
                                  may_be_missing=cls.new_param_prefixes)
        if missing:
            model.init_new_params(missing, new_params_seed if new_params_seed is not None else 0)
            logger.warning("%s: %s not in %s; newly initialised (seed %s) - train this model before using it.",
                           cls.__name__, ", ".join(sorted(missing)), directory, new_params_seed or 0)
        model.tokenizer_dir = tokenizer_dir_of(directory, cls.default_tokenizer_dir)
        if dtype is not None:
            model.to(dtype)
        return model.eval()

    @classmethod
    def check_checkpoint_keys(cls, directory, file_keys: set[str], config) -> None:
        """Refuse a checkpoint whose tensors contradict its config.json (a model family hook)."""

    def save_pretrained(self, directory: str | os.PathLike, dtype: torch.dtype | None = None,
                        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        """Collective: write transformers' layout for this model type (merged over tp, vocab unpadded,
        safetensors, tokenizer files). Weights above ``max_shard_size`` (bytes or e.g. "2GB") are split
        into transformers' indexed shards.

        Streams: every rank first checks ``directory`` and the size (a failure anywhere is raised everywhere
        before any work); then the TP group of DP rank 0 gathers one tensor at a time to its first rank,
        global rank 0 (TP groups are consecutive ranks), which casts it to ``dtype``, appends it to its file
        and frees it; other DP replicas only wait. The writer's outcome (success, or its error as the same
        sentence) reaches every rank."""
        parallel = as_state(getattr(self, "parallel", None))
        distributed = _is_distributed()
        is_writer = not distributed or torch.distributed.get_rank() == 0
        first_error_everywhere(_error_of(lambda: (check_pretrained_target(directory),
                                                  check_max_shard_size(max_shard_size))))
        takes_part = is_writer or (parallel.dp_rank == 0 and parallel.cp_rank == 0 and parallel.tp_size > 1)
        error = None
        if takes_part:
            param_map = hf_params(self)
            outputs = output_tensors(self.named_parameters(), param_map, parallel, dtype)
            config = with_dtype(self.hf_config_dict(), dtype or next(self.parameters()).dtype) if is_writer else {}
            error = stream_pretrained(directory, config, outputs, model_producer(self, param_map, parallel, is_writer),
                                      tokenizer_files(getattr(self, "tokenizer_dir", self.default_tokenizer_dir)),
                                      max_shard_size, is_writer)
        same_error_everywhere(error, src=0)


def _error_of(check) -> Exception | None:
    try:
        check()
    except Exception as err:  # noqa: BLE001 - handed to every rank by the agreement that follows
        return err
    return None


def _match_key_prefix(table: dict[str, HFParam], file_keys: set[str],
                      prefix: str) -> tuple[dict[str, HFParam], tuple[str, ...]]:
    """Adapt the table to a file whose keys carry (or lack) the bare model's prefix, as happens when a
    bare model is loaded from a heads checkpoint or when a checkpoint was converted without it.
    Returns the table and the file keys to ignore (the heads a bare model does not use)."""
    wanted = {k for hf in table.values() for k in hf.keys}
    if not prefix or wanted & file_keys:
        return table, ()

    def rekey(hf: HFParam, change) -> HFParam:
        return HFParam(tuple(change(k) for k in hf.keys), hf.spec)

    if any(k.startswith(prefix) for k in file_keys) and not any(k.startswith(prefix) for k in wanted):
        added = {n: rekey(s, lambda k: prefix + k) for n, s in table.items()}
        return added, tuple(k for k in file_keys if not k.startswith(prefix))
    stripped = {n: rekey(s, lambda k: k.removeprefix(prefix)) for n, s in table.items()}
    return stripped, ()
