"""Reading DeepSpeed ``.pt`` files without running code from them.

``torch.load`` with ``weights_only=False`` unpickles whatever a file names: a states file carrying an
object whose ``__reduce__`` calls ``os.system`` runs that command on the machine that reads it.
Checkpoints are downloaded and shared, so every zoo read of a ``.pt`` goes through
:func:`safe_torch_load`: torch's weights-only unpickler, which builds tensors, containers and
primitive values and, beyond those, only the classes and functions of :func:`checkpoint_globals`.

Those are exactly the non-tensor types that DeepSpeed 0.19 and zoo's pretraining write into a
checkpoint (found by scanning real GPT-2 and BERT checkpoints at tp = 2, ZeRO-1/2, bf16 with and
without ZeRO, and fp16 with and without ZeRO with ``torch.serialization.get_unsafe_globals_in_checkpoint``):

* DeepSpeed's loss scalers (``LossScaler``, ``DynamicLossScaler``; plain attribute bags), its
  ``ZeroStageEnum`` and the ``fragment_address`` dataclass of ZeRO's ``param_slice_mappings``;
* numpy's array reconstruction, for the numpy RNG state of zoo's client state (a uint32 array), under
  numpy 2's module name and numpy 1's (``numpy.core``), so checkpoints written with either load.

The weights-only unpickler does run code of these: a REDUCE calls an allowed class or function with
arguments from the file, a NEWOBJ calls its ``__new__``, and a BUILD calls its ``__setstate__`` if it has
one, else updates its ``__dict__`` (and ``setattr``s slot state). Every argument and state is itself built
by the same unpickler, so it holds only tensors, primitives, containers and these types. Constructing
each with any such values is harmless:

* the loss scalers' ``__init__`` only stores its arguments as attributes (no I/O, no logging, no
  collective), and they have no ``__setstate__``;
* ``ZeroStageEnum(value)`` only looks the value up among its members (an unknown one raises ValueError);
* ``fragment_address`` is a plain dataclass: its ``__init__`` stores ``numel`` and ``start``;
* ``_reconstruct(subtype, shape, dtype)`` makes an empty array of an ndarray subtype (any other class
  raises TypeError), ``np.dtype(...)`` parses a type description, and their ``__setstate__`` (numpy's C
  code) only sets the shape, the byte order and copies the data bytes; an object-dtype array can hold
  only objects this unpickler built.

A file can thus set odd attributes or ask for a large array (a memory error, not code), never call
anything outside this list. Anything else in a file is refused with one sentence naming the file and
the global, before anything of it is built.

DeepSpeed's own ``engine.load_checkpoint`` unpickles with ``weights_only=False`` (its
``TorchCheckpointEngine.load``) and takes no option to change that. :func:`check_tag_files` loads every
``.pt`` of a tag this way first, so a file that would run code never reaches it; and around the load
itself, :func:`weights_only_loads` puts this loader in place of the engine's checkpoint engine's ``load``
(every file DeepSpeed reads goes through it), so a file swapped after the check is refused as well.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zoo.errors import UserError

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:   # numpy 1.x
    from numpy.core.multiarray import _reconstruct

__all__ = ["UnsafeCheckpointError", "checkpoint_globals", "safe_torch_load", "check_tag_files", "refused_global",
           "weights_only_loads"]

# "Unsupported global: GLOBAL x.y was not an allowed global ..." or "Trying to load unsupported GLOBAL posix.system
# whose module posix is blocked" (torch's weights-only unpickler, in its versions' wordings)
_REFUSED_GLOBAL = re.compile(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL|but got) <?(?:class )?'?([\w.]+)",
                             re.IGNORECASE)
# what the weights-only unpickler says when it refuses to build something a file names
_REFUSAL = re.compile(r"WeightsUnpickler error|unsupported (?:global|operand|class)|is blocked", re.IGNORECASE)
# torch's preamble to every weights-only failure, whose advice (load with weights_only=False) is the unsafe step
_TORCH_ADVICE = "Weights only load failed"


class UnsafeCheckpointError(UserError):
    """A checkpoint file names a global outside :func:`checkpoint_globals` (it could run code when loaded)."""


def checkpoint_globals() -> list:
    """The classes and functions, beyond torch's defaults, that a zoo DeepSpeed checkpoint may name.

    Built on each call (no module-level state) and passed to ``torch.serialization.safe_globals`` for
    the one load, so zoo never widens the allow-list of other ``torch.load`` calls in the process."""
    # local: DeepSpeed costs seconds to import; only reading a checkpoint needs its classes
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum  # local: DeepSpeed import cost
    from deepspeed.utils.tensor_fragment import fragment_address  # local: DeepSpeed import cost

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address,
            np.ndarray, np.dtype, type(np.dtype(np.uint32)),
            (_reconstruct, "numpy._core.multiarray._reconstruct"),
            (_reconstruct, "numpy.core.multiarray._reconstruct")]


def refused_global(err: BaseException, path: Path) -> str:
    """The global the weights-only unpickler refused in ``path``: from its message, else from torch's scan of
    a zip-format file, else from a scan of a plain pickle's opcodes (the unpickler may stop at an opcode it
    does not take before it reaches the global)."""
    match = _REFUSED_GLOBAL.search(str(err))
    if match:
        return match.group(1)
    try:
        allowed = {name if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"
                   for entry in checkpoint_globals() for name in ([entry[1]] if isinstance(entry, tuple) else [None])}
        if zipfile.is_zipfile(path):
            found = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        else:
            from torch._weights_only_unpickler import _get_allowed_globals  # local: only a refusal needs it

            found = [name for name in pickled_globals(path) if name not in _get_allowed_globals()]
        # torch's own functions (a tensor pickled outside torch.save) come after the others: they run no user code
        names = sorted((name for name in found if name not in allowed), key=lambda name: name.startswith("torch."))
    except Exception:  # noqa: BLE001 - the scan is only to name the global; the file is refused either way
        names = []
    return names[0] if names else "an object the weights-only unpickler cannot build"


def pickled_globals(path: Path) -> list[str]:
    """The ``module.name`` of every global a plain pickle file names, read from its opcodes (nothing of it is
    built): GLOBAL carries the name, STACK_GLOBAL takes the two strings pushed before it."""
    import pickletools  # local: only a refused file is scanned

    names, strings = [], []
    with open(path, "rb") as handle:
        for opcode, argument, _ in pickletools.genops(handle):
            if opcode.name == "GLOBAL":
                names.append(argument.replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(argument, str) and "UNICODE" in opcode.name:
                strings.append(argument)
    return names


def is_pickle_stream(path: Path) -> bool:
    """Whether ``path`` parses as a plain pickle to its STOP opcode (nothing of it is built): a file that does not
    is a foreign or damaged file, whatever opcode the unpickler stopped at, not one that names code."""
    import pickletools  # local: only a refused file is checked

    try:
        with open(path, "rb") as handle:
            for opcode, _, _ in pickletools.genops(handle):
                if opcode.name == "STOP":
                    return True
    except Exception:  # noqa: BLE001 - any parse failure means the bytes are no pickle
        return False
    return False


def is_refused_global(err: BaseException) -> bool:
    """``err`` is the weights-only unpickler refusing something the file names (a global, an opcode, a
    reduce call), not a truncated or foreign file."""
    return bool(_REFUSAL.search(str(err)))


def weights_only_load(path: Path, mmap: bool, map_location: Any) -> Any:
    """``torch.load`` with the weights-only unpickler, memory-mapped when ``mmap`` and the file is in torch's zip
    format. The file is opened once in that common case: torch itself refuses to memory-map the older
    plain-pickle format, and only then is the file read again, whole."""
    if mmap:
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap can only be used" not in str(err):
                raise
    return torch.load(path, map_location=map_location, weights_only=True, mmap=False)


def safe_torch_load(path: str | Path, mmap: bool = True, map_location: Any = "cpu") -> Any:
    """``torch.load(path)`` (on the CPU by default) with the weights-only unpickler and :func:`checkpoint_globals`.

    Raises :class:`UnsafeCheckpointError` (a UserError) naming the file and the refused global when the
    file names anything else; other read errors (truncated file, not a torch file) propagate as torch
    raises them, for the caller's own sentence. ``mmap`` applies to torch's zip format only: a file in the
    older plain-pickle format is read whole, through the same unpickler, so what it names is judged too."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(checkpoint_globals()):
            return weights_only_load(path, mmap, map_location)
    except pickle.UnpicklingError as err:
        if not is_refused_global(err) or not (zipfile.is_zipfile(path) or is_pickle_stream(path)):
            raise
        raise UnsafeCheckpointError(
            f"{path} holds the pickled global {refused_global(err, path)}, code that loading the file would run; "
            "zoo refused the file and ran none of it: load only checkpoints written by zoo's pretrain from a source "
            "you trust, or an exported safetensors directory.") from None


