import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# One thread in the test process: the suite's tensors are tiny, and with two threads on a shared
# 2-core machine every small op can stall on the other thread (spawned ranks pin 1 thread too).
torch.set_num_threads(1)
