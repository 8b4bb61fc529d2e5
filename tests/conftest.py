import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# One thread in the test process: the suite's tensors are tiny, and with two threads on a shared
# 2-core machine every small op can stall on the other thread (spawned ranks pin 1 thread too).
torch.set_num_threads(1)


import pytest  # noqa: E402

from tests.helpers.corpora import wiki_sample_corpus  # noqa: E402


@pytest.fixture(autouse=True)
def environment_of_the_session():
    """Every test starts with the session's environment variables: a command run in-process that sets
    RANK, MASTER_PORT and the like (a world of one, zoo.distributed.single_process_env) would otherwise
    make a later in-process command join a process group."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def corpus_prefix(tmp_path_factory):
    """A small real corpus: the first 12 articles of the bundled Wikipedia sample, built once per test
    module that asks for it."""
    return wiki_sample_corpus(tmp_path_factory.mktemp("corpus"))
