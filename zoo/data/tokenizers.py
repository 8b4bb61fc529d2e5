"""GPT-2 byte-level BPE tokenizer, loaded as a transformers fast tokenizer from the bundled files."""

from __future__ import annotations

import os
from pathlib import Path

GPT2_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "gpt2"
GPT2_EOD_TOKEN_ID = 50256  # "<|endoftext|>", appended after every document


def load_gpt2_tokenizer(path: str | os.PathLike | None = None):
    """The fast GPT-2 tokenizer from ``path`` (default: the bundled ``zoo/assets/gpt2``)."""
    from transformers import GPT2TokenizerFast

    directory = Path(path) if path is not None else GPT2_TOKENIZER_DIR
    if not directory.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory '{directory}' does not exist; pass a directory holding "
            "vocab.json and merges.txt (or omit it to use the bundled GPT-2 tokenizer)."
        )
    return GPT2TokenizerFast.from_pretrained(str(directory))
