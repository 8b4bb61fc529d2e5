"""The settings a pretraining run resolved, shown once at its start and kept in ``<save>/config.json``.

Megatron prints its arguments at start; zoo's settings come from three places (the ds_config, its zoo block,
the flags: :mod:`zoo.config.deepspeed_overrides`) plus what the world size decides. The writer prints one
block (model shape, layout tp x pp x dp, batch arithmetic, precision with the dtype the micro-batches'
gradients are summed in, optimizer, schedule with what ``--train-iters`` rewrote, data with each corpus's weight,
documents, tokens and epochs covered) and writes the same as ``<save>/config.json``:

    {<the ds_config DeepSpeed is given>, "zoo": {<every zoo setting, resolved>}, "effective": {<the block>}}

The DeepSpeed part is what ``deepspeed.initialize`` gets (the schedule's total steps set by train_iters),
less ``gradient_accumulation_steps``, which follows from the world size (it is in ``effective.batch``): the
file is a ds_config from which the same run starts again, at any world size. It is written atomically, and
replaces only a config.json that an earlier zoo run wrote (one with these three keys).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path
from typing import Any

from zoo.atomic import check_writable_directory, unwritable_directory, write_text_atomic
from zoo.config.deepspeed_dict import SCHEDULES_OVER_TRAIN_ITERS, ZOO_TOP_LEVEL_KEYS, deepspeed_dict
from zoo.config.deepspeed_overrides import OVERRIDE_FIELDS, gradient_accumulation_dtype, gradient_reduction_dtype
from zoo.config.run_config import RunConfig
from zoo.errors import UserError
from zoo.options import settings_of
from zoo.planning.model_states import count_parameters, zero_stage_of
from zoo.planning.planner import model_config_of

__all__ = ["CONFIG_FILE", "effective_settings", "format_effective_settings", "record_effective_settings",
           "run_config_file"]

CONFIG_FILE = "config.json"


def record_effective_settings(config: RunConfig, world_size: int, gas: int) -> dict[str, Any]:
    """On the writer rank: print the block and write ``<save>/config.json``; returns the file's content."""
    content = run_config_file(config, world_size, gas)
    path = Path(config.save) / CONFIG_FILE
    check_replaceable_config_file(path)
    print(format_effective_settings(content["effective"], path), flush=True)
    check_writable_directory(config.save, "--save")
    try:
        write_text_atomic(path, json.dumps(content, indent=2) + "\n")
    except OSError as err:
        raise unwritable_directory("--save", config.save, err) from None
    return content


def check_replaceable_config_file(path: Path) -> None:
    """A config.json already in ``--save`` is replaced only when a zoo run wrote it (one sentence if not)."""
    if not path.exists() and not path.is_symlink():
        return
    try:
        existing = json.loads(path.read_text(encoding="utf-8")) if path.is_file() and not path.is_symlink() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        existing = None
    if not (isinstance(existing, dict) and all(key in existing for key in ZOO_TOP_LEVEL_KEYS)):
        raise UserError(f"{path} exists and was not written by a zoo run (it lacks the \"zoo\" and \"effective\" "
                         "entries zoo writes there), and the run keeps its settings under that name; move it, or pass "
                         "another --save.")


def run_config_file(config: RunConfig, world_size: int, gas: int) -> dict[str, Any]:
    """The content of ``<save>/config.json``: the DeepSpeed part, the zoo block and the effective settings."""
    ds = deepspeed_dict(config, gas)
    ds.pop("gradient_accumulation_steps", None)
    return {**ds, "zoo": zoo_block(config), "effective": effective_settings(config, world_size, gas)}


def zoo_block(config: RunConfig) -> dict[str, Any]:
    """Every zoo-block setting of ``config`` as resolved (the override flags are already in the DeepSpeed part,
    so they are left unset here)."""
    block_names = {f.name for f in settings_of(RunConfig) if f.metadata["in_block"]}
    return {f.name: (None if f.name in OVERRIDE_FIELDS else getattr(config, f.name))
            for f in fields(config) if f.name in block_names}


