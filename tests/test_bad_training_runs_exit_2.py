"""Hostile inputs to pretraining: each ends in one sentence on every
rank, never a traceback, a transport error on another rank, or a silent run on garbage.

The unit checks run in the pytest process. The ones that need ranks share one 2-process spawn
(``test_hostile_runs_end_in_one_sentence_on_every_rank``): one tiny tp=2 run is saved, then resumed
under a longer schedule, with another model shape, into a --save under a file, and from a tag with a
truncated rank file; a tp=1 x dp=2 run reads a planted out-of-vocabulary id on DP rank 1 only.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import struct

import numpy as np
import pytest

from tests.helpers.pretraining import TINY_MODEL, run_config
from tests.helpers.pretraining import ds_config as _ds_config
from tests.spawn import spawn
from zoo.errors import UserError


def _one_sentence(message: str) -> str:
    assert "\n" not in message, f"not one sentence: {message!r}"
    assert message.rstrip().endswith("."), f"not a sentence: {message!r}"
    return message


def _run_config(data_path, save, tp, micro, global_batch, train_iters, **changes):
    """tests/helpers/pretraining.py's run config at 16 tokens, all documents in the training split."""
    return run_config(data_path, save, tp, micro, global_batch, train_iters,
                      **{"seq_length": 16, "split": "1,0,0", **changes})


def _token_file(prefix, tokens, dtype=np.uint16):
    """One document of ``tokens``, written in Megatron's layout."""
    from zoo.data.indexed_dataset import IndexedDatasetBuilder

    with IndexedDatasetBuilder(prefix, dtype=dtype) as builder:
        builder.add_document(np.asarray(tokens))
    return str(prefix)


# ----------------------------------------------------------------------------- zoo block types
@pytest.mark.parametrize("key, value, needle", [
    ("train_iters", "6", "zoo setting 'train_iters' in .* is \"6\" \\(a string\\) but must be an integer"),
    ("tensor_parallel_size", True, "'tensor_parallel_size' .* is true \\(a boolean\\) but must be an integer"),
    ("checkpoint_activations", "yes", "'checkpoint_activations' .* must be true or false"),
    ("model_overrides", [], "'model_overrides' .* is \\[\\] \\(a list\\) but must be a JSON object"),
    ("data_path", 5, "'data_path' .* is 5 \\(an integer\\) but must be a string or a list of strings or null"),
    ("save_interval", -1, "save_interval = -1 must be 0 \\(never\\) or positive"),
    ("save", None, "save is None in the zoo block of .*; pass --save with the run directory"),
])
def test_zoo_block_of_the_wrong_type_names_the_key(key, value, needle, tmp_path, capsys):
    from zoo.cli.pretrain import main

    config = dict(_ds_config(2, 2), zoo={"model": "gpt2-tiny", key: value})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    flags = [] if key == "save" else ["--save", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exit_:
        main(["--deepspeed_config", str(path), *flags])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, errors
    assert re.search(needle, _one_sentence(errors[0])), errors
    assert not (tmp_path / "run").exists()


def test_zoo_block_that_is_not_an_object(tmp_path):
    import argparse

    from zoo.config.loading import load_run_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(dict(_ds_config(2, 2), zoo=[1])))
    with pytest.raises(ValueError, match=r"the zoo block of .*ds\.json is \[1\], not a JSON object") as err:
        load_run_config(argparse.Namespace(deepspeed_config=str(path)))
    _one_sentence(str(err.value))


# ----------------------------------------------------------------------------- index validated on open
def _patch(path, offset, fmt, value):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(struct.pack(fmt, value))


