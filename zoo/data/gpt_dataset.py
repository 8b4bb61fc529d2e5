"""GPT pretraining samples from an indexed dataset, and the data-parallel batch sampler.

Sample layout (a choice, kept stable): the documents of a split, in index order, are joined into
one token stream (each already ends with <|endoftext|>). Window ``w`` is the ``seq_length``
stream tokens ``[w*seq_length, (w+1)*seq_length)``: windows do not overlap and freely run across
document boundaries; the tail shorter than ``seq_length`` is dropped. A sample is
``{"input_ids": window, "labels": window}`` (int64): the model shifts the labels itself, as
transformers' GPT2LMHeadModel does, so each window trains ``seq_length - 1`` next-token targets.

The split is by documents: weights "969,30,1" cut the document list into contiguous train /
valid / test ranges. Window order is shuffled with ``numpy.random.default_rng((seed, split, epoch))``;
when ``num_samples`` exceeds one epoch, further epochs follow, each with a fresh shuffle.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from zoo.data.indexed_dataset import IndexedDataset
from zoo.errors import UserError
from zoo.parallel.state import as_state

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str | Sequence[float]) -> tuple[float, float, float]:
    """"969,30,1" (or "98/2/0", or a sequence) -> three non-negative weights with a positive sum."""
    if isinstance(split, str):
        parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    else:
        parts = list(split)
    try:
        weights = [float(p) for p in parts]
    except (TypeError, ValueError):
        weights = []
    while 0 < len(weights) < 3:
        weights.append(0.0)
    if len(weights) != 3 or any(w < 0 or not np.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise UserError(
            f"split {split!r} is invalid; give three non-negative train,valid,test weights such as '969,30,1'."
        )
    return tuple(weights)


def split_document_ranges(num_documents: int, split) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` document ranges for train, valid and test."""
    weights = np.asarray(parse_split(split))
    bounds = np.rint(np.cumsum(weights) / weights.sum() * num_documents).astype(np.int64)
    bounds = np.concatenate([[0], np.minimum(bounds, num_documents)])
    bounds[-1] = num_documents
    return [(int(bounds[k]), int(bounds[k + 1])) for k in range(3)]


