"""The run configuration: a DeepSpeed config JSON plus its ``"zoo"`` block, CLI flags overriding both.

A ds_config is complete for DeepSpeed (batch sizes, optimizer, scheduler, fp16/bf16, clipping).
zoo reads its own settings from the top-level ``"zoo"`` key, which DeepSpeed ignores:

    "zoo": {"tensor_parallel_size": 2, "model": "gpt2-tiny", "seq_length": 128, "train_iters": 300,
            "data_path": null, "split": "969,30,1", "seed": 1234, "save": "runs/demo",
            "pretrained": null, "log_interval": 10, "eval_interval": 100, "eval_iters": 4, "save_interval": 0,
            "checkpoint_activations": false, "compile": false, "wandb_project": null, "model_overrides": {},
            "data_workers": 2, "exit_interval": 0, "exit_duration_in_mins": null, "exit_signal_handler": true,
            "distributed_timeout_minutes": null, "sample_prompts": []}

``data_path`` null means the bundled Wikipedia sample, preprocessed once into a cache directory; a
string is one indexed-dataset prefix, a list Megatron's blend ``[W1, P1, W2, P2, ...]`` (the flag:
``--data-path W1 P1 W2 P2 ...``); either is held as a list (one prefix: a list of one).
``pretrained`` names a transformers-layout directory (GPT-2, MegatronBert or Bert, e.g. from
``save_pretrained`` or ``launch/export.py``) whose weights replace the random init, at any tp; the
preset then only names the family, the shapes come from the directory. ``load`` resumes a zoo
DeepSpeed checkpoint, also one written at another layout (the new run's ranks move it, see
zoo.checkpoint.layout_change; nothing is written beside it);
a ``load`` with no checkpoint yet starts the run from iteration 0, so a job script can always pass
``--save X --load X``.

Preemption (Megatron's flag names): ``exit_interval`` N stops with a checkpoint after every iteration
that is a multiple of N (so the same flag serves every allocation of a job); ``exit_duration_in_mins``
M stops with a checkpoint before M minutes of wall time (ranks agree); ``exit_signal_handler`` (on by
default) turns SIGTERM or SIGUSR1 on any rank into a checkpoint at the next iteration and exit 0.
``sample_prompts`` (families that generate text: GPT-2, Llama) are completed by sampling at the end of the
run, and the writer prints each beside the validation perplexity (zoo.inference.run_samples); empty, nothing
is generated. They are encoded and decoded with the run's ``tokenizer``, the directory its data was
preprocessed with (``launch/preprocess.py --tokenizer``; default the bundled GPT-2 BPE), and refused where
that tokenizer has more tokens than the model's vocabulary. ``distributed_timeout_minutes`` bounds every collective (DeepSpeed's default is 10 minutes), so a rank
that never arrives ends the job with the backend's timeout error rather than a hang.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from zoo.atomic import check_directory_can_be_made
from zoo.config.deepspeed_overrides import accumulate_bf16_in_fp32, apply_overrides, precision_flags_given
from zoo.errors import MissingInput, UserError
from zoo.options import (
    CommandParser,
    add_deepspeed_config_argument,
    add_options,
    check_block_keys,
    check_types,
    json_kind,
    merged_settings,
    option,
    shown,
)


@dataclass
class RunConfig:
    """One pretraining run's settings: each field is a ``--flag`` (dashes) and a zoo-block key (underscores)."""

    tensor_parallel_size: int = option(1, group="parallelism", help="tensor-parallel degree: ranks per model replica")
    pipeline_model_parallel_size: int = option(
        1, group="parallelism",
        help="pipeline stages (GPT-2 and Llama; DeepSpeed's pipeline engine, 1F1B): tp x pp x dp = world size (default 1: "
             "every rank holds all layers)")
    pipeline_partition_method: str = option(
        "parameters", group="parallelism",
        help="how the layers are split over the stages: 'parameters' (balanced parameter counts, DeepSpeed's "
             "default) or 'uniform' (the same number of transformer layers per stage)")
    model: str = option("gpt2-tiny", group="model", help="model preset (zoo.models.families), e.g. gpt2-medium, llama-tiny, bert-336m")
    seq_length: int = option(1024, group="model", help="tokens per training sample")
    train_iters: int = option(1000, group="training", help="optimizer steps of the whole run")
    data_path: list[str] | None = option(
        None, group="data", metavar="PATH",
        expects=("a string or a list of strings", '"data/corpus"'),
        help="an indexed-dataset prefix written by launch/preprocess.py, or a blend W1 PREFIX1 W2 PREFIX2 ... "
             "(default: the bundled Wikipedia sample)")
    split: str = option("969,30,1", group="data", help="train,valid,test weights of the documents")
    seed: int = option(1234, group="training", help="seeds the init, dropout and the data order")
    save: str | None = option("runs/pretrain", group="checkpointing",
                              help="run directory: metrics.jsonl, loss.png and checkpoints/")
    load: str | None = option(None, group="checkpointing",
                              help="resume from this run directory (at any tp); none there yet starts at iteration 0")
    pretrained: str | None = option(None, group="checkpointing",
                                    help="transformers-layout directory to start from (instead of random init)")
    log_interval: int = option(10, group="logging", help="iterations between log lines")
    eval_interval: int = option(1000, group="training", help="iterations between validations (0: never)")
    eval_iters: int = option(10, group="training",
                            help="global batches per validation: the same samples at every layout")
    save_interval: int = option(0, group="checkpointing", help="iterations between checkpoints (0: at the end only)")
    checkpoint_activations: bool = option(
        False, group="training",
        help="recompute each layer in backward (DeepSpeed activation checkpointing; Megatron's older flag for "
             "--recompute-granularity full)")
    recompute_granularity: str | None = option(
        None, group="training", help="'full' (every layer) or 'selective' (the attention core)")
    compile: bool = option(
        False, group="training", negatable=True,
        help="compile each transformer block with torch.compile (inductor; one graph serves every layer); off by "
             "default: on CPU it measured no faster than eager (benchmarks/bench_compile.py), and it has not been "
             "measured on a GPU yet")
    sequence_parallel: bool = option(
        False, group="parallelism",
        help="sequence parallelism (Korthikanti et al. 2022): LayerNorm, dropout and residuals on seq_length / tp "
             "tokens per rank; seq_length must divide by tp")
    wandb_project: str | None = option(None, group="logging", help="log to this W&B project")
    tensorboard_dir: str | None = option(None, group="logging",
                                         help="also write metrics.jsonl's scalars here as TensorBoard events")
    model_overrides: dict[str, Any] = option(group="model", flag=None, default_factory=dict,
                                             help='model config fields to change, e.g. {"resid_pdrop": 0.0}')
    # Megatron-LM's model-shape flags: each becomes a model_overrides entry under the preset's family's own
    # field name (zoo.models.families.megatron_shape_overrides), so config.json keeps them there.
    num_layers: int | None = option(None, group="model", in_block=False, help="transformer layers")
    hidden_size: int | None = option(None, group="model", in_block=False, help="hidden size")
    num_attention_heads: int | None = option(None, group="model", in_block=False, help="attention (query) heads")
    ffn_hidden_size: int | None = option(None, group="model", in_block=False,
                                         help="the MLP's inner width (default: the preset's)")
    num_key_value_heads: int | None = option(None, group="model", in_block=False,
                                             help="Llama: key/value heads of grouped-query attention")
    max_position_embeddings: int | None = option(None, group="model", in_block=False,
                                                 help="positions the model has (at least --seq-length)")
    make_vocab_size_divisible_by: int | None = option(
        None, group="model", in_block=False, help="the vocabulary is padded to a multiple of this x tp (default 128)")
    data_workers: int = option(2, group="data",
                               help="DataLoader worker processes per rank (0: read batches in the training process)")
    exit_interval: int = option(0, group="checkpointing",
                                help="stop with a checkpoint after every iteration that is a multiple of it (0: off)")
    exit_duration_in_mins: float | None = option(None, group="checkpointing",
                                                 help="stop with a checkpoint before this much wall time")
    exit_signal_handler: bool = option(
        True, group="checkpointing", negatable=True,
        help="on SIGTERM or SIGUSR1 every rank stops at the next iteration with a checkpoint and exits 0 (default: on)")
    distributed_timeout_minutes: float | None = option(
        None, group="parallelism", help="every collective's timeout (default: DeepSpeed's 10 minutes)")
    overwrite: bool = option(
        False, group="checkpointing",
        help="let a run without --load write into a --save directory that already holds checkpoints (its "
             "checkpoints and metrics are replaced)")
    sample_prompts: list[str] = option(group="logging", flag=None, default_factory=list,
                                       help="GPT-2 and Llama: text sampled from each prompt at the end (the demo)")
    tokenizer: str | None = option(None, group="logging", flag=None,
                                   help="the tokenizer directory the data was preprocessed with, which encodes and "
                                        "decodes sample_prompts (default: the bundled GPT-2 BPE)")
    # Megatron's flags for what the DeepSpeed part of the ds_config says (zoo.config.deepspeed_overrides):
    # None leaves the ds_config's own value.
    lr: float | None = option(None, group="learning rate",
                              help="peak learning rate (the optimizer's lr; WarmupDecayLR's warmup_max_lr)")
    min_lr: float | None = option(
        None, group="learning rate",
        help="learning rate at the end of the decay (WarmupCosineLR's cos_min_ratio x lr; WarmupDecayLR's "
             "warmup_min_lr, where its warm-up also starts); without it the ds_config's floor is kept")
    lr_warmup_iters: int | None = option(None, group="learning rate",
                                         help="iterations of linear warm-up (the scheduler's warmup_num_steps)")
    micro_batch_size: int | None = option(None, group="training",
                                          help="samples per rank per forward (train_micro_batch_size_per_gpu)")
    global_batch_size: int | None = option(
        None, group="training",
        help="samples per optimizer step over all ranks (train_batch_size) = micro-batch x accumulation steps x dp")
    fp16: bool | None = option(None, group="mixed precision",
                               help="train in fp16 with dynamic loss scaling (enables the fp16 block, disables bf16)")
    bf16: bool | None = option(None, group="mixed precision",
                               help="train in bf16 (enables the bf16 block, disables fp16)")
    clip_grad: float | None = option(None, group="training",
                                     help="gradient clipping by global norm (gradient_clipping; 0: off)")
    weight_decay: float | None = option(None, group="training",
                                        help="AdamW weight decay (the optimizer's weight_decay)")
    skip_fit_check: bool = option(
        False, group="parallelism", in_block=False,
        help="start even where the planner says the run does not fit in this device's memory")
    ds_config: dict[str, Any] = field(default_factory=dict, repr=False)
    ds_config_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.data_path, str):   # one prefix is a blend of one
            self.data_path = [self.data_path]

    @property
    def recompute(self) -> str | None:
        """The activation recomputation: "full", "selective" or None."""
        return "full" if self.checkpoint_activations else self.recompute_granularity

    def model_run_fields(self) -> dict[str, Any]:
        """The model-config keywords of the run's recomputation and sequence parallelism."""
        return {"activation_checkpointing": self.recompute == "full", "sequence_parallel": self.sequence_parallel,
                "recompute_granularity": "selective" if self.recompute == "selective" else None}

    @property
    def dtype_name(self) -> str:
        if self.ds_config.get("fp16", {}).get("enabled"):
            return "fp16"
        if self.ds_config.get("bf16", {}).get("enabled"):
            return "bf16"
        return "fp32"


