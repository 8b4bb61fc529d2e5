"""Config dataclasses whose fields carry their flag, help text and ``--help`` group; argparse, the merge of a
ds_config's ``zoo`` block and the block's type errors are all derived from those fields.

A field declared with :func:`option` is a setting of a command::

    seq_length: int = option(1024, group="model", help="tokens per training sample")

gives ``--seq-length`` (typed ``int``, listed under "model" in ``--help`` with its default) and the
``zoo`` block key ``seq_length``. ``flag=None`` keeps a setting in the block only; ``in_block=False``
keeps it on the command line only. A field declared with plain ``dataclasses.field()`` is neither.

Precedence is one rule for every command: the dataclass default, then the ``zoo`` block, then the flags
(a flag given on the command line always wins). A block value of the wrong JSON type is refused in one
sentence naming the key, its value, the expected type and an example. Only the standard library is
imported, so a parser (and ``--help``) is built without loading torch or DeepSpeed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from collections.abc import Iterable
from typing import Any

from zoo.errors import UserError, global_rank

# The --help groups, in Megatron's order, each with its one-line description.
GROUPS: dict[str, str] = {
    "model": "which model, its size and shape",
    "data": "what is read, and how it is cut into samples",
    "parallelism": "how the ranks split the work",
    "training": "steps, batches, optimisation and seeds",
    "learning rate": "the peak, the floor and the warm-up of the ds_config's schedule",
    "mixed precision": "the training dtype (the ds_config's fp16/bf16 blocks)",
    "checkpointing": "where the run is written, and what it resumes from",
    "logging": "what is printed and tracked, and how often",
    "generation": "what is sampled from each prompt, and how",
}
# The groups of a training command (every group but generation's), for parsers that list them all up front.
TRAINING_GROUPS: tuple[str, ...] = tuple(name for name in GROUPS if name != "generation")
AUTO = "auto"

TYPE_NAMES = {int: "an integer", str: "a string", bool: "true or false", dict: "a JSON object", float: "a number",
              list: "a list"}
TYPE_EXAMPLES = {int: "6", str: '"text"', bool: "true", dict: "{}", float: "30", list: "[]"}


def option(default: Any = dataclasses.MISSING, *, help: str, group: str, flag: str | tuple[str, ...] | None = AUTO,
           in_block: bool = True, default_factory: Any = dataclasses.MISSING, negatable: bool = False,
           expects: tuple[str, str] | None = None, **argparse_kwargs: Any) -> Any:
    """A dataclass field that is a setting: ``flag`` AUTO is ``--`` plus the name with dashes (a tuple names
    the flags and aliases; None: no flag), ``in_block`` whether a ds_config's zoo block may set it,
    ``negatable`` a boolean with a ``--no-`` form, ``expects`` (type name, JSON example) for the block's
    type error where the field's type alone says it badly; the remaining keywords go to ``add_argument``
    (choices, metavar)."""
    if group not in GROUPS:
        raise UserError(f"option group {group!r} is not one of {sorted(GROUPS)}; use one of them.")
    metadata = {"help": help, "group": group, "flag": flag, "in_block": in_block, "negatable": negatable,
                "expects": expects, "argparse": argparse_kwargs}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def settings_of(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` declared with :func:`option`, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "group" in f.metadata]


def block_keys(cls: type) -> set[str]:
    """The keys a ds_config's zoo block may set for ``cls``."""
    return {f.name for f in settings_of(cls) if f.metadata["in_block"]}


def flags_of(f: dataclasses.Field) -> tuple[str, ...]:
    flag = f.metadata.get("flag")
    if flag is None:
        return ()
    if flag == AUTO:
        return ("--" + f.name.replace("_", "-"),)
    return (flag,) if isinstance(flag, str) else tuple(flag)


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def allowed_types(hint: Any) -> tuple[type, ...]:
    """``int`` -> (int,); ``str | None`` -> (str, NoneType); ``dict[str, Any]`` -> (dict,)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for arg in typing.get_args(hint) for t in allowed_types(arg))
    return (typing.get_origin(hint) or hint,)


def _element_type(hint: Any) -> type:
    """The item type of ``list[X]`` (possibly ``| None``), for argparse's ``nargs="+"``."""
    for arg in (typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)):
        if typing.get_origin(arg) is list:
            return (typing.get_args(arg) or (str,))[0]
    return str


