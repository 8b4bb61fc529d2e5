"""A stop request at any moment of a pretraining run ends it as finished or as stopped with a checkpoint.

zoo's launcher (launch/run.py) returns 0 when every rank exits cleanly without a stop report, 75 when they
exit cleanly after reporting a stop with a checkpoint (zoo.operations.launcher); a rank that dies of the
signal instead leaves its peers a gloo "Connection reset" traceback, DeepSpeed's code 241, no summary and
the run directory's ``.zoo.lock``. Two ranks (one spawn, a stop report store served as the launcher serves
it) run two pretrainings, each stop request delivered by a hook at a chosen moment, as the launcher
delivers it (SIGTERM to the rank, or the stop asked through its store and seen by the rank's launcher
watch), never by a timed race:

1. finishing: rank 1 gets SIGTERM just after the last iteration's checkpoint is written, rank 0's
   launcher watch sees the launcher's stop while the end-of-run samples are drawn. The run finishes on
   both ranks: no stop report (exit 0), the summary and the samples printed, the lock released;
2. resuming that checkpoint at another layout (dp=2 -> tp=2): rank 0 gets SIGTERM while the layout
   change reads it. Every rank stops at the first iteration boundary with a checkpoint that ``latest``
   names and reports the stop (exit 75), the writer prints where to resume, the lock is released.

And the pretraining command (launch/pretrain.py) records a stop request for its whole process: SIGTERM to it
as its run returns (a launcher's stop that comes after the run's last moment) leaves its exit code 0.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.pretraining import ds_config, run_config
from tests.spawn import spawn

PROMPTS = ["The history of"]
WATCH_FIRE_S = 30   # a bound only: the watch polls every 0.05 s


def _report_store(rank: int):
    """Rank 0 serves the launcher's store (zoo.operations.stop_report.serve) and every rank finds it in
    $ZOO_LAUNCHER_STORE, as under zoo's launcher; rank 0 gets the store."""
    import torch.distributed as dist

    from zoo.operations.stop_report import STORE_VARIABLE, serve

    store = serve() if rank == 0 else None
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)
    os.environ[STORE_VARIABLE] = f"127.0.0.1:{port[0]}"
    return store


def _run(config, sample_text=None) -> tuple[dict, str]:
    """pretrain(config) and what it printed on stdout."""
    from zoo.training.pretrain import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = pretrain(config, sample_text=sample_text)
    return result, out.getvalue()


def _worker(rank, world_size, data_path, root):
    import torch.distributed as dist

    import zoo.training.checkpointer as checkpointer_module
    from zoo.inference import sample_lines
    from zoo.operations.launcher_watch import LauncherWatch
    from zoo.operations.stop_report import REPORT_KEY, STOP_KEY, read_stop_report, request_stop
    from zoo.training.checkpointer import Checkpointer

    store = _report_store(rank)
    outcomes = {}

    # 1. finishing: SIGTERM on rank 1 just after the final checkpoint, the launcher's stop on rank 0 during samples
    watch = None
    if rank == 0:
        watch = LauncherWatch([], interval_s=0.05, link=("127.0.0.1", int(os.environ["ZOO_LAUNCHER_STORE"].split(":")[1])))
        watch.start()
    real_save = Checkpointer.save

    def save_then_sigterm(self, state):
        real_save(self, state)
        if rank == 1 and state.iteration == self.config.train_iters:
            os.kill(os.getpid(), signal.SIGTERM)

    def samples_after_the_launchers_stop(*args):
        if rank == 0:
            request_stop(store, "signal SIGTERM")     # what zoo's launcher does on SIGTERM
            deadline = time.monotonic() + WATCH_FIRE_S
            while watch.exited is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert watch.exited == "signal SIGTERM"
        return sample_lines(*args)

    Checkpointer.save = save_then_sigterm
    try:
        outcomes["finishing"] = _run(run_config(data_path, f"{root}/run", 1, 2, 4, train_iters=2,
                                                sample_prompts=list(PROMPTS)), samples_after_the_launchers_stop)
    finally:
        Checkpointer.save = real_save
    if rank == 0:
        outcomes["finishing_report"] = read_stop_report(store)
        outcomes["finishing_lock_left"] = (Path(root) / "run" / ".zoo.lock").exists()
        store.delete_key(STOP_KEY)
    dist.barrier()

    # 2. resumed at another layout: SIGTERM on rank 0 while the layout change reads the checkpoint
    real_move = checkpointer_module.load_at_new_layout

    def sigterm_then_move(*args, **kwargs):
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_move(*args, **kwargs)

    checkpointer_module.load_at_new_layout = sigterm_then_move
    try:
        outcomes["resuming"] = _run(run_config(data_path, f"{root}/run", 2, 2, 4, train_iters=6, load=f"{root}/run"))
    finally:
        checkpointer_module.load_at_new_layout = real_move
    if rank == 0:
        outcomes["resuming_report"] = read_stop_report(store)
        store.delete_key(REPORT_KEY)
    dist.barrier()
    return outcomes


