"""The ranks waiting for rank 0's preprocessing of the bundled corpus wait on the host, under a timeout sized
from that work, not in a collective of the run's process group, whose timeout (NCCL's watchdog on GPUs,
10 minutes by default) is sized for an iteration.

Two ranks re-join with a default group of a 2 s timeout; rank 0's preprocessing takes 4 s (a stand-in that
writes a small corpus, so that the test does not tokenize the real sample)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from tests.helpers.blend_corpora import data_fields, write_corpus
from tests.spawn import free_port, spawn

PREPROCESSING_S, GROUP_TIMEOUT_S = 4.0, 2.0


def _bundled_corpus_under_a_short_group_timeout(rank, world_size, port, directory):
    import zoo.training.pretraining_data as pretraining_data
    from zoo.models import model_config
    from zoo.parallel import ParallelState

    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    prefix = f"{directory}/bundled"

    def slow_preprocessing(config, progress: bool) -> str:
        if dist.get_rank() == 0 and not (Path(prefix + ".idx")).exists():   # rank 0 first; the others after it
            time.sleep(PREPROCESSING_S)
            write_corpus(prefix, 0)
        return prefix

    pretraining_data.default_corpus = slow_preprocessing
    data = pretraining_data.PretrainingData(data_fields(None, train_iters=2), model_config("gpt2-tiny"),
                                            ParallelState.initialize(1), 2, 4, 0, False)
    return len(data.train)


def test_ranks_wait_for_the_bundled_corpus_longer_than_the_group_timeout(tmp_path):
    assert spawn(_bundled_corpus_under_a_short_group_timeout, 2, free_port(), str(tmp_path)) == [8, 8]
