"""On a GPU machine, a run never falls back to the CPU silently (issue 17 item 9)."""

import pytest


def test_gpus_with_a_cpu_accelerator_are_refused(monkeypatch):
    from zoo.distributed import check_accelerator_matches_machine

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    with pytest.raises(ValueError, match="has 2 NVIDIA GPU.* set DS_ACCELERATOR=cpu"):
        check_accelerator_matches_machine(gpus=2)


def test_the_cpu_chosen_on_purpose_or_no_gpus_passes(monkeypatch):
    from zoo.distributed import check_accelerator_matches_machine

    check_accelerator_matches_machine(gpus=0)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    check_accelerator_matches_machine(gpus=2)
