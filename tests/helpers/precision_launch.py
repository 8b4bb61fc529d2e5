"""The one 2-rank spawn that tests/test_layout_change_precisions.py and tests/test_offline_reshard.py both check,
run once per session whichever module asks first: their bf16 + ZeRO-1 tp1 x pp2 source run and its on-resume
move to tp2 x pp1 are the same runs (the same config, corpus and seed), so they are trained once.

In the spawn's root:
  <source> and <source>-saved     every source of ``SOURCES`` (4 iterations; its iteration-2 checkpoint alone as
                                  a run directory of its own);
  <move>                          every move of ``MOVES``, resumed from ``<source>-saved``, ``ON_RESUME`` from
                                  ``source`` (the same checkpoint);
  source                          the bf16 source run directory with only its iteration-2 checkpoint (what
                                  launch/reshard.py converts; ``ON_RESUME`` is its on-resume move);
  source-tp2pp1dp1                that checkpoint converted offline to tp2 x pp1 (the default output), resumed;
  one-stage-on-resume / -converted  the converted run's iteration-4 checkpoint moved to tp1 x dp2 on resume and
                                  converted offline then resumed.
Each rank returns {"moved": {move: state after the load}, "offline": what test_offline_reshard checks}; a state is
what :func:`tests.helpers.layout_change_runs.engine_state` reads.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

from tests.helpers.layout_change_runs import ITERS, SAVED_AT, engine_state, precision_run_config

SOURCES = {"bf16-tp1-pp2": (1, 2, "bf16"), "fp16u-tp2": (2, 1, "fp16u"), "fp16f-tp2": (2, 1, "fp16f")}
MOVES = {"bf16-to-tp2": ("bf16-tp1-pp2", 2, 1), "bf16-to-dp2": ("bf16-tp1-pp2", 1, 1),
         "fp16u-to-pp2": ("fp16u-tp2", 1, 2), "fp16f-to-pp2": ("fp16f-tp2", 1, 2)}
OFFLINE_SOURCE = "bf16-tp1-pp2"     # the run launch/reshard.py converts (tp1 x pp2, bf16)
ON_RESUME = "bf16-to-tp2"           # its on-resume move to tp2 x pp1, the conversion's reference
NEW_TP, NEW_PP = 2, 1


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory``: (size, mtime in ns)."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _iteration_2_run(run: Path, copy: Path, whole_run: bool) -> None:
    """``run``'s iteration-2 checkpoint as the latest of the run directory ``copy``: the checkpoint alone, or
    (``whole_run``) the whole run directory without its later tags."""
    tag = f"iter_{SAVED_AT:07d}"
    if whole_run:
        shutil.copytree(run, copy)
        for later in (copy / "checkpoints").glob("iter_*"):
            if later.name != tag:
                shutil.rmtree(later)
    else:
        shutil.copytree(run / "checkpoints" / tag, copy / "checkpoints" / tag)
    (copy / "checkpoints" / "latest").write_text(tag)


def _runs(rank, world_size, data, root):
    os.environ["LOCAL_RANK"] = str(rank)
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from zoo.training import checkpointer
    from zoo.training.offline_reshard import convert_checkpoint, plan_conversion
    from zoo.training.pretrain import pretrain

    # This CPU has no native fp16: DeepSpeed refuses fp16 by a capability check although torch computes it;
    # overriding the check runs DeepSpeed's real fp16 optimizers (DESIGN.md, "fp16 on CPU"). A bf16 run does not
    # consult it (it only adds float16 to the accelerator's supported dtypes).
    get_accelerator().is_fp16_supported = lambda: True
    root = Path(root)
    for name, (tp, pp, precision) in SOURCES.items():
        pretrain(precision_run_config(data, str(root / name), tp, pp, precision))
        if rank == 0:
            _iteration_2_run(root / name, root / f"{name}-saved", whole_run=False)
            if name == OFFLINE_SOURCE:
                _iteration_2_run(root / name, root / "source", whole_run=True)
        dist.barrier()
    before = snapshot(root / "source")
    original_load, loaded = checkpointer.Checkpointer.load, {}

    def load_and_record(self, load, *args, **kwargs):
        client = original_load(self, load, *args, **kwargs)
        loaded[self.config.save] = (engine_state(self.engine), "resharded_from" in client)
        return client

    checkpointer.Checkpointer.load = load_and_record   # this rank's process ends with the spawn
    for name, (source, tp, pp) in MOVES.items():
        precision = SOURCES[source][2]
        load = root / ("source" if name == ON_RESUME else f"{source}-saved")   # the same iteration-2 checkpoint
        pretrain(precision_run_config(data, str(root / name), tp, pp, precision, load=str(load)))
    return {"moved": {name: loaded[str(root / name)][0] for name in MOVES},
            "offline": _offline(data, root, loaded, before, world_size, convert_checkpoint, plan_conversion, pretrain)}


def _offline(data, root: Path, loaded: dict, before: dict, world_size: int, convert_checkpoint, plan_conversion,
             pretrain) -> dict:
    """launch/reshard.py's conversion of ``root/source`` to tp2 x pp1 resumed, then one stage on both sides."""
    plan = plan_conversion(str(root / "source"), NEW_TP, NEW_PP, None, None, None, None, world_size)
    record = convert_checkpoint(plan)
    converted = root / "source-tp2pp1dp1"
    written = {"latest": (converted / "checkpoints" / "latest").read_text().strip(),
               "files": sorted(p.name for p in (converted / "checkpoints" / "iter_0000002").iterdir())}
    pretrain(precision_run_config(data, str(converted), NEW_TP, NEW_PP, "bf16", load=str(converted)))
    # one stage on both sides, tp2 x dp1 -> tp1 x dp2: the offline tool against the on-resume move
    one_stage = {}
    for name in ("one-stage-on-resume", "one-stage-converted"):
        out = root / name
        if name == "one-stage-converted":
            convert_checkpoint(plan_conversion(str(converted), 1, 1, 2, None, None, str(out), world_size))
        load = out if name == "one-stage-converted" else converted
        cfg = precision_run_config(data, str(out), 1, 1, "bf16", load=str(load))
        cfg.train_iters = ITERS + 1
        pretrain(cfg)
        one_stage[name] = loaded[str(out)]
    return {"one_stage": one_stage, "on_resume": loaded[str(root / ON_RESUME)], "converted": loaded[str(converted)],
            "record": record, "output": str(plan.output), "written": written,
            "source_unchanged": snapshot(root / "source") == before}


def precision_runs(factory) -> tuple[Path, list[dict]]:
    """(root, per-rank results) of the one spawn, run once per session (keyed by the session's base temporary
    directory); a failed spawn fails every test that asks, as itself."""
    outcome = _runs_once(str(factory.getbasetemp()))
    if isinstance(outcome, AssertionError):
        raise outcome
    return outcome


@functools.cache
def _runs_once(basetemp: str) -> tuple[Path, list[dict]] | AssertionError:
    """The spawn's result, or its failure (returned, so that a second module asking sees the same failure instead
    of spawning into the directory the failed spawn left)."""
    from tests.helpers.random_corpus import make_corpus
    from tests.spawn import spawn

    try:
        root = Path(basetemp) / "precision_runs"
        root.mkdir()
        corpus = make_corpus(root / "random")
        return root, spawn(_runs, 2, corpus, str(root), timeout=480)
    except AssertionError as failure:
        return failure
