"""A Checkpointer without a process group or an engine, for tests of what it saves and restores."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tests.helpers.pretraining import run_config


def single_rank_checkpointer(tmp_path, is_writer=False, **changes):
    """The Checkpointer of a gpt2-tiny run at tp = dp = 1 saving under ``tmp_path/run``, around a stand-in
    engine whose module is one Linear; ``changes`` set RunConfig fields."""
    from zoo.config.deepspeed_dict import deepspeed_dict
    from zoo.parallel import ParallelState
    from zoo.training.checkpointer import Checkpointer

    config = run_config(str(tmp_path / "data"), str(tmp_path / "run"), 1, 1, 1, train_iters=10, **changes)
    single = ParallelState(tp_size=1, tp_rank=0, tp_group=None, dp_size=1, dp_rank=0, dp_group=None,
                           world_size=1, rank=0)
    engine = SimpleNamespace(module=torch.nn.Linear(2, 2))   # the payload names the optimizer's parameters
    return Checkpointer(engine, config, deepspeed_dict(config, 1), single, {"n_layer": 2}, is_writer)
