"""World-wide collectives per iteration: what every rank of the job waits on together, counted.

A tp=2 pretraining run of two ranks counts, per iteration, the collectives issued on the host group (on a
gloo world, the world group itself): the data agreement, the stop agreement and the metrics log's
agreement. The model's own TP all-reduces run on the TP group and are not counted. docs/design-notes.md
("World-wide collectives at 1,024 ranks") states what each costs at scale.
"""

from __future__ import annotations

import inspect
import math
import os
import time

from tests.helpers.pretraining import run_config
from tests.spawn import spawn

ITERS, LOG_INTERVAL = 8, 4
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
               "all_to_all", "reduce", "gather", "scatter")


def _world_collectives_per_iteration(rank, world_size, data_path, save):
    import torch.distributed as dist

    from zoo.training import loop as loop_module
    from zoo.training.pretrain import pretrain

    os.environ["LOCAL_RANK"] = str(rank)
    events: list[str] = []

    def counted(real):
        signature = inspect.signature(real)

        def collective(*args, **kwargs):
            group = signature.bind(*args, **kwargs).arguments.get("group")
            if group is None or group == dist.group.WORLD:
                events.append(real.__name__)
            return real(*args, **kwargs)
        return collective

    for name in COLLECTIVES:
        setattr(dist, name, counted(getattr(dist, name)))
    train_step, run = loop_module.TrainingLoop.train_step, loop_module.TrainingLoop.run

    def marked_step(self, state):
        events.append("|")
        return train_step(self, state)

    def marked_run(self, state):
        started = time.monotonic()
        try:
            return run(self, state)
        finally:
            events.append(f"end {time.monotonic() - started}")

    loop_module.TrainingLoop.train_step, loop_module.TrainingLoop.run = marked_step, marked_run
    pretrain(run_config(data_path, save, 2, 2, 2, ITERS, log_interval=LOG_INTERVAL))
    marks = [i for i, event in enumerate(events) if event == "|" or event.startswith("end")]
    per_iteration = [len(events[a + 1:b]) for a, b in zip(marks, marks[1:])]
    return per_iteration, float(events[marks[-1]].split()[1])


def test_world_collectives_per_iteration(corpus_prefix, tmp_path):
    """Iterations 1 .. ITERS-1 (the last one also saves): one data agreement each, one log agreement every
    LOG_INTERVAL, and the stop agreement at most once per STOP_AGREEMENT_PERIOD_S of training (and at
    the first iteration) instead of once per iteration."""
    from zoo.training.stop_conditions import STOP_AGREEMENT_PERIOD_S

    results = spawn(_world_collectives_per_iteration, 2, corpus_prefix, str(tmp_path / "run"))
    (counts, seconds), (other, _) = results
    assert counts == other
    counted = counts[: ITERS - 1]
    logs = sum(1 for it in range(1, ITERS) if it % LOG_INTERVAL == 0)
    stop_agreements = sum(counted) - len(counted) - logs
    assert 1 <= stop_agreements <= 1 + math.ceil(seconds / STOP_AGREEMENT_PERIOD_S), (counted, seconds)
    print(f"world-wide collectives in iterations 1..{ITERS - 1}: {counted} ({seconds:.2f} s of training)")
