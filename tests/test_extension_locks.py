"""A build lock of DeepSpeed's JIT-compiled ops left by a killed builder no longer stops every later job.

torch's ``FileBaton`` (what ``torch.utils.cpp_extension.load`` locks a build with) waits for ``<op>/lock`` to
disappear, with no timeout; DeepSpeed loads its CPU all-reduce op in ``init_distributed``. A lock left by a
killed process therefore made every later CPU job of the user hang at start-up, the spawn harness's ranks
until its timeout. zoo's join removes such a lock first (:mod:`zoo.distributed.extension_locks`), and leaves
one a live process holds, or one too young to tell from a load that is finishing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.spawn import spawn


def _lock(op_dir: Path, age_s: float) -> Path:
    """``op_dir/lock`` as a builder leaves it, last touched ``age_s`` ago."""
    lock = op_dir / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    past = time.time() - age_s
    os.utime(lock, (past, past))
    return lock


def test_only_a_lock_no_process_holds_is_taken_over(tmp_path, capsys):
    from zoo.distributed.extension_locks import MIN_LOCK_AGE_S, take_over_dead_extension_locks

    dead = _lock(tmp_path / "py311_cpu" / "dead_op", 600)
    young = _lock(tmp_path / "py311_cpu" / "loading_op", MIN_LOCK_AGE_S / 5)
    held = _lock(tmp_path / "py311_cpu" / "building_op", 600)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nf = open(sys.argv[1])\nprint('open', flush=True)\n"
                               "time.sleep(60)", str(held)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        assert take_over_dead_extension_locks(tmp_path) == [dead]
    finally:
        holder.kill()
        holder.wait()
    assert not dead.exists() and young.exists() and held.exists()
    assert f"zoo: removed {dead}, a build lock" in capsys.readouterr().err


def _join(rank, world_size, extensions_dir, lock):
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir   # torch then builds in extensions_dir/<op>/
    from zoo.distributed import join_deepspeed

    join_deepspeed()
    return os.path.exists(lock)


def test_ranks_join_past_a_dead_build_lock_of_deepspeeds_shm_op(tmp_path):
    """The spawn harness's ranks join DeepSpeed with a dead lock on its shared-memory op (a copy of this user's
    build, so nothing compiles); without the take-over they wait on it until the harness's timeout."""
    from torch.utils.cpp_extension import get_default_build_root

    built = Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / "deepspeed_shm_comm"
    if not (built / "deepspeed_shm_comm.so").exists():
        pytest.skip(f"DeepSpeed's shared-memory op is not built in {built} yet (the first DeepSpeed CPU job builds it)")
    private = tmp_path / "extensions"
    copy = private / built.name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock"))
    lock = _lock(copy, 600)
    assert spawn(_join, 2, str(private), str(lock), timeout=90) == [False, False]
