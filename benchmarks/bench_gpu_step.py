"""One training step of GPT-2 on one CUDA device: zoo (tp = 1) vs transformers' GPT2LMHeadModel (SDPA).

Prints one table (progress to stderr); nothing is asserted. Per shape and precision: the median step
time, tokens/s, achieved TFLOPs (Megatron's model-FLOPs formula, no recomputation) and zoo's time over
transformers'. A step is forward (loss with labels = inputs) + backward + AdamW step (torch's fused
AdamW) + zero_grad, fp32 weights under ``torch.autocast`` (bf16 or fp16), dropout 0, TF32 off, the same
weights and batch for both models. Neither model recomputes activations.

    python benchmarks/bench_gpu_step.py                         # gpt2-medium and gpt2-1.2b, b=8, s=1024
    python benchmarks/bench_gpu_step.py --presets gpt2-1.2b --batch 4 --precisions bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpt2_step import hf_model, log, megatron_flops_per_step, time_steps, zoo_model  # noqa: E402

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cuda_step(model: torch.nn.Module, input_ids: torch.Tensor, dtype: torch.dtype):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    model.train()

    def step():
        with torch.autocast("cuda", dtype=dtype):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(build, args, shape: argparse.Namespace, dtype: torch.dtype) -> float:
    with torch.device("cuda"):
        model = build(shape)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(1234)).cuda()
    times = time_steps(cuda_step(model, ids, dtype), args.steps, args.warmup, sync=torch.cuda.synchronize)
    del model
    torch.cuda.empty_cache()
    return statistics.median(times)


def main() -> None:
    from zoo.models.gpt2.presets import GPT2_PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["gpt2-medium", "gpt2-1.2b"], choices=sorted(GPT2_PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp16"], choices=sorted(PRECISIONS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device; this benchmark times one GPU (benchmarks/bench_gpt2_step.py is the CPU one).")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    for preset in args.presets:
        p = GPT2_PRESETS[preset]
        shape = argparse.Namespace(vocab=50257, seq=args.seq, hidden=p["n_embd"], layers=p["n_layer"],
                                   heads=p["n_head"], batch=args.batch)
        flops = megatron_flops_per_step(args.batch, args.seq, shape.layers, shape.hidden, shape.vocab)
        for precision in args.precisions:
            log(f"{preset} {precision}: zoo ...")
            zoo_s = measure(lambda s: zoo_model(s, None), args, shape, PRECISIONS[precision])
            log(f"{preset} {precision}: transformers ...")
            hf_s = measure(hf_model, args, shape, PRECISIONS[precision])
            rows.append((preset, precision, zoo_s, hf_s, flops))
    print(f"\none training step on {torch.cuda.get_device_name()}, batch {args.batch} x seq {args.seq}, "
          f"median of {args.steps} (torch {torch.__version__})")
    print(f"{'model':<12} {'prec':<5} {'zoo ms':>8} {'hf ms':>8} {'zoo/hf':>7} {'zoo TFLOPs':>11} {'hf TFLOPs':>10} "
          f"{'zoo tok/s':>10}")
    for preset, precision, zoo_s, hf_s, flops in rows:
        print(f"{preset:<12} {precision:<5} {zoo_s * 1e3:8.1f} {hf_s * 1e3:8.1f} {zoo_s / hf_s:7.3f} "
              f"{flops / zoo_s / 1e12:11.1f} {flops / hf_s / 1e12:10.1f} {args.batch * args.seq / zoo_s:10.0f}")


if __name__ == "__main__":
    main()
