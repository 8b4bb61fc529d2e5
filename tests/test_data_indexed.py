"""The mmap indexed dataset: round trip, Megatron's byte layout, atomic writes and errors."""

import os
import struct

import numpy as np
import pytest

from zoo.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_fitting_dtype


def _docs(rng, n=7, high=50257):
    return [rng.integers(0, high, size=int(k)) for k in rng.integers(0, 40, size=n)]


def test_round_trip_documents_and_mmap(tmp_path):
    rng = np.random.default_rng(0)
    docs = _docs(rng)
    prefix = tmp_path / "rt"
    with IndexedDatasetBuilder(prefix, vocab_size=50257) as b:
        for d in docs:
            b.add_document(d)
        b.add_item([1, 2, 3])  # a document of two sequences
        b.add_item([4])
        b.end_document()
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16
    assert len(ds) == len(docs) + 2 and ds.num_documents == len(docs) + 1
    np.testing.assert_array_equal(ds.doc_idx, list(range(len(docs) + 1)) + [len(docs) + 2])
    np.testing.assert_array_equal(ds.sizes, [len(d) for d in docs] + [3, 1])
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        np.testing.assert_array_equal(ds.document(i), d)
    np.testing.assert_array_equal(ds.document(len(docs)), [1, 2, 3, 4])
    np.testing.assert_array_equal(ds[-1], [4])
    long = int(np.argmax(ds.sizes))
    np.testing.assert_array_equal(ds.get(long, 3, 5), docs[long][3:8])
    np.testing.assert_array_equal(ds.get(long, 2), docs[long][2:])
    # Reads are views of the mapped files, not copies.
    assert isinstance(ds[long], np.memmap) and isinstance(ds.get(long, 1, 2), np.memmap)
    assert isinstance(ds.sizes, np.memmap) and isinstance(ds.doc_idx, np.memmap)
    assert ds.num_tokens == sum(map(len, docs)) + 4
    with pytest.raises(IndexError):
        ds.get(long, 1, int(ds.sizes[long]))
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert sorted(os.listdir(tmp_path)) == ["rt.bin", "rt.idx"]  # no temporaries left


def test_dtype_choice_and_large_ids(tmp_path):
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65500) == np.int32 and best_fitting_dtype(None) == np.int32
    with IndexedDatasetBuilder(tmp_path / "big", vocab_size=70000) as b:
        b.add_document([0, 65535, 69999])
    ds = IndexedDataset(tmp_path / "big")
    assert ds.dtype == np.int32
    np.testing.assert_array_equal(ds[0], [0, 65535, 69999])
    b = IndexedDatasetBuilder(tmp_path / "small", vocab_size=50257)
    with pytest.raises(ValueError, match="outside uint16"):
        b.add_document([70000])
    b.abort()
    assert sorted(os.listdir(tmp_path)) == ["big.bin", "big.idx"]


def test_megatron_byte_layout_written(tmp_path):
    docs = [[5, 6, 7], [50256], [1, 2]]
    with IndexedDatasetBuilder(tmp_path / "m", vocab_size=50257) as b:
        for d in docs:
            b.add_document(d)
    raw = (tmp_path / "m.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", raw[9:34])
    assert (version, code, n_seq, n_doc) == (1, 8, 3, 4)  # code 8 = uint16
    sizes = struct.unpack("<3i", raw[34:46])
    pointers = struct.unpack("<3q", raw[46:70])
    doc_idx = struct.unpack("<4q", raw[70:102])
    assert len(raw) == 102
    assert sizes == (3, 1, 2) and pointers == (0, 6, 8) and doc_idx == (0, 1, 2, 3)
    assert (tmp_path / "m.bin").read_bytes() == struct.pack("<6H", 5, 6, 7, 50256, 1, 2)


def test_reads_file_laid_out_by_hand(tmp_path):
    """An index written byte by byte per Megatron's layout (int32 tokens, 2 sentences in doc 0)."""
    tokens = np.array([10, 11, 12, 13, 14, 15], dtype="<i4")
    sizes, pointers, doc_idx = [2, 1, 3], [0, 8, 12], [0, 2, 3]
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, len(sizes), len(doc_idx))
    body = struct.pack("<3i", *sizes) + struct.pack("<3q", *pointers) + struct.pack("<3q", *doc_idx)
    (tmp_path / "h.idx").write_bytes(header + body)
    (tmp_path / "h.bin").write_bytes(tokens.tobytes())
    ds = IndexedDataset(tmp_path / "h")
    assert ds.dtype == np.int32 and len(ds) == 3 and ds.num_documents == 2
    np.testing.assert_array_equal(ds[1], [12])
    np.testing.assert_array_equal(ds.document(0), [10, 11, 12])
    np.testing.assert_array_equal(ds.document(1), [13, 14, 15])


def test_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere"):
        IndexedDataset(tmp_path / "nothere")
    with IndexedDatasetBuilder(tmp_path / "ok", vocab_size=100) as b:
        b.add_document([1, 2, 3, 4])
    good_idx = (tmp_path / "ok.idx").read_bytes()

    (tmp_path / "ok.idx").write_bytes(b"TNTIDX\x00\x00\x00" + good_idx[9:])
    with pytest.raises(ValueError, match=r"ok\.idx.*magic"):
        IndexedDataset(tmp_path / "ok")
    (tmp_path / "ok.idx").write_bytes(good_idx[:40])
    with pytest.raises(ValueError, match=r"ok\.idx.*truncated"):
        IndexedDataset(tmp_path / "ok")
    (tmp_path / "ok.idx").write_bytes(good_idx[:20])
    with pytest.raises(ValueError, match=r"ok\.idx.*truncated"):
        IndexedDataset(tmp_path / "ok")
    (tmp_path / "ok.idx").write_bytes(good_idx)
    (tmp_path / "ok.bin").write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match=r"ok\.bin.*truncated"):
        IndexedDataset(tmp_path / "ok")


def test_failed_build_leaves_nothing(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "old", vocab_size=100) as b:
        b.add_document([1, 2])
    before = {p: (tmp_path / p).read_bytes() for p in ("old.bin", "old.idx")}
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "old", vocab_size=100) as b:
            b.add_document([7, 7, 7])
            raise RuntimeError("crash mid-build")
    assert sorted(os.listdir(tmp_path)) == ["old.bin", "old.idx"]
    assert {p: (tmp_path / p).read_bytes() for p in before} == before


def test_pickle_reopens(tmp_path):
    import pickle

    with IndexedDatasetBuilder(tmp_path / "p", vocab_size=100) as b:
        b.add_document([3, 1, 4, 1, 5])
    ds = pickle.loads(pickle.dumps(IndexedDataset(tmp_path / "p")))
    np.testing.assert_array_equal(ds[0], [3, 1, 4, 1, 5])
    assert isinstance(ds[0], np.memmap)