class GPTDataset(torch.utils.data.Dataset):
    """Shuffled, fixed-length GPT windows over one split of an indexed dataset (see module doc).

    ``indexed`` is an :class:`IndexedDataset` or its prefix. ``len(ds)`` is ``num_samples``
    (default: one epoch, ``num_windows``). ``ds[i]`` costs O(1): two index-array lookups and a
    read of only that window's tokens through the mmap. With ``vocab_size`` (the model's unpadded
    vocabulary) every sample's ids are checked to lie in ``[0, vocab_size)``: data tokenized with
    another vocabulary is refused, naming the file and the sample, instead of training on ids the
    vocab-parallel embedding would silently map to zero vectors.
    """

    def __init__(
        self,
        indexed: IndexedDataset | str | os.PathLike,
        seq_length: int,
        seed: int,
        split: str | Sequence[float] = "969,30,1",
        which: str = "train",
        num_samples: int | None = None,
        vocab_size: int | None = None,
    ):
        if not isinstance(indexed, IndexedDataset):
            indexed = IndexedDataset(indexed)
        if which not in SPLIT_NAMES:
            raise UserError(f"which={which!r} is invalid; use one of {', '.join(SPLIT_NAMES)}.")
        if int(seq_length) < 1:
            raise UserError(f"seq_length={seq_length} is invalid; it must be a positive number of tokens.")
        self.indexed = indexed
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.which = which
        self.document_range = split_document_ranges(indexed.num_documents, split)[SPLIT_NAMES.index(which)]

        d0, d1 = self.document_range
        self._first_seq = int(indexed.doc_idx[d0])
        last_seq = int(indexed.doc_idx[d1])
        self._sizes = np.asarray(indexed.sizes[self._first_seq : last_seq], dtype=np.int64)
        ends = np.cumsum(self._sizes)
        self.num_tokens = int(ends[-1]) if len(ends) else 0
        self.num_windows = self.num_tokens // self.seq_length

        # Where each window starts: sequence (relative to the split) and token offset inside it.
        starts = np.arange(self.num_windows, dtype=np.int64) * self.seq_length
        self._window_seq = np.searchsorted(ends, starts, side="right")
        self._window_offset = starts - (ends[self._window_seq] - self._sizes[self._window_seq])

        if num_samples is None:
            num_samples = self.num_windows
        num_samples = int(num_samples)
        if num_samples < 0:
            raise UserError(f"num_samples={num_samples} is invalid; it must be >= 0.")
        if num_samples > 0 and self.num_windows == 0:
            raise UserError(
                f"the {which} split of {indexed.prefix} (documents {d0}..{d1}) holds {self.num_tokens} tokens, less than one "
                f"window of seq_length={self.seq_length}; give it more data or a larger split weight."
            )
        self.num_samples = num_samples
        self.num_epochs = -(-num_samples // self.num_windows) if num_samples else 0
        index_dtype = np.int32 if self.num_windows < 2**31 else np.int64
        self._shuffle = np.empty(num_samples, dtype=index_dtype)
        for epoch in range(self.num_epochs):
            rng = np.random.default_rng((self.seed, SPLIT_NAMES.index(which), epoch))
            lo = epoch * self.num_windows
            hi = min(lo + self.num_windows, num_samples)
            self._shuffle[lo:hi] = rng.permutation(self.num_windows)[: hi - lo]

    def __len__(self) -> int:
        return self.num_samples

    def window_index(self, i: int) -> int:
        """Which window (position in the unshuffled stream) sample ``i`` serves."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        return int(self._shuffle[i])

    def window(self, w: int) -> np.ndarray:
        """Stream tokens ``[w*seq_length, (w+1)*seq_length)`` as int64, read through the mmap."""
        if not 0 <= w < self.num_windows:
            raise IndexError(f"window {w} out of range for {self.num_windows} windows")
        seq, offset = int(self._window_seq[w]), int(self._window_offset[w])
        out = np.empty(self.seq_length, dtype=np.int64)
        filled = 0
        while filled < self.seq_length:
            n = min(int(self._sizes[seq]) - offset, self.seq_length - filled)
            if n > 0:
                out[filled : filled + n] = self.indexed.get(self._first_seq + seq, offset, n)
                filled += n
            seq, offset = seq + 1, 0
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.window(self.window_index(int(i)))
        if self.vocab_size is not None:
            check_token_ids(window, self.vocab_size, self.indexed, f"sample {int(i)} of the {self.which} split")
        tokens = torch.from_numpy(window)
        return {"input_ids": tokens, "labels": tokens.clone()}


def check_token_ids(tokens: np.ndarray, vocab_size: int, indexed: IndexedDataset, where: str) -> None:
    """Refuse ids outside ``[0, vocab_size)`` (one min and one max over the sample), naming the data file
    and ``where`` ("sample 12 of the train split")."""
    if tokens.size == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low >= 0 and high < vocab_size:
        return
    bad = high if high >= vocab_size else low
    raise UserError(
        f"{indexed.prefix}.bin holds token id {bad} in {where}, outside the model's vocabulary of {vocab_size} "
        "ids; the data was tokenized with another vocabulary (or is not token data), so preprocess it with the "
        "model's tokenizer or pass the --model it was built for."
    )


def build_gpt_datasets(
    prefix: str | os.PathLike,
    seq_length: int,
    seed: int,
    split: str | Sequence[float] = "969,30,1",
    num_samples: Sequence[int | None] = (None, None, None),
) -> tuple[GPTDataset, GPTDataset, GPTDataset]:
    """Train, valid and test :class:`GPTDataset` over one indexed dataset (a split may be empty)."""
    indexed = IndexedDataset(prefix)
    return tuple(
        GPTDataset(indexed, seq_length, seed, split=split, which=which, num_samples=n)
        for which, n in zip(SPLIT_NAMES, num_samples)
    )


class DistributedPretrainingSampler:
    """Yields this data-parallel rank's micro-batches of sample indices, resumable mid-run.

    Global micro-step ``k`` covers the ``dp_size * micro_batch_size`` indices starting at
    ``start = consumed_samples + k * dp_size * micro_batch_size``; DP rank ``r`` takes
    ``[start + r*mbs, start + (r+1)*mbs)``. The index depends only on ``dp_rank``, so all tensor-
    parallel ranks of a group read the same samples. The position to resume from is
    ``consumed_samples``: the number of samples the whole run has consumed so far (iterations x
    global batch size), which the trainer stores in its checkpoint. A last incomplete global
    micro-step is dropped so that every rank runs the same number of steps. Pass it as a
    DataLoader's ``batch_sampler``.
    """

    def __init__(
        self,
        total_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int = 0,
    ):
        if micro_batch_size < 1:
            raise UserError(f"micro_batch_size={micro_batch_size} is invalid; it must be >= 1.")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise UserError(f"dp_rank={dp_rank} with dp_size={dp_size} is invalid; need 0 <= dp_rank < dp_size.")
        if not 0 <= consumed_samples <= total_samples:
            raise UserError(
                f"consumed_samples={consumed_samples} is outside the dataset's {total_samples} samples; "
                "build the dataset with num_samples >= the samples the run will consume."
            )
        self.total_samples = int(total_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.consumed_samples = int(consumed_samples)

    @property
    def global_step_size(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_step_size

    def __iter__(self) -> Iterator[list[int]]:
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        for k in range(len(self)):
            start = first + k * self.global_step_size
            yield list(range(start, start + self.micro_batch_size))


class SampleFailure:
    """What a DataLoader worker returns instead of a batch when reading one of its samples raised: the
    error travels to the training process unchanged (a DataLoader would re-raise it with its own
    traceback text in the message), so it can be agreed across ranks as the same sentence."""

    def __init__(self, error: Exception):
        self.error = error


class _FailuresAsValues(torch.utils.data.Dataset):
    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        try:
            return self.dataset[i]
        except Exception as err:  # noqa: BLE001 - handed to the training process, raised there
            return SampleFailure(err)


def stack_samples(samples: list) -> dict[str, torch.Tensor] | SampleFailure:
    """A micro-batch: each key's samples stacked; the first failed sample instead, if any."""
    failure = next((s for s in samples if isinstance(s, SampleFailure)), None)
    if failure is not None:
        return failure
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


def batch_or_raise(batch: dict[str, torch.Tensor] | SampleFailure) -> dict[str, torch.Tensor]:
    """The micro-batch, or the error of its failed sample raised here."""
    if isinstance(batch, SampleFailure):
        raise batch.error
    return batch


def ignore_stop_signals(worker_id: int) -> None:
    """A worker leaves SIGTERM/SIGUSR1 to its training process, which stops at an iteration boundary
    with a checkpoint (a launcher signals the whole process tree); the worker ends with its parent."""
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


def shut_down_workers(batches, timeout_s: float = 10.0) -> None:
    """End the worker processes of a DataLoader iterator now, and wait for them.

    The workers ignore SIGTERM (:func:`ignore_stop_signals`), so nothing may leave them to
    multiprocessing's exit handler, which terminates them with SIGTERM and then joins them forever. Nor
    to the iterator's garbage collection: an exception's traceback keeps the iterator alive through
    ``sys.exit``, and torch's own shutdown does nothing once the interpreter is exiting. So the iterator
    is asked to shut them down (torch's ``_shutdown_workers``: a done event and a sentinel on every index
    queue, each worker joined), and any worker still alive after ``timeout_s`` is killed. An iterator
    without workers (``num_workers=0``) or already shut down is left as it is."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
    for worker in getattr(batches, "_workers", ()):
        worker.join(timeout_s)
        if worker.is_alive():
            worker.kill()
            worker.join(timeout_s)


def build_pretraining_dataloader(
    dataset: torch.utils.data.Dataset,
    micro_batch_size: int,
    consumed_samples: int = 0,
    parallel=None,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> torch.utils.data.DataLoader:
    """DataLoader over ``dataset`` for this rank of ``parallel`` (a ParallelState; None = one process).

    ``num_workers`` processes read (and, for BERT, mask) the next micro-batches while the model trains;
    ``pin_memory`` (on an accelerator) lets the device copy run without blocking. A sample that fails to
    read yields a :class:`SampleFailure` batch; :func:`batch_or_raise` raises its error unchanged."""
    parallel = as_state(parallel)
    dp_rank, dp_size = parallel.dp_rank, parallel.dp_size
    sampler = DistributedPretrainingSampler(len(dataset), micro_batch_size, dp_rank, dp_size, consumed_samples)
    return torch.utils.data.DataLoader(
        _FailuresAsValues(dataset), batch_sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
        collate_fn=stack_samples, worker_init_fn=ignore_stop_signals if num_workers else None,
        # its own generator: a new iterator (each validation pass, each resume) draws the workers' base
        # seed from it, never from the global torch RNG that dropout and a checkpoint's RNG state use
        generator=torch.Generator().manual_seed(0),
    )
