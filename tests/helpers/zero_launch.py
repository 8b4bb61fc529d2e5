"""The one 4-rank launch through the real `deepspeed` launcher on CPU that tests/test_zero.py checks and
tests/test_multinode.py takes as its one-node reference: a driver running, in the same 4 processes, the
non-ZeRO, ZeRO-1/2, resumed-at-another-layout and bf16 runs of the random-corpus GPT-2; and how their logged
events are compared."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.random_corpus import MODEL, make_corpus
from tests.helpers.repo import REPO

ITERS, SAVED_AT = 5, 2
PARITY = 1e-5

DRIVER = """
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from tests.helpers.pretraining import run_config
from zoo.training.pretrain import pretrain
args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]   # the launcher adds --local_rank=N
data, root, model = args[0], Path(args[1]), json.loads(Path(args[2]).read_text())

def run(name, tp, stage, iters={iters}, load=None, save_interval=0, bf16=False):
    config = run_config(data, str(root / name), tp, 1, 4, train_iters=iters, model_overrides=dict(model),
                        save_interval=save_interval, load=load, data_workers=0)
    if stage:
        config.ds_config["zero_optimization"] = {{"stage": stage}}
    if bf16:
        config.ds_config["bf16"] = {{"enabled": True}}
    pretrain(config)

run("base", 2, 0)
run("zero1", 2, 1, save_interval={saved_at})
run("zero2", 2, 2, save_interval={saved_at})
if dist.get_rank() == 0:   # each iteration-{saved_at} checkpoint as its own run directory, 'latest' naming it
    for run_name, saved in (("zero1", "saved"), ("zero2", "saved2")):
        source = root / run_name / "checkpoints" / "iter_{saved_at:07d}"
        shutil.copytree(source, root / saved / "checkpoints" / source.name)
        (root / saved / "checkpoints" / "latest").write_text(source.name)
dist.barrier()
for name, tp in (("same", 2), ("tp4", 4), ("tp1", 1)):
    run(name, tp, 1, load=str(root / "saved"))
run("zero2-tp1", 1, 2, load=str(root / "saved2"))
run("bf16-0", 2, 0, iters=3, bf16=True)
run("bf16-1", 2, 1, iters=3, bf16=True)
dist.barrier()
dist.destroy_process_group()   # torch's threads end before the interpreter does
"""


def rel(a: float, b: float) -> float:
    """|a - b| relative to b (b below 1e-12 counts as 1e-12)."""
    return abs(a - b) / max(abs(b), 1e-12)


def launcher_env() -> dict:
    """This process's environment for a launcher on CPU: one OpenMP thread a rank, gloo over loopback, offline."""
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", HF_HUB_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false")


def deepspeed_cmd() -> str:
    """The `deepspeed` launcher of this interpreter's environment."""
    return str(Path(sys.executable).parent / "deepspeed")


def one_node_launch(factory) -> tuple[Path, str]:
    """(runs root, corpus prefix) of the one 4-rank launch, run once per session whichever test module asks
    first (keyed by the session's base temporary directory)."""
    outcome = _launch_once(str(factory.getbasetemp()))
    if isinstance(outcome, AssertionError):
        raise outcome
    return outcome


@functools.cache
def _launch_once(basetemp: str) -> tuple[Path, str] | AssertionError:
    """The launch's result, or its failure (returned, so that every test asking again sees the same failure
    instead of launching into the directory the failed launch left)."""
    try:
        return _launch(Path(basetemp) / "zero_launch")
    except AssertionError as failure:
        return failure


def _launch(root: Path) -> tuple[Path, str]:
    from tests.spawn import free_port

    root.mkdir()
    corpus = make_corpus(root / "random")
    driver = root / "driver.py"
    driver.write_text(DRIVER.format(repo=str(REPO), iters=ITERS, saved_at=SAVED_AT))
    (root / "model.json").write_text(json.dumps(MODEL))   # a file: the launcher re-quotes its arguments
    cmd = [deepspeed_cmd(), "--num_gpus", "4", "--master_port", str(free_port()), str(driver), corpus,
           str(root / "runs"), str(root / "model.json")]
    proc = subprocess.run(cmd, env=launcher_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return root / "runs", corpus


def assert_matches(events: list[dict], reference: list[dict], tolerance: float, what: str,
                   grad_norm_tolerance: float | None = None) -> None:
    """``events`` log the iterations of ``reference``, each with its loss and grad norm within ``tolerance``
    relative (the grad norm within ``grad_norm_tolerance`` when given), the same LR and the same data position."""
    assert [e["iteration"] for e in events] == [e["iteration"] for e in reference], what
    for ours, theirs in zip(events, reference):
        assert rel(ours["loss"], theirs["loss"]) <= tolerance, (what, "loss", ours, theirs)
        norm_tolerance = tolerance if grad_norm_tolerance is None else grad_norm_tolerance
        assert rel(ours["grad_norm"], theirs["grad_norm"]) <= norm_tolerance, (what, "grad_norm", ours, theirs)
        assert ours["lr"] == theirs["lr"] and ours["consumed_samples"] == theirs["consumed_samples"], what
