"""``TORCH_CUDA_ARCH_LIST`` in the form DeepSpeed's op builder can parse.

DeepSpeed 0.19 JIT-builds FusedAdam (the ``AdamW`` of every GPU config) on the first engine, and its
builder parses each entry of ``TORCH_CUDA_ARCH_LIST`` as ``major.minor[+PTX]`` with ``int()``. PyTorch
also accepts architecture variants such as ``9.0a`` (Hopper's wgmma) or ``10.0f``, and CUDA images for
Hopper set them; DeepSpeed then dies with ``invalid literal for int() with base 10: '0a'`` before it
compiles anything (torch 2.11 CUDA images for H100; deepspeedai/DeepSpeed#8619 is the open fix). The
plain architecture runs the same kernels: FusedAdam uses no variant-only instruction. So the variant
letters are dropped for this process, with one warning, before DeepSpeed reads the variable.
"""

from __future__ import annotations

import os
import re
import sys

_ENTRY = re.compile(r"^(?P<major>\d+)\.(?P<minor>\d+)(?P<variant>[a-zA-Z]*)(?P<ptx>\+PTX)?$")


def parsable_arch_list(value: str) -> str:
    """``value`` with variant letters dropped from every ``major.minorX[+PTX]`` entry (duplicates once,
    first kept); entries of any other form are left for DeepSpeed to judge."""
    entries: list[str] = []
    for entry in (part.strip() for part in value.replace(" ", ";").split(";")):
        if not entry:
            continue
        match = _ENTRY.match(entry)
        plain = f"{match['major']}.{match['minor']}{match['ptx'] or ''}" if match else entry
        if plain not in entries:
            entries.append(plain)
    return ";".join(entries)


def fit_cuda_arch_list_for_deepspeed(environ=None) -> str | None:
    """Rewrite ``TORCH_CUDA_ARCH_LIST`` in ``environ`` (default: this process's) if DeepSpeed could not
    parse it; returns the warning printed, or None when nothing changed."""
    environ = os.environ if environ is None else environ
    value = environ.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return None
    fitted = parsable_arch_list(value)
    if fitted == ";".join(part.strip() for part in value.replace(" ", ";").split(";") if part.strip()):
        return None
    environ["TORCH_CUDA_ARCH_LIST"] = fitted
    warning = (f"warning: TORCH_CUDA_ARCH_LIST={value!r} has architecture variants DeepSpeed's op builder cannot "
               f"parse; building its ops for {fitted!r} instead (the same kernels run).")
    print(warning, file=sys.stderr, flush=True)
    return warning
