"""On a GPU machine, a run never falls back to the CPU silently: the CPU runs there only when the user
chose it (DS_ACCELERATOR=cpu)."""

import deepspeed.accelerator
import pytest

from zoo.distributed import check_accelerator_matches_machine


class _Accelerator:
    def __init__(self, name: str):
        self.name = name

    def device_name(self) -> str:
        return self.name


@pytest.mark.parametrize("gpus, ds_accelerator, chosen, refused", [
    (0, None, "cpu", False),       # no GPU: the CPU is the only choice
    (2, None, "cpu", True),        # GPUs torch cannot use: refused
    (2, "cpu", "cpu", False),      # the CPU chosen on purpose
    (2, "cuda", "cpu", True),      # another accelerator asked for, the CPU chosen anyway: refused
    (2, None, "cuda", False),      # the GPUs in use
])
def test_the_cpu_runs_on_a_gpu_machine_only_when_chosen(monkeypatch, gpus, ds_accelerator, chosen, refused):
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: _Accelerator(chosen))
    if ds_accelerator is None:
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    else:
        monkeypatch.setenv("DS_ACCELERATOR", ds_accelerator)
    try:
        check_accelerator_matches_machine(gpus=gpus)
        outcome = None
    except ValueError as err:
        outcome = str(err)
    assert (outcome is not None) == refused, outcome
    if refused:
        assert f"has {gpus} NVIDIA GPU(s)" in outcome and "set DS_ACCELERATOR=cpu" in outcome, outcome