def group_of(parser: argparse.ArgumentParser, name: str) -> argparse._ArgumentGroup:
    """The parser's argument group ``name`` (created on first use with its :data:`GROUPS` description)."""
    for group in parser._action_groups:
        if group.title == name:
            return group
    return parser.add_argument_group(name, GROUPS.get(name))


def add_groups(parser: argparse.ArgumentParser, names: Iterable[str] = TRAINING_GROUPS) -> None:
    """Create the groups ``names`` (default: a training command's) up front, so that ``--help`` lists them in
    Megatron's order; a group created this way is listed even while it holds no flag."""
    for name in names:
        group_of(parser, name)


def add_options(parser: argparse.ArgumentParser, cls: type, *, with_defaults: bool = False,
                exclude: Iterable[str] = ()) -> argparse.ArgumentParser:
    """One argument per flagged field of ``cls``, in its group. Without ``with_defaults`` an absent flag
    parses as None (so :func:`merged_settings` can tell it from a given one) and ``--help`` shows the
    dataclass default; with it, the dataclass default is the argparse default. A field with no default
    is a required flag."""
    hints = typing.get_type_hints(cls)
    used = [f for f in settings_of(cls) if flags_of(f) and f.name not in set(exclude)]
    add_groups(parser, [name for name in GROUPS if any(f.metadata["group"] == name for f in used)])
    for f in used:
        kinds = allowed_types(hints[f.name])
        default = default_of(f)
        kwargs: dict[str, Any] = {"dest": f.name, **f.metadata["argparse"]}
        help_text = f.metadata["help"]
        if default is dataclasses.MISSING:
            kwargs["required"] = True
        elif not (default is None or isinstance(default, bool) or default in ([], {})) and "default" not in help_text:
            help_text += f" (default: {default})"
        kwargs["help"] = help_text.replace("%", "%%")
        if default is not dataclasses.MISSING:
            kwargs["default"] = default if with_defaults else None
        if bool in kinds and f.metadata["negatable"]:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif bool in kinds:   # a flag that turns the default over: --overwrite, --no-strict
            kwargs["action"] = "store_false" if default is True else "store_true"
        elif list in kinds:   # one flag with several values, or (action="append") a repeatable flag
            kwargs.setdefault("nargs", None if "action" in kwargs else "+")
            kwargs["type"] = _element_type(hints[f.name])
        else:
            kwargs["type"] = next(kind for kind in kinds if kind is not type(None))
        group_of(parser, f.metadata["group"]).add_argument(*flags_of(f), **kwargs)
    return parser


def add_deepspeed_config_argument(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """DeepSpeed's two launcher-facing flags (``--deepspeed``, ``--deepspeed_config``), declared here so that a
    parser is built without importing DeepSpeed."""
    group = group_of(parser, "DeepSpeed")
    group.add_argument("--deepspeed", action="store_true", default=False,
                       help="accepted for DeepSpeed's launchers and examples; zoo always runs under DeepSpeed")
    group.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                       required=required, help="the DeepSpeed config JSON, with its zoo block")


LOG_LEVELS = ("info", "debug")


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    """``--log-level``: what the libraries under zoo print (zoo.operations.library_output); absent, parsed as None,
    so that ``$ZOO_LOG_LEVEL`` decides."""
    group_of(parser, "logging").add_argument(
        "--log-level", dest="log_level", choices=LOG_LEVELS, default=None,
        help="info: zoo's lines and real warnings only; debug: the libraries' own lines too (DeepSpeed's log, "
             "datasets' progress bars) (default: $ZOO_LOG_LEVEL, else info)")


def add_local_rank_argument(parser: argparse.ArgumentParser) -> None:
    """``--local_rank`` / ``--local-rank``, passed by the deepspeed launcher. Its default None lets joining
    take the local rank from whichever launcher started the process
    (:func:`zoo.distributed.launcher_local_rank`, the one place a local rank is read)."""
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                        help=argparse.SUPPRESS)