@pytest.mark.parametrize("field, needle", [
    ("size", r"sequence 1 has a negative size -3"),
    ("doc_idx", r"names sequence 9, past the 3 sequences"),
    ("doc_idx_order", r"document 1 ends at sequence 0, before it starts at 1"),
    ("pointer", r"sequence 2 starts at byte 7, not a non-negative multiple of the 2-byte token size"),
])
def test_corrupt_index_is_refused_on_open(field, needle, tmp_path):
    from zoo.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    prefix = tmp_path / "c"
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as builder:
        for doc in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
            builder.add_document(doc)
    IndexedDataset(prefix)  # intact
    n, header = 3, 34
    offsets = {"size": (header + 4 * 1, "<i", -3), "pointer": (header + 4 * n + 8 * 2, "<q", 7),
               "doc_idx": (header + 12 * n + 8 * 2, "<q", 9), "doc_idx_order": (header + 12 * n + 8 * 2, "<q", 0)}
    offset, fmt, value = offsets[field]
    _patch(f"{prefix}.idx", offset, fmt, value)
    with pytest.raises(ValueError, match=needle) as err:
        IndexedDataset(prefix)
    assert "c.idx" in str(err.value) and "rebuild it" in _one_sentence(str(err.value))


# ----------------------------------------------------------------------------- 5. ids outside the vocabulary
def test_gpt_samples_with_ids_outside_the_vocabulary_are_refused(tmp_path):
    from zoo.data import GPTDataset

    rng = np.random.default_rng(0)
    good = _token_file(tmp_path / "good", rng.integers(0, 50257, 64))
    dataset = GPTDataset(good, 16, 1, split="1,0,0", vocab_size=50257)
    assert all(int(dataset[i]["input_ids"].max()) < 50257 for i in range(len(dataset)))

    random_bytes = _token_file(tmp_path / "bytes", rng.integers(0, 65536, 64))  # e.g. a .bin of random bytes
    with pytest.raises(ValueError, match=r"bytes\.bin holds token id \d+ in sample 0 of the train split, outside "
                                         r"the model's vocabulary of 50257 ids") as err:
        GPTDataset(random_bytes, 16, 1, split="1,0,0", vocab_size=50257)[0]
    _one_sentence(str(err.value))
    negative = _token_file(tmp_path / "neg", [5] * 31 + [-4], dtype=np.int16)
    with pytest.raises(ValueError, match=r"neg\.bin holds token id -4 in sample \d of the train split"):
        [GPTDataset(negative, 16, 1, split="1,0,0", vocab_size=50257)[i] for i in range(2)]


def test_bert_samples_with_negative_ids_are_refused(tmp_path):
    from zoo.data import BertDataset
    from zoo.data.indexed_dataset import IndexedDatasetBuilder

    prefix = tmp_path / "bert"
    with IndexedDatasetBuilder(prefix, dtype=np.int32) as builder:
        for sentence in ([2000, 2001, 2002], [-7, 2003], [2004, 2005, 2006]):
            builder.add_item(np.asarray(sentence))
        builder.end_document()
    dataset = BertDataset(prefix, max_seq_length=16, seed=1, split="1,0,0")
    with pytest.raises(ValueError, match=r"bert\.bin holds token id -7 in sample 0 of the train split, outside "
                                         r"the model's vocabulary of 30522 ids"):
        [dataset[i] for i in range(len(dataset))]


