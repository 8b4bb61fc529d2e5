"""The data of a pretraining run: train/valid datasets of the model's family (one corpus, or several
blended by weight) and this rank's micro-batches, read by DataLoader worker processes and agreed across
ranks."""

from __future__ import annotations

import atexit
import multiprocessing
import sys
from collections.abc import Iterator

import torch

from zoo.config.run_config import RunConfig
from zoo.data.blend_cache import shared_blend_index
from zoo.data.blending import BlendedDataset, check_data_path
from zoo.data.gpt_dataset import batch_or_raise, build_pretraining_dataloader, shut_down_workers
from zoo.data.indexed_dataset import IndexedDataset
from zoo.distributed import raise_on_any_rank, run_on_first_rank
from zoo.parallel.context import context_shard
from zoo.training.pretraining_objectives import build_dataset, default_corpus, objective_of

__all__ = ["PretrainingData", "can_start_workers"]

# What the wait for rank 0's preprocessing of the bundled corpus is sized from (a Wikipedia sample of a few
# MB): the waiting ranks give it zoo.distributed.first_rank_timeout of this, 10 minutes and a few seconds.
BUNDLED_CORPUS_BYTES = 10_000_000


class PretrainingData:
    """Train/valid datasets of the model's family and this rank's micro-batches through DataLoaders.

    Global sample order is fixed by the seed; a global batch of ``G`` samples is split into ``gas``
    micro-steps of ``micro * dp`` samples, and DP rank r reads its own ``micro`` of each
    (:class:`zoo.data.gpt_dataset.DistributedPretrainingSampler`). TP ranks of a group share a DP rank
    and so read the same samples. ``workers`` processes read (and mask, for BERT) the next micro-batches
    while the model trains; batches are pinned on an accelerator.

    ``config.data_path`` is None (the bundled corpus, preprocessed by rank 0 while the others wait on a gloo
    group of the host whose timeout fits the work, never in a collective of the accelerator's group under its
    watchdog: :func:`zoo.distributed.run_on_first_rank`), one prefix, or Megatron's ``W1 P1 W2 P2 ...``
    (:mod:`zoo.data.blending`). One corpus of positive weight is read exactly as a single prefix; several
    are blended through one index shared by every rank (:func:`zoo.data.blend_cache.shared_blend_index`),
    each split by its own documents. ``indexed`` is the single corpus's :class:`IndexedDataset` (None for
    a blend).
    """

    def __init__(self, config: RunConfig, model_config, parallel, micro_batch: int, global_batch: int,
                 workers: int, pin_memory: bool, agreement_group=None):
        blend = raise_on_any_rank(lambda: check_data_path(config.data_path, config.split))
        if blend is None:  # bundled corpus: preprocess once on rank 0 while the others wait on the host
            run_on_first_rank(lambda: default_corpus(model_config, progress=sys.stderr.isatty()),  # no bar in a log file
                              work_bytes=BUNDLED_CORPUS_BYTES)
            blend = [(1.0, default_corpus(model_config, progress=False))]
        self.is_bundled_corpus = config.data_path is None
        self.objective = objective_of(model_config)   # its extra metrics and their log lines
        self.blend = [(weight, prefix) for weight, prefix in blend if weight > 0]
        self.parallel = parallel
        self.micro_batch = micro_batch
        # micro-batches of this rank per global batch (DeepSpeed checked that micro * dp divides global_batch)
        self.micro_steps = global_batch // (micro_batch * parallel.dp_size)
        self.workers = workers if can_start_workers() else 0
        self.pin_memory = pin_memory
        self.agreement_group = agreement_group
        train_samples = config.train_iters * global_batch
        valid_samples = config.eval_iters * global_batch if config.eval_interval else 0
        index = None
        if len(self.blend) > 1:  # one index serves both splits: valid uses its first valid_samples entries
            index = shared_blend_index(self.blend, max(train_samples, valid_samples))
        self.indexed, self.train, self.valid = raise_on_any_rank(
            lambda: self._datasets(config, model_config, index, train_samples, valid_samples))
        self._train_batches = None
        # Workers ignore SIGTERM (a launcher signals the whole process tree; the training process stops at
        # an iteration boundary instead), so multiprocessing's exit handler, which terminates them with
        # SIGTERM, would wait for them forever: they are shut down before it runs, on every way out.
        atexit.register(self.close)

    def close(self) -> None:
        """Shut the training iterator's workers down, explicitly: an error's traceback may still hold the
        iterator, so dropping this reference alone would leave them to the interpreter's exit."""
        batches, self._train_batches = self._train_batches, None
        if batches is not None:
            shut_down_workers(batches)
        atexit.unregister(self.close)

    def _datasets(self, config: RunConfig, model_config, index, train_samples: int, valid_samples: int):
        corpora = [IndexedDataset(prefix) for _, prefix in self.blend]

        def split(which: str, num_samples: int):
            if index is None:
                return build_dataset(model_config, corpora[0], config.seq_length, config.seed, config.split, which,
                                     num_samples)
            counts = BlendedDataset.counts(index, len(corpora), num_samples)
            return BlendedDataset([build_dataset(model_config, corpus, config.seq_length, config.seed, config.split,
                                                 which, count) for corpus, count in zip(corpora, counts)],
                                  index, num_samples)

        train = split("train", train_samples)
        valid = split("valid", valid_samples) if config.eval_interval else None
        return (corpora[0] if index is None else None), train, valid

    def loader(self, dataset, first_global_sample: int):
        return build_pretraining_dataloader(dataset, self.micro_batch, first_global_sample, self.parallel,
                                            num_workers=self.workers, pin_memory=self.pin_memory)

    def next_micro_batches(self, batches, count: int) -> list[dict[str, torch.Tensor]]:
        """The next ``count`` micro-batches of ``batches``, read on every rank before any of them is used:
        a bad sample (e.g. a token id outside the vocabulary) on one DP rank stops every rank with the
        same sentence instead of hanging the others' all-reduce. The agreement runs on the host group. With
        context parallelism each batch is this rank's part of every sample (:func:`zoo.parallel.context.context_shard`)."""
        read = raise_on_any_rank(lambda: [batch_or_raise(next(batches)) for _ in range(count)],
                                 group=self.agreement_group)
        return [context_shard(batch, self.parallel) for batch in read]

    def train_micro_batches(self, consumed: int, count: int) -> list[dict[str, torch.Tensor]]:
        """The iteration's micro-batches from ``consumed`` samples on (the loader is started there once)."""
        if self._train_batches is None:
            self._train_batches = iter(self.loader(self.train, consumed))
        return self.next_micro_batches(self._train_batches, count)

    def valid_iterations(self, eval_iters: int) -> Iterator[list[dict[str, torch.Tensor]]]:
        """This rank's micro-batches of each of the valid split's first ``eval_iters`` global batches, one
        global batch at a time (at most one global batch's share is held). Over the DP ranks every sample of
        the ``eval_iters * global_batch`` is read once. Close the iterator when done (``contextlib.closing``):
        that shuts the loader's workers down, also when reading or evaluating failed, never at exit."""
        batches = iter(self.loader(self.valid, 0))
        try:
            for _ in range(eval_iters):
                yield self.next_micro_batches(batches, self.micro_steps)
        finally:
            shut_down_workers(batches)


def can_start_workers() -> bool:
    """A daemonic process (a worker of a multiprocessing pool or harness) may not start DataLoader workers:
    it reads its batches itself."""
    return not multiprocessing.current_process().daemon
