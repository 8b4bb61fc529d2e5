"""BERT data: sentence-split preprocessing, SOP pairs, whole-word n-gram masking, errors.

Most tests use a synthetic sentence corpus written at the token level with the real uncased
vocab: every token id occurs once in the whole corpus, so each token of a sample points back to
its document, sentence and position, which makes order and contiguity checks exact.
"""

import gzip
import json
import os
import pickle

import numpy as np
import pytest
import torch

from zoo.data import (
    IndexedDataset,
    IndexedDatasetBuilder,
    default_bert_corpus_prefix,
    load_bert_tokenizer,
    preprocess_bert,
    split_sentences,
)
from zoo.data.bert_dataset import (
    IGNORE_INDEX,
    BertDataset,
    build_bert_datasets,
    ngram_probabilities,
    sample_ngram_spans,
    truncate_pair,
    whole_words,
)

PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103
SEQ = 128
NUM_SAMPLES = 1200  # several epochs of the synthetic corpus


@pytest.fixture(scope="module")
def tokenizer():
    return load_bert_tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, tokenizer):
    """60 documents of 1..12 sentences of 3..20 words; ~30 % of words carry 1-2 "##" pieces.

    Document 0 has a single sentence (no pair can be made from it). Returns the indexed dataset,
    the sentences as id lists per document, and ``position[id]`` = index of that id in the
    corpus stream (-1 for ids not in the corpus).
    """
    vocab = tokenizer.get_vocab()
    rng = np.random.default_rng(0)
    heads = [i for t, i in vocab.items() if t.isalpha() and t.isascii() and not t.startswith("##")]
    pieces = [i for t, i in vocab.items() if t.startswith("##") and t[2:].isalpha()]
    heads, pieces = list(rng.permutation(heads)), list(rng.permutation(pieces))
    docs = []
    for d in range(60):
        sentences = []
        for _ in range(1 if d == 0 else int(rng.integers(2, 13))):
            sentence = []
            for _ in range(int(rng.integers(3, 21))):
                sentence.append(int(heads.pop()))
                if rng.random() < 0.3:
                    sentence.extend(int(pieces.pop()) for _ in range(int(rng.integers(1, 3))))
            sentences.append(sentence)
        docs.append(sentences)
    prefix = tmp_path_factory.mktemp("bert") / "corpus"
    with IndexedDatasetBuilder(prefix, vocab_size=len(tokenizer)) as builder:
        for sentences in docs:
            for sentence in sentences:
                builder.add_item(sentence)
            builder.end_document()
    stream = [t for sentences in docs for s in sentences for t in s]
    position = np.full(len(tokenizer), -1, dtype=np.int64)
    position[stream] = np.arange(len(stream))
    assert len(set(stream)) == len(stream)
    return IndexedDataset(prefix), docs, position


