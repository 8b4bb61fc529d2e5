"""Regionally compiled transformer blocks against eager on CPU: one training step (forward + backward) of a
GPT-2 and a Llama, and what the compiler fused in a Llama block.

    python benchmarks/bench_compile.py [--steps 10] [--batch 4] [--seq 256] [--threads 1] [--kernels]
                                       [--hidden H] [--vocab V]

The models are gpt2-tiny and llama-tiny with 4 layers; ``--hidden`` and ``--vocab`` widen them and shrink the
vocabulary, so that the blocks rather than the LM head dominate the step. Each model is built twice from one seed (one single-process model, fp32, the preset's dropout), one copy left
eager and one with :func:`zoo.models.compiled.compile_transformer_blocks` (inductor); after ``--warmup`` steps
of each (the compiled copy's first step compiles), their steps alternate, so a load that varies over the run
falls on both alike. The table gives each one's median step, in wall-clock and in process CPU time (with one
torch thread the CPU time is what the step itself cost, whoever else shares the machine), and the first
compiled step (the compile). ``--kernels`` prints the generated kernels of one Llama block, forward and
backward: each ``cpp_fused_*`` name lists the operations fused into that one pass over the activations.
Timing only: nothing here is asserted, and the suite never runs it.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch

MODELS = {"gpt2-tiny": {"n_layer": 4}, "llama-tiny": {"num_hidden_layers": 4}}


def shapes(args) -> dict[str, dict]:
    """Each preset's overrides: 4 layers, and the width and vocabulary ``--hidden`` / ``--vocab`` ask for."""
    models = {preset: dict(overrides) for preset, overrides in MODELS.items()}
    if args.hidden:
        models["gpt2-tiny"]["n_embd"] = args.hidden
        models["llama-tiny"].update(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4 // 32 * 32)
    if args.vocab:
        for overrides in models.values():
            overrides["vocab_size"] = args.vocab
    return models


def build(preset: str, overrides: dict, compiled: bool):
    from zoo.models import model_config
    from zoo.models.compiled import compile_transformer_blocks
    from zoo.models.families import build_model

    torch.manual_seed(0)
    model = build_model(model_config(preset, **overrides), None)
    model.train()
    if compiled:
        compile_transformer_blocks(model)
    return model


def step(model, ids: torch.Tensor) -> tuple[float, float]:
    """(wall s, CPU s) of one forward + backward."""
    wall, cpu = time.perf_counter(), time.process_time()
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(preset: str, overrides: dict, args) -> dict:
    vocab = overrides.get("vocab_size", 50257)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    eager, compiled = build(preset, overrides, False), build(preset, overrides, True)
    first = step(compiled, ids)
    for _ in range(args.warmup):
        step(eager, ids)
        step(compiled, ids)
    times: dict[str, list[tuple[float, float]]] = {"eager": [], "compiled": []}
    for _ in range(args.steps):
        times["eager"].append(step(eager, ids))
        times["compiled"].append(step(compiled, ids))
    return {"first_compiled": first, **{k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
                                        for k, v in times.items()}}


def llama_block_kernels(args) -> list[str]:
    """The names of the kernels inductor generated for one Llama block's forward and backward."""
    from torch._inductor.utils import run_and_get_code

    from zoo.models.compiled import compile_transformer_blocks
    from zoo.models.llama.rope import rotary_cos_sin

    model = build("llama-tiny", shapes(args)["llama-tiny"], False)
    block = model.model.layers[0]
    compile_transformer_blocks(block)
    x = torch.randn(args.batch, args.seq, model.config.hidden_size, requires_grad=True)
    cos, sin = rotary_cos_sin(model.config, torch.arange(args.seq).unsqueeze(0), x.dtype)

    def run():
        block(x, cos, sin).sum().backward()

    _, sources = run_and_get_code(run)
    names = []
    for source in sources:
        names.extend(dict.fromkeys(re.findall(r"def (cpp_fused_\w+)\(|^(cpp_fused_\w+) = ", source, re.M)))
    return [a or b for a, b in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=0, help="model width (default: the preset's 128)")
    parser.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the preset's 50257)")
    parser.add_argument("--kernels", action="store_true", help="print the Llama block's generated kernels")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = shapes(args)
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch} x seq {args.seq}, fp32, "
          f"median of {args.steps} steps after {args.warmup} warm-up steps; {models}")
    print(f"{'model':<12} {'eager ms':>9} {'compiled ms':>12} {'speed-up':>9} {'eager CPU ms':>13} "
          f"{'compiled CPU ms':>16} {'CPU speed-up':>13} {'compile s':>10}")
    for preset, overrides in models.items():
        r = measure(preset, overrides, args)
        (ew, ec), (cw, cc) = r["eager"], r["compiled"]
        print(f"{preset:<12} {ew * 1e3:>9.1f} {cw * 1e3:>12.1f} {ew / cw:>8.2f}x {ec * 1e3:>13.1f} {cc * 1e3:>16.1f} "
              f"{ec / cc:>12.2f}x {r['first_compiled'][0]:>10.1f}")
    if args.kernels:
        for name in llama_block_kernels(args):
            print(name)


if __name__ == "__main__":
    main()
