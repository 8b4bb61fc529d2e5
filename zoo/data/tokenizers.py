"""GPT-2 byte-level BPE tokenizer, loaded as a transformers fast tokenizer from the bundled files."""

from __future__ import annotations

import os
from pathlib import Path

GPT2_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "gpt2"
GPT2_EOD_TOKEN_ID = 50256  # "<|endoftext|>", appended after every document


BERT_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "bert-base-uncased"


def _load_fast_tokenizer(class_name: str, path, default: Path, needs: str):
    import transformers

    directory = Path(path) if path is not None else default
    if not directory.is_dir():
        raise FileNotFoundError(
            f"tokenizer directory '{directory}' does not exist; pass a directory holding {needs} "
            f"(or omit it to use the bundled {default.name} tokenizer)."
        )
    return getattr(transformers, class_name).from_pretrained(str(directory))


def load_gpt2_tokenizer(path: str | os.PathLike | None = None):
    """The fast GPT-2 tokenizer from ``path`` (default: the bundled ``zoo/assets/gpt2``)."""
    return _load_fast_tokenizer("GPT2TokenizerFast", path, GPT2_TOKENIZER_DIR, "vocab.json and merges.txt")


def load_bert_tokenizer(path: str | os.PathLike | None = None):
    """The fast WordPiece tokenizer from ``path`` (default: the bundled ``zoo/assets/bert-base-uncased``)."""
    return _load_fast_tokenizer("BertTokenizerFast", path, BERT_TOKENIZER_DIR, "vocab.txt")
