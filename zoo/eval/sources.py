"""Reading the zero-shot inputs: a raw file in its original layout, or a `datasets` directory.

WikiText-103 is read as one string (the file's exact text, newlines included), because the paper
counts its words and tokenizes it as a single stream. LAMBADA is read as one passage per line of
the jsonl (``{"text": ...}``). Either may instead be a directory written by
``datasets.Dataset.save_to_disk`` (or a ``DatasetDict``, of which ``split`` is taken) with a
"text" column; nothing is ever downloaded.

The jsonl is parsed line by line with ``json`` rather than through ``datasets.load_dataset("json")``
so that a bad line is reported by its number, and no cache directory is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from zoo.errors import MissingInput, UserError

TEXT_COLUMN = "text"


def read_wikitext(path: str | os.PathLike, split: str = "test") -> str:
    """The raw WikiText text: the file's contents, or a dataset's rows (the file's lines) rejoined.

    Rows without a trailing newline (``datasets``' text loader strips it, and wikitext-103-raw-v1
    stores blank lines as "") get one back, so the rows rejoin into the file's line layout.
    """
    path = Path(path)
    if path.is_dir():
        rows = _dataset_texts(path, split, "WikiText")
        text = "".join(row if row.endswith("\n") else row + "\n" for row in rows)
    elif path.is_file():
        text = path.read_bytes().decode("utf-8")
    else:
        raise MissingInput(f"WikiText data {path} does not exist; pass --data the raw wiki.test.tokens "
                                "file or a directory written by datasets' save_to_disk.")
    if not text.strip():
        raise UserError(f"WikiText data {path} holds no text; pass a non-empty wiki.test.tokens file.")
    return text


def read_lambada(path: str | os.PathLike, split: str = "test") -> list[str]:
    """The LAMBADA passages, one per non-blank jsonl line (or dataset row)."""
    path = Path(path)
    if path.is_dir():
        texts = _dataset_texts(path, split, "LAMBADA")
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise UserError(f"row {index} of the LAMBADA dataset {path} has a non-string 'text' "
                                 f"({text!r}); fix the dataset so every row has a text passage.")
    elif path.is_file():
        texts = [_jsonl_text(line, number, path)
                 for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
                 if line.strip()]
    else:
        raise MissingInput(f"LAMBADA data {path} does not exist; pass --data the lambada_test.jsonl "
                                "file or a directory written by datasets' save_to_disk.")
    if not texts:
        raise UserError(f"LAMBADA data {path} holds no passages; pass a jsonl file with one "
                         '{"text": ...} object per line.')
    return texts


def _jsonl_text(line: str, number: int, path: Path) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"line {number} of {path} is not valid JSON ({err.msg}); write one "
                         '{"text": ...} object per line.') from None
    if not isinstance(record, dict) or not isinstance(record.get(TEXT_COLUMN), str):
        raise UserError(f"line {number} of {path} has no string 'text' field; write one "
                         '{"text": ...} object per line, as in lambada_test.jsonl.')
    return record[TEXT_COLUMN]


def _dataset_texts(path: Path, split: str, task: str) -> list[str]:
    import datasets  # local: datasets costs ~1.5 s to import; only a saved-dataset directory needs it

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise MissingInput(f"{task} data {path} is a directory but not a saved dataset; pass a raw file "
                                "or a directory written by datasets' save_to_disk.") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserError(f"the {task} dataset {path} has no split {split!r} (it has {sorted(loaded)}); "
                             "pass --split with one of them.")
        loaded = loaded[split]
    if TEXT_COLUMN not in loaded.column_names:
        raise UserError(f"the {task} dataset {path} has no 'text' column (it has {loaded.column_names}); "
                         "save a dataset whose 'text' column holds the passages.")
    return list(loaded[TEXT_COLUMN])