PRECEDENCE = ("Precedence, one rule for every setting: a flag given on the command line overrides the ds_config's "
              "zoo block, which overrides the ds_config's own DeepSpeed values (--lr, --min-lr, --lr-warmup-iters, "
              "--micro-batch-size, --global-batch-size, --fp16, --bf16, --clip-grad and --weight-decay rewrite the "
              "optimizer, scheduler, batch and precision entries they name); what neither sets keeps the ds_config's "
              "value. The run prints the settings it resolved and keeps them in <save>/config.json.")


def build_parser(description: str) -> argparse.ArgumentParser:
    """The pretraining parser: every RunConfig flag in its --help group (absent flags parse as None, so the
    zoo block keeps its values), plus DeepSpeed's ``--deepspeed_config``."""
    parser = CommandParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=textwrap.fill(PRECEDENCE, 100))
    add_options(parser, RunConfig)
    add_deepspeed_config_argument(parser)
    return parser


def read_ds_config(path: str | None) -> dict[str, Any]:
    """The JSON of ``--deepspeed_config``, with one-sentence errors (shared by pretraining and finetuning)."""
    if path is None:
        raise UserError("no DeepSpeed config given; pass --deepspeed_config ds_configs/<name>.json.")
    if not Path(path).is_file():
        raise MissingInput(f"DeepSpeed config {path} does not exist; {closest_ds_config_hint(path)}.")
    try:
        ds_config = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"DeepSpeed config {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                         f"{err.start}); fix the file.") from None
    except json.JSONDecodeError as err:
        raise UserError(f"DeepSpeed config {path} is not valid JSON ({err}); fix the file.") from None
    if not isinstance(ds_config, dict):
        raise UserError(f"DeepSpeed config {path} holds {json_kind(ds_config)}, not a JSON object; write it as "
                         "{\"train_batch_size\": 8, \"train_micro_batch_size_per_gpu\": 4, \"optimizer\": {...}, ...}, "
                         "like the files in ds_configs/.")
    return ds_config


