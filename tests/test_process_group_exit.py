"""A CLI destroys the process group it created once its work succeeded (torch warns at exit about a group
never destroyed: seen on every NCCL run of an H100), and never a group its caller made, nor after a
failure, when another rank may still wait in a collective (zoo.distributed.process_group_left_on_success)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.spawn import free_port
from zoo.distributed import process_group_left_on_success


def _join_world_of_one() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


@pytest.fixture
def no_group_left():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_group_the_command_created_is_destroyed_after_success(no_group_left):
    with process_group_left_on_success():
        _join_world_of_one()
    assert not dist.is_initialized()


def test_the_callers_group_is_left_alone(no_group_left):
    _join_world_of_one()
    with process_group_left_on_success():
        pass
    assert dist.is_initialized()


def test_nothing_is_torn_down_after_a_failure(no_group_left):
    with pytest.raises(ValueError):
        with process_group_left_on_success():
            _join_world_of_one()
            raise ValueError("a rank failed")
    assert dist.is_initialized()
