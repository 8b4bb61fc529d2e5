"""Text generation from a GPT-2 checkpoint at any tensor-parallel degree (see zoo.inference).

    python launch/generate.py --load out/hf --prompt "The capital of France is" --greedy
    python launch/generate.py --load out/hf --prompt "Hello" --dtype bfloat16     # or: --dtype float32 --tf32
    deepspeed --num_gpus 2 launch/generate.py --load runs/gpt2 --prompt-file prompts.txt \\
        --temperature 0.8 --top-k 50 --top-p 0.95 --max-new-tokens 64 --output out.jsonl

Under the ``deepspeed`` launcher or ``torchrun`` it joins the process group; ``--tensor-parallel-size``
defaults to the world size (the remaining factor is data parallelism over the prompts). ``--load`` is
a Hugging Face-style GPT-2 directory or a zoo DeepSpeed run/checkpoint directory (exported once to a
cache). Every TP rank produces the same tokens; rank 0 prints the completions and writes ``--output``
(JSONL of {prompt, completion, tokens, finish_reason}, atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from zoo.dtypes import add_dtype_argument, torch_dtype
from zoo.errors import report_error



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True,
                        help="HF-style GPT-2 directory (config.json + safetensors) or a zoo DeepSpeed run directory")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompt-file", default=None, help="a text file of prompts, one per line (blank lines skipped)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--greedy", action="store_true", help="arg-max decoding (also implied by --temperature 0)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1: off)")
    parser.add_argument("--seed", type=int, default=1234, help="seeds every prompt's sampling stream")
    parser.add_argument("--no-cache", dest="use_cache", action="store_false",
                        help="recompute the whole sequence every step instead of using the KV cache")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (left-padded)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, help="default: the world size")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory (default: --load if it has one, else the bundled GPT-2 BPE)")
    add_dtype_argument(parser, "float32", "weights and activations of the model")
    parser.add_argument("--tf32", action="store_true",   # zoo.eval.runner.TF32_HELP (imported late: it loads torch)
                        help="let float32 matmuls and cuDNN use TF32 tensor cores (Ampere/Hopper GPUs: several times "
                             "faster, inputs rounded to 10 mantissa bits); off by default, and a no-op on CPU")
    parser.add_argument("--output", default=None, help="also write the completions here as JSONL")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help=argparse.SUPPRESS)     # passed by the deepspeed launcher
    return parser


def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt values, then the non-blank lines of --prompt-file (UTF-8 text)."""
    prompts = list(args.prompt)
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file '{path}' does not exist; pass a text file with one prompt per line.")
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise ValueError(f"prompt file '{path}' is not UTF-8 text (byte {data[err.start]:#04x} on line {line}); "
                             "convert it, e.g. iconv -f latin1 -t utf-8.") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompts given; pass --prompt TEXT (repeatable) or --prompt-file FILE.")
    return prompts


def generation_config(args: argparse.Namespace):
    """The decoding settings, validated (zoo.inference) before anything is loaded."""
    from zoo.inference import GenerationConfig

    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size} must be a positive integer.")
    return GenerationConfig(max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed, use_cache=args.use_cache).validate()


def run(args: argparse.Namespace, texts: list[str], config):
    """Load, generate (collective), and return every prompt's TextCompletion on every rank."""
    import torch.distributed as dist

    from zoo.data import load_gpt2_tokenizer
    from zoo.distributed import join_process_group, launched_distributed, single_device
    from zoo.eval.runner import set_tf32, transformers_directory
    from zoo.inference import generate_text
    from zoo.models import GPT2LMHeadModel
    from zoo.parallel import ParallelState

    set_tf32(args.tf32)
    device = join_process_group(args.local_rank) if launched_distributed() else single_device()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    ps = ParallelState.initialize(args.tensor_parallel_size or world)
    hf_dir = transformers_directory(args.load)
    model = GPT2LMHeadModel.from_pretrained(hf_dir, parallel=ps, dtype=torch_dtype(args.dtype)).to(device).eval()
    tokenizer = load_gpt2_tokenizer(args.tokenizer or getattr(model, "tokenizer_dir", None))
    return generate_text(model, tokenizer, texts, config, ps, batch_size=args.batch_size)


def check_output(output: str | None) -> None:
    """Refuse an --output that could not be written, before any model is loaded or token generated."""
    if output is None:
        return
    from zoo.atomic import check_writable_directory

    path = Path(output)
    if path.is_dir():
        raise ValueError(f"--output {path} is a directory; pass a file path such as {path / 'completions.jsonl'}.")
    try:
        check_writable_directory(path.parent, "--output")
    except ValueError:
        raise ValueError(f"--output {path} cannot be written (its directory {path.parent} is not a writable "
                         "directory); pass a path in a directory you can write to.") from None


def write_jsonl_atomic(path: str | os.PathLike, rows: list[dict]) -> None:
    """One JSON object per line, written atomically (zoo.atomic: never half-written, the umask's mode)."""
    from zoo.atomic import atomic_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    try:
        texts = read_prompts(args)  # before importing torch: a bad prompt file fails in a fraction of a second
        config = generation_config(args)
        check_output(args.output)
        results = run(args, texts, config)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            for index, result in enumerate(results):
                print(f"--- [{index}] ({len(result.tokens)} tokens, {result.finish_reason})")
                print(result.prompt + result.completion)
            if args.output:
                write_jsonl_atomic(args.output, [r.to_dict() for r in results])
        return results
    except (ValueError, FileNotFoundError) as err:
        report_error(err)
        sys.exit(2)
    finally:
        _leave_process_group()


def _leave_process_group() -> None:
    """Destroy the process group this script joined under a launcher (nothing to do if torch never loaded)."""
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    from zoo.distributed import launched_distributed

    if launched_distributed() and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
