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

As with transformers' ``generate``, the model directory's ``generation_config.json`` gives the defaults of the
settings zoo's generator has (do_sample, temperature, top_k, top_p, max_new_tokens or max_length, eos_token_id,
pad_token_id, use_cache; zoo.inference.generation_file) and the flags given override them: ``--greedy``,
``--temperature``, ``--top-k`` and ``--top-p`` choose greedy or sampling as they do without the file. A setting
neither gives keeps zoo's default. With the completions, one line on stderr says what applied and where each
value came from. A file zoo cannot apply (no JSON object, refused by transformers, an invalid value, or num_beams
> 1 and other decoding zoo's generator does not do) is refused in one sentence; ``--no-generation-config``
ignores the file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.atomic import atomic_file, check_writable_directory
from zoo.cli.command import command_parser, run_command
from zoo.cli.evaluate import TF32_HELP
from zoo.dtypes import add_dtype_argument, torch_dtype
from zoo.errors import MissingInput, UserError, alike_on_every_rank
from zoo.options import CommandParser, add_options, default_of, group_of, option, settings_of


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
    max_new_tokens: int = option(32, group="generation", help="tokens generated per prompt at most (default: "
                                                              "generation_config.json's, else 32)")
    greedy: bool = option(False, group="generation", help="arg-max decoding (also implied by --temperature 0; "
                                                          "default: generation_config.json's do_sample, else sampling)")
    temperature: float = option(1.0, group="generation", help="divides the logits before sampling (default: "
                                                              "generation_config.json's, else 1.0)")
    top_k: int = option(0, group="generation", help="keep the k most likely tokens (0: off; default: "
                                                    "generation_config.json's, else 0)")
    top_p: float = option(1.0, group="generation", help="nucleus sampling mass in (0, 1] (1: off; default: "
                                                        "generation_config.json's, else 1.0)")
    seed: int = option(1234, group="generation", help="seeds every prompt's sampling stream")
    use_cache: bool = option(True, group="generation", flag="--no-cache",
                             help="recompute the whole sequence every step instead of using the KV cache")
    generation_config: bool = option(True, group="generation", flag="--no-generation-config",
                                     help="ignore the model directory's generation_config.json (transformers' "
                                          "generation defaults, which otherwise apply where no flag is given)")
    output: str | None = option(None, group="logging", help="also write the completions here as JSONL")


# The settings a generation_config.json may give (GenerateOptions = GenerationConfig field names): their flags
# (and --seed) parse as None when absent, so that a flag given is told from the default.
FILE_SETTINGS = ("max_new_tokens", "greedy", "temperature", "top_k", "top_p", "use_cache")
SAMPLING_FLAGS = ("temperature", "top_k", "top_p")   # given without --greedy, they mean sampling, file or not
FILE_SOURCE = "generation_config.json"
DEFAULT_SOURCE = "default"


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, GenerateOptions, with_defaults=True)
    parser.set_defaults(**dict.fromkeys((*FILE_SETTINGS, "seed")))   # --help still names each dataclass default
    add_dtype_argument(group_of(parser, "model"), "float32", "weights and activations of the model")
    group_of(parser, "model").add_argument("--tf32", action="store_true", help=TF32_HELP)
    return command_parser(parser)


def option_default(name: str) -> Any:
    return next(default_of(f) for f in settings_of(GenerateOptions) if f.name == name)


def flag_of(name: str) -> str:
    return {"greedy": "--greedy", "use_cache": "--no-cache"}.get(name, "--" + name.replace("_", "-"))


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