def effective_settings(config: RunConfig, world_size: int, gas: int) -> dict[str, Any]:
    """The resolved settings as plain data: model, layout, batch, precision, optimizer, schedule, data, run."""
    ds = deepspeed_dict(config, gas)
    tp, pp, cp = config.tensor_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size
    dp = world_size // (tp * pp * cp)
    micro, global_batch = ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]
    return {
        "model": model_settings(config),
        "layout": {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "world_size": world_size},
        "batch": {"micro": micro, "accumulation": gas, "dp": dp, "global": global_batch,
                  "tokens_per_iteration": global_batch * config.seq_length},
        "precision": {"dtype": config.dtype_name, "grad_accum_dtype": gradient_accumulation_dtype(ds),
                      "grad_reduce_dtype": gradient_reduction_dtype(ds),
                      "zero_stage": zero_stage_of(ds),
                      "gradient_clipping": ds.get("gradient_clipping", 0.0), "recompute": config.recompute or "none",
                      "sequence_parallel": config.sequence_parallel, "compiled_blocks": config.compile},
        "optimizer": {"type": (ds.get("optimizer") or {}).get("type"), **((ds.get("optimizer") or {}).get("params") or {})},
        "schedule": schedule_settings(config, ds),
        "data": data_settings(config, global_batch),
        "run": {"train_iters": config.train_iters, "samples": config.train_iters * global_batch,
                "eval_interval": config.eval_interval, "eval_iters": config.eval_iters,
                "save_interval": config.save_interval, "log_interval": config.log_interval, "seed": config.seed},
    }


def model_settings(config: RunConfig) -> dict[str, Any]:
    """The model's shape as the run builds it (preset, overrides or ``--pretrained`` directory) and its
    parameter count (the padded vocabulary included, counted on the meta device)."""
    from zoo.models.families import shape_of  # local: torch and transformers import cost

    model_config = model_config_of(config)
    shape = shape_of(model_config)
    return {"preset": config.model, "pretrained": config.pretrained, "layers": shape.layers, "hidden": shape.hidden,
            "heads": shape.heads, "kv_heads": shape.kv_heads, "vocab": shape.vocab,
            "padded_vocab": model_config.padded_vocab_size(config.tensor_parallel_size),
            "max_positions": shape.max_positions, "seq_length": config.seq_length,
            "parameters": count_parameters(model_config, config.tensor_parallel_size).total}


def schedule_settings(config: RunConfig, ds: dict[str, Any]) -> dict[str, Any] | None:
    """The scheduler DeepSpeed gets, in absolute learning rates where its params are ratios, and what
    train_iters rewrote (``total_num_steps_in_file`` where it differs)."""
    scheduler = ds.get("scheduler")
    if not scheduler:
        return None
    kind, params = scheduler.get("type"), dict(scheduler.get("params") or {})
    peak = ((ds.get("optimizer") or {}).get("params") or {}).get("lr")
    settings: dict[str, Any] = {"type": kind, **params}
    if kind == "WarmupCosineLR" and peak is not None:
        settings["start_lr"] = params.get("warmup_min_ratio", 0.0) * peak
        settings["peak_lr"] = peak
        settings["min_lr"] = params.get("cos_min_ratio", 0.0001) * peak
    elif kind in ("WarmupDecayLR", "WarmupLR"):
        settings["start_lr"] = params.get("warmup_min_lr", 0.0)
        settings["peak_lr"] = params.get("warmup_max_lr", peak if kind == "WarmupLR" else 0.001)
        if kind == "WarmupDecayLR":
            settings["min_lr"] = settings["start_lr"]
    in_file = ((config.ds_config.get("scheduler") or {}).get("params") or {}).get("total_num_steps")
    if kind in SCHEDULES_OVER_TRAIN_ITERS and in_file != params.get("total_num_steps"):
        settings["total_num_steps_in_file"] = in_file
    return settings


def data_settings(config: RunConfig, global_batch: int) -> list[dict[str, Any]]:
    """One entry per corpus: its weight, and where it is cheap to know (an indexed dataset's header and file
    size) its documents, tokens and the epochs of its train split the run covers (samples drawn x seq_length
    / train tokens, the split taken by its share of the documents: an estimate). The bundled sample has none
    until it is preprocessed."""
    from zoo.data.blending import parse_data_path  # local: torch import cost
    from zoo.data.gpt_dataset import parse_split  # local: torch import cost
    from zoo.data.indexed_dataset import IndexedDataset  # local: torch import cost

    blend = parse_data_path(config.data_path)
    if blend is None:
        return [{"corpus": "the bundled Wikipedia sample", "weight": 1.0}]
    train_share = parse_split(config.split)[0] / sum(parse_split(config.split))
    entries = []
    for weight, prefix in blend:
        indexed = IndexedDataset(prefix)
        tokens = Path(prefix + ".bin").stat().st_size // indexed.dtype.itemsize
        drawn = weight * config.train_iters * global_batch * config.seq_length
        train_tokens = tokens * train_share
        epochs = drawn / train_tokens if train_tokens else math.inf
        entries.append({"corpus": prefix, "weight": weight, "documents": indexed.num_documents, "tokens": tokens,
                        "epochs": epochs})
    return entries


