"""One dtype vocabulary for every CLI (``--dtype``): torch's names, with the short aliases users type.

    --dtype float32 | bfloat16 | float16        (also fp32 | bf16 | fp16)

Imports neither torch nor anything of zoo, so a CLI can parse its flags before loading either.
"""

from __future__ import annotations

import argparse

DTYPE_NAMES = ("float32", "bfloat16", "float16")
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_name(value: str) -> str:
    """The canonical name of a ``--dtype`` value (argparse ``type=``); anything else is one sentence."""
    name = ALIASES.get(value, value)
    if name not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"--dtype {value!r} is not one of {', '.join(DTYPE_NAMES)} (or "
                                         f"{', '.join(ALIASES)}); pass one of those.")
    return name


def torch_dtype(name: str | None):
    """The torch dtype of a canonical name (None stays None)."""
    import torch  # local: torch import cost; every CLI parses --dtype without torch

    return None if name is None else getattr(torch, name)


def add_dtype_argument(parser: argparse.ArgumentParser, default: str | None, help: str) -> None:
    parser.add_argument("--dtype", type=dtype_name, default=default, metavar="{float32,bfloat16,float16}",
                        help=f"{help} (also fp32, bf16, fp16)")