@dataclass(frozen=True)
class Settings:
    """The decoding settings of the command (a zoo.inference GenerationConfig) and where each came from."""

    config: Any
    sources: dict[str, str]   # GenerationConfig field -> a flag, FILE_SOURCE or DEFAULT_SOURCE
    ignored_file: bool = False   # a generation_config.json was there, and --no-generation-config ignored it

    @property
    def limit(self) -> str:
        """The length limit that applies, as the line names it: ``--max-new-tokens 40``, ``max_length 64
        (generation_config.json)``."""
        if self.config.max_length is not None:
            return f"max_length {self.config.max_length} ({FILE_SOURCE})"
        source = self.sources["max_new_tokens"]
        if source == FILE_SOURCE:
            return f"max_new_tokens {self.config.max_new_tokens} ({FILE_SOURCE})"
        return f"--max-new-tokens {self.config.max_new_tokens}"

    def line(self) -> str:
        """One line naming each setting that applies, with its source in parentheses (the key/value cache only when
        it is off: it changes the time, not the tokens)."""
        config, sources = self.config, self.sources

        def item(name: str, value: Any) -> str:
            shown = json.dumps(list(value) if isinstance(value, tuple) else value)
            return f"{name} {shown} ({sources[name]})"

        mode = "greedy" if config.is_greedy else "sampling"
        items = [f"{mode} ({sources['greedy']})"]
        if not config.is_greedy:
            items += [item(name, getattr(config, name)) for name in ("temperature", "top_k", "top_p", "seed")]
        items.append(item("max_length", config.max_length) if config.max_length is not None
                      else item("max_new_tokens", config.max_new_tokens))
        items.append(f"eos_token_id {json.dumps(list(config.eod_ids))} ({sources['eod_token_id']})")
        items += [item(name, getattr(config, name)) for name in ("pad_token_id", "use_cache")
                  if sources[name] != DEFAULT_SOURCE and not (name == "use_cache" and config.use_cache)]
        ignored = (f"; {FILE_SOURCE} ignored (--no-generation-config)" if self.ignored_file else "")
        return "generation settings: " + ", ".join(items) + ignored


def check_batch_size(args: argparse.Namespace) -> None:
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size} must be a positive integer.")


def generation_settings(args: argparse.Namespace, file_fields: dict[str, Any] | None = None,
                        ignored_file: bool = False) -> Settings:
    """The decoding settings, validated (zoo.inference): each from its flag if given, else from
    ``file_fields`` (the GenerationConfig fields a generation_config.json sets), else zoo's default.

    The mode: ``--greedy`` if given; else sampling if ``--temperature``, ``--top-k`` or ``--top-p`` is given
    (they sample, file or not; ``--temperature 0`` is greedy); else the file's do_sample; else sampling. The length:
    ``--max-new-tokens``, else the file's max_new_tokens, else its max_length (tokens with the prompt; the new
    tokens are bounded by it), else 32. Every value of a file has been checked where it was read."""
    from zoo.inference import GenerationConfig  # local: torch import cost, after parsing

    file_fields = file_fields or {}
    values, sources = {}, {}

    def take(name: str, flag_value: Any = None, flag: str | None = None) -> None:
        if flag_value is not None:
            values[name], sources[name] = flag_value, flag or flag_of(name)
        elif name in file_fields:
            values[name], sources[name] = file_fields[name], FILE_SOURCE
        else:
            sources[name] = DEFAULT_SOURCE

    for name in ("temperature", "top_k", "top_p", "use_cache", "pad_token_id", "eod_token_id"):
        take(name, getattr(args, name, None))
    sampling_flag = next((name for name in SAMPLING_FLAGS if getattr(args, name) is not None), None)
    if args.greedy:
        take("greedy", True)
    elif sampling_flag is not None:
        take("greedy", False, flag_of(sampling_flag))
    else:
        take("greedy")
    if values.get("temperature") == 0 and not values.get("greedy"):   # greedy: there is nothing to divide by
        sources["greedy"] = ("--temperature 0" if sources["temperature"] != FILE_SOURCE
                             else f"temperature 0 in {FILE_SOURCE}")
    if args.max_new_tokens is None and "max_new_tokens" not in file_fields and "max_length" in file_fields:
        values["max_length"] = values["max_new_tokens"] = file_fields["max_length"]
        sources["max_length"] = sources["max_new_tokens"] = FILE_SOURCE
    else:
        take("max_new_tokens", args.max_new_tokens)
    values["max_new_tokens"] = values.get("max_new_tokens", option_default("max_new_tokens"))
    take("seed", args.seed)
    defaults = {name: option_default(name) for name in (*FILE_SETTINGS, "seed")}
    config = GenerationConfig(**{**defaults, **values}).validate()
    return Settings(config, sources, ignored_file)


