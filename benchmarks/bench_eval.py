"""WikiText zero-shot evaluation throughput: overlap 32 (the paper's) vs disjoint windows, tp=1.

With window L and stride o, scoring T tokens takes about T / o forwards of L tokens, so the
overlapping evaluation costs roughly L / o times the disjoint one (8x at L=256, o=32; 32x at
L=1024) and buys every token at least L - o tokens of context. The script measures it on a tiny
random GPT-2 and a synthetic text in wiki.test.tokens' layout, built from the bundled Wikipedia
sample (zoo/assets/corpora/wiki-sample.jsonl.gz) by re-applying WikiText's tokenization
(" = Title = " headings, " @-@ ", " @,@ ", " @.@ ", spaces around punctuation).

Prints one table; nothing is asserted.

    .venv/bin/python benchmarks/bench_eval.py                 # L=256, ~6k words, a minute or two on 2 cores
    .venv/bin/python benchmarks/bench_eval.py --quick         # L=128, ~1.5k words, seconds
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from zoo.assets import BUNDLED_CORPUS as CORPUS


def wikitext_tokenize(paragraph: str) -> str:
    """Plain prose -> WikiText's word-level layout (the inverse of the detokenizer, roughly)."""
    text = re.sub(r"(\d),(\d)", r"\1 @,@ \2", paragraph)
    text = re.sub(r"(\d)\.(\d)", r"\1 @.@ \2", text)
    text = re.sub(r"(\w)-(\w)", r"\1 @-@ \2", text)
    text = re.sub(r"'s\b", " 's", text)
    text = re.sub(r"([,.;:!?()\[\]\"])", r" \1 ", text)
    return " ".join(text.split())


def synthetic_wikitext(max_words: int) -> str:
    """Articles of the bundled sample as " = Title = " sections with " "-blank lines, up to max_words words."""
    lines, words = [" \n"], 0
    with gzip.open(CORPUS, "rt", encoding="utf-8") as source:
        for record in map(json.loads, source):
            lines += [f" = {wikitext_tokenize(record['title'])} = \n", " \n"]
            for paragraph in record["text"].split("\n"):
                if not paragraph.strip():
                    continue
                line = wikitext_tokenize(paragraph)
                lines += [f" {line} \n", " \n"]
                words += len(line.split())
                if words >= max_words:
                    return "".join(lines)
    return "".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--overlap", type=int, default=32)
    parser.add_argument("--words", type=int, default=6000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: stable figures on a shared 2-core machine)")
    parser.add_argument("--quick", action="store_true", help="L=128, 1500 words")
    args = parser.parse_args()
    if args.quick:
        args.seq_length, args.words = 128, 1500
    torch.set_num_threads(args.threads)

    from zoo.data import load_gpt2_tokenizer
    from zoo.eval import evaluate_wikitext
    from zoo.models import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=args.seq_length, n_embd=args.hidden, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    tokenizer = load_gpt2_tokenizer()
    text = synthetic_wikitext(args.words)
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab 50257, fp32, tp=1, "
          f"{torch.get_num_threads()} thread(s); text: {len(text.split())} WikiText words", file=sys.stderr)
    evaluate_wikitext(model, text[:2000], tokenizer, seq_length=args.seq_length, overlap=args.seq_length,
                      batch_size=args.batch_size)                                     # warm-up

    rows = []
    for overlap in (args.overlap, args.seq_length):
        start = time.perf_counter()
        result = evaluate_wikitext(model, text, tokenizer, seq_length=args.seq_length, overlap=overlap,
                                   batch_size=args.batch_size)
        seconds = time.perf_counter() - start
        rows.append((overlap, result, seconds))
        print(f"overlap {overlap}: {seconds:.1f} s", file=sys.stderr)

    print(f"\nWikiText eval, seq_length {args.seq_length}, T = {rows[0][1].num_tokens} BPE tokens "
          f"(T_o = {rows[0][1].num_original_tokens} original tokens), batch {args.batch_size}, "
          f"{args.layers}x{args.hidden} random GPT-2, tp=1, {torch.get_num_threads()} thread(s)")
    print(f"{'overlap':>8} {'windows':>8} {'time s':>8} {'scored tok/s':>13} {'fwd tok/s':>10} {'loss':>8} "
          f"{'adj. ppl':>10}")
    for overlap, result, seconds in rows:
        forwarded = sum(min(result.seq_length, result.num_predicted - k * overlap) for k in range(result.num_windows))
        print(f"{overlap:>8} {result.num_windows:>8} {seconds:>8.2f} {result.num_predicted / seconds:>13.0f} "
              f"{forwarded / seconds:>10.0f} {result.loss:>8.4f} {result.adjusted_ppl:>10.4g}")
    slow, fast = rows[0][2], rows[1][2]
    print(f"overlap {args.overlap} costs {slow / fast:.1f}x the disjoint evaluation "
          f"(ideal L/o = {args.seq_length / args.overlap:.1f}x)")


if __name__ == "__main__":
    main()
