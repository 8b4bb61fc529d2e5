"""Shared test helpers: counting collectives, asserting named per-rank check results, the error
measures every parity test uses, and loading a launch/ script and reading a CLI's one error line.

Tolerances and rounding. A parity test is about correctness, so its verdict must not depend on the
rounding of one CPU's kernels (BLAS blocking, vector width, thread count). Two measures keep it so:

- ``rel_err`` (max|a - b| / max|b|) for quantities whose size is set by the tensor itself (outputs,
  losses, the gradients of a float64 run, where rounding is ~1e-16 and 1e-9 is a bug-only margin);
- ``layer_scaled_grad_errors`` for float32 gradients: a gradient that is small because its terms
  cancel (a query bias read through softmax) keeps the rounding noise of those terms, which is set by
  the largest gradient of its layer, not by its own size. Its error is therefore measured against that
  scale; its own relative error is checked in float64 instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from pathlib import Path

import torch
import torch.distributed as dist


@contextlib.contextmanager
def record_collectives():
    """Within the block, record every torch.distributed all_reduce / all_gather as
    (name, elements moved, op), where op is "MAX", "SUM" or "" (all_gather)."""
    calls: list[tuple[str, int, str]] = []
    real_all_reduce, real_all_gather = dist.all_reduce, dist.all_gather

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        kind = "MAX" if op == dist.ReduceOp.MAX else "SUM" if op == dist.ReduceOp.SUM else str(op)
        calls.append(("all_reduce", tensor.numel(), kind))
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def counting_all_gather(tensor_list, tensor, group=None, async_op=False):
        calls.append(("all_gather", tensor.numel() * len(tensor_list), ""))
        return real_all_gather(tensor_list, tensor, group=group, async_op=async_op)

    dist.all_reduce, dist.all_gather = counting_all_reduce, counting_all_gather
    try:
        yield calls
    finally:
        dist.all_reduce, dist.all_gather = real_all_reduce, real_all_gather


def failed_checks(results: dict[str, bool | float], tol: float, prefix: str = "") -> list[tuple[str, object, float]]:
    """The entries of one rank's {check name: bool or relative error} (those whose name starts with
    ``prefix``) that fail: False, or an error above ``tol`` (NaN included), as (name, value, tol)."""
    return [(name, value, tol) for name, value in results.items() if name.startswith(prefix)
            and not (value if isinstance(value, bool) else value <= tol)]


def assert_named_checks(results_by_tp: dict, tp: int, prefix: str, tol: float) -> None:
    """``results_by_tp[tp]`` is a list (one per rank) of {check name: bool or relative error}; every check
    whose name starts with ``prefix`` must be True or have an error <= ``tol``. A failure arrives as
    pytest's diff of the failing (tp, rank, name, value, tol) against []."""
    ranks = results_by_tp[tp]
    assert any(name.startswith(prefix) for results in ranks for name in results), f"no check named {prefix}*"
    failing = [(tp, rank, *failure) for rank, results in enumerate(ranks)
               for failure in failed_checks(results, tol, prefix)]
    assert failing == [], f"failing (tp, rank, name, value, tol): {failing}"


def rel_err(actual: torch.Tensor | float, expected: torch.Tensor | float) -> float:
    """max|actual - expected| / max|expected|, computed in float64 (tensors or plain numbers)."""
    actual = torch.as_tensor(actual, dtype=torch.float64).detach()
    expected = torch.as_tensor(expected, dtype=torch.float64).detach()
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1e-300)).item()


def layer_of(name: str) -> str:
    """The layer an (HF-named) parameter belongs to: its transformer block (``bert.encoder.layer.3``,
    ``transformer.h.3``), else the top module below the model (``bert.embeddings``, ``cls.predictions``,
    ``transformer.wte``, ``classifier``)."""
    block = re.match(r"(.*?\.(?:layer|h)\.\d+)\.", name)
    parts = name.split(".")
    return block.group(1) if block else ".".join(parts[:min(2, len(parts) - 1)])


