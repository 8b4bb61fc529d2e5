"""Zero-shot evaluation of a GPT-2 or Llama checkpoint: WikiText-103 perplexity or LAMBADA accuracy.

    python launch/evaluate.py --task wikitext --data wiki.test.tokens --load out/hf --out ppl.json
    deepspeed --num_gpus 8 launch/evaluate.py --task lambada --data lambada_test.jsonl --load out/hf \\
        --tensor-parallel-size 4          # tp=4 x dp=2

Under the ``deepspeed`` launcher or ``torchrun`` (RANK and WORLD_SIZE set) it joins the process
group and evaluates on the tp x dp grid; started as a plain process it runs alone
(``ParallelState.single()``). ``--load`` is a Hugging Face-style directory (config.json +
safetensors), as zoo's or transformers' ``save_pretrained`` writes it, of a family that generates text (its
model_type picks the class through zoo.models.families; a BERT directory is one sentence). Rank 0 shows a progress
bar, prints the results and writes them as JSON (``--out``, atomically; every rank checks before
evaluating that it can be written) and, optionally, to W&B. The command is :mod:`zoo.cli.evaluate`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zoo.atomic import check_writable_directory
from zoo.checkpoint.deepspeed_export import export_checkpoint
from zoo.checkpoint.files import tag_directory
from zoo.data import load_gpt2_tokenizer
from zoo.distributed import (
    directory_bytes,
    join_process_group,
    launched_distributed,
    launcher_local_rank,
    run_on_first_rank,
    single_device,
)
from zoo.dtypes import torch_dtype
from zoo.errors import UserError
from zoo.eval.lambada import evaluate_lambada
from zoo.eval.sources import read_lambada, read_wikitext
from zoo.eval.wikitext import evaluate_wikitext
from zoo.models.families import text_model_family
from zoo.parallel import ParallelState


def evaluate_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    """Run one evaluation (collective when launched distributed); every rank returns the results."""
    set_tf32(args.tf32)
    data = read_wikitext(args.data, args.split) if args.task == "wikitext" else read_lambada(args.data, args.split)
    device = join_process_group(args.local_rank) if launched_distributed() else single_device()
    parallel = ParallelState.initialize(args.tensor_parallel_size)
    hf_dir = transformers_directory(args.load)
    family = text_model_family(hf_dir, "zero-shot evaluation")
    model = family.pretraining_model.from_pretrained(hf_dir, parallel=parallel, dtype=torch_dtype(args.dtype))
    model = model.to(device).eval()
    tokenizer = load_gpt2_tokenizer(args.tokenizer or getattr(model, "tokenizer_dir", None))
    progress = parallel.rank == 0
    if args.task == "wikitext":
        result = evaluate_wikitext(model, data, tokenizer, seq_length=args.seq_length, overlap=args.overlap,
                                   parallel=parallel, batch_size=args.batch_size, progress=progress)
    else:
        result = evaluate_lambada(model, data, tokenizer, strict=args.strict, parallel=parallel,
                                  batch_size=args.batch_size, progress=progress)
    results = {**result.to_dict(), "data": str(args.data), "load": str(args.load), "tp": parallel.tp_size,
               "dp": parallel.dp_size, "dtype": args.dtype, "tf32": args.tf32}
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return results


def set_tf32(enabled: bool) -> None:
    """``--tf32``: TF32 for float32 matmuls (``torch.backends.cuda.matmul.allow_tf32``) and cuDNN
    (``torch.backends.cudnn.allow_tf32``), or neither: without the flag a float32 evaluation or generation
    computes in full float32 on a GPU. The flags only steer CUDA kernels, so on CPU nothing changes."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def transformers_directory(load: str) -> str:
    """``load`` itself when it holds a transformers-layout model (config.json); for a zoo DeepSpeed
    training checkpoint (a run directory or its checkpoints/), the tag in ``latest`` exported once
    to this user's private cache directory by local rank 0 of each node, the other ranks waiting
    (collective; an export error reaches every rank as the same sentence).

    The cached export is keyed on the tag's content (:func:`export_cache_key`: the path and the name,
    size and modification time of every file in it), so a tag whose files were rewritten (a new run with
    the same ``--save``) is exported again; rank 0 says when a cached export is used."""
    if (Path(load) / "config.json").is_file() and not (Path(load) / "checkpoints").is_dir():
        return str(load)   # a transformers directory; a zoo run keeps its settings in config.json beside checkpoints/
    tag_dir = tag_directory(load)   # one-sentence error for a missing or incomplete checkpoint
    target = export_cache_path() / export_cache_key(tag_dir)
    is_first = launcher_local_rank() == 0

    def export_here() -> None:
        make_private_directory(target.parent)
        if (target / "config.json").is_file():
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"using the cached export {target} of {tag_dir} (its files are unchanged since it was "
                      "exported)", flush=True)
            return
        export_checkpoint(load, target, tag=tag_dir.name)

    # The other ranks wait on a host group whose timeout is sized from the checkpoint's bytes, not in the
    # NCCL group under its watchdog (zoo.distributed.run_on_first_rank says why).
    run_on_first_rank(export_here, work_bytes=directory_bytes(tag_dir), first=lambda: is_first)
    return str(target)


