import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# This interpreter's bin first on PATH, for the suite and every process it starts, as `make test` puts the venv's:
# DeepSpeed JIT-builds its ops with the first `ninja` on PATH, and two ninja versions (the venv's wheel and the
# system's) each rebuild what the other built in ~/.cache/torch_extensions (deepspeed_shm_comm: 25-50 s on 2 cores,
# paid by whichever rank loads it next). A suite started without the Makefile then loads the ops `make test` and
# `make demo` built instead of rebuilding them.
_INTERPRETER_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _INTERPRETER_BIN:
    os.environ["PATH"] = os.pathsep.join([_INTERPRETER_BIN, os.environ.get("PATH", "")])

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
