"""``launch/generate.py``: text generation from a GPT-2 or Llama checkpoint at any tensor-parallel degree.

    python launch/generate.py --load out/hf --prompt "The capital of France is" --greedy
    python launch/generate.py --load out/hf --prompt "Hello" --dtype bfloat16     # or: --dtype float32 --tf32
    deepspeed --num_gpus 2 launch/generate.py --load runs/gpt2 --prompt-file prompts.txt \\
        --temperature 0.8 --top-k 50 --top-p 0.95 --max-new-tokens 64 --output out.jsonl

Under the ``deepspeed`` launcher or ``torchrun`` it joins the process group; ``--tensor-parallel-size``
defaults to the world size (the remaining factor is data parallelism over the prompts). ``--load`` is
a Hugging Face-style directory of a family that generates text (GPT-2, Llama; its model_type picks the class,
through zoo.models.families) or a zoo DeepSpeed run/checkpoint directory (exported once to a cache); a BERT
directory is refused in one sentence. Every TP rank produces the same tokens; rank 0 prints the completions and writes ``--output``
(JSONL of {prompt, completion, tokens, finish_reason}, atomically).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from zoo.atomic import atomic_file, check_writable_directory
from zoo.cli.command import command_parser, run_command
from zoo.cli.evaluate import TF32_HELP
from zoo.dtypes import add_dtype_argument, torch_dtype
from zoo.errors import MissingInput, UserError
from zoo.options import CommandParser, add_options, group_of, option


@dataclass(kw_only=True)
class GenerateOptions:
    """The settings of one generation command."""

    load: str = option(group="model", help="HF-style GPT-2 or Llama directory (config.json + safetensors) or a zoo "
                                           "DeepSpeed run directory")
    tokenizer: str | None = option(None, group="model",
                                   help="tokenizer directory (default: --load if it has one, else the bundled GPT-2 BPE)")
    prompt: list[str] = option(group="generation", default_factory=list, action="append", help="a prompt (repeatable)")
    prompt_file: str | None = option(None, group="generation",
                                     help="a text file of prompts, one per line (blank lines skipped)")
    batch_size: int = option(8, group="generation", help="prompts decoded together (left-padded)")
    tensor_parallel_size: int | None = option(None, group="parallelism", help="default: the world size")
    max_new_tokens: int = option(32, group="generation", help="tokens generated per prompt at most")
    greedy: bool = option(False, group="generation", help="arg-max decoding (also implied by --temperature 0)")
    temperature: float = option(1.0, group="generation", help="divides the logits before sampling")
    top_k: int = option(0, group="generation", help="keep the k most likely tokens (0: off)")
    top_p: float = option(1.0, group="generation", help="nucleus sampling mass in (0, 1] (1: off)")
    seed: int = option(1234, group="generation", help="seeds every prompt's sampling stream")
    use_cache: bool = option(True, group="generation", flag="--no-cache",
                             help="recompute the whole sequence every step instead of using the KV cache")
    output: str | None = option(None, group="logging", help="also write the completions here as JSONL")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, GenerateOptions, with_defaults=True)
    add_dtype_argument(group_of(parser, "model"), "float32", "weights and activations of the model")
    group_of(parser, "model").add_argument("--tf32", action="store_true", help=TF32_HELP)
    return command_parser(parser)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt values, then the non-blank lines of --prompt-file (UTF-8 text)."""
    prompts = list(args.prompt)
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise MissingInput(f"prompt file '{path}' does not exist; pass a text file with one prompt per line.")
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise UserError(f"prompt file '{path}' is not UTF-8 text (byte {data[err.start]:#04x} on line {line}); "
                             "convert it, e.g. iconv -f latin1 -t utf-8.") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise UserError("no prompts given; pass --prompt TEXT (repeatable) or --prompt-file FILE.")
    return prompts


def generation_config(args: argparse.Namespace):
    """The decoding settings, validated (zoo.inference) before anything is loaded."""
    from zoo.inference import GenerationConfig  # local: torch import cost, after parsing

    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size} must be a positive integer.")
    return GenerationConfig(max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed, use_cache=args.use_cache).validate()


