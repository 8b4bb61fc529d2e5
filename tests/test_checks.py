"""The shared check helpers report every failing entry with its value and tolerance, not a bare False."""

from __future__ import annotations

import math

import pytest
import torch

from tests.checks import assert_named_checks, failed_checks, rel_err, tolerance_failures


def test_named_checks_fail_as_a_list_of_the_failing_entries():
    results = {2: [{"fwd:out": 1e-7, "fwd:ok": True}, {"fwd:out": 3e-4, "fwd:ok": False, "bwd:out": 1.0}]}
    assert_named_checks(results, 2, "bwd", 2.0)
    with pytest.raises(AssertionError) as caught:
        assert_named_checks(results, 2, "fwd", 1e-5)
    assert "(2, 1, 'fwd:out', 0.0003, 1e-05)" in str(caught.value), caught.value
    assert "(2, 1, 'fwd:ok', False, 1e-05)" in str(caught.value), caught.value
    assert [name for name, _, _ in failed_checks({"x": math.nan, "y": 0.5}, 1.0)] == ["x"]


def test_tolerance_failures_name_value_and_tolerance():
    assert tolerance_failures({"grad64:w": 2e-9, "grad32:w": 2e-6, "loss": 1e-6}, 1e-5) == [("grad64:w", 2e-9, 1e-9)]


def test_rel_err_takes_tensors_and_numbers():
    assert rel_err(torch.tensor([1.0, 2.2], dtype=torch.float64), torch.tensor([1.0, 2.0])) == pytest.approx(0.1, rel=1e-12)
    assert rel_err(3.3, 3.0) == pytest.approx(0.1, rel=1e-12)
