"""The per-invocation values of a sweep: what every user changes, given on ``finetune/sweep.py``'s command line.

``--pretrained``, ``--data-dir`` and ``--deepspeed-config`` replace the sweep file's value wherever the file
sets it: a parameter (``value:``, or a ``values:`` list, which becomes that one value), under the dash or
the underscore spelling, or a literal flag of its ``command:`` after ``${program}``. A flag the file does not
set is added as a fixed parameter. Each value is checked before anything runs (a wrong one is one sentence,
not one failed run per grid point); the same checks cover the file's own values before a real run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.config.ds_config_file import check_ds_config, read_ds_config
from zoo.errors import MissingInput, UserError

BERT_DIRECTORY = "a BERT directory in transformers' layout (config.json, model.safetensors, vocab.txt)"
TASK_DATA = "the task's data (a directory in the original or HF hub layout, a file the task reads, or hub:NAME[/CONFIG])"
HUB_PREFIX = "hub:"


def flag_key(name: str) -> str:
    """A flag or parameter name as compared: no leading dashes, underscores read as dashes."""
    return name.lstrip("-").replace("_", "-")


def without_flags(args: tuple[str, ...], keys: set[str]) -> tuple[str, ...]:
    """``args`` less every ``--flag=value`` or ``--flag value`` whose :func:`flag_key` is in ``keys``."""
    kept: list[str] = []
    drop_value = False
    for arg in args:
        if drop_value:
            drop_value = False
            if not arg.startswith("-"):
                continue
        name, has_value, _ = arg.partition("=")
        if arg.startswith("--") and flag_key(name) in keys:
            drop_value = not has_value
            continue
        kept.append(arg)
    return tuple(kept)


def check_pretrained(value: Any, named: str) -> None:
    """``named`` introduces the value in the sentence: the flag and value, or the file's parameter."""
    path = Path(str(value))
    if not str(value).strip():
        raise UserError(f"{named} is empty; pass --pretrained {BERT_DIRECTORY}.")
    if not path.exists():
        raise MissingInput(f"{named} does not exist; pass --pretrained {BERT_DIRECTORY}.")
    if not path.is_dir():
        raise UserError(f"{named} is a file, not a directory; pass --pretrained the directory holding config.json "
                         "and the weights.")
    if not (path / "config.json").is_file():
        raise MissingInput(f"{named} has no config.json; pass --pretrained a directory written by "
                                "save_pretrained (zoo or transformers).")


def check_data_dir(value: Any, named: str) -> None:
    """A hub name, or a path that exists (a directory, or a file for a task that reads one: the task checks
    its layout)."""
    text = str(value)
    if text.startswith(HUB_PREFIX):
        if not text[len(HUB_PREFIX):].strip("/ "):
            raise UserError(f"{named} names no hub dataset; pass --data-dir hub:NAME[/CONFIG] "
                             "(e.g. hub:nyu-mll/glue/mnli) or a path.")
        return
    if not text.strip():
        raise UserError(f"{named} is empty; pass --data-dir {TASK_DATA}.")
    if not Path(text).exists():
        raise MissingInput(f"{named} does not exist; pass --data-dir {TASK_DATA}.")


def check_deepspeed_config(value: Any, named: str) -> None:
    """The ds_config's own sentences name the file (they are the finetune scripts' checks)."""
    if not str(value).strip():
        raise UserError(f"{named} is empty; pass --deepspeed-config ds_configs/<name>.json.")
    if not Path(str(value)).is_file():
        raise MissingInput(f"{named} does not exist; pass --deepspeed-config one of the files in ds_configs/.")
    check_ds_config(read_ds_config(str(value)), str(value), needs_optimizer=False)


# The sweep files' parameter name of each override, and its check.
CHECKS = {"pretrained": check_pretrained, "data-dir": check_data_dir, "deepspeed_config": check_deepspeed_config}


@dataclass(frozen=True)
class SweepOverrides:
    pretrained: str | None = None
    data_dir: str | None = None
    deepspeed_config: str | None = None

    def values(self) -> dict[str, str]:
        """The overridden parameters, under the names the sweep files use."""
        named = {"pretrained": self.pretrained, "data-dir": self.data_dir, "deepspeed_config": self.deepspeed_config}
        return {name: value for name, value in named.items() if value is not None}

    def check(self) -> None:
        """Every given value is usable (a directory with config.json, existing task data or a hub name, a
        readable ds_config), or one sentence naming the flag and the value."""
        for name, value in self.values().items():
            CHECKS[name](value, f"--{flag_key(name)} {value}")

    def apply(self, fixed: dict[str, Any], grid: dict[str, list[Any]], program_args: tuple[str, ...]
              ) -> tuple[dict[str, Any], dict[str, list[Any]], tuple[str, ...]]:
        """The sweep's fixed values, grid and literal program arguments with the overrides in their place
        (a fixed value keeps its position and spelling; a grid entry becomes a fixed value)."""
        overridden = {flag_key(name): value for name, value in self.values().items()}
        new_fixed = {name: overridden.get(flag_key(name), value) for name, value in fixed.items()}
        new_grid = {}
        for name, values in grid.items():
            if flag_key(name) in overridden:
                new_fixed[name] = overridden[flag_key(name)]
            else:
                new_grid[name] = values
        present = {flag_key(name) for name in new_fixed}
        for name, value in self.values().items():
            if flag_key(name) not in present:
                new_fixed[name] = value
        return new_fixed, new_grid, without_flags(program_args, set(overridden))


def check_file_values(fixed: dict[str, Any], grid: dict[str, list[Any]], overrides: SweepOverrides,
                      sweep_file: str) -> None:
    """The sweep file's own pretrained, data-dir and ds_config values (those no flag replaced) are usable,
    checked before a real run; the sentence names the file and the flag that replaces the value."""
    replaced = {flag_key(name) for name in overrides.values()}
    entries = [(name, [value]) for name, value in fixed.items()] + list(grid.items())
    for name, values in entries:
        key = flag_key(name)
        check = {flag_key(check_name): check for check_name, check in CHECKS.items()}.get(key)
        if check is None or key in replaced:
            continue
        for value in values:
            check(value, f"{name} {value} (set in {sweep_file})")