def greedy_note(args: argparse.Namespace) -> str | None:
    """The line that says ``--temperature 0`` decodes greedily (there is nothing to divide by), so the
    sampling flags and the seed do not change the tokens; None for any other setting."""
    if args.greedy or args.temperature != 0:
        return None
    return ("note: --temperature 0 is greedy decoding (the most likely token at every step), so --seed, --top-k "
            "and --top-p do not change the completions.")


def context_note(results, max_new_tokens: int, n_positions: int) -> str | None:
    """The line that names the completions stopped where prompt and completion filled the model's context
    (``n_positions``) before ``--max-new-tokens``, and how many tokens each got; None when none did."""
    from zoo.inference.generate import FINISH_CONTEXT  # local: torch import cost, after parsing

    stopped = [(index, len(result.tokens)) for index, result in enumerate(results)
               if result.finish_reason == FINISH_CONTEXT]
    if not stopped:
        return None
    where = ", ".join(f"[{index}] after {count}" for index, count in stopped)
    return (f"note: {len(stopped)} completion{'s' if len(stopped) > 1 else ''} stopped where the prompt and "
            f"completion filled the model's context of {n_positions} tokens, before --max-new-tokens "
            f"{max_new_tokens}: {where} new tokens.")


def check_output(output: str | None) -> None:
    """Refuse an --output that could not be written, before any model is loaded or token generated."""
    if output is None:
        return
    path = Path(output)
    if path.is_dir():
        raise UserError(f"--output {path} is a directory; pass a file path such as {path / 'completions.jsonl'}.")
    try:
        check_writable_directory(path.parent, "--output")
    except ValueError:
        raise UserError(f"--output {path} cannot be written (its directory {path.parent} is not a writable "
                         "directory); pass a path in a directory you can write to.") from None


def write_jsonl_atomic(path: str | os.PathLike, rows: list[dict]) -> None:
    """One JSON object per line, written atomically (zoo.atomic: never half-written, the umask's mode)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def generate_from_checkpoint(args: argparse.Namespace, texts: list[str], config):
    """Load, generate (collective), and return every prompt's TextCompletion on every rank, with the model's
    context length (``n_positions``)."""
    import torch.distributed as dist  # local: torch import cost, after parsing

    from zoo.data import load_gpt2_tokenizer  # local: torch import cost, after parsing
    from zoo.distributed import join_process_group, launched_distributed, single_device  # local: torch import cost
    from zoo.eval.zero_shot import set_tf32, transformers_directory  # local: torch import cost, after parsing
    from zoo.inference import generate_text  # local: torch import cost, after parsing
    from zoo.models.families import text_model_family  # local: torch import cost, after parsing
    from zoo.parallel import ParallelState  # local: torch import cost, after parsing

    set_tf32(args.tf32)
    device = join_process_group(args.local_rank) if launched_distributed() else single_device()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    parallel = ParallelState.initialize(args.tensor_parallel_size or world)
    hf_dir = transformers_directory(args.load)
    family = text_model_family(hf_dir, "generation")
    model = family.pretraining_model.from_pretrained(hf_dir, parallel=parallel, dtype=torch_dtype(args.dtype))
    model = model.to(device).eval()
    tokenizer = load_gpt2_tokenizer(args.tokenizer or getattr(model, "tokenizer_dir", None))
    return generate_text(model, tokenizer, texts, config, parallel, batch_size=args.batch_size), model.config.n_positions


def main(argv: list[str] | None = None):
    """Every rank returns the completions; rank 0 prints them and writes ``--output``."""
    args = build_parser().parse_args(argv)

    def work():
        import torch.distributed as dist  # local: torch import cost, after parsing

        from zoo.config.loading import launched_as_writer  # local: torch import cost, after parsing

        texts = read_prompts(args)
        config = generation_config(args)
        check_output(args.output)
        if (note := greedy_note(args)) and launched_as_writer():
            print(note, file=sys.stderr, flush=True)
        results, n_positions = generate_from_checkpoint(args, texts, config)
        is_writer = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        if is_writer:
            if note := context_note(results, config.max_new_tokens, n_positions):
                print(note, file=sys.stderr, flush=True)
            for index, result in enumerate(results):
                print(f"--- [{index}] ({len(result.tokens)} tokens, {result.finish_reason})")
                print(result.prompt + result.completion)
            if args.output:
                write_jsonl_atomic(args.output, [r.to_dict() for r in results])
        return results

    return run_command(work, log_level=args.log_level)