def layer_scales(ref_grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """{parameter name: the largest |reference gradient| among the parameters of its layer}."""
    largest: dict[str, float] = {}
    for name, grad in ref_grads.items():
        layer = layer_of(name)
        largest[layer] = max(largest.get(layer, 0.0), grad.detach().abs().max().item())
    return {name: largest[layer_of(name)] for name in ref_grads}


def layer_scaled_grad_errors(grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """{"grad32:<name>": max|g - g_ref| / (largest |g_ref| of the parameter's layer)} -- the float32
    gradient measure (see the module docstring)."""
    scales = layer_scales(ref_grads)
    return {f"grad32:{name}": (grads[name].detach().double() - ref.detach().double()).abs().max().item()
            / max(scales[name], 1e-300) for name, ref in ref_grads.items()}


def float64_grad_errors(grads: dict[str, torch.Tensor], ref_grads: dict[str, torch.Tensor],
                        analytically_zero: tuple[str, ...] = ()) -> dict[str, float]:
    """{"grad64:<name>": relative error} of float64 gradients. A gradient that is zero in exact arithmetic
    (names ending in ``analytically_zero``) holds rounding noise only on both sides: its entry is its
    largest magnitude against the largest gradient of the model instead."""
    largest = max(g.detach().abs().max().item() for g in ref_grads.values())
    errors = {}
    for name, ref in ref_grads.items():
        if name.endswith(analytically_zero):
            errors[f"grad64:{name}"] = max(grads[name].abs().max().item(), ref.abs().max().item()) / largest
        else:
            errors[f"grad64:{name}"] = rel_err(grads[name], ref)
    return errors


def decision_margin(logits: torch.Tensor, index: torch.Tensor | None = None) -> float:
    """How firmly rows of logits decide "is ``index`` the arg-max?" (``index`` None: each row's arg-max):
    min over rows of |z[index] - max_{v != index} z_v|, relative to max|logits|. A token id or an accuracy
    compared for exact equality is immune to rounding when this margin is well above the logits'
    tolerance; a test asserts it of its reference data, so a near-tie fails as bad data, not as a bug."""
    z = logits.detach().double().reshape(-1, logits.shape[-1])
    index = z.argmax(-1) if index is None else index.reshape(-1).to(z.device)
    chosen = z.gather(-1, index[:, None]).squeeze(-1)
    others = z.scatter(-1, index[:, None], float("-inf")).max(-1).values
    return ((chosen - others).abs().min() / z.abs().max()).item()


FP64_TOL = 1e-9   # float64 runs: rounding is ~1e-16 relative, so anything above 1e-9 is a real difference


def tolerance_failures(errors: dict[str, float], fp32_tol: float,
                       fp64_tol: float = FP64_TOL) -> list[tuple[str, float, float]]:
    """The entries of {name: error} above their tolerance, as (name, error, tolerance): ``fp64_tol`` for
    float64 entries (a name whose tag before ':' ends in "64", e.g. "grad64:..." or "logits64:"),
    ``fp32_tol`` for the rest. A NaN error fails."""
    failures = []
    for name, error in errors.items():
        tol = fp64_tol if name.split(":", 1)[0].endswith("64") else fp32_tol
        if not error <= tol:
            failures.append((name, error, tol))
    return failures


REPO = Path(__file__).resolve().parent.parent


def launch_script(name: str):
    """``launch/<name>.py`` as a module (its ``main`` runs in the test process)."""
    spec = importlib.util.spec_from_file_location(f"launch_{name}", REPO / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_error_line(capsys, from_zoo: bool = False) -> str:
    """The CLI's stderr ends in exactly one ``error: ...`` sentence; ``from_zoo``: raised by zoo's own checks
    (the line names no library location)."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == err[-1], err
    assert errors[0].endswith("."), errors[0]
    assert not from_zoo or "raised in" not in errors[0], errors[0]
    return errors[0]