BUNDLED_DS_CONFIGS = Path(__file__).resolve().parents[2] / "ds_configs"


def closest_ds_config_hint(path: str | os.PathLike, bundled: Path = BUNDLED_DS_CONFIGS) -> str:
    """What to pass instead of the missing ``path``: the closest name among the JSON files of its own directory
    (where that exists) and of zoo's ds_configs/ (difflib), else the list of ds_configs/."""
    import difflib  # local: only a missing config pays for it

    wanted = Path(path)
    candidates: dict[str, Path] = {}
    for directory in (bundled, wanted.parent):
        if directory.is_dir():
            candidates.update({file.name: file for file in sorted(directory.glob("*.json"))})
    match = difflib.get_close_matches(wanted.name, list(candidates), n=1, cutoff=0.6)
    if match:
        return f"pass {shown_path(candidates[match[0]])}, the closest name there is"
    return f"pass one of the files in {shown_path(bundled)}/"


def shown_path(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it (as a user types it)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# Blocks of a ds_config that DeepSpeed reads as JSON objects.
DS_CONFIG_BLOCKS = ("optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "zoo")
DS_CONFIG_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def check_ds_config(ds_config: dict[str, Any], path: str | None, *, needs_optimizer: bool) -> None:
    """The settings of a ds_config that zoo and DeepSpeed both rely on, checked before anything is built or
    written (DeepSpeed's own checks come after the engine starts, as assertions): its blocks are JSON
    objects, the batch sizes present are positive integers (``gradient_accumulation_steps`` may be
    "auto"), at most one of fp16 and bf16 is enabled, and, where DeepSpeed builds the optimizer from the
    file (``needs_optimizer``: pretraining), an ``optimizer`` block with a ``type`` is there."""
    for block in DS_CONFIG_BLOCKS:
        if block in ds_config and not isinstance(ds_config[block], dict):
            raise UserError(f"{block!r} in DeepSpeed config {path} is {shown(ds_config[block])} "
                             f"({json_kind(ds_config[block])}), not a JSON object; write it as \"{block}\": "
                             "{...} like the files in ds_configs/.")
    for key in DS_CONFIG_BATCH_KEYS:
        value = ds_config.get(key)
        if key not in ds_config or (key == "gradient_accumulation_steps" and value == "auto"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            kind = "" if isinstance(value, int) and not isinstance(value, bool) else f" ({json_kind(value)})"
            raise UserError(f"{key} in DeepSpeed config {path} is {shown(value)}{kind}, not a positive integer; "
                             f"write it as e.g. \"{key}\": 8.")
    enabled = [name for name in ("fp16", "bf16") if ds_config.get(name, {}).get("enabled") is True]
    if len(enabled) == 2:
        raise UserError(f"DeepSpeed config {path} enables both fp16 and bf16; set \"enabled\": false in one of "
                         "them (bf16 needs no loss scaling, fp16 runs where bf16 is not supported).")
    if needs_optimizer:
        optimizer = ds_config.get("optimizer")
        if optimizer is None:
            raise UserError(f"DeepSpeed config {path} has no optimizer block, and DeepSpeed builds the optimizer "
                             "from it; add e.g. \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1.5e-4, "
                             "\"weight_decay\": 0.01}}.")
        if not isinstance(optimizer.get("type"), str):
            raise UserError(f"the optimizer block of DeepSpeed config {path} names no type (it has "
                             f"{shown(optimizer.get('type'))}); add e.g. \"type\": \"AdamW\".")


def load_run_config(args: argparse.Namespace) -> RunConfig:
    """ds_config file (``--deepspeed_config``) + its zoo block, then CLI flags on top; validated."""
    path = getattr(args, "deepspeed_config", None)
    ds_config = read_ds_config(path)
    block = ds_config.get("zoo", {})
    if not isinstance(block, dict):
        check_block_keys(block, RunConfig, path)
    check_ds_config(ds_config, path, needs_optimizer=True)
    block = check_block_keys(block, RunConfig, path)
    if precision_flags_given(args):   # --fp16 or --bf16 chooses the precision: the block's choice is not read
        block = {key: value for key, value in block.items() if key not in ("fp16", "bf16")}
    config = RunConfig(**merged_settings(RunConfig, block, args), ds_config=copy.deepcopy(ds_config),
                       ds_config_path=str(path))
    check_field_types(config)
    config = check_input_paths(validate_static(apply_overrides(shape_flags_into_overrides(config))))
    if launched_as_writer():
        for warning in data_warnings(config):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    return config


LAUNCHER_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")   # torchrun/DeepSpeed, mpirun, srun


def launched_as_writer(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is global rank 0 as its launcher numbers it (a single process is), so that a
    warning found from the configuration alone is printed once, before any process group exists."""
    environ = os.environ if environ is None else environ
    for name in LAUNCHER_RANK_VARIABLES:
        if name in environ:
            return environ[name].strip() == "0"
    return True


def data_warnings(config: RunConfig) -> list[str]:
    """Sentences for data settings that are accepted but probably not meant: a ``--data-path`` corpus named
    twice or of weight 0 (:func:`zoo.data.blending.blend_warnings`), a ``--split`` of fewer than three
    numbers (the missing ones are 0: no validation or no test documents)."""
    from zoo.data.blending import blend_warnings  # local: torch import cost (the parser is built without torch)

    warnings = blend_warnings(config.data_path)
    if isinstance(config.split, str):
        numbers = [part for part in config.split.replace("/", ",").split(",") if part.strip()]
        if 0 < len(numbers) < 3:
            read_as = ",".join(numbers + ["0"] * (3 - len(numbers)))
            missing = "valid and test" if len(numbers) == 1 else "test"
            warnings.append(f"--split {config.split} has {len(numbers)} number{'s' if len(numbers) > 1 else ''} "
                            f"of train,valid,test, read as {read_as}: no {missing} documents; give all three, e.g. "
                            f"{read_as}, to say so.")
    return warnings


def check_input_paths(config: RunConfig) -> RunConfig:
    """Every file the run reads exists, and the TensorBoard directory it writes can be made, checked before a process group, a model or an engine is built: the
    ``.bin`` and ``.idx`` of every ``data_path`` prefix (one, or each corpus of a blend), the ``pretrained``
    directory and its config.json (read and checked, see :func:`zoo.models.families.read_checked_config_json`), and ``load`` when it exists (a ``load`` not
    there yet is a run to start, so a job script can always pass ``--save X --load X``)."""
    from zoo.data.blending import parse_data_path  # local: torch import cost (the parser is built without torch)
    from zoo.data.indexed_dataset import check_dataset_files  # local: torch import cost
    from zoo.models.families import read_checked_config_json  # local: torch import cost

    if config.tensorboard_dir is not None:
        check_directory_can_be_made(config.tensorboard_dir, "--tensorboard-dir")
    for _, prefix in parse_data_path(config.data_path) or ():
        check_dataset_files(prefix)
    if config.pretrained is not None:
        read_checked_config_json(config.pretrained)
    if config.load is not None and Path(config.load).exists() and not Path(config.load).is_dir():
        raise MissingInput(f"--load {config.load} is a file, not a directory; pass the run directory (or its "
                                "checkpoints/ directory) to resume from.")
    return config


MEGATRON_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_key_value_heads",
                        "max_position_embeddings", "make_vocab_size_divisible_by")


def shape_flags_into_overrides(config: RunConfig) -> RunConfig:
    """``config`` with the Megatron shape flags it was given moved into ``model_overrides`` (flags win over the
    block's overrides), under the field names of its preset's family; the flag fields are left unset."""
    from zoo.models.families import megatron_shape_overrides  # local: torch import cost

    flags = {name: getattr(config, name) for name in MEGATRON_SHAPE_FLAGS}
    if any(value is not None for value in flags.values()):
        config.model_overrides = {**config.model_overrides, **megatron_shape_overrides(config.model, flags)}
        for name in MEGATRON_SHAPE_FLAGS:
            setattr(config, name, None)
    return config


def validate_static(config: RunConfig) -> RunConfig:
    """Checks that need no process group."""
    from zoo.models.config import check_overrides  # local: torch import cost (the parser is built without torch)
    from zoo.models.families import model_config

    check_field_types(config)
    check_ds_config(config.ds_config, config.ds_config_path, needs_optimizer=False)
    family_config = model_config(config.model)  # raises on an unknown preset
    allowed = {f.name for f in fields(family_config)} - {"extra"}
    bad = sorted(set(config.model_overrides) - allowed)
    if bad:
        raise UserError(f"model_overrides key {bad[0]!r} is not a {type(family_config).__name__} field; "
                         f"use one of {sorted(allowed)}.")
    check_overrides(model_config(config.model, **config.model_overrides), config.model_overrides)
    for name in ("train_iters", "seq_length", "tensor_parallel_size", "pipeline_model_parallel_size", "log_interval",
                 "eval_iters"):
        if getattr(config, name) < 1:
            raise UserError(f"{name} = {getattr(config, name)} must be at least 1; fix the zoo block or the flag.")
    for name in ("eval_interval", "save_interval", "exit_interval", "data_workers"):
        if getattr(config, name) < 0:
            raise UserError(f"{name} = {getattr(config, name)} must be 0 (never) or positive; fix the zoo block "
                             "or the flag.")
    for name in ("exit_duration_in_mins", "distributed_timeout_minutes"):
        if getattr(config, name) is not None and not 0 < getattr(config, name) < math.inf:
            raise UserError(f"{name} = {getattr(config, name)} must be a positive number of minutes; fix the zoo "
                             "block or the flag.")
    check_sample_prompts(config, model_config(config.model, **config.model_overrides))
    check_pipeline(config, model_config(config.model, **config.model_overrides))
    if config.recompute_granularity not in (None, "full", "selective"):
        raise UserError(f"recompute_granularity {config.recompute_granularity!r} is not 'full' or 'selective'; pass "
                         "--recompute-granularity full (every layer) or selective (the attention core).")
    if config.checkpoint_activations and config.recompute_granularity == "selective":
        raise UserError("checkpoint_activations (full recomputation) contradicts recompute_granularity 'selective'; "
                         "drop one of them.")
    if config.sequence_parallel and config.seq_length % config.tensor_parallel_size:
        raise UserError(f"sequence parallelism splits seq_length {config.seq_length} over tp="
                         f"{config.tensor_parallel_size} ranks, which does not divide it; pass a --seq-length that "
                         f"is a multiple of {config.tensor_parallel_size}.")
    if not config.save:
        raise UserError(f"save is {config.save!r} in the zoo block of {config.ds_config_path}; pass --save with the run "
                         "directory that receives the metrics, the plot and the checkpoints.")
    if config.pretrained is not None and not Path(config.pretrained).is_dir():
        raise MissingInput(f"--pretrained directory {config.pretrained} does not exist; pass a directory written "
                                "by save_pretrained or launch/export.py.")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):
        if key not in config.ds_config:
            raise UserError(f"DeepSpeed config {config.ds_config_path} lacks {key!r}; zoo fixes the global "
                             "batch in the config, add both train_batch_size and train_micro_batch_size_per_gpu.")
    return config


def check_sample_prompts(config: RunConfig, family_config) -> None:
    """``sample_prompts`` are strings, for a family that generates text, in the run's ``tokenizer`` (the
    sampler's), whose tokens all lie in the model's vocabulary, each leaving room for new tokens in its
    context: checked before training, not after it, where they are used."""
    from zoo.models.families import family_of  # local: torch import cost (the parser is built without torch)

    prompts = config.sample_prompts
    if not prompts:
        return
    bad = next((p for p in prompts if not isinstance(p, str)), None)
    if bad is not None:
        raise UserError(f"sample_prompts holds {shown(bad)} ({json_kind(bad)}), not a string; write it as e.g. "
                         "\"sample_prompts\": [\"The history of\"].")
    family = family_of(family_config)
    if not family.generates_text:
        raise UserError(f"sample_prompts are for GPT models, but model {config.model!r} is a "
                         f"{family_config.model_type} model, which does not generate text; remove sample_prompts "
                         "from the zoo block.")
    if config.pretrained is not None:   # the directory's n_positions: generation checks the lengths itself
        return
    from zoo.data.tokenizers import load_gpt2_tokenizer  # local: torch import cost (the parser is built without torch)

    n_positions = family.shape(family_config).max_positions
    tokenizer = load_gpt2_tokenizer(config.tokenizer)
    named = f"the tokenizer in {config.tokenizer}" if config.tokenizer else "the bundled GPT-2 tokenizer"
    if len(tokenizer) > family_config.vocab_size:
        raise UserError(f"sample_prompts are encoded with {named} ({len(tokenizer)} tokens), more than the "
                         f"vocab_size {family_config.vocab_size} of model {config.model!r}; set the zoo block's "
                         "\"tokenizer\" to the directory the run's data was preprocessed with, or remove sample_prompts.")
    for index, prompt in enumerate(prompts):
        length = len(tokenizer.encode(prompt))
        if length >= n_positions:
            raise UserError(f"sample prompt {index} has {length} tokens, which leaves no room for new tokens in the "
                             f"model's n_positions={n_positions}; shorten it.")


def check_pipeline(config: RunConfig, family_config) -> None:
    """A pipeline layout zoo and DeepSpeed's pipeline engine can run: a family with pipeline stages, a known
    partition method, every stage with a layer (``uniform``: the same number), ZeRO stage 0 or 1."""
    from zoo.models.families import FAMILIES, family_of  # local: torch import cost (the parser is built without torch)

    pp = config.pipeline_model_parallel_size
    if config.pipeline_partition_method not in ("parameters", "uniform"):
        raise UserError(f"pipeline_partition_method {config.pipeline_partition_method!r} is not 'parameters' or "
                         "'uniform'; pass --pipeline-partition-method parameters (balanced parameter counts) or "
                         "uniform (equal transformer layers per stage).")
    if pp == 1:
        return
    family = family_of(family_config)
    if family.pipeline is None:
        staged = " and ".join(f.display_name for f in FAMILIES if f.pipeline is not None)
        raise UserError(f"pipeline stages are built for {staged} only, and model {config.model!r} is "
                         f"{family.display_name} (model_type {family_config.model_type!r}); train it with "
                         "--pipeline-model-parallel-size 1 (tensor, sequence and data parallelism).")
    layers = family.shape(family_config).layers
    if config.pretrained is None and layers < pp:
        raise UserError(f"--pipeline-model-parallel-size {pp} asks for more stages than the {layers} transformer "
                         f"layers of model {config.model!r}; pass at most {layers} stages.")
    if config.pretrained is None and config.pipeline_partition_method == "uniform" and layers % pp:
        fits = [p for p in range(1, layers + 1) if layers % p == 0]
        raise UserError(f"--pipeline-partition-method uniform splits the {layers} transformer layers of model "
                         f"{config.model!r} equally, which {pp} stages cannot; pass --pipeline-model-parallel-size one "
                         f"of {fits} or --pipeline-partition-method parameters.")
    stage = (config.ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage >= 2:
        raise UserError(f"ZeRO stage {stage} in {config.ds_config_path} partitions gradients, which DeepSpeed's "
                         "pipeline engine cannot; set zero_optimization stage 0 or 1 with "
                         f"--pipeline-model-parallel-size {pp}.")


def pipeline_sampling_warning(config: RunConfig) -> str | None:
    """The warning to print when ``sample_prompts`` are skipped: sampling needs every layer on one rank."""
    if config.pipeline_model_parallel_size == 1 or not config.sample_prompts:
        return None
    return (f"sample_prompts are skipped: --pipeline-model-parallel-size {config.pipeline_model_parallel_size} splits "
            "the layers over ranks and sampling needs them all on one; export the checkpoint (launch/export.py) and "
            "sample with launch/generate.py.")


def pipeline_bubble_warning(config: RunConfig, gas: int) -> str | None:
    """The warning to print (one sentence) when the 1F1B bubble (P - 1) / (m + P - 1) exceeds half the step."""
    pp = config.pipeline_model_parallel_size
    if pp == 1 or gas >= pp:
        return None
    bubble = (pp - 1) / (gas + pp - 1)
    return (f"{gas} micro-batches per step over {pp} pipeline stages leave the stages idle {bubble:.0%} of the step "
            f"(the 1F1B bubble (P - 1) / (m + P - 1)); raise train_batch_size to at least {pp} micro-batches per "
            "data-parallel replica.")


def check_field_types(config: RunConfig) -> None:
    """Every zoo setting has its field's type (CLI flags are typed by argparse, so a wrong type comes
    from the zoo block of the ds_config): one sentence naming the key, its value and the expected type."""
    check_types(config, config.ds_config_path)


def validate_for_world(config: RunConfig, world_size: int) -> int:
    """Batch sizes against the data-parallel size; returns the gradient-accumulation steps."""
    from zoo.parallel.state import check_grid  # local: torch import cost (the parser is built without torch)

    tp, pp = config.tensor_parallel_size, config.pipeline_model_parallel_size
    check_grid(tp, world_size, pp)
    dp = world_size // (tp * pp)
    global_batch = config.ds_config["train_batch_size"]
    micro = config.ds_config["train_micro_batch_size_per_gpu"]
    if global_batch % (micro * dp) != 0:
        raise UserError(batch_arithmetic_error(global_batch, micro, dp, world_size, tp, pp))
    gas = global_batch // (micro * dp)
    declared = config.ds_config.get("gradient_accumulation_steps")
    if declared not in (None, "auto", gas):
        raise UserError(f"gradient_accumulation_steps {declared} disagrees with train_batch_size {global_batch} "
                         f"/ (micro {micro} x dp {dp}) = {gas}; remove it and DeepSpeed derives it.")
    return gas


def batch_arithmetic_error(global_batch: int, micro: int, dp: int, world_size: int, tp: int, pp: int) -> str:
    """The one sentence for a global batch that micro-batch x accumulation steps x dp cannot make, with the
    nearest global batches that work and the micro-batches that would."""
    step = micro * dp
    below, above = global_batch // step * step, (global_batch // step + 1) * step
    nearest = f"{below} or {above}" if below else f"{above}"
    micros = [m for m in range(1, global_batch // dp + 1) if global_batch % (m * dp) == 0] if global_batch % dp == 0 else []
    other = f", or --micro-batch-size one of {micros[-6:]}" if micros else ""
    return (f"the global batch {global_batch} (train_batch_size, --global-batch-size) must equal micro-batch {micro} x "
            f"accumulation steps x data-parallel size {dp} (= {world_size} ranks / (tp {tp} x pp {pp})), which no "
            f"whole number of accumulation steps gives; pass --global-batch-size {nearest}{other}.")


# The top-level keys of a ds_config that are zoo's, not DeepSpeed's: the zoo block, and the effective settings a
# run's <save>/config.json carries beside it (zoo.training.effective_settings).
ZOO_TOP_LEVEL_KEYS = ("zoo", "effective")
SCHEDULES_OVER_TRAIN_ITERS = ("WarmupCosineLR", "WarmupDecayLR")


def deepspeed_dict(config: RunConfig, gas: int) -> dict[str, Any]:
    """The dict handed to deepspeed.initialize: the file's config, schedule length tied to train_iters
    (a warm-up longer than the run is cut to it; :func:`clipped_warmup_warning` says so), bf16 gradients
    accumulated in fp32 (:func:`zoo.config.deepspeed_overrides.accumulate_bf16_in_fp32`)."""
    ds = accumulate_bf16_in_fp32(config.ds_config)
    for key in ZOO_TOP_LEVEL_KEYS:
        ds.pop(key, None)
    ds["gradient_accumulation_steps"] = gas
    scheduler = ds.get("scheduler")
    if scheduler and scheduler.get("type") in SCHEDULES_OVER_TRAIN_ITERS:
        params = scheduler.setdefault("params", {})
        params["total_num_steps"] = config.train_iters
        params["warmup_num_steps"] = max(1, min(params.get("warmup_num_steps", 1), config.train_iters))
    return ds


def clipped_warmup_warning(config: RunConfig) -> str | None:
    """The warning to print (one sentence) when the ds_config's warm-up is longer than the run and is cut to it."""
    scheduler = config.ds_config.get("scheduler") or {}
    warmup = (scheduler.get("params") or {}).get("warmup_num_steps", 1)
    if scheduler.get("type") not in SCHEDULES_OVER_TRAIN_ITERS or warmup <= config.train_iters:
        return None
    return (f"the {scheduler['type']} warm-up of {warmup} steps in {config.ds_config_path} is longer than "
            f"train_iters {config.train_iters}, so it is cut to {config.train_iters} steps and the learning rate "
            f"never decays; pass --train-iters above {warmup} or lower warmup_num_steps.")


def lr_schedule(ds: dict[str, Any]) -> dict[str, Any] | None:
    """The LR schedule of a :func:`deepspeed_dict` result, as recorded in checkpoints: type and params."""
    scheduler = ds.get("scheduler")
    if not scheduler:
        return None
    return {"type": scheduler.get("type"), **dict(scheduler.get("params") or {})}


def schedule_change_warning(old: dict[str, Any] | None, new: dict[str, Any] | None, iteration: int) -> str | None:
    """The warning to print (one sentence) when a resumed run's LR schedule differs from the checkpoint's.

    Megatron's rule stays: this run's flags govern and the step count continues, so from ``iteration``
    on the learning rate follows the new schedule; the warning names both.
    """
    if old == new:
        return None
    return (f"the checkpoint at iteration {iteration} was trained with the LR schedule "
            f"{describe_schedule(old, new)} and this run continues with {describe_schedule(new, old)}, so the "
            f"learning rate follows the new schedule from iteration {iteration}; resume with the old --train-iters "
            "and scheduler settings to keep the old one.")


def describe_schedule(schedule: dict[str, Any] | None, other: dict[str, Any] | None) -> str:
    """``WarmupCosineLR(total_num_steps=3, warmup_num_steps=3)``: the type and the params that differ
    from ``other`` (all of them when the types differ)."""
    if schedule is None:
        return "none (a constant learning rate)"
    other = other or {}
    same_type = other.get("type") == schedule.get("type")
    shown = {k: v for k, v in schedule.items() if k != "type" and not (same_type and other.get(k) == v)}
    if same_type:
        shown.update({k: None for k in other if k not in schedule})
    return f"{schedule.get('type')}(" + ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) + ")"
