"""The checks of a :class:`~zoo.config.run_config.RunConfig`: those that need no process group
(:func:`validate_static`: types, ranges, the model's overrides, sample prompts, the pipeline layout; the
files the run reads, :func:`check_input_paths`), those against the world size (:func:`validate_for_world`:
the grid and the batch arithmetic), and the warnings for settings that are accepted but probably not meant."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

from zoo.atomic import check_directory_can_be_made
from zoo.config.ds_config_file import check_ds_config
from zoo.config.run_config import RunConfig
from zoo.errors import MissingInput, UserError
from zoo.options import check_types, json_kind, shown


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
    for name in ("train_iters", "seq_length", "tensor_parallel_size", "pipeline_model_parallel_size",
                 "context_parallel_size", "log_interval", "eval_iters"):
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
    check_context_parallel(config, model_config(config.model, **config.model_overrides))
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


def check_context_parallel(config: RunConfig, family_config) -> None:
    """A context-parallel layout zoo can run: a causal decoder (GPT-2, Llama), one pipeline stage, eager blocks, a
    sequence the c (and, with sequence parallelism, t c) ranks split evenly, and heads the t c ranks split."""
    from zoo.models.families import CAUSAL_LM, family_of  # local: torch import cost (the parser is built without torch)
    from zoo.parallel.context import check_context_heads

    cp, tp = config.context_parallel_size, config.tensor_parallel_size
    if cp == 1:
        return
    family = family_of(family_config)
    if family.objective != CAUSAL_LM:
        raise UserError(f"context parallelism is built for causal decoders (GPT-2, Llama), and model {config.model!r} "
                         f"is {family.display_name}, whose padded, bidirectional samples it does not split; train it "
                         "with --context-parallel-size 1.")
    if config.pipeline_model_parallel_size > 1:
        raise UserError(f"--context-parallel-size {cp} with {config.pipeline_model_parallel_size} pipeline stages is "
                         "not supported: DeepSpeed's pipeline engine sums gradients over the data-parallel group alone, "
                         "not over the context-parallel ranks; pass --pipeline-model-parallel-size 1.")
    if config.compile:
        raise UserError(f"--compile with --context-parallel-size {cp} is not supported: DeepSpeed-Ulysses' all-to-all "
                         "is not traced by torch.compile; pass --no-compile or --context-parallel-size 1.")
    split = cp * tp if config.sequence_parallel else cp
    if config.seq_length % split:
        over = f"context-parallel size {cp} x tensor-parallel size {tp} (sequence parallelism)" \
            if config.sequence_parallel else f"context-parallel size {cp}"
        raise UserError(f"seq_length {config.seq_length} does not divide by the {over}; pass a --seq-length that is a "
                         f"multiple of {split}.")
    shape = family.shape(family_config)
    check_context_heads(shape.heads, shape.kv_heads, tp, cp)


def pipeline_sampling_warning(config: RunConfig) -> str | None:
    """The warning to print when ``sample_prompts`` are skipped: sampling needs every layer on one rank."""
    if config.context_parallel_size > 1 and config.sample_prompts:
        return (f"sample_prompts are skipped: --context-parallel-size {config.context_parallel_size} splits each "
                "sequence over ranks and sampling decodes from a key/value cache on one; export the checkpoint "
                "(launch/export.py) and sample with launch/generate.py.")
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

    tp, pp, cp = config.tensor_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size
    check_grid(tp, world_size, pp, cp)
    dp = world_size // (tp * pp * cp)
    global_batch = config.ds_config["train_batch_size"]
    micro = config.ds_config["train_micro_batch_size_per_gpu"]
    if global_batch % (micro * dp) != 0:
        raise UserError(batch_arithmetic_error(global_batch, micro, dp, world_size, tp, pp, cp))
    gas = global_batch // (micro * dp)
    declared = config.ds_config.get("gradient_accumulation_steps")
    if declared not in (None, "auto", gas):
        raise UserError(f"gradient_accumulation_steps {declared} disagrees with train_batch_size {global_batch} "
                         f"/ (micro {micro} x dp {dp}) = {gas}; remove it and DeepSpeed derives it.")
    return gas


def batch_arithmetic_error(global_batch: int, micro: int, dp: int, world_size: int, tp: int, pp: int,
                           cp: int = 1) -> str:
    """The one sentence for a global batch that micro-batch x accumulation steps x dp cannot make, with the
    nearest global batches that work and the micro-batches that would."""
    step = micro * dp
    below, above = global_batch // step * step, (global_batch // step + 1) * step
    nearest = f"{below} or {above}" if below else f"{above}"
    micros = [m for m in range(1, global_batch // dp + 1) if global_batch % (m * dp) == 0] if global_batch % dp == 0 else []
    other = f", or --micro-batch-size one of {micros[-6:]}" if micros else ""
    return (f"the global batch {global_batch} (train_batch_size, --global-batch-size) must equal micro-batch {micro} x "
            f"accumulation steps x data-parallel size {dp} (= {world_size} ranks / (tp {tp} x pp {pp}"
            f"{f' x cp {cp}' if cp > 1 else ''})), which no "
            f"whole number of accumulation steps gives; pass --global-batch-size {nearest}{other}.")


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


__all__ = ["batch_arithmetic_error", "check_field_types", "check_input_paths", "check_pipeline", "check_sample_prompts",
           "data_warnings", "pipeline_bubble_warning", "pipeline_sampling_warning", "validate_for_world",
           "validate_static"]