def check_tag_files(tag_dir: str | Path, rank: int = 0, world_size: int = 1) -> None:
    """Load every ``.pt`` file of checkpoint ``tag_dir`` (this rank's share: the files at positions
    ``rank``, ``rank + world_size``, ... in name order) with :func:`safe_torch_load`, memory-mapped (the
    tensors are not read), so that no file of the tag reaches an unpickler that could run code from it.
    A file that does not load this way is refused: one sentence naming it."""
    files = sorted(Path(tag_dir).glob("*.pt"))
    for path in files[rank::world_size]:
        try:
            safe_torch_load(path)
        except UnsafeCheckpointError as err:
            raise UserError(str(err)) from None   # a user error: ranks agree on it by its kind
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
            text = [line for line in str(err).strip().splitlines() if line.strip() and _TORCH_ADVICE not in line]
            raise UserError(f"{path} cannot be read as a torch checkpoint ({text[0] if text else type(err).__name__});"
                             " it is truncated or not a DeepSpeed states file, copy the complete checkpoint tag or "
                             "re-save it.") from None


class WeightsOnlyLoads:
    """A DeepSpeed checkpoint engine whose ``load`` is :func:`safe_torch_load` (``map_location`` honoured,
    no memory map, as DeepSpeed's own load); everything else is the wrapped engine's."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load(self, path, map_location=None):
        try:
            return safe_torch_load(path, mmap=False, map_location=map_location)
        except UnsafeCheckpointError as err:
            raise UserError(str(err)) from None   # a user error: ranks agree on it by its kind


@contextmanager
def weights_only_loads(engine):
    """Within the block, every file DeepSpeed's ``engine`` loads (``engine.load_checkpoint``: model states,
    ZeRO/BF16 partitions) is read by the weights-only unpickler; the engine's checkpoint engine is restored
    after."""
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = WeightsOnlyLoads(inner)
    try:
        yield engine
    finally:
        engine.checkpoint_engine = inner