def greedy_note(args: argparse.Namespace) -> str | None:
    """The line that says ``--temperature 0`` decodes greedily (there is nothing to divide by), so the
    sampling flags and the seed do not change the tokens; None for any other setting."""
    if args.greedy or args.temperature != 0:
        return None
    return ("note: --temperature 0 is greedy decoding (the most likely token at every step), so --seed, --top-k "
            "and --top-p do not change the completions.")


def context_note(results, limit: str, n_positions: int) -> str | None:
    """The line that names the completions stopped where prompt and completion filled the model's context
    (``n_positions``) before the length ``limit`` (``--max-new-tokens 40``), and how many tokens each got;
    None when none did."""
    from zoo.inference.generate import FINISH_CONTEXT  # local: torch import cost, after parsing

    stopped = [(index, len(result.tokens)) for index, result in enumerate(results)
               if result.finish_reason == FINISH_CONTEXT]
    if not stopped:
        return None
    where = ", ".join(f"[{index}] after {count}" for index, count in stopped)
    return (f"note: {len(stopped)} completion{'s' if len(stopped) > 1 else ''} stopped where the prompt and "
            f"completion filled the model's context of {n_positions} tokens, before {limit}: {where} new tokens.")


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


def file_settings(args: argparse.Namespace, hf_dir: str) -> Settings:
    """The settings with ``hf_dir``'s generation_config.json (unless ``--no-generation-config``) under the flags.
    Every rank reads the same file, so a refusal is printed once."""
    from zoo.inference.generation_file import GENERATION_CONFIG_FILE, read_generation_defaults  # local: torch

    with alike_on_every_rank():
        if args.generation_config:
            defaults = read_generation_defaults(hf_dir)
            return generation_settings(args, defaults.fields() if defaults is not None else None)
        return generation_settings(args, ignored_file=(Path(hf_dir) / GENERATION_CONFIG_FILE).is_file())


def generate_from_checkpoint(args: argparse.Namespace, texts: list[str]):
    """Load, generate (collective), and return every prompt's TextCompletion on every rank, with the model's
    context length (``n_positions``) and the settings that applied."""
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
    settings = file_settings(args, hf_dir)
    model = family.pretraining_model.from_pretrained(hf_dir, parallel=parallel, dtype=torch_dtype(args.dtype))
    model = model.to(device).eval()
    tokenizer = load_gpt2_tokenizer(args.tokenizer or getattr(model, "tokenizer_dir", None))
    results = generate_text(model, tokenizer, texts, settings.config, parallel, batch_size=args.batch_size)
    return results, model.config.n_positions, settings


def main(argv: list[str] | None = None):
    """Every rank returns the completions; rank 0 prints them and writes ``--output``."""
    args = build_parser().parse_args(argv)

    def work():
        import torch.distributed as dist  # local: torch import cost, after parsing

        from zoo.config.loading import launched_as_writer  # local: torch import cost, after parsing

        texts = read_prompts(args)
        check_batch_size(args)
        generation_settings(args)   # the flags' values are checked before anything is loaded
        check_output(args.output)
        if (note := greedy_note(args)) and launched_as_writer():
            print(note, file=sys.stderr, flush=True)
        results, n_positions, settings = generate_from_checkpoint(args, texts)
        is_writer = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
        if is_writer:
            print(settings.line(), file=sys.stderr, flush=True)
            if note := context_note(results, settings.limit, n_positions):
                print(note, file=sys.stderr, flush=True)
            for index, result in enumerate(results):
                print(f"--- [{index}] ({len(result.tokens)} tokens, {result.finish_reason})")
                print(result.prompt + result.completion)
            if args.output:
                write_jsonl_atomic(args.output, [r.to_dict() for r in results])
        return results

    return run_command(work, log_level=args.log_level)
