"""Multi-node launches through pdsh stop as single-node ones do, proven on loopback.

Two "nodes" (:mod:`tests.fake_nodes`: real pdsh, an sshd-like ``ssh``, the per-node launchers in new
sessions outside the runner's process tree, one shared run directory) run a tp=2 pretraining, one rank
per node, through DeepSpeed's pdsh runner. Once iteration 3 is logged:

a. SIGTERM to the ``deepspeed`` runner: the runner kills pdsh, so the ranks' stdout and stderr break;
   the ranks stop with a checkpoint that ``latest`` names, and no process of the job is left;
b. ``kill -9`` of the runner: the ranks on the runner's node see it go, every rank stops with a
   checkpoint, and no process of the job is left within 30 s;
c. SIGTERM to zoo's launcher (``launch/run.py``) running the pdsh job: it returns 75 once ``latest``
   names the stop's checkpoint, without DeepSpeed's ``pkill -f`` kill command: another job's DeepSpeed
   launcher on a node (a bystander with the same command line) survives;
d. launch/slurm_pretrain.sbatch's per-node command on both nodes, SIGTERM to every process of the step
   as SLURM's preemption sends it, and SLURM's end of the step (every process left is killed when a
   task's main process exits non-zero, or once all have exited): each task returns 75 after its ranks'
   clean stop, so SLURM kills nothing, and ``latest`` names the stop's checkpoint.

Skipped, with the reason, where pdsh is not installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.fake_nodes import NODES, PDSH, Nodes, start_nodes
from tests.helpers.pretraining import NO_DROPOUT, ds_config
from tests.spawn import free_port

pytestmark = pytest.mark.skipif(PDSH is None, reason="pdsh is not installed (Debian/Ubuntu: apt-get install pdsh)")

REPO = Path(__file__).resolve().parent.parent
ITERS = 100_000             # never reached: every case stops the run
SIGNAL_AT = 3               # the iteration logged before the signal
BOUND_S = 30                # the bound: nothing of the job alive 30 s after the signal
STOPPED_AND_CHECKPOINTED = 75
SBATCH = REPO / "launch" / "slurm_pretrain.sbatch"


@dataclass
class Outcome:
    """How a case ended: the exit codes of the processes a user or SLURM started, what ``latest`` names
    (None: no checkpoint), the processes of the job still alive ``BOUND_S`` after the signal (what SLURM
    killed, for the SLURM case), the last logged iteration and the tail of the output."""

    codes: list[int | None]
    latest: str | None
    alive: list[str]
    reached: int
    output: str = ""
    complete: dict[str, bool] = field(default_factory=dict)


def _config(root: Path) -> Path:
    config = dict(ds_config(2, 2), zoo={"tensor_parallel_size": 2, "model": "gpt2-tiny", "seq_length": 32,
                                        "train_iters": ITERS, "split": "80,20,0", "log_interval": 1,
                                        "eval_interval": 0, "save_interval": 0, "data_workers": 1,
                                        "model_overrides": NO_DROPOUT})
    config["scheduler"]["params"]["total_num_steps"] = ITERS
    path = root / "ds.json"
    path.write_text(json.dumps(config))
    return path


def _logged(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line)["iteration"] for line in path.read_text().splitlines() if line.endswith("}")),
               default=0)


def _latest(run: Path) -> str | None:
    path = run / "checkpoints" / "latest"
    return path.read_text().strip() if path.exists() else None


def _complete_tags(run: Path) -> dict[str, bool]:
    from zoo.checkpoint.files import tags_in

    checkpoints = run / "checkpoints"
    complete = tags_in(checkpoints) if checkpoints.is_dir() else []
    return {tag.name: tag.name in complete for tag in checkpoints.glob("iter_*")}


def _tree(pids: list[int]) -> list:
    """The processes ``pids`` and everything below them."""
    import psutil

    found = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            found += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return found


def _living(processes: list) -> list:
    import psutil

    living = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                living.append(process)
        except psutil.NoSuchProcess:
            pass
    return living


def _describe(processes: list) -> list[str]:
    import psutil

    described = []
    for process in processes:
        try:
            described.append(" ".join(process.cmdline())[:100])
        except psutil.NoSuchProcess:
            pass
    return described


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait_for_iteration(mains: list[subprocess.Popen], run: Path, log: Path) -> None:
    deadline = time.monotonic() + 300
    while _logged(run) < SIGNAL_AT:
        assert all(p.poll() is None for p in mains) and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)


def _pretrain_args(config: Path, corpus: str, run: Path) -> list[str]:
    return ["launch/pretrain.py", "--deepspeed_config", str(config), "--data-path", corpus, "--save", str(run),
            "--load", str(run)]


def _runner_args(nodes: Nodes, config: Path, corpus: str, run: Path) -> list[str]:
    return ["--hostfile", str(nodes.hostfile), "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            *_pretrain_args(config, corpus, run)]


def _bystander(nodes: Nodes) -> subprocess.Popen:
    """Another job's DeepSpeed per-node launcher on the first node, as ``pkill -f`` sees it (its command line
    starts like every per-node launcher's), started there through ssh."""
    fake = f"{sys.executable} -u -m deepspeed.launcher.launch --world_info=another-job"
    return subprocess.Popen(["ssh", NODES[0], f"exec -a '{fake}' sleep 600"], env=nodes.job_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _finish(mains: list[subprocess.Popen], job: list, run: Path, log: Path) -> Outcome:
    """Wait up to ``BOUND_S`` for the job to end, then collect the outcome (what is alive is named, then
    killed by the caller's clean-up)."""
    import psutil

    psutil.wait_procs(job, timeout=BOUND_S)
    alive = _living(job)
    for main in mains:
        try:
            main.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    return Outcome([main.poll() for main in mains], _latest(run), _describe(alive), _logged(run),
                   log.read_text()[-6000:], _complete_tags(run))


def _kill(mains: list[subprocess.Popen], nodes: Nodes, job: list) -> None:
    for process in _living(job):
        try:
            process.kill()
        except Exception:
            pass
    for main in mains:
        if main.poll() is None:
            main.kill()
            main.wait()
    nodes.close()


def run_case(case: str, root: Path, corpus: str) -> Outcome:
    """Run one case ("runner-term", "runner-kill", "zoo-term", "slurm-term") under ``root``."""
    nodes = start_nodes(root / "nodes")
    config, run, log = _config(root), root / "run", root / "output.txt"
    env = nodes.job_env()
    mains: list[subprocess.Popen] = []
    job: list = []
    bystander = _bystander(nodes) if case == "zoo-term" else None
    try:
        if case == "slurm-term":
            return _slurm_case(nodes, config, corpus, run, root)
        deepspeed = str(Path(sys.executable).parent / "deepspeed")
        launcher = [sys.executable, "launch/run.py"] if case == "zoo-term" else [deepspeed]
        mains = [_start([*launcher, *_runner_args(nodes, config, corpus, run)], env, log)]
        _wait_for_iteration(mains, run, log)
        job = _tree([mains[0].pid, nodes.sshd.pid])[1:]
        job = [p for p in job if p.pid != nodes.sshd.pid and (bystander is None or not _is_bystander(p))]
        if case == "runner-kill":
            mains[0].kill()
        else:
            mains[0].send_signal(signal.SIGTERM)
        outcome = _finish(mains, job, run, log)
        if bystander is not None:
            outcome.alive.append(f"bystander alive: {bystander.poll() is None}")
        return outcome
    finally:
        if bystander is not None:
            bystander.kill()
            bystander.wait()
        _kill(mains, nodes, job)


def _is_bystander(process) -> bool:
    import psutil

    try:
        return "another-job" in " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return False


# ------------------------------------------------------------------------------------------------- SLURM

def per_node_command() -> str:
    """The command launch/slurm_pretrain.sbatch has srun run on every node (the ``bash -c '...'`` body)."""
    match = re.search(r"^srun [^\n]*bash -c '(.*?)'$", SBATCH.read_text(), re.S | re.M)
    assert match, "launch/slurm_pretrain.sbatch has no `srun ... bash -c '...'` per-node command"
    return match.group(1)


def _slurm_case(nodes: Nodes, config: Path, corpus: str, run: Path, root: Path) -> Outcome:
    """Both nodes' srun tasks, then preemption: SIGTERM to every process of the step; SLURM ends the step
    (SIGKILL to what is left) when a task exits non-zero (``--kill-on-bad-exit=1``), once every task has
    exited, or after its KillWait (30 s)."""
    import psutil

    run.mkdir()
    hostfile = run / "hostfile-1"
    hostfile.write_text("".join(f"{node} slots=1\n" for node in NODES))
    env = dict(nodes.job_env(), HOSTFILE=str(hostfile), HEAD="127.0.0.1", PORT=str(free_port()), CONFIG=str(config),
               DATA=corpus, RUN=str(run), MINUTES="1000")
    logs = [root / f"task{rank}.txt" for rank in (0, 1)]
    tasks = [_start(["bash", "-c", per_node_command()], dict(env, SLURM_NODEID=str(rank)), logs[rank])
             for rank in (0, 1)]
    try:
        _wait_for_iteration(tasks, run, logs[0])
        step = _tree([task.pid for task in tasks])
        for process in step:
            try:
                process.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            codes = [task.poll() for task in tasks]
            if any(code not in (None, 0, STOPPED_AND_CHECKPOINTED) for code in codes) or None not in codes:
                break
            time.sleep(0.1)
        killed = _living(step)                # what SLURM kills at the end of the step
        described = _describe(killed)
        for process in killed:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        for task in tasks:
            task.wait(timeout=30)
        return Outcome([task.returncode for task in tasks], _latest(run), described, _logged(run),
                       "\n".join(log.read_text()[-3000:] for log in logs), _complete_tags(run))
    finally:
        _kill(tasks, nodes, _tree([task.pid for task in tasks]))


# ------------------------------------------------------------------------------------------------- cases

def _assert_stopped_with_checkpoint(outcome: Outcome) -> None:
    """``latest`` names the complete checkpoint of the iteration the run stopped at, the only tag."""
    tag = f"iter_{outcome.reached:07d}"
    assert SIGNAL_AT <= outcome.reached < ITERS, outcome.output
    assert outcome.latest == tag, (outcome.latest, outcome.output)
    assert outcome.complete == {tag: True}, outcome.complete


def test_sigterm_to_the_deepspeed_runner_stops_every_rank_with_a_checkpoint(corpus_prefix, tmp_path):
    outcome = run_case("runner-term", tmp_path, corpus_prefix)
    assert not outcome.alive, outcome.alive
    assert outcome.codes == [1], outcome.codes          # DeepSpeed's runner exits 1 after its kill command
    _assert_stopped_with_checkpoint(outcome)


def test_kill_9_of_the_deepspeed_runner_leaves_no_rank_on_any_node(corpus_prefix, tmp_path):
    outcome = run_case("runner-kill", tmp_path, corpus_prefix)
    assert not outcome.alive, outcome.alive
    assert outcome.codes == [-signal.SIGKILL]
    _assert_stopped_with_checkpoint(outcome)


def test_sigterm_to_zoo_launcher_returns_75_and_kills_no_other_job(corpus_prefix, tmp_path):
    outcome = run_case("zoo-term", tmp_path, corpus_prefix)
    assert outcome.alive == ["bystander alive: True"], outcome.alive
    assert outcome.codes == [STOPPED_AND_CHECKPOINTED], (outcome.codes, outcome.output)
    _assert_stopped_with_checkpoint(outcome)
    assert "pkill" not in outcome.output


def test_slurm_preemption_ends_each_task_after_its_ranks_clean_stop(corpus_prefix, tmp_path):
    outcome = run_case("slurm-term", tmp_path, corpus_prefix)
    assert not outcome.alive, outcome.alive              # nothing left for SLURM to kill
    assert outcome.codes == [0, 0], (outcome.codes, outcome.output)
    for rank in (0, 1):
        assert f"node {rank}: stopped with a checkpoint (exit code 75)" in outcome.output, outcome.output
    _assert_stopped_with_checkpoint(outcome)
