"""HF-style checkpoints at any tp degree: sharded ``save_pretrained`` that transformers loads, and the round
trip zoo tp=2 -> save -> zoo tp=1 -> save -> zoo tp=4 -> save -> transformers, plus the per-rank memory of
a tp=4 load.

Tolerance: gathered logits max|a - b| / max|b| <= 1e-5 (fp32, dropout off). The saved weights themselves
are compared bit-exactly: merging shards is a copy, so every hop must write identical tensors.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.checks import rel_err
from tests.spawn import spawn

REL_TOL = 1e-5
VOCAB = 1000            # not a multiple of 128: every tp pads it differently
SMALL_SHARD = 60_000    # bytes: forces several shards for the ~0.4 MB tiny model


def tiny_config():
    from zoo.models import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1,
                      eos_token_id=VOCAB - 1)


def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def seeded_model(parallel):
    """A random zoo GPT-2 whose biases and LayerNorms are also random (they start at 0/1), so a wrong
    merge of any parameter changes the logits."""
    from zoo.models import GPT2LMHeadModel

    torch.manual_seed(1234)
    model = GPT2LMHeadModel(tiny_config(), parallel=parallel)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def saved_tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def shard_files(directory) -> list[str]:
    return sorted(p.name for p in directory.glob("model*.safetensors"))


# ----------------------------------------------------------------------------- sharded save_pretrained
def test_sharded_save_loads_in_transformers(tmp_path):
    import transformers

    from zoo.models import GPT2LMHeadModel

    model = seeded_model(None)
    ids = input_ids()
    with torch.no_grad():
        expected = model(ids, gather_output=True).logits
    out = tmp_path / "hf"
    model.save_pretrained(out, max_shard_size=SMALL_SHARD)

    files = shard_files(out)
    assert len(files) > 1 and "model.safetensors" not in files, files
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files), files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = saved_tensors(out)
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())

    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        assert rel_err(hf(ids).logits, expected) <= REL_TOL
        assert rel_err(GPT2LMHeadModel.from_pretrained(out)(ids, gather_output=True).logits, expected) <= REL_TOL

    # Re-saving below the limit replaces the directory atomically: no stale shards or index remain.
    model.save_pretrained(out)
    assert shard_files(out) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging directories left behind"


def test_bad_shard_size_is_one_sentence(tmp_path):
    with pytest.raises(ValueError, match=r"max_shard_size '12XB' is not a size") as err:
        seeded_model(None).save_pretrained(tmp_path / "hf", max_shard_size="12XB")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- tp=2 -> 1 -> 4 -> transformers
def _gathered_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids(), gather_output=True).logits


def _round_trip_worker(rank, world_size, dirs):
    """Four processes run every zoo hop in turn (one spawn instead of three): tp=2 (x dp=2) builds and
    saves, tp=1 (every process alone; rank 0 writes) loads and saves, tp=4 loads and saves."""
    from zoo.models import GPT2LMHeadModel
    from zoo.parallel import ParallelState, is_tensor_parallel

    tp2 = seeded_model(ParallelState.initialize(2))
    logits = {"tp2": _gathered_logits(tp2)}
    tp2.save_pretrained(dirs["tp2"], max_shard_size=SMALL_SHARD)

    tp1 = GPT2LMHeadModel.from_pretrained(dirs["tp2"]).eval()
    logits["tp1"] = _gathered_logits(tp1)
    tp1.save_pretrained(dirs["tp1"])

    tp4 = GPT2LMHeadModel.from_pretrained(dirs["tp1"], parallel=ParallelState.initialize(4)).eval()
    logits["tp4"] = _gathered_logits(tp4)
    tp4.save_pretrained(dirs["tp4"], max_shard_size=SMALL_SHARD)
    sharded = sum(p.numel() * p.element_size() for p in tp4.parameters() if is_tensor_parallel(p))
    replicated = sum(p.numel() * p.element_size() for p in tp4.parameters() if not is_tensor_parallel(p))
    return {"logits": logits, "tp4_sharded_bytes": sharded, "tp4_replicated_bytes": replicated}


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """Saves of each hop and the logits every model computed on the same input."""
    import transformers

    root = tmp_path_factory.mktemp("round_trip")
    dirs = {hop: root / hop for hop in ("tp2", "tp1", "tp4")}
    ranks = spawn(_round_trip_worker, 4, dirs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dirs["tp4"]).eval()
    with torch.no_grad():
        transformers_logits = hf(input_ids()).logits
    return {"dirs": dirs, "ranks": ranks, "transformers": transformers_logits}


def test_round_trip_logits_equal_at_every_hop(round_trip):
    reference = round_trip["ranks"][0]["logits"]["tp2"]
    assert reference.shape == (2, 12, VOCAB)
    for rank in round_trip["ranks"]:
        for hop in ("tp2", "tp1", "tp4"):
            assert rel_err(rank["logits"][hop], reference) <= REL_TOL, (hop, rank)
    assert rel_err(round_trip["transformers"], reference) <= REL_TOL


def test_round_trip_writes_identical_weights(round_trip):
    dirs = round_trip["dirs"]
    assert len(shard_files(dirs["tp2"])) > 1 and len(shard_files(dirs["tp4"])) > 1
    assert shard_files(dirs["tp1"]) == ["model.safetensors"]
    reference = saved_tensors(dirs["tp2"])
    assert reference["transformer.wte.weight"].shape == (VOCAB, 64)                    # unpadded
    assert reference["transformer.h.0.attn.c_attn.weight"].shape == (64, 3 * 64)      # Conv1D (in, out)
    for hop in ("tp1", "tp4"):
        tensors = saved_tensors(dirs[hop])
        assert set(tensors) == set(reference), hop
        for key, tensor in reference.items():
            assert torch.equal(tensors[key], tensor), (hop, key)


def test_tp4_load_holds_a_quarter_of_the_sharded_weights(round_trip):
    ranks = round_trip["ranks"]
    sharded_total = sum(r["tp4_sharded_bytes"] for r in ranks)
    replicated = ranks[0]["tp4_replicated_bytes"]
    full = sharded_total + replicated
    for rank, r in enumerate(ranks):
        share = (r["tp4_sharded_bytes"] + r["tp4_replicated_bytes"]) / full
        print(f"tp=4 rank {rank}: sharded {r['tp4_sharded_bytes']} B of {sharded_total} B "
              f"({r['tp4_sharded_bytes'] / sharded_total:.3f}), replicated {r['tp4_replicated_bytes']} B, "
              f"{share:.3f} of the full model's {full} B")
        assert r["tp4_sharded_bytes"] * 4 == sharded_total
        assert share < 0.5