@pytest.fixture(scope="module")
def dataset(corpus, tokenizer):
    return BertDataset(corpus[0], SEQ, seed=7, split="1,0,0", num_samples=NUM_SAMPLES, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def samples(dataset):
    batch = [dataset[i] for i in range(len(dataset))]
    return {k: torch.stack([s[k] for s in batch]).numpy() for k in batch[0]}


def _originals(samples):
    """Token ids before masking: the label where a position was chosen, else the input."""
    return np.where(samples["labels"] != IGNORE_INDEX, samples["labels"], samples["input_ids"])


# ------------------------------------------------------------------------------------------------
# Preprocessing
# ------------------------------------------------------------------------------------------------


def test_split_sentences_rules():
    text = (
        "The Hobbit was written by J. R. R. Tolkien. It sold well! Did Mr. Smith read it? "
        '"Yes." Sales, e.g. In Europe, rose. it ends 3.5 times lower.\n\nA new paragraph\nA caption'
    )
    assert split_sentences(text) == [
        "The Hobbit was written by J. R. R. Tolkien.",
        "It sold well!",
        "Did Mr. Smith read it?",
        '"Yes."',
        "Sales, e.g. In Europe, rose. it ends 3.5 times lower.",
        "A new paragraph",
        "A caption",
    ]
    assert split_sentences("  \n\n ") == []


def test_preprocess_keeps_one_sequence_per_sentence_and_caches(tmp_path, tokenizer):
    texts = [
        "Anarchism is a philosophy. It rejects the state!\n\nThe term comes from Greek. Proudhon used it.",
        " \n ",  # blank: no document
        "One sentence only.",
    ]
    corpus = tmp_path / "tiny.jsonl.gz"
    with gzip.open(corpus, "wt") as f:
        f.writelines(json.dumps({"id": i, "title": "t", "text": t}) + "\n" for i, t in enumerate(texts))
    cache = tmp_path / "cache"
    prefix = default_bert_corpus_prefix(cache, corpus=corpus, workers=1)
    assert prefix == str(cache / "tiny_bert-uncased_sentences")
    ds = IndexedDataset(prefix)
    want = [split_sentences(texts[0]), split_sentences(texts[2])]
    assert [len(s) for s in want] == [4, 1]
    assert ds.num_documents == 2 and len(ds) == 5 and list(ds.doc_idx) == [0, 4, 5]
    for seq, sentence in enumerate(s for doc in want for s in doc):
        ids = ds[seq].tolist()
        assert ids == tokenizer(sentence, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == sentence.lower()
        assert not set(ids) & {PAD, CLS, SEP, MASK}
    stamp = os.stat(prefix + ".idx").st_mtime_ns
    assert default_bert_corpus_prefix(cache, corpus=corpus) == prefix  # built once
    assert os.stat(prefix + ".idx").st_mtime_ns == stamp

    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    with pytest.raises(ValueError, match="no non-blank documents"):
        preprocess_bert([blank], tmp_path / "o", progress=False)
    assert not list(tmp_path.glob("o.*")) and not list(tmp_path.glob(".zoo-preprocess-*"))


# ------------------------------------------------------------------------------------------------
# Spans, pairs and layout
# ------------------------------------------------------------------------------------------------


def test_spans_partition_each_document_into_multi_sentence_pairs(dataset, corpus):
    indexed, docs, _ = corpus
    epoch = dataset.samples_per_epoch
    assert 0 < epoch < NUM_SAMPLES and dataset.num_epochs >= 2
    doc_of_sentence = np.repeat(np.arange(indexed.num_documents), np.diff(indexed.doc_idx))
    covered = np.zeros(len(indexed), dtype=int)
    targets = []
    for i in range(epoch):
        first, end, target = dataset.sample_span(i)
        assert end - first >= 2, "a pair needs two sentences"
        assert doc_of_sentence[first] == doc_of_sentence[end - 1], "a span stays in one document"
        covered[first:end] += 1
        targets.append(target)
    # One epoch covers every sentence of every document with >= 2 sentences exactly once;
    # the single-sentence document 0 is skipped.
    np.testing.assert_array_equal(covered, (doc_of_sentence != 0).astype(int))
    # Every epoch draws fresh targets: short_seq_prob = 0.1 of them uniform in [2, SEQ - 3].
    targets = np.array([dataset.sample_span(i)[2] for i in range(NUM_SAMPLES)])
    assert targets.max() == SEQ - 3 and targets.min() >= 2
    assert abs(np.mean(targets < SEQ - 3) - 0.1) < 0.035  # 1200 draws: sd 0.009


def test_truncation_matches_the_token_by_token_rule():
    """Closed form vs the paper's loop: drop from the longer segment (B on a tie) until it fits."""
    rng = np.random.default_rng(0)
    for len_a, len_b, limit in [(50, 10, 40), (10, 50, 40), (30, 30, 41), (30, 30, 60), (7, 3, 2), (90, 80, 125)]:
        a, b = np.arange(len_a), np.arange(100, 100 + len_b)
        want_a, want_b = len_a, len_b
        while want_a + want_b > limit:
            if want_a > want_b:
                want_a -= 1
            else:
                want_b -= 1
        fronts = []
        for _ in range(200):
            ta, tb = truncate_pair(a, b, limit, rng)
            assert (len(ta), len(tb)) == (want_a, want_b)
            # What is left is one contiguous piece of each segment.
            assert np.array_equal(ta, np.arange(ta[0], ta[0] + want_a))
            assert np.array_equal(tb, np.arange(tb[0], tb[0] + want_b))
            fronts.append(ta[0] + tb[0] - 100)
        cut = len_a - want_a + len_b - want_b
        # Front or back with p 0.5 per removed token: the mean front cut is cut / 2 (tolerance 4 sd).
        assert abs(np.mean(fronts) - cut / 2) <= 4 * np.sqrt(cut / 4 / 200) + 1e-9


def test_layout_special_tokens_padding_and_lengths(dataset, samples):
    ids, types, attn, labels = (samples[k] for k in ("input_ids", "token_type_ids", "attention_mask", "labels"))
    assert ids.shape == (NUM_SAMPLES, SEQ) and ids.dtype == np.int64
    assert samples["next_sentence_label"].shape == (NUM_SAMPLES,)
    for i in range(NUM_SAMPLES):
        length = int(attn[i].sum())
        assert attn[i, :length].all() and not attn[i, length:].any()
        assert (ids[i, length:] == PAD).all() and (labels[i, length:] == IGNORE_INDEX).all()
        sep = np.flatnonzero(ids[i] == SEP)
        assert ids[i, 0] == CLS and len(sep) == 2 and sep[1] == length - 1
        len_a, len_b = sep[0] - 1, length - sep[0] - 2
        assert len_a >= 1 and len_b >= 1
        assert len_a + len_b <= dataset.sample_span(i)[2] <= SEQ - 3
        np.testing.assert_array_equal(types[i, : sep[0] + 1], 0)
        np.testing.assert_array_equal(types[i, sep[0] + 1 : length], 1)
        assert not types[i, length:].any()
        for special in (0, sep[0], sep[1]):
            assert labels[i, special] == IGNORE_INDEX
    assert np.isin(ids, [PAD, CLS, SEP])[attn == 1].sum() == 3 * NUM_SAMPLES  # no stray specials


def test_sentence_order_labels_balanced_and_correct(dataset, samples, corpus):
    _, _, position = corpus
    original = _originals(samples)
    sop = samples["next_sentence_label"]
    # p = 0.5 swap: tolerance 0.05 is about 3.5 standard deviations at 1200 samples.
    assert abs(sop.mean() - 0.5) < 0.05
    indexed = dataset.indexed
    for i in range(NUM_SAMPLES):
        sep = np.flatnonzero(original[i] == SEP)
        first_seg, second_seg = original[i, 1 : sep[0]], original[i, sep[0] + 1 : sep[1]]
        pos_first, pos_second = position[first_seg], position[second_seg]
        assert (pos_first >= 0).all() and (pos_second >= 0).all()
        # Each segment is one contiguous piece of the document (truncated at its ends only).
        assert (np.diff(pos_first) == 1).all() and (np.diff(pos_second) == 1).all()
        first, end, _ = dataset.sample_span(i)
        lo = position[indexed.get(first)[0]]
        hi = position[indexed.get(end - 1)[-1]]
        assert lo <= min(pos_first[0], pos_second[0]) and max(pos_first[-1], pos_second[-1]) <= hi
        if sop[i] == 0:
            assert pos_first[-1] < pos_second[0], f"sample {i}: label 0 but A does not precede B"
        else:
            assert pos_second[-1] < pos_first[0], f"sample {i}: label 1 but the segments are in order"


def test_deterministic_by_seed_and_picklable(dataset, corpus, tokenizer):
    again = BertDataset(corpus[0], SEQ, seed=7, split="1,0,0", num_samples=50, tokenizer=tokenizer)
    other = BertDataset(corpus[0], SEQ, seed=8, split="1,0,0", num_samples=50, tokenizer=tokenizer)
    clone = pickle.loads(pickle.dumps(dataset))
    differs = 0
    for i in (0, 17, 49):
        x = dataset[i]
        for y in (dataset[i], again[i], clone[i]):
            assert all(torch.equal(x[k], y[k]) for k in x)
        differs += not torch.equal(x["input_ids"], other[i]["input_ids"])
    assert differs == 3


# ------------------------------------------------------------------------------------------------
# Masking
# ------------------------------------------------------------------------------------------------


def test_masking_rate_and_80_10_10(dataset, samples):
    ids, labels, attn = samples["input_ids"], samples["labels"], samples["attention_mask"]
    original = _originals(samples)
    content = (attn == 1) & ~np.isin(original, [CLS, SEP])
    chosen = labels != IGNORE_INDEX
    assert not (chosen & ~content).any(), "only content tokens are masked"
    per_sample = chosen.sum(1)
    budget = np.maximum(1, np.rint(0.15 * content.sum(1)))
    assert (per_sample >= 1).all() and (per_sample <= budget).all()
    # Overall 15 % of content tokens: tolerance 0.005 (round() and "at least 1" on short samples
    # lift it a little; it falls short only when no whole word fits the rest of the budget).
    assert abs(chosen.sum() / content.sum() - 0.15) < 0.005
    n = chosen.sum()  # ~15,000 masked tokens: the tolerances below are ~4 standard deviations
    assert n > 10000
    as_mask = (ids == MASK) & chosen
    kept = (ids == labels) & chosen
    replaced = chosen & ~as_mask & ~kept
    assert abs(as_mask.sum() / n - 0.8) < 0.013
    assert abs(kept.sum() / n - 0.1) < 0.01
    assert abs(replaced.sum() / n - 0.1) < 0.01
    random_ids = ids[replaced]
    assert not np.isin(random_ids, dataset.vocab.random_ids, invert=True).any()
    assert not np.isin(random_ids, [PAD, UNK, CLS, SEP, MASK]).any() and (random_ids >= 999).all()  # no [unusedN]


def test_whole_words_never_split(dataset, samples):
    original = _originals(samples)
    chosen = samples["labels"] != IGNORE_INDEX
    content = (samples["attention_mask"] == 1) & ~np.isin(original, [CLS, SEP])
    continuation = dataset.vocab.is_continuation[original] & content
    # A "##" piece whose left neighbour is a content token belongs to that neighbour's word.
    inside_word = continuation[:, 1:] & content[:, :-1]
    assert inside_word.sum() > 1000
    assert (chosen[:, 1:] == chosen[:, :-1])[inside_word].all()
    # And some masked words really are multi-piece (the check is not vacuous).
    assert (chosen[:, 1:] & inside_word).sum() > 100


def test_whole_words_of_a_truncated_segment():
    maskable = np.array([0, 1, 1, 1, 0, 1, 1, 0], dtype=bool)
    is_cont = np.array([0, 1, 0, 1, 0, 1, 1, 1], dtype=bool)  # position 1: "##" right after [CLS]
    starts, ends = whole_words(maskable, is_cont)
    assert starts.tolist() == [1, 2, 5] and ends.tolist() == [2, 4, 7]


@pytest.mark.parametrize("budget,tolerance", [(75, 0.015), (19, 0.04)])
def test_ngram_lengths_follow_one_over_n(budget, tolerance):
    """Realized n-gram lengths vs p(n) = (1/n) / (1 + 1/2 + 1/3) = 6/11, 3/11, 2/11.

    Stated tolerance: cutting the last n-gram to fit the token budget shifts mass to n=1, by
    ~0.01 at 512-token samples (budget 75) and ~0.03 at 128 (budget 19). Megatron's
    overlap-rejection order would give ~0.60 for n=1 and fail the 19-token case.
    """
    rng = np.random.default_rng(3)
    counts = np.zeros(4)
    for _ in range(400 if budget > 50 else 1500):
        num_words = budget * 7 // 2  # ~500 or ~125 tokens at 1.4 tokens per word
        lengths = rng.choice([1, 1, 1, 2, 3], size=num_words)
        ends = np.cumsum(lengths) + np.repeat([1, 2], [num_words // 2, num_words - num_words // 2])  # a [SEP] gap
        starts = ends - lengths
        spans = sample_ngram_spans(starts, ends, budget, 3, rng)
        tokens = sum(ends[w + n - 1] - starts[w] for w, n in spans)
        assert budget - 2 <= tokens <= budget
        for w, n in spans:
            assert (ends[w : w + n - 1] == starts[w + 1 : w + n]).all(), "an n-gram never jumps over [SEP]"
            counts[n] += 1
    realized = counts[1:] / counts.sum()
    np.testing.assert_allclose(realized, ngram_probabilities(3), atol=tolerance)
    np.testing.assert_allclose(ngram_probabilities(3), [6 / 11, 3 / 11, 2 / 11])


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def test_errors(tmp_path, corpus, tokenizer):
    indexed = corpus[0]
    with pytest.raises(ValueError, match=r"max_seq_length=128 exceeds .*max_position_embeddings=64"):
        BertDataset(indexed, SEQ, seed=1, tokenizer=tokenizer, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"30522.*vocab_size=30000"):
        BertDataset(indexed, SEQ, seed=1, tokenizer=tokenizer, vocab_size=30000)

    with IndexedDatasetBuilder(tmp_path / "empty", vocab_size=30522):
        pass
    with pytest.raises(ValueError, match="empty"):
        BertDataset(tmp_path / "empty", SEQ, seed=1, tokenizer=tokenizer)

    with IndexedDatasetBuilder(tmp_path / "gpt_style", vocab_size=30522) as b:  # one sequence per document
        for d in range(4):
            b.add_document(np.arange(2000 + 10 * d, 2010 + 10 * d))
    with pytest.raises(ValueError, match="two or more sentences"):
        BertDataset(tmp_path / "gpt_style", SEQ, seed=1, tokenizer=tokenizer)

    for kwargs, text in [
        ({"masked_lm_prob": 0.0}, "masked_lm_prob=0.0"),
        ({"max_ngram": 0}, "max_ngram=0"),
        ({"which": "dev"}, "which='dev'"),
        ({"max_seq_length": 4}, "max_seq_length=4"),
    ]:
        args = {"max_seq_length": SEQ, **kwargs}
        with pytest.raises(ValueError, match=text):
            BertDataset(indexed, seed=1, tokenizer=tokenizer, **args)


def test_build_bert_datasets_splits(corpus, tokenizer):
    train, valid, test = build_bert_datasets(corpus[0].prefix, SEQ, seed=1, split="8,2,0", tokenizer=tokenizer)
    assert [d.document_range for d in (train, valid, test)] == [(0, 48), (48, 60), (60, 60)]
    assert len(train) > len(valid) > 0 and len(test) == 0
    first_valid = {train.sample_span(i)[0] for i in range(len(train))} & {
        valid.sample_span(i)[0] for i in range(len(valid))
    }
    assert not first_valid
