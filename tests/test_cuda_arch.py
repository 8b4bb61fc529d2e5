"""TORCH_CUDA_ARCH_LIST with architecture variants (``9.0a``) reaches DeepSpeed's op builder in a form it
parses (CUDA images for H100 set ``9.0a``, on which FusedAdam's build dies at ``int('0a')``)."""

from __future__ import annotations

import pytest

from zoo.operations.cuda_arch import fit_cuda_arch_list_for_deepspeed, parsable_arch_list


@pytest.mark.parametrize("value, expected", [
    ("9.0a", "9.0"),
    ("8.0;9.0a;10.0f+PTX", "8.0;9.0;10.0+PTX"),
    ("9.0 9.0a", "9.0"),
    ("7.0;8.6+PTX", "7.0;8.6+PTX"),
])
def test_variants_are_dropped_and_plain_entries_kept(value, expected):
    assert parsable_arch_list(value) == expected


def test_the_environment_is_rewritten_once_with_a_warning(capsys):
    environ = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    warning = fit_cuda_arch_list_for_deepspeed(environ)
    assert environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert "'9.0a'" in warning and "'9.0'" in warning and capsys.readouterr().err.count("\n") == 1
    assert fit_cuda_arch_list_for_deepspeed(environ) is None


@pytest.mark.parametrize("environ", [{}, {"TORCH_CUDA_ARCH_LIST": ""}, {"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}])
def test_a_list_deepspeed_parses_is_left_alone(environ, capsys):
    before = dict(environ)
    assert fit_cuda_arch_list_for_deepspeed(environ) is None
    assert environ == before and capsys.readouterr().err == ""


@pytest.mark.parametrize("value", ["9.0a", "8.0;9.0a;10.0f+PTX"])
def test_deepspeeds_own_builder_fails_on_the_variant_and_builds_the_fitted_list(value, monkeypatch):
    """DeepSpeed's CUDA FusedAdam builder computes its -gencode flags from the variable without a GPU
    (its cross-compile path parses the entries exactly as its JIT path does)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = False
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    with pytest.raises(ValueError, match="invalid literal for int"):
        builder.compute_capability_args()
    fit_cuda_arch_list_for_deepspeed()
    assert "-gencode=arch=compute_90,code=sm_90" in builder.compute_capability_args()
