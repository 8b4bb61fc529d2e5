"""DeepSpeed's offline checkpoint tools refuse a zoo checkpoint written at tp > 1, in one sentence.

DeepSpeed's ``zero_to_fp32.py`` (and ``zero_to_torch.py``), which every ZeRO save copies into the save
directory (``RUN/checkpoints/``, beside the tags; run as ``python checkpoints/zero_to_fp32.py checkpoints OUT``),
and ``deepspeed.checkpoint.ds_to_universal`` know nothing of zoo's tensor-parallel layout: at tp > 1 the
first fails ("Expected 2 ... found 4 files") and the second, with ``--inject_missing_state``, completes
and writes a universal checkpoint whose merged tensors are wrong. zoo's own tools read these
checkpoints at any tp: ``launch/export.py`` (a transformers-layout directory) and ``--load`` (resume).

* :func:`refuse_universal_conversion` (every rank, before ``engine.save_checkpoint``): the module carries
  a ``universal_checkpoint_info`` that DeepSpeed saves in every ``mp_rank_*_model_states.pt``; it names
  no parameter pattern to merge and one "unsupported" entry whose reason is the sentence, which
  ``ds_to_universal`` raises (as a ValueError) before it writes anything, with or without
  ``--inject_missing_state``. DeepSpeed reads that attribute only when saving; zoo's resume and export
  do not read the key.
* :func:`guard_deepspeed_tools` (rank 0, after the save's barrier): the recovery scripts DeepSpeed
  copied into the save directory are replaced by one that prints the sentence and exits 2.

At tp = 1 both leave the checkpoint as DeepSpeed writes it: its tools read a tp = 1 checkpoint right.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from zoo.atomic import write_text_atomic

RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"                          # deepspeed.checkpoint.constants
AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS = "autotp_unsupported_parameter_patterns"  # read by ds_to_universal
UNSUPPORTED_WHAT = "zoo's tensor-parallel parameters"


def refusal_sentence(tp_size: int, tool: str, load: str = "RUN") -> str:
    """The one sentence a DeepSpeed tool prints for a zoo checkpoint written at ``tp_size``."""
    return (f"this zoo checkpoint was written at tp={tp_size}, whose tensor-parallel shards DeepSpeed's {tool} "
            f"cannot merge; export it with `python launch/export.py --load {load} [--tag TAG] --out DIR` "
            f"(a transformers-layout directory that loads at any tp), or resume it with --load")


def refuse_universal_conversion(engine, tp_size: int) -> None:
    """Make the model states DeepSpeed saves from now on tell ``ds_to_universal`` to stop (tp > 1)."""
    if tp_size <= 1:
        return
    # ds_to_universal prints "... not supported for <key>: <reason>." around it
    info = {AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: {UNSUPPORTED_WHAT: refusal_sentence(tp_size, "ds_to_universal")}}
    setattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, info)


def guard_deepspeed_tools(save_dir: str | os.PathLike, tp_size: int) -> list[Path]:
    """Replace the recovery scripts DeepSpeed copied into ``save_dir`` (the directory handed to
    ``engine.save_checkpoint``; tp > 1) by a script that prints :func:`refusal_sentence`, naming the
    directory it sits in, and exits 2. Only scripts that are there are replaced (this save's DeepSpeed
    copied them); each is written atomically and stays executable. Returns the replaced paths."""
    if tp_size <= 1:
        return []
    replaced = []
    for name in RECOVERY_SCRIPTS:
        path = Path(save_dir) / name
        if not path.is_file():
            continue
        write_text_atomic(path, _refusing_script(tp_size, name))
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        replaced.append(path)
    return replaced


def _refusing_script(tp_size: int, name: str) -> str:
    return f'''#!/usr/bin/env python
"""Written by zoo in place of DeepSpeed's {name}: this checkpoint was saved at tp={tp_size}, which that script
cannot merge. Use zoo's launch/export.py (any tp) or resume with --load."""
import sys
from pathlib import Path

sentence = {refusal_sentence(tp_size, name, load="{load}")!r}
print("error: " + sentence.format(load=Path(__file__).resolve().parent) + ".", file=sys.stderr)
sys.exit(2)
'''
