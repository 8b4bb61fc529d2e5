"""GPT-2 byte-level BPE tokenizer, loaded as a transformers fast tokenizer from the bundled files.

The bundled tokenizer configs name ``clean_up_tokenization_spaces``, whose default transformers 4 and 5 disagree
on, so text decodes the same on every transformers version setup.cfg allows: GPT-2's is false (decoding gives
back exactly the text the byte-level tokens encode, " ," included), BERT's true (as bert-base-uncased's own).
"""

from __future__ import annotations

import os
from pathlib import Path

from zoo.assets import BERT_TOKENIZER_DIR, GPT2_TOKENIZER_DIR
from zoo.errors import MissingInput, UserError

GPT2_EOD_TOKEN_ID = 50256  # "<|endoftext|>", appended after every document


def _load_fast_tokenizer(class_name: str, path, default: Path, needs: tuple[str, ...]):
    """``transformers.<class_name>.from_pretrained(path)``; a directory that cannot give one is refused
    with one sentence naming it (missing, a file, without the vocabulary files, or unreadable files)."""
    import transformers  # local: slow to import, and only loading a tokenizer needs it

    directory = Path(path) if path is not None else default
    files = " and ".join(needs)
    fallback = f"or omit it to use the bundled {default.name} tokenizer"
    if not directory.is_dir():
        state = "is not a directory" if directory.exists() else "does not exist"
        raise MissingInput(f"tokenizer directory '{directory}' {state}; pass a directory holding {files} "
                                f"(or tokenizer.json), {fallback}.")
    if not (directory / "tokenizer.json").is_file() and not all((directory / name).is_file() for name in needs):
        raise MissingInput(f"tokenizer directory '{directory}' holds neither {files} nor tokenizer.json; "
                                f"pass a directory that does, {fallback}.")
    try:
        return getattr(transformers, class_name).from_pretrained(str(directory))
    except Exception as err:  # tokenizers raises bare Exceptions for unreadable vocabularies
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")
        raise UserError(f"tokenizer directory '{directory}' cannot be loaded ({detail}); check that its tokenizer "
                         f"files are intact UTF-8 text, {fallback}.") from None


def load_gpt2_tokenizer(path: str | os.PathLike | None = None):
    """The fast GPT-2 tokenizer from ``path`` (default: the bundled ``zoo/assets/gpt2``)."""
    return _load_fast_tokenizer("GPT2TokenizerFast", path, GPT2_TOKENIZER_DIR, ("vocab.json", "merges.txt"))


def load_bert_tokenizer(path: str | os.PathLike | None = None):
    """The fast WordPiece tokenizer from ``path`` (default: the bundled ``zoo/assets/bert-base-uncased``)."""
    return _load_fast_tokenizer("BertTokenizerFast", path, BERT_TOKENIZER_DIR, ("vocab.txt",))
