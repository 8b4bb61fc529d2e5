"""Task data named by its Hugging Face hub name: ``--data-dir hub:NAME[/CONFIG]``.

``hub:glue/mnli``, ``hub:glue/qqp``, ``hub:squad``, ``hub:squad_v2``, ``hub:race/all`` (or an
owner-qualified name such as ``hub:nyu-mll/glue/mnli``, or the path of a local dataset repository
in the hub's layout). A hub name may itself contain ``/`` (``owner/name``), so the last part is
read as the configuration only when it is one of the task's configurations
(:data:`TASK_CONFIGS`); otherwise the whole text is the dataset name and the dataset's default
configuration is loaded.

This module only parses the text: it imports nothing heavy, so the readers can test a
``--data-dir`` for the prefix without importing ``datasets``. Loading is in
:func:`zoo.finetune.hub_layouts.load_hub_dataset`.
"""

from __future__ import annotations

import os

from zoo.errors import UserError

HUB_PREFIX = "hub:"

# The configurations of each task's hub datasets, by the reader that reads them.
TASK_CONFIGS = {
    "mnli": ("mnli",),
    "qqp": ("qqp",),
    "squad": ("plain_text",),   # squad_v2's own configuration is its default one
    "race": ("all", "middle", "high"),
}

# What a user types for each task (examples in messages).
TASK_EXAMPLES = {"mnli": "hub:glue/mnli", "qqp": "hub:glue/qqp", "squad": "hub:squad or hub:squad_v2",
                 "race": "hub:race/all"}


def is_hub_name(data_dir: str | os.PathLike) -> bool:
    """Whether ``--data-dir`` names a hub dataset (``hub:...``) rather than a directory."""
    return isinstance(data_dir, str) and data_dir.startswith(HUB_PREFIX)


def split_hub_name(data_dir: str, task: str) -> tuple[str, str | None]:
    """``(name, config)`` of ``hub:NAME[/CONFIG]``; ``config`` is None when the last part is not
    one of ``task``'s configurations (the dataset's default configuration is then loaded)."""
    text = data_dir[len(HUB_PREFIX):].strip().rstrip("/")
    if not text:
        raise UserError(f"--data-dir {data_dir!r} names no dataset; pass hub:NAME[/CONFIG], e.g. "
                         f"{TASK_EXAMPLES[task]}.")
    name, _, last = text.rpartition("/")
    if name and last in TASK_CONFIGS[task]:
        return name, last
    return text, None