# ----------------------------------------------------------------------------- `latest` naming a missing tag
def test_latest_naming_a_missing_tag_says_the_callers_fix(tmp_path):
    from zoo.checkpoint.files import tag_directory
    from zoo.checkpoint.resume import LATEST_FIX

    root = tmp_path / "checkpoints"
    (root / "iter_0000002").mkdir(parents=True)
    (root / "iter_0000002" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (root / "latest").write_text("iter_0000004")
    with pytest.raises(FileNotFoundError) as err:
        tag_directory(root, fix=LATEST_FIX)  # pretraining: there is no --tag flag
    message = _one_sentence(str(err.value))
    assert "--tag" not in message and "'iter_0000004' is not a directory" in message
    assert f"into {root / 'latest'}" in message and "['iter_0000002']" in message
    with pytest.raises(FileNotFoundError, match=r"pass --tag with one of \['iter_0000002'\]"):
        tag_directory(root)  # export and evaluation keep their --tag
    (root / "latest").write_text("\n")
    with pytest.raises(FileNotFoundError, match=r"checkpoint tag '' is not a directory"):
        tag_directory(root, fix=LATEST_FIX)


# ----------------------------------------------------------------------------- schedules (pure parts)
def test_warmup_longer_than_the_run_is_cut_with_a_warning():
    from zoo.config.deepspeed_dict import clipped_warmup_warning, deepspeed_dict

    config = _run_config(None, "unused", 1, 2, 2, train_iters=3)
    config.ds_config["scheduler"]["params"]["warmup_num_steps"] = 2000
    params = deepspeed_dict(config, 1)["scheduler"]["params"]
    assert (params["total_num_steps"], params["warmup_num_steps"]) == (3, 3)   # Megatron's clip, kept
    warning = _one_sentence(clipped_warmup_warning(config))
    assert "warm-up of 2000 steps" in warning and "cut to 3 steps" in warning and "--train-iters" in warning
    config.ds_config["scheduler"]["params"]["warmup_num_steps"] = 3
    assert clipped_warmup_warning(config) is None


def test_schedule_change_names_old_and_new():
    from zoo.config.deepspeed_dict import schedule_change_warning

    old = {"type": "WarmupCosineLR", "total_num_steps": 3, "warmup_num_steps": 3, "cos_min_ratio": 0.1}
    new = dict(old, total_num_steps=6, warmup_num_steps=6)
    warning = _one_sentence(schedule_change_warning(old, new, 3))
    assert ("LR schedule WarmupCosineLR(total_num_steps=3, warmup_num_steps=3) and this run continues with "
            "WarmupCosineLR(total_num_steps=6, warmup_num_steps=6)") in warning
    assert "from iteration 3" in warning
    assert schedule_change_warning(old, dict(old), 3) is None
    assert "none (a constant learning rate)" in schedule_change_warning(None, new, 3)


def test_model_config_differences_ignore_dropout():
    from zoo.checkpoint.resume import model_config_differences

    recorded = {"n_layer": 2, "n_embd": 64, "resid_pdrop": 0.1, "model_type": "gpt2"}
    assert model_config_differences(recorded, dict(recorded, resid_pdrop=0.0)) == []
    assert model_config_differences(recorded, dict(recorded, n_layer=3, n_embd=32)) == [
        "n_embd 64 in the checkpoint, 32 in this run", "n_layer 2 in the checkpoint, 3 in this run"]


# ----------------------------------------------------------------------------- the runs on ranks
def _outcome(fn):
    """("ok", value) or (exception type name, message), with rank 0's stderr."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            value = fn()
        return "ok", value, stderr.getvalue()
    except Exception as err:  # noqa: BLE001 - the test compares what every rank raised
        return type(err).__name__, str(err), stderr.getvalue()


def _hostile_worker(rank, world_size, data_path, bad_data_path, root):
    import os

    import torch.distributed as dist

    from zoo.distributed import raise_on_any_rank
    from zoo.training.pretrain import pretrain

    def fail_on_rank_1(error):
        def fn():
            if dist.get_rank() == 1:
                raise error
            return "fine"
        return fn

    run = f"{root}/run"
    results = {
        "agree_ok": _outcome(lambda: raise_on_any_rank(lambda: dist.get_rank() * 10)),
        "agree_user": _outcome(lambda: raise_on_any_rank(fail_on_rank_1(UserError("rank 1 is unhappy.")))),
        "agree_bug": _outcome(lambda: raise_on_any_rank(fail_on_rank_1(KeyError("k")))),
        "first": _outcome(lambda: pretrain(_run_config(data_path, run, 2, 2, 2, train_iters=2))),
        # Resumed under a longer schedule: one warning naming both, the step count continues.
        "longer": _outcome(lambda: pretrain(_run_config(data_path, run, 2, 2, 2, train_iters=4, load=run))),
        "same": _outcome(lambda: pretrain(_run_config(data_path, run, 2, 2, 2, train_iters=4, load=run))),
        # 2: another model shape.
        "shape": _outcome(lambda: pretrain(_run_config(data_path, f"{root}/other", 2, 2, 2, train_iters=5, load=run,
                                                       model_overrides=dict(TINY_MODEL, n_layer=3)))),
        # 4: --save under a file.
        "save": _outcome(lambda: pretrain(_run_config(data_path, f"{root}/a-file/run", 2, 2, 2, train_iters=1))),
    }
    # 3: rank 1's model-states file truncated (rank 0's is intact).
    dist.barrier()
    if rank == 0:
        path = f"{run}/checkpoints/iter_0000004/mp_rank_01_model_states.pt"
        os.truncate(path, os.path.getsize(path) // 2)
    dist.barrier()
    results["truncated"] = _outcome(lambda: pretrain(_run_config(data_path, f"{root}/other", 2, 2, 2, train_iters=5, load=run)))
    # 5: tp=1 x dp=2, an id outside the vocabulary in the first sample of DP rank 1 only.
    results["vocab"] = _outcome(lambda: pretrain(_run_config(bad_data_path, f"{root}/vocab-run", 1, 1, 2, train_iters=2)))
    return results


def test_hostile_runs_end_in_one_sentence_on_every_rank(tmp_path):
    from zoo.data import GPTDataset
    from zoo.training.metrics import read_metrics

    rng = np.random.default_rng(0)
    data_path = _token_file(tmp_path / "data", rng.integers(0, 1000, 400))
    # DP rank 1 reads global sample 1 first (micro batch 1): plant one id >= 50257 in its window only.
    tokens = rng.integers(0, 1000, 400)
    window = GPTDataset(_token_file(tmp_path / "probe", tokens), 16, 1234, split="1,0,0").window_index(1)
    tokens[window * 16 + 5] = 60000
    bad_data_path = _token_file(tmp_path / "bad", tokens)
    (tmp_path / "a-file").write_text("not a directory")

    ranks = spawn(_hostile_worker, 2, data_path, bad_data_path, str(tmp_path), timeout=400)

    for rank, results in enumerate(ranks):
        for name in ("first", "longer", "same"):
            assert results[name][0] == "ok", (rank, name, results[name])
    # The agreement itself: the same user error on every rank; a bug stays itself where it happened.
    assert [r["agree_ok"][:2] for r in ranks] == [("ok", 0), ("ok", 10)]
    assert [r["agree_user"][:2] for r in ranks] == [("UserError", "rank 1 is unhappy.")] * 2
    assert ranks[0]["agree_bug"][:2] == ("RuntimeError", "rank 1 failed with KeyError: 'k'")
    assert ranks[1]["agree_bug"][0] == "KeyError"

    # One warning on rank 0 naming the old and new schedule; the resumed run continues the step count.
    warning = ranks[0]["longer"][2]
    assert warning.count("warning:") == 1, warning
    assert ("the checkpoint at iteration 2 was trained with the LR schedule WarmupCosineLR(total_num_steps=2) and "
            "this run continues with WarmupCosineLR(total_num_steps=4)") in warning
    assert "warning" not in ranks[1]["longer"][2] and "warning" not in ranks[0]["same"][2]
    events = [e for e in read_metrics(tmp_path / "run") if "split" not in e]
    assert [e["iteration"] for e in events] == [1, 2, 3, 4]

    expected = {
        "shape": ("UserError", r"--load .*run holds a checkpoint of another model \(n_layer 2 in the checkpoint, 3 "
                                r"in this run\); pass the --model preset and model_overrides it was trained with"),
        "save": ("UserError", r"--save .*a-file/run lies under a file, not a directory"),
        "truncated": ("UserError", r"iter_0000004/mp_rank_01_model_states\.pt cannot be read as a torch checkpoint"),
        "vocab": ("UserError", r"bad\.bin holds token id 60000 in sample 1 of the train split, outside the model's "
                                r"vocabulary of 50257 ids"),
    }
    for name, (kind, pattern) in expected.items():
        outcomes = [r[name][:2] for r in ranks]
        assert outcomes[0] == outcomes[1], (name, outcomes)   # the same sentence on every rank
        assert outcomes[0][0] == kind, (name, outcomes)
        assert re.search(pattern, _one_sentence(outcomes[0][1])), (name, outcomes)
    assert not (tmp_path / "a-file" / "run").exists() and (tmp_path / "a-file").is_file()
    assert not (tmp_path / "other").exists()  # every refusal came before the run directory was made
