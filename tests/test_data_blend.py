"""Blending several corpora by weight (--data-path W1 P1 W2 P2 ...): the shares, the shared index built
once, the same sample sequence at any data-parallel degree and after a resume, and the one-sentence
errors for bad blends and splits."""

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.blend_corpora import CORPUS_IDS, EOD, SEQ, WEIGHTS, blend_items, data_fields, write_corpus
from tests.helpers.pretraining import run_config as pretrain_config
from tests.helpers.pretraining import train_events
from tests.spawn import spawn
from zoo.data import BertDataset, GPTDataset, IndexedDatasetBuilder
from zoo.data.blend_cache import blend_cache_path, shared_blend_index
from zoo.data.blending import BlendedDataset, blend_index, check_data_path, parse_data_path
from zoo.models import model_config
from zoo.parallel import ParallelState
from zoo.training.pretraining_data import PretrainingData

SINGLE = ParallelState.single()


@pytest.fixture
def corpora(tmp_path):
    return [write_corpus(tmp_path / f"corpus{k}", k) for k in range(3)]


def corpus_of(input_ids: torch.Tensor) -> np.ndarray:
    """Which corpus each window of ``input_ids`` (b, s) came from (ids other than EOD name it)."""
    ids = input_ids.numpy()
    return np.array([int(np.median(row[row != EOD])) // CORPUS_IDS for row in ids])


def read_global_batches(data: PretrainingData, consumed: int, micro: int, steps: int) -> list[torch.Tensor]:
    return [data.train_micro_batches(consumed, 1)[0]["input_ids"] for _ in range(steps)]


def test_shares_match_the_weights_in_every_global_batch(corpora):
    """10,000 samples of a 0.2/0.3/0.5 blend: each corpus's share within 1 % of its weight overall, and
    within 1 + K * w samples in every global batch of 50."""
    data = PretrainingData(data_fields(blend_items(corpora), train_iters=200), model_config("gpt2-tiny"), SINGLE,
                           micro_batch=50, global_batch=50, workers=0, pin_memory=False)
    train = data.train
    assert isinstance(train, BlendedDataset) and len(train) == 10_000
    assert data.indexed is None and all(isinstance(d, GPTDataset) for d in train.datasets)
    served = corpus_of(torch.stack([train[i]["input_ids"] for i in range(len(train))]))
    np.testing.assert_array_equal(served, np.asarray(train.index.corpus))
    for k, weight in enumerate(WEIGHTS):
        assert abs(np.mean(served == k) - weight) <= 0.01
        per_batch = (served.reshape(-1, 50) == k).sum(axis=1)
        assert np.abs(per_batch - 50 * weight).max() <= 1 + 3 * weight


def test_one_corpus_of_positive_weight_reads_as_a_single_prefix(corpora):
    """A single prefix, and a blend where only one corpus weighs anything, give the plain dataset of that
    corpus (the same windows in the same order), with no blend index written."""
    single = PretrainingData(data_fields(corpora[2], 4), model_config("gpt2-tiny"), SINGLE, 2, 4, 0, False)
    zeroed = PretrainingData(data_fields(["0", corpora[0], "0", corpora[1], "3", corpora[2]], 4),
                             model_config("gpt2-tiny"), SINGLE, 2, 4, 0, False)
    for data in (single, zeroed):
        assert isinstance(data.train, GPTDataset) and data.indexed.prefix == corpora[2]
    reference = GPTDataset(corpora[2], SEQ, 1234, split="90,10,0", num_samples=16)
    for i in range(16):
        assert torch.equal(zeroed.train[i]["input_ids"], reference[i]["input_ids"])
    assert not list(Path(corpora[2]).parent.glob("*.blend-*"))


def _read_at_tp2(rank, world_size, prefixes, micro, global_batch, steps, resume_at):
    """tp=2 x dp=2: the blend index (built once), each step's micro-batch of this rank, and the same
    after a restart at ``resume_at`` consumed samples."""
    ps = ParallelState.initialize(2)
    config = data_fields(blend_items(prefixes), train_iters=steps * global_batch // (micro * ps.dp_size))
    data = PretrainingData(config, model_config("gpt2-tiny"), ps, micro, global_batch, 0, False)
    batches = [data.train_micro_batches(0, 1)[0]["input_ids"] for _ in range(steps)]
    resumed = PretrainingData(config, model_config("gpt2-tiny"), ps, micro, global_batch, 0, False)
    after = [resumed.train_micro_batches(resume_at, 1)[0]["input_ids"] for _ in range(steps - resume_at // (micro * 2))]
    return ps.tp_rank, ps.dp_rank, data.train.index.built_here, batches, after


def test_index_built_once_across_4_ranks_and_same_sequence_at_dp1_dp2_and_after_resume(corpora):
    micro, global_batch, steps = 4, 8, 12
    results = spawn(_read_at_tp2, 4, corpora, micro, global_batch, steps, 5 * micro * 2)
    assert sum(built for _, _, built, _, _ in results) == 1
    assert len(list(Path(corpora[0]).parent.glob("*.blend-*.npy"))) == 1
    by_rank = {(tp, dp): (batches, after) for tp, dp, _, batches, after in results}
    for dp in (0, 1):  # both tensor-parallel ranks of a data-parallel rank read the same samples
        for mine, theirs in zip(by_rank[(0, dp)][0], by_rank[(1, dp)][0]):
            assert torch.equal(mine, theirs)
    dp2 = torch.cat([torch.cat([by_rank[(0, 0)][0][s], by_rank[(0, 1)][0][s]]) for s in range(steps)])
    resumed = torch.cat([torch.cat([a, b]) for a, b in zip(by_rank[(0, 0)][1], by_rank[(0, 1)][1])])

    one = PretrainingData(data_fields(blend_items(corpora), train_iters=steps * micro * 2 // global_batch),
                          model_config("gpt2-tiny"), SINGLE, global_batch, global_batch, 0, False)
    dp1 = torch.cat(read_global_batches(one, 0, global_batch, steps * micro * 2 // global_batch))
    assert torch.equal(dp2, dp1)
    assert torch.equal(resumed, dp1[5 * micro * 2 :])
    assert len(set(corpus_of(dp1).tolist())) == 3


def test_bert_pretraining_blends_its_corpora(tmp_path):
    """Two sentence-per-sequence corpora blended 1:3 for BERT: a BlendedDataset of BertDatasets whose
    sample i is sample sample[i] of corpus corpus[i], each corpus split by its own documents."""
    prefixes = []
    for k in range(2):
        rng = np.random.default_rng(k)
        prefix = tmp_path / f"bert{k}"
        with IndexedDatasetBuilder(prefix, vocab_size=30522) as builder:
            for _ in range(30):
                for n in rng.integers(3, 12, size=4):
                    builder.add_item(rng.integers(2000 + 10000 * k, 12000 + 10000 * k, size=n))
                builder.end_document()
        prefixes.append(str(prefix))
    config = data_fields(["1", prefixes[0], "3", prefixes[1]], train_iters=10, eval_interval=5)
    config.seq_length = 32
    data = PretrainingData(config, model_config("bert-tiny"), SINGLE, 2, 4, 0, False)
    assert all(isinstance(d, BertDataset) for d in data.train.datasets + data.valid.datasets)
    assert [d.document_range for d in data.train.datasets] == [(0, 27), (0, 27)]
    assert BlendedDataset.counts(data.train.index, 2, 40) == [10, 30]
    for i in (0, 1, 17, 39):
        k, j = int(data.train.index.corpus[i]), int(data.train.index.sample[i])
        assert torch.equal(data.train[i]["input_ids"], data.train.datasets[k][j]["input_ids"])


def test_parse_data_path_normalises_weights():
    assert parse_data_path(None) is None
    assert parse_data_path("a") == parse_data_path(["a"]) == [(1.0, "a")]
    assert parse_data_path(["1", "a", "3", "b"]) == [(0.25, "a"), (0.75, "b")]
    assert parse_data_path([0.5, "a", 1.5, "b"]) == [(0.25, "a"), (0.75, "b")]


def test_bad_blends_and_splits_are_one_sentence(corpora, tmp_path):
    a, b, _ = corpora
    cases = [
        (["0.5", a, "x", b], ValueError, f"--data-path weight 'x' (before prefix '{b}') is not a number; give "
         "W1 PREFIX1 W2 PREFIX2 ... (weights with indexed-dataset prefixes), or a single prefix."),
        (["0.5", a, "-0.2", b], ValueError, f"--data-path weight -0.2 of '{b}' is negative; give every corpus a "
         "weight >= 0 (they are normalised to sum to 1)."),
        (["0", a, "0.0", b], ValueError, "--data-path weights 0 0.0 are all zero; give at least one corpus a "
         "positive weight."),
        (["0.5", a, "0.5"], ValueError, f"--data-path has 3 items (0.5 {a} 0.5), an odd number; give W1 PREFIX1 W2 "
         "PREFIX2 ... (weights with indexed-dataset prefixes), or a single prefix."),
        ([], ValueError, "--data-path is empty; give W1 PREFIX1 W2 PREFIX2 ... (weights with indexed-dataset "
         "prefixes), or a single prefix."),
        (["0.5", a, "0.5", str(tmp_path / "nope")], FileNotFoundError, f"--data-path {tmp_path / 'nope'} "
         f"names no indexed dataset ({tmp_path / 'nope'}.bin and {tmp_path / 'nope'}.idx are missing); pass the "
         "--output-prefix that launch/preprocess.py wrote, without .bin or .idx."),
    ]
    wide = write_corpus(tmp_path / "wide", 1, dtype=np.int32)
    cases.append((["1", a, "1", wide], ValueError, f"--data-path corpora '{a}' and '{wide}' hold token ids of "
                  "different dtypes (uint16 and int32), so they come from different vocabularies; preprocess every "
                  "corpus of a blend with the same tokenizer."))
    other = write_corpus(tmp_path / "other", 1, end_id=2)
    cases.append((["1", a, "1", other], ValueError, f"--data-path corpora '{a}' and '{other}' end their documents "
                  "with different end-of-document ids (50256 and 2), so they were tokenized with different "
                  "vocabularies; preprocess every corpus of a blend with the same tokenizer."))
    sentences = tmp_path / "sentences"
    with IndexedDatasetBuilder(sentences, vocab_size=30522) as builder:
        for _ in range(5):
            builder.add_item([2000, 2001, 1012])
            builder.add_item([2002, 1012])
            builder.end_document()
    cases.append((["1", a, "1", str(sentences)], ValueError, f"--data-path corpus '{sentences}' holds one sequence "
                  f"per sentence (BERT preprocessing) but '{a}' one per document (GPT preprocessing), so they were "
                  "tokenized for different models; preprocess every corpus of a blend with the same tokenizer and "
                  "script."))
    for data_path, kind, message in cases:
        with pytest.raises(kind) as caught:
            check_data_path(data_path)
        assert str(caught.value) == message
    for split in ("0,0,0", "-1,2,0"):
        with pytest.raises(ValueError) as caught:
            check_data_path(blend_items(corpora), split)
        assert str(caught.value) == (f"split {split!r} is invalid; give three non-negative train,valid,test "
                                     "weights such as '969,30,1'.")
    assert check_data_path(blend_items(corpora), "949,50,1") == parse_data_path(blend_items(corpora))
    assert not list(tmp_path.glob("*.blend-*"))


def test_cache_path_depends_on_the_blend(corpora):
    blend = parse_data_path(blend_items(corpora))
    assert blend_cache_path(blend, 100).parent == Path(corpora[0]).parent
    assert blend_cache_path(blend, 100) != blend_cache_path(blend, 101)
    assert blend_cache_path(blend, 100) != blend_cache_path(parse_data_path(blend_items(corpora, (1, 1, 1))), 100)


def _pretrain_on_a_blend(rank, world_size, data_path, save):
    from zoo.training.pretrain import pretrain  # local: imports DeepSpeed (~1.5 s), needed only by this test

    pretrain(pretrain_config(data_path, save, 1, 2, 4, train_iters=2))  # what --data-path 0.5 A 0.5 B parses to


def test_pretraining_trains_on_a_blend(corpora, tmp_path):
    """--data-path 0.5 A 0.5 B reaches the training loop: two iterations logged with a finite loss."""
    spawn(_pretrain_on_a_blend, 1, ["0.5", corpora[0], "0.5", corpora[1]], str(tmp_path / "run"))
    events = train_events(tmp_path / "run")
    assert [e["iteration"] for e in events] == [1, 2] and all(np.isfinite(e["loss"]) for e in events)
    assert len(list(Path(corpora[0]).parent.glob("corpus0.blend-*.npy"))) == 1


def test_index_is_a_prefix_of_any_longer_one_whatever_the_chunk():
    """A run that trains further (or builds its index in other chunks) continues the same sequence."""
    short, long = blend_index(WEIGHTS, 5_000, chunk=7), blend_index(WEIGHTS, 20_000)
    np.testing.assert_array_equal(short[0], long[0][:5_000])
    np.testing.assert_array_equal(short[1], long[1][:5_000])
    for k in range(3):  # each corpus's samples are used in order 0, 1, 2, ...
        np.testing.assert_array_equal(long[1][long[0] == k], np.arange(np.count_nonzero(long[0] == k)))


def test_a_damaged_blend_index_is_one_sentence_and_left_in_place(corpora):
    blend = parse_data_path(blend_items(corpora))
    path = shared_blend_index(blend, 100).path
    with open(path, "r+b") as damaged:
        damaged.truncate(300)
    with pytest.raises(ValueError) as caught:
        shared_blend_index(blend, 100)
    assert str(caught.value) == (f"blend index {path} does not hold the 100 blend entries its name stands for; "
                                 "delete it so that the next run rebuilds it.")
    assert path.stat().st_size == 300