# ---------------------------------------------------------------------------------------------- the block
def format_effective_settings(s: dict[str, Any], path: str | Path | None = None) -> str:
    """The printed block of :func:`effective_settings` (``path``: where it is kept)."""
    model, layout, batch, precision = s["model"], s["layout"], s["batch"], s["precision"]
    lines = [f"effective settings{f' (kept in {path})' if path else ''}:",
             f"  model      {describe_model(model)}",
             f"  layout     tp {layout['tp']}{context_factor(layout)} x pp {layout['pp']} x dp {layout['dp']} = "
             f"{layout['world_size']} ranks",
             f"  batch      micro {batch['micro']} x accumulation {batch['accumulation']} x dp {batch['dp']} = global "
             f"{batch['global']} samples ({batch['tokens_per_iteration']:,} tokens) per iteration",
             f"  precision  {describe_precision(precision)}",
             f"  optimizer  {describe_optimizer(s['optimizer'])}",
             f"  schedule   {describe_schedule(s['schedule'])}"]
    for index, corpus in enumerate(s["data"]):
        lines.append(f"  {'data' if index == 0 else '':<10} {describe_corpus(corpus)}")
    run = s["run"]
    evaluation = (f"validation every {run['eval_interval']} ({run['eval_iters']} global batches = "
                  f"{run['eval_iters'] * batch['global']:,} samples)" if run["eval_interval"] else "no validation")
    saving = f"checkpoints every {run['save_interval']}" if run["save_interval"] else "a checkpoint at the end"
    lines.append(f"  run        {run['train_iters']:,} iterations = {run['samples']:,} samples, {evaluation}, {saving}, "
                 f"a log line every {run['log_interval']}, seed {run['seed']}")
    return "\n".join(lines)


def describe_model(m: dict[str, Any]) -> str:
    """The model line: its key/value heads too where they are fewer than its heads (grouped-query attention), as
    the planner's line says them."""
    source = f"{m['preset']}" + (f" from {m['pretrained']}" if m["pretrained"] else "")
    kv_heads = m.get("kv_heads", m["heads"])
    heads = f"{m['heads']} heads" + (f" ({kv_heads} key/value heads)" if kv_heads != m["heads"] else "")
    return (f"{source}: {m['layers']} layers, hidden {m['hidden']}, {heads}, vocab {m['vocab']} (padded to "
            f"{m['padded_vocab']}), {m['seq_length']} of {m['max_positions']} positions, "
            f"{m['parameters'] / 1e6:,.1f}M parameters")


def context_factor(layout: dict[str, Any]) -> str:
    """`` x cp C (each sequence split over C ranks)`` in the layout line where context parallelism is on."""
    cp = layout.get("cp", 1)
    return f" x cp {cp} (each sequence split over {cp} ranks)" if cp > 1 else ""


def describe_precision(p: dict[str, Any]) -> str:
    clipping = f"gradient clipping {p['gradient_clipping']:g}" if p["gradient_clipping"] else "no gradient clipping"
    extras = (f", recompute {p['recompute']}" + (", sequence parallel" if p["sequence_parallel"] else "")
              + (", transformer blocks compiled (torch.compile)" if p.get("compiled_blocks") else ""))
    accumulation = (f" (gradients accumulated in {p['grad_accum_dtype']}, all-reduced in {p['grad_reduce_dtype']})"
                    if p.get("grad_accum_dtype") else "")
    return f"{p['dtype']}{accumulation}, ZeRO stage {p['zero_stage']}, {clipping}{extras}"


def describe_optimizer(o: dict[str, Any]) -> str:
    shown = ", ".join(f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}"
                      for key, value in o.items() if key != "type")
    return f"{o['type']}: {shown}" if shown else f"{o['type']}"


def describe_schedule(s: dict[str, Any] | None) -> str:
    if s is None:
        return "none: a constant learning rate"
    if "peak_lr" not in s:
        return f"{s['type']}(" + ", ".join(f"{k}={v}" for k, v in s.items() if k != "type") + ")"
    warmup = max(2, s.get("warmup_num_steps", 1000))   # DeepSpeed's warm-ups last at least 2 steps
    text = f"{s['type']}: warm-up {warmup} steps from {s['start_lr']:.3g} to {s['peak_lr']:.3g}"
    if "min_lr" in s:
        decay = "cosine" if s["type"] == "WarmupCosineLR" else "linear"
        text += f", {decay} decay to {s['min_lr']:.3g} at step {s.get('total_num_steps')}"
    if "total_num_steps_in_file" in s:
        text += f" (total_num_steps set by train_iters; the ds_config says {s['total_num_steps_in_file']})"
    return text


def describe_corpus(c: dict[str, Any]) -> str:
    if "documents" not in c:
        return f"{c['corpus']} (weight {c['weight']:g}; preprocessed into zoo's cache at first use)"
    return (f"{c['corpus']}: weight {c['weight']:.3g}, {c['documents']:,} documents, {c['tokens']:,} tokens, "
            f"~{c['epochs']:.2f} epochs of its train split")