def export_cache_key(tag_dir: Path) -> str:
    """A name for the export of ``tag_dir`` that changes whenever its content may have: a hash of the tag's
    resolved path and of the name, size, inode, modification time and status-change time (ns) of every
    file in it. The modification time alone is not enough: copy tools restore it (``cp -p``, ``rsync -a``,
    ``os.utime``) and some filesystems keep it coarse. The status-change time cannot be set by any copy
    tool and moves on every write (a file replaced by a new one also has a new inode), so a rewritten file
    always gives a new key; a chmod or a new hard link gives one too, which costs only a fresh export."""
    digest = hashlib.sha256(str(tag_dir.resolve()).encode())
    for path in sorted(tag_dir.iterdir()):
        if path.is_file():
            info = path.stat()
            digest.update(f"\0{path.name}:{info.st_size}:{info.st_ino}:{info.st_mtime_ns}:{info.st_ctime_ns}"
                          .encode())
    return digest.hexdigest()[:24]


def export_cache_path() -> Path:
    """``$TMPDIR/zoo-eval-exports-<uid>``: node-local, one per user."""
    return Path(tempfile.gettempdir()) / f"zoo-eval-exports-{os.getuid()}"


def make_private_directory(cache: Path) -> None:
    """Create ``cache`` (or take it over) as a directory only this user can enter (mode 0700), so the exports
    in it (written with the umask's permissions) are neither readable nor plantable by other users."""
    try:
        cache.mkdir(mode=0o700, exist_ok=True)
        info = cache.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            os.chmod(cache, 0o700)
            return
    except OSError as err:
        raise UserError(f"the export cache {cache} cannot be created ({err.strerror}); set TMPDIR to a "
                         "directory you can write to.") from None
    raise UserError(f"the export cache {cache} is not a directory owned by this user; remove it or set TMPDIR "
                     "to another directory.")


def check_output_file(path: str | os.PathLike) -> Path:
    """Prove, before evaluating, that the results can be written to ``path`` (a file, not a directory)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"--out {path} is a directory; pass a file path such as {path / 'results.json'}.")
    check_writable_directory(path.parent, "--out's directory")
    return path


def format_results(results: dict[str, Any]) -> str:
    if results["task"] == "wikitext":
        return (f"wikitext: loss {results['loss']:.4f}  ppl {results['ppl']:.3f}  "
                f"adjusted ppl {results['adjusted_ppl']:.3f}  (T={results['num_tokens']}, "
                f"T_o={results['num_original_tokens']}, windows={results['num_windows']}, "
                f"seq_length={results['seq_length']}, overlap={results['overlap']})")
    mode = "strict" if results["strict"] else "non-strict"
    return (f"lambada ({mode}): accuracy {results['accuracy']:.4f}  ({results['correct']}/{results['total']}, "
            f"{results['multi_token_targets']} multi-token targets, {results['truncated']} truncated)")


def log_to_wandb(project: str, results: dict[str, Any]) -> bool:
    """Log the results as one W&B run; any failure is reported in one warning line and swallowed (it never
    stops the eval): a missing wandb (an install without its dependencies) says how to install it."""
    try:
        import wandb  # local: wandb is optional; only --wandb-project needs it
    except ImportError:
        print(f"warning: wandb is not installed, so the results are not logged to W&B project {project!r}; "
              "pip install wandb to log them (they are still printed, and written with --out).", file=sys.stderr)
        return False
    try:
        run = wandb.init(project=project, job_type="eval", name=f"{results['task']}-{Path(results['load']).name}",
                         config={k: v for k, v in results.items() if not isinstance(v, float)})
        run.log({k: v for k, v in results.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        run.finish()
        return True
    except Exception as err:  # noqa: BLE001 - tracking must never stop an evaluation
        print(f"warning: W&B logging skipped ({type(err).__name__}: {err}); the results are still printed "
              "and written with --out.", file=sys.stderr)
        return False
