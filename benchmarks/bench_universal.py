"""DeepSpeed's universal checkpoint on a zoo checkpoint: does ``ds_to_universal`` convert it, at what cost, and
would the result restore right at another tp? Against zoo's own layout-free reader
(``zoo.checkpoint.training_state.CheckpointTrainingState``), tensor by tensor.

The source is ``bench_reshard.py``'s bf16 + ZeRO-1 tp = 2 run (``--cache``, built there). zoo writes its
checkpoints with a ``universal_checkpoint_info`` that makes ``ds_to_universal`` stop (tp > 1), so each variant
converts a copy of the tag (the optimizer partitions linked, the model-states files rewritten) whose info is:

* ``none``: removed, converted with ``--inject_missing_state`` (DeepSpeed left to itself);
* ``described``: what zoo would have to publish for ``ds_to_universal``: the vocabulary pattern and
  ``original_vocab_size``, the row-parallel weights, the tp-replicated tensors, and the fused QKV weight and bias
  as three sub-parameters (``parameter_with_sub_params`` with ``sub_param_shard_widths``, universal-checkpoint
  version 0.4).

For each variant: the conversion's wall seconds and peak resident set (``/usr/bin/time``, the largest of its
worker processes), the universal directory's bytes on disk and file count; then for every parameter and each of
fp32 / exp_avg / exp_avg_sq, whether the universal tensor equals zoo's merged master (vocabulary padding cut);
then, at each ``--new-tp``, whether the slice DeepSpeed's own restore
(``deepspeed.checkpoint.universal_checkpoint.load_hp_checkpoint_state``, on a stand-in parameter of the new
rank's local shape) equals the shard zoo's move gives that rank. ``--pipeline`` also tries a tiny tp = 1 x
pp = 2 bf16 + ZeRO-1 checkpoint (built here with the launcher). Nothing is asserted.

    .venv/bin/python benchmarks/bench_universal.py --cache /tmp/bench-reshard [--pipeline]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_reshard import (  # noqa: E402
    REPO,
    build_source,
    launcher,
    launcher_env,
    make_corpus,
    source_config,
    tag_directory,
)

UNIVERSAL_VERSION = 0.4


def described_info(model_config: dict, tp: int) -> dict:
    """The ``universal_checkpoint_info`` a one-stage GPT-2 of zoo at ``tp`` would need (zoo's (out, in) layout)."""
    hidden = model_config["n_embd"]
    qkv_widths = [[hidden // tp] * tp for _ in range(3)]
    return {
        "universal_checkpoint_version": UNIVERSAL_VERSION,
        "original_vocab_size": model_config["vocab_size"],
        "vocabulary_parameter_patterns": [r"transformer\.wte\.weight$"],
        "parameter_with_row_parallelism_patterns": [r".*\.attn\.c_proj\.weight$", r".*\.mlp\.c_proj\.weight$"],
        "tp_replicated_parameter_patterns": [r"transformer\.wpe\.weight$", r".*\.ln_(1|2|f)\.(weight|bias)$",
                                             r".*\.c_proj\.bias$"],
        "parameter_with_sub_params": [
            {"patterns": [r".*\.attn\.c_attn\.weight$"], "shape": ((hidden,) * 3, hidden), "partition_dim": 0},
            {"patterns": [r".*\.attn\.c_attn\.bias$"], "shape": ((hidden,) * 3,), "partition_dim": 0},
        ],
        "sub_param_shard_widths": {r".*\.attn\.c_attn\.weight$": qkv_widths, r".*\.attn\.c_attn\.bias$": qkv_widths},
    }


def prepared_copy(tag: Path, into: Path, info: dict | None) -> Path:
    """``into/<tag name>``: the tag's files, the model-states files with ``universal_checkpoint_info`` = ``info``
    (removed when None), the rest linked."""
    from zoo.checkpoint.safe_load import safe_torch_load

    copy = into / tag.name
    copy.mkdir(parents=True)
    for path in sorted(tag.iterdir()):
        if path.name.startswith("mp_rank_") and path.name.endswith("_model_states.pt"):
            states = safe_torch_load(path, mmap=False)   # weights-only, with the globals zoo's files hold
            states.pop("universal_checkpoint_info", None)
            if info is not None:
                states["universal_checkpoint_info"] = info
            torch.save(states, copy / path.name)
        else:
            (copy / path.name).symlink_to(path.resolve())
    return copy


def convert(copy: Path, out: Path, inject: bool) -> dict:
    """Run ``ds_to_universal``; its wall seconds, peak RSS, exit code, last lines, and the output's size."""
    command = ["/usr/bin/time", "-f", "TIME %e %M", sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
               "--input_folder", str(copy), "--output_folder", str(out)]
    if inject:
        command.append("--inject_missing_state")
    result = subprocess.run(command, env=launcher_env(), capture_output=True, text=True)
    timing = [line for line in result.stderr.splitlines() if line.startswith("TIME ")]
    seconds, peak_kb = (float(v) for v in timing[-1].split()[1:]) if timing else (None, None)
    files = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    errors = [line for line in (result.stderr + result.stdout).splitlines() if "Error" in line or "error" in line]
    return {"rc": result.returncode, "seconds": seconds, "peak_bytes": None if peak_kb is None else peak_kb * 1024,
            "bytes": sum(p.stat().st_size for p in files), "files": len(files), "errors": errors[-3:]}


def load_universal_tensor(path: Path) -> dict:
    """One universal file (a dict holding ``param`` and, for sub-parameters, DeepSpeed's SubparamShape)."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape

    with torch.serialization.safe_globals([SubparamShape]):
        return torch.load(path, map_location="cpu", weights_only=True)


def zoo_reader(tag: Path, tp: int):
    """zoo's layout-free reader of the source and the model's specs and config."""
    from zoo.checkpoint.files import model_states_path, read_model_states
    from zoo.checkpoint.layout import layout_model, recover_config
    from zoo.checkpoint.training_state import CheckpointTrainingState
    from zoo.parallel.partition import partition_specs

    first = read_model_states(model_states_path(tag, 0))
    config, _ = recover_config(first, tp, model_states_path(tag, 0))
    specs = partition_specs(layout_model(config, tp))
    return CheckpointTrainingState(tag, tp, 1, set(specs)), specs, config


def compare_merged(universal: Path, reader, specs) -> dict:
    """Per state key: how many parameters' universal tensors equal zoo's merged master (padding cut)."""
    counts = {}
    for key, file in (("master", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        equal, wrong = 0, []
        for name, spec in specs.items():
            want = reader.master(name, spec, key)
            if spec.vocab_rows is not None:
                want = want.narrow(0, 0, spec.vocab_rows)
            got = load_universal_tensor(universal / "zero" / name / f"{file}.pt")["param"]
            if got.shape == want.shape and torch.equal(got, want):
                equal += 1
            else:
                wrong.append(name.split(".", 3)[-1] if ".h." in name else name)
        counts[key] = (equal, len(specs), sorted(set(wrong)))
    return counts


class StandInMapping:
    """The part of DeepSpeed's hp mapping that ``load_hp_checkpoint_state`` touches: one fragment, the whole
    local tensor."""

    def __init__(self, numel: int):
        self.lp_fragment_address = types.SimpleNamespace(start=0, numel=numel)
        self.fragment = torch.empty(numel)
        self.optim_fragment = {}

    def get_hp_fragment(self):
        return self.fragment


def compare_restored(universal: Path, reader, specs, config, new_tp: int) -> tuple[int, int, list[str]]:
    """How many (rank, parameter, state) slices DeepSpeed's restore gives exactly as zoo's move does at
    ``new_tp``."""
    from deepspeed.checkpoint.universal_checkpoint import load_hp_checkpoint_state

    from zoo.checkpoint.layout import layout_model

    padded = config.padded_vocab_size(new_tp)
    equal, total, wrong = 0, 0, set()
    for rank in range(new_tp):
        local = dict(layout_model(config, new_tp, rank).named_parameters())
        for name, spec in specs.items():
            stand_in = torch.nn.Parameter(torch.empty(local[name].shape), requires_grad=False)
            stand_in._hp_mapping = StandInMapping(stand_in.numel())
            try:
                load_hp_checkpoint_state(stand_in, str(universal / "zero" / name), rank, new_tp)
                restored = {"master": stand_in._hp_mapping.fragment, **stand_in._hp_mapping.optim_fragment}
            except (AssertionError, RuntimeError) as err:
                restored = {"error": str(err)}
            for key in ("master", "exp_avg", "exp_avg_sq"):
                want = spec.shard(spec.repad(reader.master(name, spec, key), padded), rank, new_tp).flatten()
                got = restored.get(key)
                total += 1
                if got is not None and got.shape == want.shape and torch.equal(got, want):
                    equal += 1
                else:
                    wrong.add(name.split(".", 3)[-1] if ".h." in name else name)
    return equal, total, sorted(wrong)


def pipeline_source(cache: Path) -> Path:
    """A tiny tp = 1 x pp = 2 bf16 + ZeRO-1 run with one checkpoint, built once with the launcher."""
    run = cache / "bf16z1-tp1pp2-tiny"
    if (run / "checkpoints" / "latest").is_file():
        return run
    shutil.rmtree(run, ignore_errors=True)
    args = argparse.Namespace(layers=2, hidden=128, heads=4)
    config = source_config("bf16", args)
    config["zoo"]["tensor_parallel_size"] = 1
    path = cache / "bf16z1-tp1pp2-tiny.json"
    path.write_text(json.dumps(config, indent=2))
    command = launcher(2) + [str(REPO / "launch" / "pretrain.py"), "--deepspeed_config", str(path),
                             "--pipeline-model-parallel-size", "2", "--save", str(run),
                             "--data-path", make_corpus(cache / "random_text_document")]
    subprocess.run(command, check=True, env=launcher_env(), cwd=REPO, stdout=sys.stderr)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", required=True, help="bench_reshard.py's --cache (its bf16z1-tp2 run is the source)")
    parser.add_argument("--new-tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--pipeline", action="store_true", help="also try a tiny tp1 x pp2 bf16 + ZeRO-1 checkpoint")
    parser.add_argument("--layers", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    args = parser.parse_args()

    cache = Path(args.cache).resolve()
    source = build_source("bf16z1-tp2", cache, make_corpus(cache / "random_text_document"), args, REPO)
    tag = tag_directory(source)
    work = cache / "universal"
    shutil.rmtree(work, ignore_errors=True)   # this script's own earlier output
    reader, specs, config = zoo_reader(tag, 2)
    print(f"source: {tag} ({sum(p.stat().st_size for p in tag.iterdir()) / 2**30:.2f} GiB, "
          f"{len(list(tag.iterdir()))} files), {len(specs)} parameters")
    for variant, info in (("none", None), ("described", described_info(config.to_hf_dict(), 2))):
        copy = prepared_copy(tag, work / variant / "input", info)
        out = work / variant / "universal" / tag.name
        figures = convert(copy, out, inject=info is None)
        print(f"\n[{variant}] ds_to_universal: exit {figures['rc']}, {figures['seconds']} s, peak RSS "
              f"{(figures['peak_bytes'] or 0) / 2**30:.2f} GiB, {figures['bytes'] / 2**30:.2f} GiB in "
              f"{figures['files']} files (load {os.getloadavg()[0]:.1f})")
        if figures["rc"] != 0:
            print("  " + "\n  ".join(figures["errors"]))
            continue
        for key, (equal, total, wrong) in compare_merged(out, reader, specs).items():
            print(f"  merged {key}: {equal}/{total} equal zoo's master; differ: {', '.join(wrong) or '-'}")
        for new_tp in args.new_tp:
            equal, total, wrong = compare_restored(out, reader, specs, config, new_tp)
            print(f"  restored at tp={new_tp}: {equal}/{total} (rank, parameter, state) slices equal zoo's move; "
                  f"differ: {', '.join(wrong) or '-'}")
        shutil.rmtree(out, ignore_errors=True)
    if args.pipeline:
        pipeline_tag = tag_directory(pipeline_source(cache))
        copy = prepared_copy(pipeline_tag, work / "pipeline" / "input", None)
        figures = convert(copy, work / "pipeline" / "universal" / pipeline_tag.name, inject=True)
        print(f"\n[tp1 x pp2, info removed] ds_to_universal: exit {figures['rc']}, {figures['files']} files; "
              + "; ".join(figures["errors"]))
        if figures["rc"] == 0:
            compare_pipeline(work / "pipeline" / "universal" / pipeline_tag.name, pipeline_tag)


def model_name(stage_name: str, n_layer: int) -> str:
    """A PipelineModule parameter name of zoo's GPT-2 stages as ``GPT2LMHeadModel`` names it."""
    if stage_name.startswith("tied_modules."):
        return "transformer." + stage_name.split(".", 2)[2]
    index, rest = stage_name.split(".", 1)
    if rest.startswith(("wpe.", "ln_f.")):
        return f"transformer.{rest}"
    return f"transformer.h.{int(index) - 2}.{rest}"


def compare_pipeline(universal: Path, tag: Path) -> None:
    """The pipeline run's universal tensors, under the stage modules' names, against zoo's merged masters."""
    from zoo.checkpoint.files import model_states_path, read_model_states
    from zoo.checkpoint.training_state import CheckpointTrainingState
    from zoo.parallel.partition import REPLICATED

    n_layer = read_model_states(model_states_path(tag, 0))["model_config"]["n_layer"]
    names = sorted(p.name for p in (universal / "zero").iterdir() if p.is_dir())
    reader = CheckpointTrainingState(tag, 1, 2, {model_name(name, n_layer) for name in names})

    equal = sum(torch.equal(load_universal_tensor(universal / "zero" / name / "fp32.pt")["param"],
                            reader.master(model_name(name, n_layer), REPLICATED)) for name in names)
    print(f"  {len(names)} parameter directories named by the stages' modules ({', '.join(names[:3])}, ...); "
          f"fp32 equal to zoo's master (tp = 1, no merge): {equal}/{len(names)}")


if __name__ == "__main__":
    main()