def test_a_stop_request_at_any_moment_ends_finished_or_stopped_with_a_checkpoint(corpus_prefix, tmp_path):
    ranks = spawn(_worker, 2, corpus_prefix, str(tmp_path), timeout=300)
    run = tmp_path / "run"
    writer = ranks[0]

    # 1. finished on both ranks: exit 0 under zoo's launcher, the summary and the samples printed
    assert [r["finishing"][0]["stopped_by"] for r in ranks] == [None, None]
    assert [r["finishing"][0]["iteration"] for r in ranks] == [2, 2]
    assert writer["finishing_report"] is None
    assert not writer["finishing_lock_left"]
    out = writer["finishing"][1]
    assert "signal SIGTERM came after the last stop check, as the run was finishing: it finished" in out, out
    assert "done: 2 iterations" in out, out
    assert PROMPTS[0] in out, out

    # 2. stopped with a checkpoint at the first iteration boundary: exit 75 under zoo's launcher
    assert [r["resuming"][0]["stopped_by"] for r in ranks] == ["signal SIGTERM", "a signal on another rank"]
    assert [r["resuming"][0]["iteration"] for r in ranks] == [3, 3]
    report = writer["resuming_report"]     # every rank reports; the launcher reads the last one written
    assert report is not None and report["iteration"] == 3, report
    out = writer["resuming"][1]
    assert "resumed from iter_0000002 (iteration 2, 8 samples consumed) at tp1×pp1×dp2 → tp2×pp1×dp1" in out, out
    assert f"stopped by signal SIGTERM after iteration 3: checkpoint {run}/checkpoints/iter_0000003" in out, out
    assert (run / "checkpoints" / "latest").read_text() == "iter_0000003"

    assert not (run / ".zoo.lock").exists()


LATE_SIGNAL_DRIVER = """
import os, signal, sys
import zoo.training.pretrain

def run_then_sigterm(config, *args):
    os.kill(os.getpid(), signal.SIGTERM)   # the stop request that comes as the run returns
    print("the run returned", flush=True)

zoo.training.pretrain.pretrain = run_then_sigterm
from zoo.cli.pretrain import main
main(sys.argv[1:])
"""


def test_the_pretraining_command_outlives_a_stop_request_after_its_run(corpus_prefix, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(dict(ds_config(2, 2), zoo={"model": "gpt2-tiny", "seq_length": 32, "train_iters": 2,
                                                             "split": "80,20,0", "model_overrides": {"n_layer": 1}})))
    (tmp_path / "driver.py").write_text(LATE_SIGNAL_DRIVER)
    done = subprocess.run([sys.executable, str(tmp_path / "driver.py"), "--deepspeed_config", str(config),
                           "--data-path", corpus_prefix, "--save", str(tmp_path / "run")],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert (done.returncode, done.stdout.strip().splitlines()[-1:]) == (0, ["the run returned"]), done.stderr[-3000:]
