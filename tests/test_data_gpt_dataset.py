"""GPT windows over the document stream, the document split, the shuffle and the DP sampler."""

import numpy as np
import pytest
import torch

from zoo.data import (
    DistributedPretrainingSampler,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetBuilder,
    build_pretraining_dataloader,
)
from zoo.data.gpt_dataset import shut_down_workers, split_document_ranges

SEQ = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """20 documents of 1..30 tokens with distinct ids, each ending in EOD, as preprocess writes them."""
    rng = np.random.default_rng(1)
    docs, nxt = [], 0
    for n in rng.integers(1, 30, size=20):
        docs.append(np.append(np.arange(nxt, nxt + n - 1) % 50000, 50256))
        nxt += n
    prefix = tmp_path_factory.mktemp("gpt") / "corpus"
    with IndexedDatasetBuilder(prefix, vocab_size=50257) as b:
        for d in docs:
            b.add_document(d)
    return IndexedDataset(prefix), docs


def test_windows_equal_the_stream_across_documents(corpus):
    indexed, docs = corpus
    ds = GPTDataset(indexed, SEQ, seed=0, split="1,0,0")
    stream = np.concatenate(docs)
    assert ds.num_windows == len(stream) // SEQ == len(ds)
    for w in range(ds.num_windows):
        np.testing.assert_array_equal(ds.window(w), stream[w * SEQ : (w + 1) * SEQ])
    # Some window really spans a document boundary (contains an EOD before its last position).
    assert any((ds.window(w)[:-1] == 50256).any() for w in range(ds.num_windows))
    sample = ds[3]
    assert set(sample) == {"input_ids", "labels"}
    assert sample["input_ids"].dtype == torch.long and sample["input_ids"].shape == (SEQ,)
    assert torch.equal(sample["labels"], sample["input_ids"])
    np.testing.assert_array_equal(sample["input_ids"].numpy(), ds.window(ds.window_index(3)))


def test_split_is_by_document_and_disjoint(corpus):
    indexed, docs = corpus
    ranges = split_document_ranges(20, "5,3,2")
    assert ranges == [(0, 10), (10, 16), (16, 20)]
    assert split_document_ranges(96, "969,30,1") == [(0, 93), (93, 96), (96, 96)]
    seen = []
    for which, (d0, d1) in zip(("train", "valid", "test"), ranges):
        ds = GPTDataset(indexed, SEQ, seed=0, split="5,3,2", which=which)
        assert ds.document_range == (d0, d1) and ds.num_windows > 0
        stream = np.concatenate(docs[d0:d1])
        got = np.concatenate([ds.window(w) for w in range(ds.num_windows)])
        np.testing.assert_array_equal(got, stream[: ds.num_windows * SEQ])
        seen.append(set(got.tolist()) - {50256})
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])


def test_shuffle_deterministic_and_epochs(corpus):
    indexed, _ = corpus
    order = lambda ds: [ds.window_index(i) for i in range(len(ds))]  # noqa: E731
    a, b = GPTDataset(indexed, SEQ, seed=7, split="1,0,0"), GPTDataset(indexed, SEQ, seed=7, split="1,0,0")
    c = GPTDataset(indexed, SEQ, seed=8, split="1,0,0")
    assert order(a) == order(b) and order(a) != order(c)
    assert sorted(order(a)) == list(range(a.num_windows))
    n = a.num_windows
    many = GPTDataset(indexed, SEQ, seed=7, split="1,0,0", num_samples=2 * n + 3)
    idx = order(many)
    assert len(many) == 2 * n + 3 and many.num_epochs == 3
    assert idx[:n] == order(a)
    assert sorted(idx[n : 2 * n]) == list(range(n)) and idx[n : 2 * n] != idx[:n]
    assert len(set(idx[2 * n :])) == 3


def test_bad_arguments(corpus):
    indexed, _ = corpus
    with pytest.raises(ValueError, match="split"):
        GPTDataset(indexed, SEQ, seed=0, split="a,b")
    with pytest.raises(ValueError, match="which"):
        GPTDataset(indexed, SEQ, seed=0, which="dev")
    with pytest.raises(ValueError, match="test split"):
        GPTDataset(indexed, SEQ, seed=0, split="1,0,0", which="test", num_samples=4)


def _run(total, mbs, dp_size, consumed=0, steps=None):
    out = []
    for r in range(dp_size):
        batches = list(DistributedPretrainingSampler(total, mbs, r, dp_size, consumed))
        out.append(batches if steps is None else batches[:steps])
    return out


def test_sampler_disjoint_covering_and_resume():
    total, mbs, dp = 50, 3, 4
    per_rank = _run(total, mbs, dp)
    steps = total // (mbs * dp)
    assert all(len(b) == steps for b in per_rank)
    for k in range(steps):  # each global micro-step is split without overlap or gap
        joined = sum((per_rank[r][k] for r in range(dp)), [])
        assert joined == list(range(k * mbs * dp, (k + 1) * mbs * dp))
    # TP ranks of one DP group pass the same dp_rank and read the same samples.
    assert list(DistributedPretrainingSampler(total, mbs, 2, dp)) == per_rank[2]
    # Resuming from consumed_samples continues where the uninterrupted run was.
    done = 2
    resumed = _run(total, mbs, dp, consumed=done * mbs * dp)
    for r in range(dp):
        assert resumed[r] == per_rank[r][done:]
    with pytest.raises(ValueError, match="consumed_samples"):
        DistributedPretrainingSampler(total, mbs, 0, dp, consumed_samples=total + 1)
    with pytest.raises(ValueError, match="dp_rank"):
        DistributedPretrainingSampler(total, mbs, 4, dp)


def test_dataloader_batches(corpus):
    indexed, _ = corpus
    ds = GPTDataset(indexed, SEQ, seed=0, split="1,0,0")
    batches = list(build_pretraining_dataloader(ds, micro_batch_size=2, consumed_samples=2))
    assert len(batches) == (len(ds) - 2) // 2
    assert batches[0]["input_ids"].shape == (2, SEQ)
    assert torch.equal(batches[0]["input_ids"][1], ds[3]["input_ids"])


def test_workers_are_shut_down_while_an_error_still_holds_their_iterator(corpus):
    """The workers ignore SIGTERM; an error whose traceback holds the iterator must not leave them alive
    (multiprocessing's exit handler would wait for them forever): shut_down_workers ends them."""
    indexed, _ = corpus
    ds = GPTDataset(indexed, SEQ, seed=0, split="1,0,0")
    batches = iter(build_pretraining_dataloader(ds, micro_batch_size=2, num_workers=2))
    workers = list(batches._workers)

    def read_then_fail(batches):
        next(batches)
        raise ValueError("a bad sample")

    try:
        read_then_fail(batches)
    except ValueError as err:
        held = err                       # the traceback's frame holds the iterator, as sys.exit(2) does
    del batches
    assert all(worker.is_alive() for worker in workers)
    shut_down_workers(held.__traceback__.tb_next.tb_frame.f_locals["batches"])
    assert not any(worker.is_alive() for worker in workers)
