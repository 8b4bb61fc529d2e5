"""What earlier zoo runs wrote into a run's ``checkpoints/``: a summary for the refusal sentence, and the removal
``--overwrite`` does, which takes only the files zoo's saves write (tags, ``latest``, DeepSpeed's recovery
scripts, resharded copies) and leaves everything else, never following a symbolic link. It imports the rest of
zoo.checkpoint (torch, seconds) only when it reads a directory, so a check of names stays light."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from zoo.errors import UserError


def checkpoint_summary(run_dir: Path) -> str | None:
    """"latest iter_0000004" / "tags iter_0000002, iter_0000004" when ``run_dir`` holds DeepSpeed checkpoints,
    complete or not (a ``latest`` file, or a tag under ``checkpoints/`` with a model-states file), None
    otherwise. A tag without a completion marker (a save that did not finish, or one written by a zoo that
    wrote no markers) is still an earlier run's file, so it counts here though no reader would load it."""
    # local: zoo.checkpoint imports torch and transformers (seconds); a sweep's --out check reads only names
    from zoo.checkpoint.files import CHECKPOINT_SUBDIR, LATEST_FILE, tags_with_model_states

    root = run_dir / CHECKPOINT_SUBDIR
    latest = root / LATEST_FILE
    if latest.is_file():
        try:
            return f"latest {latest.read_text().strip() or '(empty)'}"
        except (OSError, UnicodeDecodeError):
            return "a latest file"
    tags = tags_with_model_states(root)
    if tags:
        return "tags " + ", ".join(tags[:3]) + (", ..." if len(tags) > 3 else "")
    return None


def refuse_symlinked_checkpoints(run_dir: Path) -> None:
    """``--overwrite`` removes only what a run wrote into ``run_dir``: a ``checkpoints`` that is a symbolic
    link leads elsewhere, so it is one sentence rather than removals in the link's target."""
    from zoo.checkpoint.files import CHECKPOINT_SUBDIR

    checkpoints = run_dir / CHECKPOINT_SUBDIR
    if checkpoints.is_symlink():
        raise UserError(f"--save {run_dir}: its checkpoints {checkpoints} is a symbolic link to "
                         f"{os.readlink(checkpoints)}, whose contents --overwrite does not remove; remove the link "
                         "(or what it points to) yourself, or pass another --save.")


ZOO_TAG = re.compile(r"iter_\d{7}")                        # zoo.training.checkpointer's tag names
ATOMIC_TEMPORARY = re.compile(r"\..+\.[^.]+\.tmp")          # zoo.atomic's temporary names, beside the target


def zoo_tag_file(name: str) -> bool:
    """A file zoo's save writes into a tag: DeepSpeed's model, pipeline-layer and optimizer states, and the
    completion marker (or its temporary)."""
    from zoo.checkpoint.files import COMPLETE_MARKER, MODEL_STATES_RE
    from zoo.checkpoint.zero_reshard import OPTIM_STATES_RE

    return bool(name == COMPLETE_MARKER or MODEL_STATES_RE.fullmatch(name) or OPTIM_STATES_RE.fullmatch(name)
                or re.fullmatch(r"layer_\d+-model_\d+-model_states\.pt", name)
                or (ATOMIC_TEMPORARY.fullmatch(name) and name.startswith(f".{COMPLETE_MARKER}.")))


def zoo_root_file(name: str) -> bool:
    """A file zoo's save writes beside the tags: ``latest`` (or its temporary) and DeepSpeed's recovery
    scripts."""
    from zoo.checkpoint.deepspeed_tools import RECOVERY_SCRIPTS
    from zoo.checkpoint.files import LATEST_FILE

    return (name == LATEST_FILE or name in RECOVERY_SCRIPTS
            or bool(ATOMIC_TEMPORARY.fullmatch(name) and name.startswith(f".{LATEST_FILE}.")))


def zoo_resharded_file(name: str) -> bool:
    """A file of a resharded copy (:mod:`zoo.checkpoint.reshard`): its source record and states files."""
    from zoo.checkpoint.reshard import SOURCE_RECORD

    return name == SOURCE_RECORD or (zoo_tag_file(name) and not name.startswith("."))


def _remove_files(directory: Path, is_zoos: Callable[[str], bool], prefix: str) -> list[str]:
    """Remove the regular files of ``directory`` that ``is_zoos`` names, then the directory if that emptied
    it; returns what is left (``prefix`` + name), never following a symbolic link."""
    left = []
    for entry in sorted(directory.iterdir()):
        if entry.is_file() and not entry.is_symlink() and is_zoos(entry.name):
            entry.unlink()
        else:
            left.append(prefix + entry.name)
    if not left:
        directory.rmdir()
    return left


def remove_earlier_checkpoints(root: Path) -> list[str]:
    """Remove what earlier zoo runs wrote into ``root`` (a run's ``checkpoints/``): the files zoo's saves
    write into its tags (``iter_`` and seven digits), ``latest`` and DeepSpeed's recovery scripts beside them,
    and resharded copies under ``resharded/``; a directory that this empties goes too, ``root`` included.
    Anything else (the user's files and directories, symbolic links, a file of the user's inside a tag) is
    left where it is; returns those paths relative to ``root``, sorted. Nothing is followed through a link."""
    from zoo.checkpoint.reshard import RESHARDED_SUBDIR

    left: list[str] = []
    for entry in sorted(root.iterdir()):
        if entry.is_symlink():
            left.append(entry.name)
        elif entry.is_dir() and ZOO_TAG.fullmatch(entry.name):
            left += _remove_files(entry, zoo_tag_file, f"{entry.name}/")
        elif entry.is_dir() and entry.name == RESHARDED_SUBDIR:
            left += _remove_resharded(entry)
        elif entry.is_file() and zoo_root_file(entry.name):
            entry.unlink()
        else:
            left.append(entry.name)
    if not left:
        root.rmdir()
    return left


def _remove_resharded(resharded: Path) -> list[str]:
    from zoo.checkpoint.reshard import SOURCE_RECORD

    left = []
    for copy in sorted(resharded.iterdir()):
        if copy.is_dir() and not copy.is_symlink() and (copy / SOURCE_RECORD).is_file():
            left += _remove_files(copy, zoo_resharded_file, f"{resharded.name}/{copy.name}/")
        else:
            left.append(f"{resharded.name}/{copy.name}")
    if not left:
        resharded.rmdir()
    return left