def check_block_keys(block: Any, cls: type, source: str | None, unknown_fix: str | None = None) -> dict[str, Any]:
    """The zoo block as a dict, refused in one sentence when it is not a JSON object or names a key ``cls``
    does not read (``unknown_fix`` replaces the default hint listing the valid keys)."""
    known = block_keys(cls)
    if not isinstance(block, dict):
        raise UserError(f"the zoo block of {source} is {block!r}, not a JSON object; write it as "
                         "\"zoo\": {\"tensor_parallel_size\": 1, \"model\": \"gpt2-tiny\", ...}.")
    unknown = sorted(set(block) - known)
    if unknown:
        fix = unknown_fix or f"valid keys are {sorted(known)}"
        raise UserError(f"unknown key {unknown[0]!r} in the zoo block of {source}; {fix}.")
    return dict(block)


def merged_settings(cls: type, block: dict[str, Any], args: argparse.Namespace | None) -> dict[str, Any]:
    """The zoo block's values with every flag given in ``args`` on top (flags win); what neither sets is left
    to the dataclass default."""
    values = dict(block)
    for f in settings_of(cls):
        value = getattr(args, f.name, None) if args is not None and flags_of(f) else None
        if value is not None:
            values[f.name] = value
    return values


def check_types(config: Any, source: str | None) -> None:
    """Every setting of the dataclass instance ``config`` has its field's type (flags are typed by argparse,
    so a wrong type comes from the zoo block): one sentence naming the key, its value and the expected type."""
    hints = typing.get_type_hints(type(config))
    for f in settings_of(type(config)):
        value = getattr(config, f.name)
        allowed = allowed_types(hints[f.name])
        if has_type(value, allowed):
            continue
        kind = allowed[0]
        nullable = " or null" if type(None) in allowed else ""
        expected, example = f.metadata["expects"] or (TYPE_NAMES[kind], TYPE_EXAMPLES[kind])
        raise UserError(f"zoo setting {f.name!r} in {source} is {shown(value)} ({json_kind(value)}) but must be "
                         f"{expected}{nullable}; write it as e.g. \"{f.name}\": {example}.")


def has_type(value: Any, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):   # bool is an int subclass: true is not an iteration count
        return bool in allowed
    if isinstance(value, int) and float in allowed:   # JSON's 30 is a number of minutes too
        return True
    return isinstance(value, allowed)


def shown(value: Any) -> str:
    """``value`` as JSON where it can be (as the user wrote it in the file), else its repr."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def json_kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a JSON object"}.get(type(value), type(value).__name__)


class CommandParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, ``error: <sentence>``, and exit code 2, as every other
    user error of a zoo command (argparse's own is the whole usage block and then the message): an unknown
    flag is named with the closest flag the command takes (difflib), and any other parse error (a value of
    the wrong type, a missing required flag, an ambiguous abbreviation) is argparse's message plus where the
    flags are listed. Only the writer rank prints it (every rank of a launched job parses the same command
    line); every rank exits 2. ``--help`` is argparse's."""

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's, unknown flags answered here
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_argument_sentence(extras[0], self))
        return parsed

    def error(self, message: str) -> typing.NoReturn:
        if global_rank() == 0:
            sys.stderr.write(f"error: {one_sentence(message, self.prog)}\n")
            sys.stderr.flush()
        sys.exit(2)


def known_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag ``parser`` takes (aliases included), ``--help`` left out."""
    return [flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"]


def unknown_argument_sentence(argument: str, parser: argparse.ArgumentParser) -> str:
    """The sentence for an argument ``parser`` does not take: a flag with the closest known flag (difflib, the
    dash and underscore spellings alike), else where the flags are listed; a bare value as such."""
    import difflib  # local: only a command line with an unknown flag pays for it

    if not argument.startswith("-"):
        return (f"unexpected argument {argument!r}, which no flag of {parser.prog} takes; drop it, or put the flag "
                f"it belongs to before it (see {parser.prog} --help).")
    flag = argument.split("=", 1)[0]
    flags = known_flags(parser)
    by_spelling = {name.replace("_", "-"): name for name in flags}
    match = difflib.get_close_matches(flag.replace("_", "-"), list(by_spelling), n=1, cutoff=0.6)
    if match:
        return f"unknown flag {flag} for {parser.prog}; did you mean {by_spelling[match[0]]}?"
    return f"unknown flag {flag} for {parser.prog}; see {parser.prog} --help for the flags it takes."


def one_sentence(message: str, prog: str) -> str:
    """argparse's error ``message`` as a zoo sentence: it names the flag and the value, and this adds where the
    valid flags and values are listed."""
    return message if message.endswith((".", "?")) else f"{message}; see {prog} --help."
