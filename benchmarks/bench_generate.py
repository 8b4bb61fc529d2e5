"""Generation throughput with and without the KV cache (zoo.inference.generate), tp = 1.

A randomly initialised GPT-2 (default 6 layers, h = 512, 8 heads, the 50257-token vocabulary,
fp32, eval mode) decodes greedily with EOD stopping off, so every row produces exactly
``new_tokens`` tokens. For each (prompt length, new tokens) the table prints the wall time and
new tokens per second with the cache and without it (every step recomputes the whole sequence),
and the speed-up. Each cell is the median of ``--repeats`` runs after one warm-up run; the tokens
of the two paths are compared (they must be equal). Nothing is asserted about time.

    .venv/bin/python benchmarks/bench_generate.py                    # 32/256-token prompts, 32/128 new
    .venv/bin/python benchmarks/bench_generate.py --quick            # a few seconds
    .venv/bin/python benchmarks/bench_generate.py --device cuda --threads 8 --prompt-lengths 128 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_model(layers: int, hidden: int, heads: int, n_positions: int, device: str):
    from zoo.models import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=n_positions,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).to(device).eval()


def timed_generate(model, prompts, new_tokens: int, use_cache: bool, repeats: int) -> tuple[float, list]:
    """Median seconds of ``repeats`` greedy generations (after one warm-up), and the tokens."""
    from zoo.inference import GenerationConfig, generate

    config = GenerationConfig(max_new_tokens=new_tokens, greedy=True, eod_token_id=None, use_cache=use_cache)
    tokens = [c.tokens for c in generate(model, prompts, config, batch_size=len(prompts))]   # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(model, prompts, config, batch_size=len(prompts))
        times.append(time.perf_counter() - start)
    return statistics.median(times), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--device", default=None, help="default: DeepSpeed's accelerator device")
    parser.add_argument("--quick", action="store_true", help="2 layers, h=128, 16-token prompts, 16 new tokens")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.heads, args.prompt_lengths, args.new_tokens = 2, 128, 4, [16], [16]
    torch.set_num_threads(args.threads)
    if args.device is None:
        from deepspeed.accelerator import get_accelerator

        args.device = get_accelerator().current_device_name()
    n_positions = max(args.prompt_lengths) + max(args.new_tokens)
    model = build_model(args.layers, args.hidden, args.heads, max(n_positions, 1024), args.device)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    gen = torch.Generator().manual_seed(0)

    print(f"GPT-2 {args.layers} layers, h={args.hidden}, {args.heads} heads, vocab 50257 ({params:.1f}M params), "
          f"fp32, tp=1, greedy, batch {args.batch_size}, device {args.device}, {args.threads} thread(s), "
          f"median of {args.repeats} after a warm-up")
    header = (f"{'prompt':>7} {'new':>5} | {'cache s':>8} {'cache tok/s':>12} | {'no-cache s':>10} "
              f"{'no-cache tok/s':>15} | {'speed-up':>8} {'same tokens':>12}")
    print(header)
    print("-" * len(header))
    for prompt_length in args.prompt_lengths:
        prompts = torch.randint(0, 50257, (args.batch_size, prompt_length), generator=gen).tolist()
        for new_tokens in args.new_tokens:
            log(f"prompt {prompt_length}, {new_tokens} new tokens ...")
            cached_s, cached = timed_generate(model, prompts, new_tokens, True, args.repeats)
            full_s, full = timed_generate(model, prompts, new_tokens, False, args.repeats)
            produced = args.batch_size * new_tokens
            print(f"{prompt_length:>7} {new_tokens:>5} | {cached_s:>8.2f} {produced / cached_s:>12.1f} | "
                  f"{full_s:>10.2f} {produced / full_s:>15.1f} | {full_s / cached_s:>7.1f}x "
                  f"{str(cached == full):>12}", flush=True)


if __name__ == "__main__":
    main()
