"""Several nodes sharing one filesystem (Lustre, NFS) build a derived file once.

* The blend index: 4 gloo ranks that all say LOCAL_RANK=0 (four nodes of one rank each, or srun without
  LOCAL_RANK) and share one data directory build it exactly once; the build is made slow (0.5 s) so that
  every rank asks for it while the first is still building.
* The lock behind it (:func:`zoo.distributed.build_once`): a lock left by a dead process of this host is
  taken over, a lock held elsewhere is waited on for the stated time and then named in one sentence, and a
  failed build leaves neither the file nor the lock.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.blend_corpora import blend_items, write_corpus
from tests.spawn import spawn
from zoo.distributed import build_once
from zoo.distributed.build_once import lock_path

BUILD_S = 0.5


def _blend_index_at_local_rank_0(rank, world_size, prefixes):
    import zoo.data.blend_cache as blend_cache
    from zoo.data.blending import parse_data_path

    os.environ["LOCAL_RANK"] = "0"
    builds = []
    real = blend_cache.blend_index

    def slow_blend_index(*args, **kwargs):
        builds.append(rank)
        time.sleep(BUILD_S)
        return real(*args, **kwargs)

    blend_cache.blend_index = slow_blend_index
    index = blend_cache.shared_blend_index(parse_data_path(blend_items(prefixes)), 1000)
    return len(builds), index.built_here, np.asarray(index.corpus).tolist()


def test_ranks_that_all_say_local_rank_0_build_the_blend_index_once(tmp_path):
    prefixes = [write_corpus(tmp_path / f"corpus{k}", k) for k in range(3)]
    results = spawn(_blend_index_at_local_rank_0, 4, prefixes)
    assert sum(builds for builds, _, _ in results) == 1
    assert sum(built for _, built, _ in results) == 1
    assert all(corpus == results[0][2] for _, _, corpus in results)
    assert [p.name for p in tmp_path.iterdir() if ".blend-" in p.name and not p.name.endswith(".npy")] == []


def write(target: Path) -> None:
    target.write_text("built")


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    target = tmp_path / "index.npy"
    lock_path(target).write_text(f"{socket.gethostname()} {dead_pid()}\n")
    assert build_once(target, write, timedelta(seconds=5)) is True
    assert target.read_text() == "built" and not lock_path(target).exists()
    assert build_once(target, write, timedelta(seconds=5)) is False


def test_a_lock_held_on_another_host_is_waited_on_then_named(tmp_path):
    target = tmp_path / "index.npy"
    lock_path(target).write_text("node017 4242\n")
    started = time.monotonic()
    with pytest.raises(ValueError) as caught:
        build_once(target, write, timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - started < 3
    assert str(caught.value) == (f"{target} was not written within 0.3 s by process 4242 on node017, which holds "
                                 f"{lock_path(target)}; if no run is building it any more, delete that lock file "
                                 "and start again.")
    assert not target.exists()


def test_a_failed_build_leaves_neither_the_file_nor_the_lock(tmp_path):
    target = tmp_path / "index.npy"

    def fail(path: Path) -> None:
        raise MemoryError("no room for the index")

    with pytest.raises(MemoryError):
        build_once(target, fail, timedelta(seconds=5))
    assert list(tmp_path.iterdir()) == []
