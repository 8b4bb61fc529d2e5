"""Preemption-safe exits through the real `deepspeed` launcher, sharing launches:

1. ``--save X --load X --exit-interval 2`` on a run with no checkpoint yet: one line says it starts
   fresh; the ranks stop after iteration 2 with a checkpoint and the launcher exits 0;
2. the same command without the exit interval, resumed, iterations slowed by a driver script: SIGTERM to
   the launcher's process group once iteration 4 is logged; every process ends, the checkpoint of the
   iteration reached is named by ``latest``, rank 0 printed where it is;
3. (one 2-process spawn) resumed to the end, next to an uninterrupted reference: losses equal <= 1e-5
   and metrics.jsonl holds each iteration exactly once; SIGUSR1 on one rank only stops both ranks at the
   same iteration with a checkpoint; ``--exit-duration-in-mins`` stops before its budget.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers.launcher_runs import SLOW_DRIVER, launcher_command, logged_iterations
from tests.helpers.pretraining import NO_DROPOUT, ds_config, run_config, train_events
from tests.spawn import spawn

REPO = Path(__file__).resolve().parent.parent
ITERS = 10


def _finish_worker(rank, world_size, data_path, root):
    import torch.distributed as dist

    from zoo.training.loop import TrainingLoop
    from zoo.training.pretrain import pretrain

    def config(save, **changes):
        return run_config(data_path, save, 2, 2, 4, train_iters=ITERS, model_overrides=dict(NO_DROPOUT), **changes)

    results = {"finish": pretrain(config(f"{root}/run", load=f"{root}/run")),
               "reference": pretrain(config(f"{root}/reference"))}
    real_step = TrainingLoop.train_step

    def signal_on_rank_1(self, state):
        if state.iteration == 1 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_step(self, state)

    TrainingLoop.train_step = signal_on_rank_1
    try:
        results["usr1"] = pretrain(config(f"{root}/usr1"))
    finally:
        TrainingLoop.train_step = real_step
    results["late"] = pretrain(config(f"{root}/late", exit_duration_in_mins=1e-6))
    return results


def test_exit_interval_sigterm_and_resume_through_the_launcher(corpus_prefix, tmp_path):
    import psutil

    config = dict(ds_config(2, 4), zoo={"tensor_parallel_size": 2, "model": "gpt2-tiny", "seq_length": 32,
                                        "train_iters": ITERS, "split": "80,20,0", "log_interval": 1,
                                        "eval_interval": 0, "save_interval": 0, "model_overrides": NO_DROPOUT})
    config_path = tmp_path / "ds.json"
    config_path.write_text(json.dumps(config))
    (tmp_path / "slow_pretrain.py").write_text(SLOW_DRIVER)
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")

    # 1. auto-resume on an empty run, --exit-interval 2
    first = subprocess.run(launcher_command("launch/pretrain.py", config_path, corpus_prefix, run, "--exit-interval", "2"),
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert first.returncode == 0, (first.stdout[-3000:], first.stderr[-3000:])
    assert f"--load {run}: no checkpoint yet, starting from iteration 0" in first.stdout
    assert f"stopped by --exit-interval 2 after iteration 2: checkpoint {run}/checkpoints/iter_0000002" in first.stdout
    assert (run / "checkpoints" / "latest").read_text() == "iter_0000002"
    assert logged_iterations(run) == [1, 2]

    # 2. resumed; SIGTERM to the launcher's whole process group mid-run
    second = subprocess.Popen(launcher_command(str(tmp_path / "slow_pretrain.py"), config_path, corpus_prefix, run),
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    deadline = time.monotonic() + 300
    while max(logged_iterations(run), default=0) < 4:
        assert second.poll() is None and time.monotonic() < deadline, second.communicate()
        time.sleep(0.05)
    processes = [psutil.Process(second.pid), *psutil.Process(second.pid).children(recursive=True)]
    sent = time.monotonic()
    os.killpg(second.pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(processes, timeout=60)
    exit_seconds = time.monotonic() - sent
    out, err = second.communicate(timeout=60)
    assert not alive, (alive, out[-3000:], err[-3000:])
    reached = max(logged_iterations(run))
    assert 4 <= reached < ITERS, (reached, out[-3000:])
    assert (run / "checkpoints" / "latest").read_text() == f"iter_{reached:07d}", err[-3000:]
    assert f"stopped by signal SIGTERM after iteration {reached}: checkpoint" in out, (out[-3000:], err[-3000:])
    print(f"SIGTERM to exit of every process: {exit_seconds:.1f} s (stopped after iteration {reached})")

    # 3. resumed to the end, the uninterrupted reference, SIGUSR1 on one rank, the time budget
    ranks = spawn(_finish_worker, 2, corpus_prefix, str(tmp_path), timeout=400)
    resumed, reference = train_events(run), train_events(tmp_path / "reference")
    assert [e["iteration"] for e in resumed] == list(range(1, ITERS + 1))
    assert [e["iteration"] for e in reference] == list(range(1, ITERS + 1))
    for a, b in zip(reference, resumed):
        for key in ("loss", "grad_norm", "lr"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(abs(a[key]), 1e-12), (key, a, b)
    assert (run / "checkpoints" / "latest").read_text() == f"iter_{ITERS:07d}"
    usr1 = [r["usr1"] for r in ranks]
    assert [r["stopped_by"] for r in usr1] == ["a signal on another rank", "signal SIGUSR1"], usr1
    assert [r["iteration"] for r in usr1] == [2, 2], usr1
    assert (tmp_path / "usr1" / "checkpoints" / "latest").read_text() == "iter_0000002"
    late = [r["late"] for r in ranks]
    assert all(r["stopped_by"] == "--exit-duration-in-mins 1e-06" and r["iteration"] == 1 for r in late), late
    assert (tmp_path / "late" / "checkpoints" / "latest").read_text() == "iter_0000001"
